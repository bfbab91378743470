"""Byte-level text data that needs no download.

The default corpus is the running Python's standard-library source (``*.py``
under ``sysconfig``'s stdlib path, without test suites and site-packages), read
in sorted path order. ``--data PATH`` takes a text file or a folder of text
files instead. Tokens are raw bytes (vocab 256), so loss is in nats per byte.

Validation is held out by file (every 10th file) when there are at least 10
files, otherwise by position (the last 10% of bytes).
"""

from __future__ import annotations

import dataclasses
import os
import sysconfig
from pathlib import Path

import numpy as np

from training.data import DataError

_SKIP_DIRS = {'site-packages', 'dist-packages', 'test', 'tests', 'idlelib', '__pycache__'}
VAL_EVERY = 10


def stdlib_files() -> list[Path]:
  """The standard library's ``*.py`` files in sorted order (no tests, no site-packages)."""
  root = Path(sysconfig.get_paths()['stdlib'])
  files = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
    files += [Path(dirpath) / f for f in sorted(filenames) if f.endswith('.py')]
  return sorted(files)


def _text_files(path: Path) -> list[Path]:
  if not path.exists():
    raise DataError(f"--data '{path}' does not exist; give a text file or a folder of text files")
  if path.is_file():
    return [path]
  if not path.is_dir():  # /dev/null, a pipe, a socket: nothing to read a corpus from
    raise DataError(f"--data '{path}' is not a regular file or a folder; give a text file or a "
                    'folder of text files')
  files = []

  def unreadable(err: OSError):  # os.walk skips what it cannot list unless told otherwise
    raise DataError(f"--data: cannot read '{err.filename}': {err.strerror}")
  for dirpath, dirnames, filenames in os.walk(path, onerror=unreadable):
    files += [Path(dirpath) / f for f in filenames if not f.startswith('.')]
  return sorted(f for f in files if f.is_file())


def _read_text(path: Path) -> bytes | None:
  try:
    data = path.read_bytes()
  except OSError as e:
    raise DataError(f"--data: cannot read '{path}': {e.strerror}") from None
  return None if b'\0' in data[:8192] else data  # binary files have NUL bytes


@dataclasses.dataclass(frozen=True)
class TextData:
  """Train and validation byte streams (uint8 arrays) and where they came from."""
  train: np.ndarray
  val: np.ndarray
  source: str
  num_files: int

  def batch(self, step: int, batch_size: int, seq_len: int, seed: int) -> np.ndarray:
    """Training windows of ``seq_len + 1`` bytes for ``step``: a pure function of (seed, step)."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(self.train) - seq_len - 1, size=batch_size)
    return np.stack([self.train[s:s + seq_len + 1] for s in starts]).astype(np.int32)

  def val_batches(self, num_batches: int, batch_size: int, seq_len: int) -> list[np.ndarray]:
    """A fixed set of validation windows, evenly spaced over the held-out bytes."""
    n = num_batches * batch_size
    starts = np.linspace(0, len(self.val) - seq_len - 1, n).astype(np.int64)
    windows = np.stack([self.val[s:s + seq_len + 1] for s in starts]).astype(np.int32)
    return list(windows.reshape(num_batches, batch_size, seq_len + 1))


def load_text(path: str | None, seq_len: int) -> TextData:
  """Loads a byte corpus and splits off validation.

  Args:
    path: a text file or folder of text files; None for the Python stdlib source.
    seq_len: the window length; both splits must hold more than ``seq_len + 1`` bytes.

  Raises:
    DataError: missing path, no text files, or too little text.
  """
  if path is None:
    files, source = stdlib_files(), f"python stdlib source ({sysconfig.get_paths()['stdlib']})"
  else:
    files, source = _text_files(Path(path)), str(path)
  texts = [t for t in (_read_text(f) for f in files) if t]
  if not texts:
    raise DataError(f"--data '{source}' holds no text files")
  if len(texts) >= VAL_EVERY:
    train = b'\n'.join(t for i, t in enumerate(texts) if i % VAL_EVERY != VAL_EVERY - 1)
    val = b'\n'.join(t for i, t in enumerate(texts) if i % VAL_EVERY == VAL_EVERY - 1)
  else:
    joined = b'\n'.join(texts)
    cut = int(len(joined) * 0.9)
    train, val = joined[:cut], joined[cut:]
  need = seq_len + 2
  if min(len(train), len(val)) < need:
    raise DataError(f"--data '{source}' is too small: {len(train) + len(val)} bytes; "
                    f'train and validation splits each need at least {need} bytes for --seq-len {seq_len}')
  as_array = lambda b: np.frombuffer(b, dtype=np.uint8)
  return TextData(as_array(train), as_array(val), source, len(texts))
