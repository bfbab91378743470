"""Every ```python block of the user docs runs as written."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Markdown files whose python blocks must run as is.
DOC_FILES = ['docs/own-model.md']

_BLOCK = re.compile(r'^```python\n(.*?)^```', re.S | re.M)


def _snippets():
  for name in DOC_FILES:
    for i, match in enumerate(_BLOCK.finditer((ROOT / name).read_text())):
      line = (ROOT / name).read_text()[:match.start()].count('\n') + 1
      yield pytest.param(match.group(1), id=f'{name}:{line}')


def test_docs_have_snippets():
  assert len(list(_snippets())) >= 4


@pytest.mark.parametrize('code', _snippets())
def test_snippet_runs(code):
  exec(compile(code, '<snippet>', 'exec'), {'__name__': '__snippet__'})
