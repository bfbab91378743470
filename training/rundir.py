"""The run folder (``--out``): path checks, the one-writer lock, and durable ``metrics.jsonl``."""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
from pathlib import Path

LOCK_NAME = '.lock'
METRICS_NAME = 'metrics.jsonl'
_NAME_MAX = 255  # bytes per path component on Linux and macOS file systems


class RunDirError(ValueError):
  """An unusable ``--out`` or one held by another run; the message is one line."""


def default_name(config: str, remat: str) -> str:
  """``CONFIG-SPEC`` with the spec made file-name safe; a long spec is cut and tagged by a hash."""
  safe = ''.join(c if c.isalnum() or c in '-_.' else '_' for c in remat)
  if len(safe) > 64:  # well under any file system's name limit, and still readable
    safe = f"{safe[:48]}-{hashlib.sha256(remat.encode()).hexdigest()[:12]}"
  return f'{config}-{safe}'


def check_out(out: Path):
  """Checks that ``out`` is, or can become, a writable folder; creates nothing.

  Raises:
    RunDirError: a file in the way, a name too long, or no write permission.
  """
  for part in out.parts:
    if len(os.fsencode(part)) > _NAME_MAX:
      raise RunDirError(f"--out: the name '{part[:40]}...' is longer than {_NAME_MAX} bytes; "
                        'pass a shorter --out')
  if out.exists():
    if not out.is_dir():
      raise RunDirError(f"--out '{out}' is a file, not a folder; pass another --out")
    if not os.access(out, os.W_OK | os.X_OK):
      raise RunDirError(f"--out '{out}' is not writable (permission denied); pass another --out")
    return
  parent = out.absolute().parent
  while not parent.exists():
    parent = parent.parent
  if not parent.is_dir():
    raise RunDirError(f"--out '{out}' cannot be created: '{parent}' is a file")
  if not os.access(parent, os.W_OK | os.X_OK):
    raise RunDirError(f"--out '{out}' cannot be created: no write permission in '{parent}'")


class RunLock:
  """An exclusive ``flock`` on ``<out>/.lock`` holding the owner's pid.

  The OS drops the lock when the process ends, however it ends, so a lock left
  by a killed run never blocks the next one.
  """

  def __init__(self, out: Path):
    self.path = out / LOCK_NAME
    self._fd = None

  def acquire(self):
    """Takes the lock or raises :class:`RunDirError` naming the pid holding it."""
    try:
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
      raise RunDirError(f"--out: cannot create '{self.path}': {e.strerror}") from None
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = os.pread(fd, 32, 0).decode(errors='replace').strip() or 'unknown'
      os.close(fd)
      raise RunDirError(f'{self.path.parent} is in use by another train.py run (pid {holder}); '
                        'wait for it to end, or pass another --out') from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f'{os.getpid()}\n'.encode(), 0)
    self._fd = fd

  def release(self):
    if self._fd is not None:
      os.close(self._fd)  # closing drops the flock; the file stays (removing it would race)
      self._fd = None

  def __enter__(self):
    self.acquire()
    return self

  def __exit__(self, *exc):
    self.release()


def strict(row: dict) -> dict:
  """``row`` with NaN and infinities as None, so it dumps as strict JSON (``null``)."""
  return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}


def read_rows(path: Path) -> list[dict]:
  """The rows of a ``metrics.jsonl``; a torn last line (a kill mid-write) is skipped."""
  rows = []
  if path.exists():
    for line in path.read_text().splitlines():
      try:
        rows.append(json.loads(line))
      except json.JSONDecodeError:
        continue
  return rows


class MetricsLog:
  """``metrics.jsonl``, append-only, each step once.

  Opening it keeps the rows up to ``through_step`` (the step the run starts
  from; the later ones are redone) and rewrites the file atomically. Each row
  is flushed to the OS when written (it survives a killed process);
  :meth:`sync` makes the rows durable on disk, and runs before each checkpoint,
  so a checkpoint never holds a step whose row can be lost.
  """

  def __init__(self, out: Path, through_step: int):
    self.path = out / METRICS_NAME
    by_step = {}
    for row in read_rows(self.path):
      if isinstance(row.get('step'), int) and row['step'] <= through_step:
        by_step[row['step']] = row  # the last row of a step wins
    tmp = self.path.with_name(self.path.name + '.tmp')
    with open(tmp, 'w') as f:
      f.writelines(json.dumps(strict(r), allow_nan=False) + '\n' for _, r in sorted(by_step.items()))
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, self.path)  # a kill mid-rewrite leaves the old file, never half of one
    _fsync_dir(out)
    self._file = open(self.path, 'a')

  def write(self, row: dict):
    self._file.write(json.dumps(strict(row), allow_nan=False) + '\n')
    self._file.flush()

  def sync(self):
    self._file.flush()
    os.fsync(self._file.fileno())

  def close(self):
    self.sync()
    self._file.close()


def _fsync_dir(path: Path):
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)
