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
# Lines of metrics.jsonl that are not JSON rows (a torn last line, a hand edit), kept verbatim.
UNREADABLE_NAME = 'metrics.unreadable.txt'
RECORD_NAME = 'run.json'
TOKENIZER_NAME = 'tokenizer'  # the run's copy of its tokenizer (training/run/tokenizer_copy.py)
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
  by a killed run never blocks the next one. :meth:`acquire` only takes the
  lock; the pid is written by :meth:`claim`, which the trainer calls once every
  check has passed, so a refused command leaves the file as it was.
  """

  def __init__(self, out: Path):
    self.path = out / LOCK_NAME
    self._fd = None

  def acquire(self):
    """Takes the lock or raises :class:`RunDirError` naming the pid holding it; writes nothing
    (it creates ``.lock`` in a folder that has none)."""
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
    self._fd = fd

  def claim(self):
    """Writes this process's pid into the held lock file (what a second run's error names).

    Raises:
      DiskFullError, RunDirError: one line, for a file that cannot be written.
    """
    try:
      os.ftruncate(self._fd, 0)
      os.pwrite(self._fd, f'{os.getpid()}\n'.encode(), 0)
    except OSError as e:
      if is_disk_full(e):
        raise DiskFullError(f'no space left on device writing {self.path}') from None
      raise RunDirError(f"--out: cannot write '{self.path}': {e.strerror}") from None

  def release(self):
    if self._fd is not None:
      os.close(self._fd)  # closing drops the flock; the file stays (removing it would race)
      self._fd = None

  def __enter__(self):
    self.acquire()
    self.claim()
    return self

  def __exit__(self, *exc):
    self.release()


def strict(row: dict) -> dict:
  """``row`` with NaN and infinities as None, so it dumps as strict JSON (``null``)."""
  return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}


def read_lines(path: Path) -> tuple[list[dict], list[str]]:
  """(rows, other lines) of a ``metrics.jsonl``: each line that is a JSON object is a row; any
  other line (a torn last line of a killed run, a hand edit, damage) is returned as it was."""
  rows, other = [], []
  if path.exists():
    for line in path.read_bytes().decode('utf-8', errors='replace').splitlines():
      try:
        row = json.loads(line)
      except ValueError:
        row = None
      if isinstance(row, dict):
        rows.append(row)
      elif line.strip():
        other.append(line)
  return rows, other


def read_rows(path: Path) -> list[dict]:
  """The rows of a ``metrics.jsonl``; lines that are not JSON rows are skipped (see
  :class:`MetricsLog`, which sets them aside)."""
  return read_lines(path)[0]


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

  Lines that are not JSON rows (a torn last line, a damaged or hand-edited line)
  are appended verbatim to ``metrics.unreadable.txt`` before the rewrite;
  ``warn`` gets one line when any of them was more than a torn last line.

  Attributes:
    rows: the kept rows, oldest first (the run's history up to ``through_step``).
  """

  def __init__(self, out: Path, through_step: int, warn=lambda _: None):
    self.path = out / METRICS_NAME
    by_step, aside = {}, []
    found, unreadable = read_lines(self.path)
    if unreadable:
      _append_durably(out / UNREADABLE_NAME, ''.join(l + '\n' for l in unreadable))
      # A last line without its end is a row a killed run was writing: expected, not reported.
      text = self.path.read_bytes().decode('utf-8', errors='replace')
      torn = not text.endswith('\n') and text.splitlines()[-1] == unreadable[-1]
      if len(unreadable) > torn:
        warn(f'{len(unreadable)} lines of {self.path} are not JSON rows; they are kept in '
             f'{out / UNREADABLE_NAME}')
    for row in found:
      if isinstance(row.get('step'), int) and row['step'] <= through_step:
        if row['step'] in by_step:
          aside.append(by_step[row['step']])
        by_step[row['step']] = row  # the last row of a step wins
      else:
        aside.append(row)
    if aside:  # before the rewrite: a kill in between leaves a row twice, never none
      _append_durably(out / REDONE_NAME, ''.join(
          json.dumps(strict({**r, 'redone_after': through_step}), allow_nan=False) + '\n'
          for r in aside))
    self.rows = [r for _, r in sorted(by_step.items())]
    tmp = self.path.with_name(self.path.name + '.tmp')
    with open(tmp, 'w') as f:
      f.writelines(json.dumps(strict(r), allow_nan=False) + '\n' for r in self.rows)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, self.path)  # a kill mid-rewrite leaves the old file, never half of one
    fsync_dir(out)
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


def _append_durably(path: Path, text: str):
  with open(path, 'a') as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())


def read_record(out: Path) -> dict | None:
  """``<out>/run.json`` (None if absent or unreadable; :func:`record_problem` tells which)."""
  try:
    record = json.loads((out / RECORD_NAME).read_text())
  except (OSError, ValueError):
    return None
  return record if isinstance(record, dict) else None


def record_problem(out: Path) -> str | None:
  """Why ``<out>/run.json`` exists but cannot be read as a run record; None if it reads or is
  absent."""
  path = out / RECORD_NAME
  if not path.exists() and not path.is_symlink():
    return None
  try:
    record = json.loads(path.read_text())
  except OSError as e:
    return e.strerror or type(e).__name__
  except ValueError as e:
    return f'not JSON ({str(e).splitlines()[0]})'
  return None if isinstance(record, dict) else f'a JSON {type(record).__name__}, not a record'


def set_record_aside(out: Path) -> Path:
  """Moves an unreadable ``run.json`` to ``run.json.unreadable`` (``.2``, ... if taken); returns
  where. Its history is kept there; the run starts a new record."""
  dest = out / f'{RECORD_NAME}.unreadable'
  n = 1
  while dest.exists():
    n += 1
    dest = out / f'{RECORD_NAME}.unreadable.{n}'
  os.replace(out / RECORD_NAME, dest)
  fsync_dir(out)
  return dest


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
  fsync_dir(out)


def history(out: Path, record: dict | None) -> str | None:
  """What says ``out`` held checkpoints of a run (None: it never completed one).

  A run killed before its first save completed has none and may start over. A
  ``run.json`` that cannot be read counts as a run's history: it may have saved.
  """
  if record and record.get('saved') is not None:
    return f"checkpoint {record['saved']} was saved (run.json)"
  problem = None if record else record_problem(out)
  if problem:
    return f'its run record {out / RECORD_NAME} cannot be read: {problem}'
  damaged = out / DAMAGED_NAME
  if damaged.is_dir() and any(damaged.iterdir()):
    return f'its damaged checkpoints are in {damaged}'
  return None


def set_previous_aside(out: Path) -> Path | None:
  """Moves what a run left in ``out`` to ``out/previous/N/`` (for ``--restart``); None if nothing.

  Checkpoints, damaged checkpoints, metrics, the run record (and any unreadable one set aside),
  the tokenizer copy, the best step (``--keep-best``), the generations (``--eval-generate``) and
  the TensorBoard files move; nothing is deleted.
  """
  # best/, generations.jsonl and tensorboard/ are the names of training/run/best.py,
  # training/step/held_out_eval.py and training/run/tensorboard.py, spelled here: best.py imports
  # this module (through checkpoints.py), and tests/test_keep_best.py checks the three agree.
  names = ('checkpoints', DAMAGED_NAME, METRICS_NAME, REDONE_NAME, UNREADABLE_NAME, RECORD_NAME,
           TOKENIZER_NAME, 'best', 'generations.jsonl', 'tensorboard')
  present = [n for n in names if (out / n).exists()] + sorted(
      p.name for p in out.glob(f'{RECORD_NAME}.unreadable*'))
  if not present:
    return None
  n = 1
  while (out / PREVIOUS_NAME / str(n)).exists():
    n += 1
  dest = out / PREVIOUS_NAME / str(n)
  dest.mkdir(parents=True)
  for name in present:
    shutil.move(str(out / name), dest / name)
  fsync_dir(out)
  return dest


def fsync_dir(path: Path):
  """Makes a rename or a new file in the folder ``path`` durable (fsync of the folder)."""
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)
