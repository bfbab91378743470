"""The run folder (``--out``): path checks, the one-writer lock, the run record, ``metrics.jsonl``.

A run folder remembers what it is: ``run.json`` holds the run's settings, the
newest checkpoint it completed and its history (starts, resumes, accepted
setting changes, restarts), so a ``--resume`` after every checkpoint was lost
refuses instead of starting over, and takes the run's settings, not the
config's defaults. Nothing the folder holds is deleted by a resume: rows of
steps that are redone move to ``metrics.redone.jsonl``, damaged checkpoints to
``damaged/``, and ``--restart`` moves the previous attempt to ``previous/N/``.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import hashlib
import json
import math
import os
import shutil
from pathlib import Path

LOCK_NAME = '.lock'
METRICS_NAME = 'metrics.jsonl'
REDONE_NAME = 'metrics.redone.jsonl'  # rows of steps a resume redid, kept beside metrics.jsonl
RECORD_NAME = 'run.json'
DAMAGED_NAME = 'damaged'
PREVIOUS_NAME = 'previous'
_NAME_MAX = 255  # bytes per path component on Linux and macOS file systems


class RunDirError(ValueError):
  """An unusable ``--out`` or one held by another run; the message is one line."""


class DiskFullError(RunDirError):
  """The file system of ``--out`` is full; the message is one line and says what is intact."""


def is_disk_full(e: BaseException) -> bool:
  """Whether ``e`` (or an exception it was raised from) is ENOSPC, however it was wrapped.

  TensorStore reports it inside a ``ValueError`` text (``RESOURCE_EXHAUSTED: ... No
  space left on device [os_error_code='28']``); Python's file writes as ``OSError``.
  """
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
      return True
    text = str(e)
    if 'No space left on device' in text or "os_error_code='28'" in text:
      return True
    e = e.__cause__ or e.__context__
  return False


def free_bytes(path: Path) -> int | None:
  """Bytes free to this user on the file system of ``path`` (None if it cannot be read)."""
  try:
    st = os.statvfs(path)
  except OSError:
    return None
  return st.f_bavail * st.f_frsize


def now() -> str:
  return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')


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


def kept_rows(out: Path, through_step: int) -> list[dict]:
  """The rows of ``<out>/metrics.jsonl`` up to ``through_step``, each step once (the last wins)."""
  by_step = {}
  for row in read_rows(out / METRICS_NAME):
    if isinstance(row.get('step'), int) and row['step'] <= through_step:
      by_step[row['step']] = row
  return [r for _, r in sorted(by_step.items())]


class MetricsLog:
  """``metrics.jsonl``, append-only, each step once; no row is ever deleted.

  Opening it keeps the rows up to ``through_step`` (the step the run starts
  from) and rewrites the file atomically; the rows of later steps (which the
  run redoes) and duplicates are appended to ``metrics.redone.jsonl`` first,
  each with ``"redone_after": through_step``. Each row is flushed to the OS
  when written (it survives a killed process); :meth:`sync` makes the rows
  durable on disk, and runs before each checkpoint, so a checkpoint never
  holds a step whose row can be lost.

  Attributes:
    rows: the kept rows, oldest first (the run's history up to ``through_step``).
  """

  def __init__(self, out: Path, through_step: int):
    self.path = out / METRICS_NAME
    by_step, aside = {}, []
    for row in read_rows(self.path):
      if isinstance(row.get('step'), int) and row['step'] <= through_step:
        if row['step'] in by_step:
          aside.append(by_step[row['step']])
        by_step[row['step']] = row  # the last row of a step wins
      else:
        aside.append(row)
    if aside:  # before the rewrite: a kill in between leaves a row twice, never none
      with open(out / REDONE_NAME, 'a') as f:
        f.writelines(json.dumps(strict({**r, 'redone_after': through_step}), allow_nan=False)
                     + '\n' for r in aside)
        f.flush()
        os.fsync(f.fileno())
    self.rows = [r for _, r in sorted(by_step.items())]
    tmp = self.path.with_name(self.path.name + '.tmp')
    with open(tmp, 'w') as f:
      f.writelines(json.dumps(strict(r), allow_nan=False) + '\n' for r in self.rows)
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


def read_record(out: Path) -> dict | None:
  """``<out>/run.json`` (None if absent or unreadable)."""
  try:
    record = json.loads((out / RECORD_NAME).read_text())
  except (OSError, ValueError):
    return None
  return record if isinstance(record, dict) else None


def write_record(out: Path, record: dict):
  """Writes ``<out>/run.json`` atomically and durably."""
  path = out / RECORD_NAME
  tmp = path.with_name(path.name + '.tmp')
  with open(tmp, 'w') as f:
    json.dump(record, f, indent=1)
    f.write('\n')
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)
  _fsync_dir(out)


def history(out: Path, record: dict | None) -> str | None:
  """What says ``out`` held checkpoints of a run (None: it never completed one).

  A run killed before its first save completed has none and may start over.
  """
  if record and record.get('saved') is not None:
    return f"checkpoint {record['saved']} was saved (run.json)"
  damaged = out / DAMAGED_NAME
  if damaged.is_dir() and any(damaged.iterdir()):
    return f'its damaged checkpoints are in {damaged}'
  return None


def set_previous_aside(out: Path) -> Path | None:
  """Moves what a run left in ``out`` to ``out/previous/N/`` (for ``--restart``); None if nothing.

  Checkpoints, damaged checkpoints, metrics and the run record move; nothing is deleted.
  """
  names = ('checkpoints', DAMAGED_NAME, METRICS_NAME, REDONE_NAME, RECORD_NAME)
  present = [n for n in names if (out / n).exists()]
  if not present:
    return None
  n = 1
  while (out / PREVIOUS_NAME / str(n)).exists():
    n += 1
  dest = out / PREVIOUS_NAME / str(n)
  dest.mkdir(parents=True)
  for name in present:
    shutil.move(str(out / name), dest / name)
  _fsync_dir(out)
  return dest


def _fsync_dir(path: Path):
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)
