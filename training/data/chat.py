"""Chat rows ``{"messages": [{"role": ..., "content": ...}, ...]}``: rendered with the tokenizer's
chat template, trained on the assistant turns only.

The template is the ``chat_template`` of the ``tokenizer_config.json`` beside the
run's ``tokenizer.json`` (a string, or a list of named templates of which
``default`` is taken), rendered with Jinja2 as ``transformers``'
``apply_chat_template`` renders it: a sandboxed environment with
``trim_blocks`` and ``lstrip_blocks``, the ``tojson`` filter, ``raise_exception``,
and the config's ``bos_token`` and ``eos_token``; no ``transformers`` at run time.

Which text is an assistant turn is found by rendering: for the assistant
message ``i``, the conversation before it with ``add_generation_prompt=True``
(what the model is given) and the conversation up to it (what it should
produce) differ by the assistant's turn, end marker included, which is trained;
everything else is masked. A template whose rendering of a conversation's
start changes as the conversation grows cannot be split this way, and its
rows are refused in one line. Each piece is tokenized on its own, without the
post-processor's special tokens (the template writes those as text).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from training.data import DataError

Segments = list[tuple[str, bool]]   # (text, trained) in order


def template_of(tokenizer) -> str | None:
  """The chat template of ``tokenizer`` (its folder's ``tokenizer_config.json``), or None."""
  path = getattr(tokenizer, 'path', None)
  config = Path(path).parent / 'tokenizer_config.json' if path else None
  if config is None or not config.is_file():
    return None
  try:
    data = json.loads(config.read_text())
  except (OSError, ValueError):
    return None
  template = data.get('chat_template') if isinstance(data, dict) else None
  if isinstance(template, list):   # [{"name": "default", "template": ...}, ...]
    named = {t.get('name'): t.get('template') for t in template if isinstance(t, dict)}
    template = named.get('default')
  return template if isinstance(template, str) else None


def _token_text(config: dict, name: str) -> str:
  value = config.get(name)
  return value.get('content', '') if isinstance(value, dict) else (value or '')


def renderer(tokenizer) -> Callable[[list[dict]], Segments] | None:
  """``render(messages) -> segments`` for ``tokenizer``'s chat template; None without one."""
  template = template_of(tokenizer)
  if template is None:
    return None
  import jinja2
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)
  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=['jinja2.ext.loopcontrols'])
  env.filters['tojson'] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
  env.globals['raise_exception'] = raise_exception
  try:
    compiled = env.from_string(template)
  except jinja2.exceptions.TemplateError as e:
    raise DataError(f'the chat template of {tokenizer.path.parent / "tokenizer_config.json"} '
                    f'does not compile: {e}') from None
  config = json.loads((Path(tokenizer.path).parent / 'tokenizer_config.json').read_text())
  tokens = {'bos_token': _token_text(config, 'bos_token'),
            'eos_token': _token_text(config, 'eos_token')}

  def render(messages: list[dict], generation: bool) -> str:
    try:
      return compiled.render(messages=messages, add_generation_prompt=generation, **tokens)
    except jinja2.exceptions.TemplateError as e:
      raise DataError(f'the chat template refused a row: {e}') from None

  return lambda messages: segments(render, messages)


def segments(render, messages: list[dict]) -> Segments:
  """The rendered conversation as (text, trained) pieces (module docstring).

  Raises:
    DataError: no assistant turn, or a template that renders a conversation's start differently
      as it grows.
  """
  out, done = [], ''
  for i, message in enumerate(messages):
    if message['role'] != 'assistant':
      continue
    asked, answered = render(messages[:i], True), render(messages[:i + 1], False)
    if not (asked.startswith(done) and answered.startswith(asked)):
      raise DataError('the chat template renders the start of a conversation differently as it '
                      'grows, so its assistant turns cannot be told apart for the loss')
    out += [(asked[len(done):], False), (answered[len(asked):], True)]
    done = answered
  if not out:
    raise DataError('a chat row needs an assistant turn: the loss is on assistant turns only')
  whole = render(messages, False)
  if not whole.startswith(done):
    raise DataError('the chat template renders the start of a conversation differently as it '
                    'grows, so its assistant turns cannot be told apart for the loss')
  return [(t, trained) for t, trained in out + [(whole[len(done):], False)] if t]


def check_messages(row: dict) -> str | None:
  """What is wrong with a chat row's ``messages`` (None: nothing)."""
  messages = row.get('messages')
  if not isinstance(messages, list) or not messages:
    return '"messages" must be a non-empty list'
  for k, m in enumerate(messages):
    if not (isinstance(m, dict) and isinstance(m.get('role'), str)
            and isinstance(m.get('content'), str)):
      return f'message {k + 1} needs a string "role" and a string "content"'
  return None
