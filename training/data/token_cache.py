"""The on-disk token cache: keyed by content, verified on open, safe under concurrency, self-healing.

An entry is a folder ``<root>/<key>`` of flat binary files (each split's
tokens, loss mask and document offsets) and ``meta.json``, which records each
file's size and SHA-256. What makes it trustworthy:

* **Keyed by content.** The key is a SHA-256 of every data file's bytes (in
  order) and of the tokenizer's files, read at disk speed with a progress bar
  on large corpora. Path, size and modification time are not used: a file
  edited in place at the same size and mtime gets a new entry, and the same
  data under another path reuses its entry.
* **Verified on open.** Every file of an entry is hashed and compared with
  ``meta.json``, and its token ids checked against the tokenizer's vocabulary,
  before a run memory-maps it: tokens overwritten at the same size are caught.
* **Self-healing.** A damaged or partial entry (no ``meta.json``, a missing,
  short or altered file) is rebuilt, with one warning line naming it.
* **Atomic and concurrent.** An entry is written into a ``.building-*``
  folder and renamed into place when complete (``os.rename`` of a folder onto
  an existing, non-empty one fails, so the first complete entry wins). A
  builder that loses the race verifies the winner's entry and uses it. Each
  builder holds an ``flock`` on its folder while it works; a ``.building-*``
  folder whose lock nobody holds was left by a killed run and is removed.
* **One line** for every failure, naming the cache path (a full disk, a
  read-only cache folder).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np
from tqdm import tqdm

from training.data import DataError
from training.run.rundir import fsync_dir

CACHE_VERSION = 2      # 2: keyed by content, per-file digests in meta.json
BUILDING = '.building-'
READ_BYTES = 8 << 20   # per read while hashing: large enough for disk speed
BAR_DELAY = 1.0        # seconds before a hashing bar shows (small data shows none)
TOKEN_DTYPE = np.uint32


def cache_root() -> Path:
  """``$REMAT_CACHE`` or ``~/.cache/remat``; token caches live in its ``tokens/``."""
  return Path(os.environ.get('REMAT_CACHE') or Path.home() / '.cache' / 'remat') / 'tokens'


class Hasher:
  """SHA-256 of files read in large blocks, with one progress bar over all of them."""

  def __init__(self, total: int, desc: str):
    self.bar = tqdm(total=total, unit='B', unit_scale=True, desc=desc, file=sys.stderr,
                    delay=BAR_DELAY, mininterval=0.5, leave=False)

  def file(self, path: Path, h=None, each: Callable[[bytes], None] | None = None):
    """Feeds ``path``'s bytes to ``h`` (a new SHA-256 if None) and ``each``; returns ``h``."""
    h = h or hashlib.sha256()
    with open(path, 'rb') as f:
      while block := f.read(READ_BYTES):
        h.update(block)
        if each is not None:
          each(block)
        self.bar.update(len(block))
    return h

  def close(self):
    self.bar.close()


def content_key(files: list[Path], jsonl: bool, tokenizer, desc: str) -> str:
  """The entry name of ``files`` tokenized by ``tokenizer``: a digest of their contents.

  Raises:
    DataError: one line, for a data file that cannot be read.
  """
  h = hashlib.sha256(f'v{CACHE_VERSION} jsonl={jsonl} eot={tokenizer.eot_id}\n'.encode())
  tok_files = tokenizer_files(tokenizer)
  sizes = [f.stat().st_size for f in files + tok_files]
  hasher = Hasher(sum(sizes), f'hashing {desc}')
  try:
    for f in tok_files:
      h.update(f'tokenizer {f.name}\0'.encode())
      hasher.file(f, h)
    for f in files:
      h.update(f'\0{f.stat().st_size}\0'.encode())   # file boundaries are document boundaries
      try:
        hasher.file(f, h)
      except OSError as e:
        raise DataError(f"--data: cannot read '{f}': {e.strerror}") from None
  finally:
    hasher.close()
  return h.hexdigest()[:32]


def tokenizer_files(tokenizer) -> list[Path]:
  """The files that define ``tokenizer``'s ids: its tokenizer.json and tokenizer_config.json
  (the end-of-text token); none for bytes."""
  if tokenizer.path is None:
    return []
  path = Path(tokenizer.path)
  config = path.parent / 'tokenizer_config.json'
  return [path] + ([config] if config.is_file() else [])


def _problem(folder: Path, vocab_size: int) -> str | None:
  """What is wrong with entry ``folder`` (None: it is complete and matches its digests)."""
  meta_file = folder / 'meta.json'
  if not meta_file.is_file():
    return 'no meta.json: a partial entry'
  try:
    meta = json.loads(meta_file.read_text())
    files = meta['files']
    assert meta['version'] == CACHE_VERSION and isinstance(files, dict)
  except (OSError, ValueError, KeyError, TypeError, AssertionError):
    return 'meta.json is not a cache record of this version'
  sizes = {name: (folder / name).stat().st_size if (folder / name).is_file() else None
           for name in files}
  for name, want in files.items():
    if sizes[name] != want['bytes']:
      return (f'{name} is missing' if sizes[name] is None else
              f"{name} has {sizes[name]:,} bytes, not {want['bytes']:,}")
  hasher = Hasher(sum(sizes.values()), f'verifying the token cache {folder.name[:12]}')
  try:
    for name, want in sorted(files.items()):
      top = [0]
      each = ((lambda b: top.__setitem__(0, max(top[0], int(np.frombuffer(
          b[:len(b) // 4 * 4], TOKEN_DTYPE).max(initial=0))))) if name.endswith('.tokens')
              else None)
      if hasher.file(folder / name, each=each).hexdigest() != want['sha256']:
        return f'{name} does not match its SHA-256 digest'
      if each is not None and top[0] >= vocab_size:
        return f'{name} holds token id {top[0]}, beyond the vocabulary of {vocab_size}'
  finally:
    hasher.close()
  return None


def open_entry(root: Path, key: str, vocab_size: int, build: Callable[[Path], None],
               warn: Callable[[str], None],
               check: Callable[[dict, Path], None] = lambda meta, folder: None
               ) -> tuple[Path, dict, bool]:
  """The verified entry ``root/key``, built with ``build(folder)`` if absent or damaged.

  ``build`` writes the entry's files into the folder it is given; this
  function adds their digests (``meta.json``) and renames the folder into
  place. ``check(meta, folder)`` raises for an entry the caller cannot use: it runs
  before a new entry is renamed into place (a refused run leaves no entry) and
  on an entry read from the cache. Returns (entry folder, its meta, whether it
  was read rather than built).

  Raises:
    DataError: one line: ``build``'s, or a file system error naming the cache path.
  """
  folder = root / key
  try:
    root.mkdir(parents=True, exist_ok=True)
    remove_abandoned(root)
    problem = None
    if folder.exists():
      problem = _problem(folder, vocab_size)
      if problem is None:
        check(_meta(folder), folder)
        return folder, _meta(folder), True
      warn(f'token cache entry {folder} is damaged ({problem}); rebuilding it')
    _build_and_publish(root, folder, vocab_size, build, warn, check,
                       reported=problem is not None)
    return folder, _meta(folder), False
  except OSError as e:
    raise DataError(_os_error_line(e, root)) from None


def _meta(folder: Path) -> dict:
  return json.loads((folder / 'meta.json').read_text())


def _build_and_publish(root, folder, vocab_size, build, warn, check, reported: bool) -> Path:
  """Builds into a ``.building-*`` folder and renames it to ``folder``; ``reported``: the
  entry there was already reported damaged (it is replaced without another line)."""
  tmp, fd = _claim_building_folder(root, folder.name)
  try:
    build(tmp)
    files = {p.name: {'bytes': p.stat().st_size, 'sha256': _sha256(p)}
             for p in sorted(tmp.iterdir()) if p.is_file() and p.name != 'meta.json'}
    meta = json.loads((tmp / 'meta.json').read_text()) if (tmp / 'meta.json').exists() else {}
    check(meta, tmp)
    _write_durably(tmp / 'meta.json', json.dumps({**meta, 'version': CACHE_VERSION,
                                                  'files': files}))
    for _ in range(3):
      try:
        os.rename(tmp, folder)   # atomic: the entry appears complete or not at all
        fsync_dir(root)
        return folder
      except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
          raise
      # Another run published this entry first: use it if it verifies, else replace it.
      problem = _problem(folder, vocab_size)
      if problem is None:
        return folder
      if not reported:
        warn(f'token cache entry {folder} is damaged ({problem}); replacing it')
        reported = True
      _discard(root, folder)
    raise OSError(errno.EEXIST, 'other runs keep replacing this entry', str(folder))
  finally:
    os.close(fd)
    if tmp.exists():
      shutil.rmtree(tmp, ignore_errors=True)


def _claim_building_folder(root: Path, key: str) -> tuple[Path, int]:
  """A new ``.building-*`` folder and an fd holding its flock (retried if a cleaner took it)."""
  while True:
    tmp = Path(tempfile.mkdtemp(prefix=f'{BUILDING}{key[:12]}-', dir=root))
    fd = os.open(tmp, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    if tmp.exists():   # a cleaner between mkdtemp and flock took it for abandoned
      return tmp, fd
    os.close(fd)


def remove_abandoned(root: Path):
  """Removes ``.building-*`` folders whose flock no process holds: left by a killed build."""
  for tmp in root.glob(f'{BUILDING}*'):
    try:
      fd = os.open(tmp, os.O_RDONLY)
    except OSError:
      continue   # gone meanwhile
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      os.close(fd)   # a build in progress
      continue
    try:
      shutil.rmtree(tmp, ignore_errors=True)
    finally:
      os.close(fd)


def _discard(root: Path, folder: Path):
  """Moves a damaged entry out of the way (atomically), then deletes it."""
  aside = Path(tempfile.mkdtemp(prefix='.damaged-', dir=root))
  try:
    os.rename(folder, aside / 'entry')
  except FileNotFoundError:
    pass   # another run moved it first
  shutil.rmtree(aside, ignore_errors=True)


def _sha256(path: Path) -> str:
  h = hashlib.sha256()
  with open(path, 'rb') as f:
    while block := f.read(READ_BYTES):
      h.update(block)
  return h.hexdigest()


def _write_durably(path: Path, text: str):
  with open(path, 'w') as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())


def _os_error_line(e: OSError, root: Path) -> str:
  where = e.filename or root
  if e.errno in (errno.ENOSPC, errno.EDQUOT):
    return (f"no space left on device writing the token cache '{where}'; free space there, or "
            'point $REMAT_CACHE at another folder')
  return (f"token cache '{where}': {e.strerror or e}; fix its permissions, or point $REMAT_CACHE "
          'at another folder')
