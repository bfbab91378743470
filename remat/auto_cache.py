"""The on-disk cache of ``--remat=auto``: one JSON file per question, so a second call is instant.

A question is keyed by everything that changes its answer: the program (a
hash of the jaxpr of ``build(none)``'s program, which holds every shape and
dtype, or a caller's own description such as the model config and its source
hash), the example arguments' shapes and dtypes, the target and its memory,
the device count and backend, the JAX and jaxlib versions, the budget, and
the search's own settings and version. Records are JSON (never pickle): the
chosen spec with the compiler's figures, and every plan compiled on the way.

The folder is ``$REMAT_CACHE`` if set, else ``~/.cache/remat/auto``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from pathlib import Path

import jax

# Bump when the search or the record changes meaning: older records are then never read.
SEARCH_VERSION = 4   # 2: the mesh is part of the key; superset pruning; 3: each plan's memory,
# impossible budgets recorded, the resolved budget in the key; 4: a GPU target's plans traced for
# the GPU (layout='auto' had chosen the CPU's layout when this machine's backend was the CPU)


def cache_dir() -> Path:
  """``$REMAT_CACHE``, else ``~/.cache/remat/auto``."""
  env = os.environ.get('REMAT_CACHE')
  return Path(env) if env else Path.home() / '.cache' / 'remat' / 'auto'


def environment(target) -> dict:
  """The parts of the key that describe where the answer holds."""
  import jaxlib
  return {'jax': jax.__version__, 'jaxlib': getattr(jaxlib, '__version__', '?'),
          'backend': jax.default_backend(), 'devices': jax.device_count(),
          'target': target.name, 'target_device': target.description,
          'device_memory': target.device_memory, 'search': SEARCH_VERSION}


def jaxpr_fingerprint(closed_jaxpr) -> str:
  """A hash of a jaxpr's text, without the object addresses some parameters print."""
  text = re.sub(r' at 0x[0-9a-f]+', '', str(closed_jaxpr))
  return hashlib.sha256(text.encode()).hexdigest()


def key(parts: dict) -> str:
  """The cache key of a question (``parts`` must be JSON-serialisable)."""
  blob = json.dumps(parts, sort_keys=True, default=str)
  return hashlib.sha256(blob.encode()).hexdigest()[:32]


def load(k: str) -> dict | None:
  """The record stored under ``k``, or None (absent or unreadable)."""
  path = cache_dir() / f'{k}.json'
  try:
    with open(path) as f:
      rec = json.load(f)
  except (OSError, ValueError):
    return None
  return rec if isinstance(rec, dict) and rec.get('key') == k else None


def store(k: str, record: dict) -> Path | None:
  """Writes ``record`` under ``k`` atomically; returns its path (None if the folder is not writable)."""
  folder = cache_dir()
  try:
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix='.tmp')
    with os.fdopen(fd, 'w') as f:
      json.dump({**record, 'key': k}, f, indent=1)
    path = folder / f'{k}.json'
    os.replace(tmp, path)
    return path
  except OSError:
    return None   # a read-only home: the answer stands, only the next call is slow
