"""Tokenized documents, cached on disk and packed into training windows with segment ids.

The data a person has: text files (one document each) or ``.jsonl`` files (a
file, or a folder of them) whose rows are ``{"text": ...}`` or ``{"prompt":
..., "completion": ...}``. A prompt/completion row is one document whose
prompt tokens are masked out of the loss (``loss_mask`` 0): the model learns
to continue a prompt, not to write prompts. Each document ends with the
tokenizer's end-of-text token (byte-level text has none; its documents are
told apart by segment ids alone).

Tokenizing happens once: the first run writes the token stream, the loss mask
and the document offsets as flat binary files into a cache entry keyed by the
content of the data files and of the tokenizer, with a progress bar; later
runs verify the entry and memory-map it. Documents are streamed through the
tokenizer in chunks, so a large corpus is never held in Python lists. The
entry's safety (content key, per-file digests checked on open, atomic rename,
concurrent runs, damaged entries rebuilt) is :mod:`training.data.token_cache`'s.

Windows of ``seq_len + 1`` tokens are cut from the stream anywhere, so one
window holds the end of a document and the start of others; each comes with
the segment id of every token (attention does not cross a document boundary),
its position (restarting at 0 at each document start and at the window's
start) and its loss mask (:mod:`models.tasks`). A step's windows are a pure
function of (seed, step), so a resumed run sees the batches it would have.

Validation is held out by document (every 10th) when there are at least 10
documents, otherwise as the last 10% of the token stream.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Iterator

import numpy as np
from tqdm import tqdm

from training.data import DataError
from training.data import token_cache
from training.data.byte_text import VAL_EVERY, stdlib_files
from training.data.token_cache import TOKEN_DTYPE, cache_root  # noqa: F401  (re-exported)
from training.data.tokenizer import ByteTokenizer

CHUNK_DOCS = 1024      # documents handed to the tokenizer at once
CUT_FRACTION = 0.9     # under VAL_EVERY documents: the first 90% of tokens train


def is_jsonl(path: str | None) -> bool:
  """True if ``path`` is a ``.jsonl`` file or a folder holding one."""
  if path is None:
    return False
  p = Path(path)
  if p.is_file():
    return p.suffix == '.jsonl'
  return p.is_dir() and any(f.suffix == '.jsonl' for f in _walk(p))


def _walk(p: Path) -> list[Path]:
  files = []

  def unreadable(err: OSError):
    raise DataError(f"--data: cannot read '{err.filename}': {err.strerror}")
  for dirpath, dirnames, filenames in os.walk(p, onerror=unreadable):
    dirnames[:] = sorted(d for d in dirnames if not d.startswith('.'))
    files += [Path(dirpath) / f for f in sorted(filenames) if not f.startswith('.')]
  return sorted(f for f in files if f.is_file())


def _files(path: str | None) -> tuple[list[Path], bool, str]:
  """(files, whether they are jsonl, how to name the source)."""
  if path is None:
    return stdlib_files(), False, 'python stdlib source'
  p = Path(path)
  if not p.exists():
    raise DataError(f"--data '{p}' does not exist; give a text file, a .jsonl file or a folder "
                    'of either')
  if p.is_file():
    return [p], p.suffix == '.jsonl', str(p)
  if not p.is_dir():
    raise DataError(f"--data '{p}' is not a regular file or a folder")
  files = _walk(p)
  jsonl = [f for f in files if f.suffix == '.jsonl']
  return (jsonl, True, str(p)) if jsonl else (files, False, str(p))


def _rows(file: Path, bar) -> Iterator[tuple[str, str | None]]:
  """(text, None) or (prompt, completion) per row of a .jsonl file."""
  with open(file, 'rb') as f:
    for number, line in enumerate(f, 1):
      bar.update(len(line))
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except ValueError as e:
        raise DataError(f'--data {file} line {number} is not JSON: {str(e).splitlines()[0]}'
                        ) from None
      if isinstance(row, dict) and isinstance(row.get('text'), str):
        yield row['text'], None
      elif (isinstance(row, dict) and isinstance(row.get('prompt'), str)
            and isinstance(row.get('completion'), str)):
        yield row['prompt'], row['completion']
      else:
        got = (f"keys {', '.join(sorted(row))}" if isinstance(row, dict) and row
               else f'a JSON {type(row).__name__}')
        raise DataError(f'--data {file} line {number}: a row needs a string "text", or string '
                        f'"prompt" and "completion"; got {got}')


def _text_docs(files: list[Path], bar) -> Iterator[tuple[str, str | None]]:
  for f in files:
    try:
      data = f.read_bytes()
    except OSError as e:
      raise DataError(f"--data: cannot read '{f}': {e.strerror}") from None
    bar.update(len(data))
    if data and b'\0' not in data[:8192]:  # binary files have NUL bytes
      yield data.decode('utf-8', errors='replace'), None


def _chunks(docs: Iterator, size: int) -> Iterator[list]:
  chunk = []
  for d in docs:
    chunk.append(d)
    if len(chunk) == size:
      yield chunk
      chunk = []
  if chunk:
    yield chunk


def _encode(tokenizer, chunk: list[tuple[str, str | None]]):
  """Token and loss-mask arrays of each document of ``chunk``, end-of-text appended."""
  eot = [] if tokenizer.eot_id is None else [tokenizer.eot_id]
  heads = tokenizer.encode_batch([p for p, _ in chunk])
  tails_at = [i for i, (_, c) in enumerate(chunk) if c is not None]
  tails = dict(zip(tails_at, tokenizer.encode_batch([chunk[i][1] for i in tails_at],
                                                    special=False))) if tails_at else {}
  for i, head in enumerate(heads):
    tail = tails.get(i)
    if tail is None:   # a text document: every token is a target
      tokens = np.concatenate([head, eot]).astype(TOKEN_DTYPE)
      yield tokens, np.ones(len(tokens), np.uint8)
    else:              # prompt (masked) + completion + end-of-text
      tokens = np.concatenate([head, tail, eot]).astype(TOKEN_DTYPE)
      yield tokens, np.concatenate([np.zeros(len(head), np.uint8),
                                    np.ones(len(tokens) - len(head), np.uint8)])


class _Stream:
  """One split's files being written: tokens, loss mask, document offsets."""

  def __init__(self, folder: Path, name: str):
    self.folder, self.name = folder, name
    self.tok_f = open(folder / f'{name}.tokens', 'wb')
    self.mask_f = open(folder / f'{name}.mask', 'wb')
    self.offsets = [0]

  def add(self, tokens: np.ndarray, mask: np.ndarray):
    self.tok_f.write(tokens.tobytes())
    self.mask_f.write(mask.tobytes())
    self.offsets.append(self.offsets[-1] + len(tokens))

  def close(self):
    self.tok_f.close()
    self.mask_f.close()
    np.asarray(self.offsets, np.int64).tofile(self.folder / f'{self.name}.offsets')


def _build(folder: Path, files: list[Path], jsonl: bool, tokenizer, source: str):
  """Tokenizes every document into ``folder``: each split's tokens, mask and offsets, meta.json.

  Document ``i`` goes to validation when ``i % 10 == 9`` (so a corpus of fewer
  than 10 documents has no validation stream; :func:`load_tokens` then splits
  the training stream by position). :mod:`training.data.token_cache` gives the
  folder, adds the files' digests and renames it into place.
  """
  total = sum(f.stat().st_size for f in files)
  streams = {'train': _Stream(folder, 'train'), 'val': _Stream(folder, 'val')}
  docs = 0
  # leave=False: the bar is cleared when done (or failed); the data line says what happened.
  with tqdm(total=total, unit='B', unit_scale=True, desc=f'tokenizing {source}',
            file=sys.stderr, mininterval=0.5, leave=False) as bar:
    texts = (_rows(f, bar) for f in files) if jsonl else iter([_text_docs(files, bar)])
    for stream in texts:
      for chunk in _chunks(stream, CHUNK_DOCS):
        for tokens, mask in _encode(tokenizer, chunk):
          streams['val' if docs % VAL_EVERY == VAL_EVERY - 1 else 'train'].add(tokens, mask)
          docs += 1
  for s in streams.values():
    s.close()
  (folder / 'meta.json').write_text(json.dumps({
      'documents': docs, 'tokenizer': tokenizer.name, 'source': source,
      **{f'{k}_tokens': s.offsets[-1] for k, s in streams.items()}}))


@dataclasses.dataclass(frozen=True)
class Split:
  """One split's token stream and loss mask (memory-mapped) and its document starts."""
  tokens: np.ndarray
  mask: np.ndarray
  starts: np.ndarray   # int64, ascending, starts[0] == 0

  def __len__(self):
    return len(self.tokens)

  def windows(self, starts: np.ndarray, length: int) -> dict[str, np.ndarray]:
    """Packed windows of ``length`` tokens from ``starts`` (module docstring)."""
    idx = starts[:, None] + np.arange(length)[None, :]
    doc = np.searchsorted(self.starts, idx, side='right') - 1
    begin = np.maximum(self.starts[doc], starts[:, None])
    return {'tokens': self.tokens[idx].astype(np.int32),
            'segment_ids': (doc - doc[:, :1]).astype(np.int32),
            'positions': (idx - begin).astype(np.int32),
            'loss_mask': self.mask[idx].astype(np.int32)}


def _open_split(folder: Path, name: str, n: int) -> Split:
  if n == 0:
    return Split(np.zeros(0, TOKEN_DTYPE), np.zeros(0, np.uint8), np.zeros(1, np.int64))
  offsets = np.fromfile(folder / f'{name}.offsets', np.int64)
  return Split(np.memmap(folder / f'{name}.tokens', TOKEN_DTYPE, 'r', shape=(n,)),
               np.memmap(folder / f'{name}.mask', np.uint8, 'r', shape=(n,)), offsets[:-1])


def _cut(split: Split, fraction: float = CUT_FRACTION) -> tuple[Split, Split]:
  """Splits one stream by position (the last 10% held out); documents cut in two stay apart."""
  cut = int(len(split) * fraction)
  starts = split.starts
  val_starts = np.concatenate([[0], starts[starts > cut] - cut]).astype(np.int64)
  return (Split(split.tokens[:cut], split.mask[:cut], starts[starts < cut]),
          Split(split.tokens[cut:], split.mask[cut:], val_starts))


@dataclasses.dataclass(frozen=True)
class TokenData:
  """Train and validation splits of a tokenized corpus, and where they came from."""
  train: Split
  val: Split
  source: str
  tokenizer: str
  num_documents: int
  cached: bool

  def batch(self, step: int, batch_size: int, seq_len: int, seed: int,
            rows: tuple[int, ...] | None = None) -> dict[str, np.ndarray]:
    """Training windows of ``seq_len + 1`` tokens for ``step``: a pure function of (seed, step).

    ``rows`` (a process's share on a mesh, :meth:`training.step.mesh.Placement.local_rows`): only
    those windows are read from the memory map; the other rows are zeros, which the process
    never hands to a device. Every process draws the same starts, so the batch is the same
    global batch whichever process reads which rows.
    """
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(self.train) - seq_len - 1, size=batch_size)
    if rows is None:
      return self.train.windows(starts, seq_len + 1)
    rows = list(rows)
    got = self.train.windows(starts[rows], seq_len + 1)
    out = {k: np.zeros((batch_size,) + v.shape[1:], v.dtype) for k, v in got.items()}
    for k, v in got.items():
      out[k][rows] = v
    return out

  def val_batches(self, num_batches: int, batch_size: int, seq_len: int) -> list[dict]:
    """A fixed set of validation windows, evenly spaced over the held-out tokens."""
    starts = np.linspace(0, len(self.val) - seq_len - 1, num_batches * batch_size).astype(np.int64)
    w = self.val.windows(starts, seq_len + 1)
    return [{k: v[i * batch_size:(i + 1) * batch_size] for k, v in w.items()}
            for i in range(num_batches)]

  @property
  def description(self) -> str:
    return (f"{self.source}: {self.num_documents:,} documents, {len(self.train):,} train / "
            f"{len(self.val):,} val tokens ({self.tokenizer}; "
            f"{'read from the token cache' if self.cached else 'tokenized and cached'})")


def load_tokens(path: str | None, tokenizer, seq_len: int, cache: Path | None = None,
                warn=None, check=None) -> TokenData:
  """Tokenizes (or reads from the cache) the documents at ``path`` and splits off validation.

  Args:
    path: a text file, a ``.jsonl`` file, or a folder of either; None: the Python stdlib source.
    tokenizer: a :mod:`training.data.tokenizer` tokenizer.
    seq_len: the window length; both splits must hold more than ``seq_len + 1`` tokens.
    cache: the cache root (default :func:`cache_root`).
    warn: gets the one line that says a damaged cache entry is rebuilt (default: stderr).
    check: ``check(train_tokens, val_tokens)`` raises a DataError for splits the run cannot use
      (``--eval-batches`` beyond the held-out windows). Like the size checks here, it runs
      before a new entry is put in the cache: data that is refused leaves no entry.

  Raises:
    DataError: one line: a missing path, a bad row, no documents, too few tokens, a cache
      folder that cannot be written.
  """
  files, jsonl, source = _files(path)
  if not files:
    raise DataError(f"--data '{source}' holds no files")

  def usable(meta: dict):
    total = meta['train_tokens'] + meta['val_tokens']
    if meta['documents'] == 0 or total == 0:
      raise DataError(f"--data '{source}' holds no {'rows' if jsonl else 'text'}")
    train_len, val_len = _split_sizes(meta)
    need = seq_len + 2
    if min(train_len, val_len) < need:
      raise DataError(f"--data '{source}' is too small: {total:,} tokens; train and "
                      f'validation splits each need at least {need} for --seq-len {seq_len}')
    if check is not None:
      check(train_len, val_len)

  root = cache or cache_root()
  key = token_cache.content_key(files, jsonl, tokenizer, source)
  folder, meta, cached = token_cache.open_entry(
      root, key, tokenizer.vocab_size, lambda tmp: _build(tmp, files, jsonl, tokenizer, source),
      warn or (lambda m: print(f'warning: {m}', file=sys.stderr, flush=True)), usable)
  train = _open_split(folder, 'train', meta['train_tokens'])
  val = _open_split(folder, 'val', meta['val_tokens'])
  if meta['documents'] < VAL_EVERY:
    train, val = _cut(train)
  return TokenData(train, val, source, tokenizer.name, meta['documents'], cached)


def _split_sizes(meta: dict) -> tuple[int, int]:
  """The train and validation lengths :func:`load_tokens` gives an entry (see :func:`_cut`)."""
  if meta['documents'] < VAL_EVERY:
    cut = int(meta['train_tokens'] * CUT_FRACTION)
    return cut, meta['train_tokens'] - cut
  return meta['train_tokens'], meta['val_tokens']


def byte_level_default(path: str | None, tokenizer) -> bool:
  """True when the run takes :mod:`training.data.byte_text`'s plain byte stream (the README's run)."""
  return isinstance(tokenizer, ByteTokenizer) and not is_jsonl(path)
