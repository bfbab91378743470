"""Held-out text: ``--eval-data`` files, and the prompts of held-out rows for ``--eval-generate``.

An ``--eval-data`` file (``.jsonl`` or text, or a folder of them) is read as
``--data`` is (:mod:`training.data.packed_text`), into a token-cache entry of
its own in which every row is held out, in file order, and packed whole into
windows (:mod:`training.data.row_packing`). Its loss is over every row once.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np

from training.data import DataError
from training.data import row_packing
from training.data import token_cache
from training.data.image_folder import IMAGE_SUFFIXES
from training.data.packed_text import Split, _build, _files, _open_split, cache_root


@dataclasses.dataclass
class HeldOutSet:
  """One held-out set of a run.

  Attributes:
    name: the metrics' prefix: ``val`` or ``eval_<stem>``.
    batches: host batches of packed windows (vision: of images).
    prompts: (prompt ids, reference completion ids) of the rows ``--eval-generate`` reads.
  """
  name: str
  batches: list
  prompts: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class HeldOutData:
  """An ``--eval-data`` file: every row held out, packed whole into windows.

  Attributes:
    split: its rows, in file order.
    windows: their packing into windows of ``seq_len + 1`` tokens.
    source: the path as given.
    pad_id: the padding token.
  """
  split: Split
  windows: row_packing.Packing
  source: str
  pad_id: int

  def batches(self, batch_size: int) -> list[dict]:
    """Every window once, in batches of ``batch_size`` (the last filled up with empty windows)."""
    n = len(self.windows)
    got = self.windows.windows(self.split.tokens, self.split.mask, np.arange(n), self.pad_id)
    empty = -n % batch_size
    if empty:
      cap = self.windows.capacity
      got = {k: np.concatenate([v, np.zeros((empty, cap), np.int32) if k != 'positions' else
                                np.broadcast_to(np.arange(cap, dtype=np.int32), (empty, cap))])
             for k, v in got.items()}
      got['tokens'][n:] = self.pad_id
    return [{k: v[i:i + batch_size] for k, v in got.items()} for i in range(0, n, batch_size)]


def prompts_and_completions(split: Split, limit: int) -> list[tuple[list[int], list[int]]]:
  """(prompt ids, completion ids without the end-of-text token) of the first ``limit`` rows that
  have a prompt (masked tokens first, then trained ones), in order; text rows are passed over."""
  starts, lengths = row_packing.row_bounds(split.starts, len(split))
  out = []
  for s, n in zip(starts.tolist(), lengths.tolist()):
    if len(out) == limit:
      break
    mask = np.asarray(split.mask[s:s + n])
    first = int(np.argmax(mask > 0))
    if mask[0] or not mask.any():
      continue
    ids = np.asarray(split.tokens[s:s + n]).tolist()
    out.append((ids[:first], ids[first:]))
  return out


def load_held_out(path: str, tokenizer, seq_len: int, cache: Path | None = None,
                  warn=None) -> HeldOutData:
  """An ``--eval-data`` file (or folder): every row held out, tokenized into the cache (an entry
  of its own) and packed whole into windows of ``seq_len + 1`` tokens.

  Raises:
    DataError: one line, as :func:`load_tokens` (naming ``--eval-data``).
  """
  try:
    files, jsonl, source = _files(path)
  except DataError as e:
    raise DataError(str(e).replace('--data', '--eval-data', 1)) from None
  if not files:
    raise DataError(f"--eval-data '{source}' holds no files")
  if all(f.suffix.lower() in IMAGE_SUFFIXES for f in files):   # else read as bytes of text
    raise DataError(f"--eval-data '{source}' holds images ({files[0].suffix} files); a gpt or "
                    'llama run evaluates text, a .jsonl or text file or a folder of them (an image '
                    'folder is for a vit or resnet run)')
  capacity = seq_len + 1
  opened = {}

  def usable(meta: dict, folder: Path):
    split = _open_split(folder, 'val', meta['val_tokens'])
    if split.targets() == 0:
      raise DataError(f"--eval-data '{source}' holds no token the loss counts")
    n, longest, rows = split.long_rows(capacity)
    if n:
      raise DataError(
          f"--eval-data '{source}': {n:,} of {rows:,} rows with a prompt are longer than a "
          f'window of --seq-len {seq_len} + 1 = {capacity} tokens (the longest has '
          f'{longest:,}): pass --seq-len {longest - 1} or more, or shorten those rows')
    opened.update(split=split, windows=split.packing(capacity))

  key = token_cache.content_key(files, jsonl, tokenizer, source) + '-held-out'

  def build(tmp):
    try:
      _build(tmp, files, jsonl, tokenizer, source, held_out=True)
    except DataError as e:
      raise DataError(str(e).replace('--data', '--eval-data', 1)) from None
  token_cache.open_entry(cache or cache_root(), key, tokenizer.vocab_size, build,
                         warn or (lambda m: print(f'warning: {m}', file=sys.stderr, flush=True)),
                         usable)
  return HeldOutData(opened['split'], opened['windows'], source,
                     0 if tokenizer.eot_id is None else int(tokenizer.eot_id))
