"""Every ```python block of the user docs runs as written."""

import re
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Markdown files whose python blocks must run as is.
DOC_FILES = ['README.md', 'docs/own-model.md', 'docs/measuring.md']

# A fence may be indented (a code block inside a list item).
_BLOCK = re.compile(r'^([ \t]*)```python\n(.*?)^\1```', re.S | re.M)


def _snippets():
  for name in DOC_FILES:
    text = (ROOT / name).read_text()
    for match in _BLOCK.finditer(text):
      line = text[:match.start()].count('\n') + 1
      yield pytest.param(textwrap.dedent(match.group(2)), id=f'{name}:{line}')


def test_docs_have_snippets():
  assert len(list(_snippets())) >= 5


@pytest.mark.parametrize('code', list(_snippets()))
def test_snippet_runs(code):
  exec(compile(code, '<snippet>', 'exec'), {'__name__': '__snippet__'})


def test_no_merge_conflict_markers_in_tracked_text():
  """A merge left '<<<<<<< HEAD' in docs/measuring.md once; no tracked text file keeps one."""
  import subprocess
  files = subprocess.run(['git', 'ls-files', '*.md', '*.py', '*.json', '*.toml', '*.txt'],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
  marker = re.compile(r'^(<{7} |>{7} |={7}$)', re.M)
  bad = [f for f in files if (ROOT / f).is_file() and marker.search((ROOT / f).read_text())]
  assert not bad, bad
