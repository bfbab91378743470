"""Orbax's own reports of a failed save, kept off the terminal (the run reports it in one line).

When a write fails (a full disk), orbax logs a traceback per writer thread on
the ``absl`` logger, and TensorStore's writes still in flight later call back
into the event loops orbax has closed by then; each such callback prints
``RuntimeError: Event loop is closed`` with its traceback straight to
``sys.stderr`` (not through ``sys.excepthook``), from other threads and up to
interpreter exit. A 30 MB tmpfs filled by the tiny config's second save gave
62 of them. :func:`quiet` silences both for the span of a save; once a
save has failed, :func:`after_failed_save` waits for orbax's writer threads
to end (so its partial folder can be removed for good) and silences both for
the rest of the process.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import threading

_NOISE = 'RuntimeError: Event loop is closed'


@contextlib.contextmanager
def quiet():
  """Orbax's ERROR logs and closed-loop tracebacks kept off the terminal in the block; its
  failures still raise."""
  logger = logging.getLogger('absl')
  level, stream = logger.level, sys.stderr
  logger.setLevel(logging.CRITICAL)
  if not isinstance(stream, _Filter):
    sys.stderr = _Filter(stream)
  try:
    yield
  finally:
    logger.setLevel(level)
    if sys.stderr is not stream and isinstance(sys.stderr, _Filter):
      sys.stderr.flush()
      sys.stderr = stream


class _Filter(io.TextIOBase):
  """A text stream that holds each ``Traceback ...`` block to its last line, and drops it if that
  line is the closed-loop error; everything else passes through unchanged."""

  def __init__(self, stream):
    super().__init__()
    self.stream = stream
    self._line = ''    # the current, unfinished line
    self._block = []   # the lines of a traceback being held

  def write(self, text: str) -> int:
    self._line += text
    while '\n' in self._line:
      line, self._line = self._line.split('\n', 1)
      self._take(line + '\n')
    if not self._block and self._line and not 'Traceback'.startswith(self._line[:9]):
      self.stream.write(self._line)  # a partial line that cannot open a traceback: pass it on
      self._line = ''
    return len(text)

  def _take(self, line: str):
    if not self._block:
      if line.startswith('Traceback (most recent call last):'):
        self._block = [line]
      else:
        self.stream.write(line)
      return
    if line.startswith('train.py: '):  # ours, printed by another thread meanwhile: never held
      self.stream.write(line)
      return
    self._block.append(line)
    if not line.startswith((' ', '\t')):  # the exception line ends the block
      if line.rstrip('\n') != _NOISE:
        self.stream.write(''.join(self._block))
      self._block = []

  def flush(self):
    self.stream.flush()

  def __getattr__(self, name):  # fileno, encoding, isatty, ...: the wrapped stream's
    return getattr(self.stream, name)


def after_failed_save(timeout: float = 60.0):
  """Waits (up to ``timeout`` s each) for orbax's threads still writing, then keeps their
  reports off the terminal for the rest of the process."""
  wait_for_writers(timeout)
  logging.getLogger('absl').setLevel(logging.CRITICAL)
  if not isinstance(sys.stderr, _Filter):
    sys.stderr = _Filter(sys.stderr)


def wait_for_writers(timeout: float = 60.0):
  """Joins orbax's threads still running (up to ``timeout`` s each)."""
  for t in threading.enumerate():
    if t is not threading.current_thread() and type(t).__module__.startswith('orbax.'):
      t.join(timeout)
