"""Tokenized documents, cached on disk and packed into training windows with segment ids.

The data a person has: text files (one document each) or ``.jsonl`` files (a
file, or a folder of them) whose rows are ``{"text": ...}``, ``{"prompt":
..., "completion": ...}`` or chat rows ``{"messages": [...]}`` (rendered with the
tokenizer's chat template, trained on the assistant turns: :mod:`training.data.chat`). A prompt/completion row is one document whose
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

Each split's rows are packed whole into windows of ``seq_len + 1`` tokens
(:mod:`training.data.row_packing`): a row with a prompt is never cut, so no
window holds a completion without its prompt; a text row longer than a window
is cut into pieces; the rest of a window is masked padding. Each window comes
with the segment id of every token (attention does not cross a row boundary),
its position (restarting at 0 at each row) and its loss mask
(:mod:`models.tasks`). Training draws windows at random, a pure function of
(seed, step), so a resumed run sees the batches it would have; the training
rows are packed in an order shuffled by a fixed seed, the held-out rows in
file order.

Validation is held out by document (every 10th) when there are at least 10
documents, otherwise as the last 10% of the token stream (moved back to a row's start
rather than cut a row with a prompt).
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
from training.data import chat as chat_rows
from training.data import row_packing
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


def _rows(file: Path, bar, chat=None) -> Iterator[tuple]:
  """(text, None), (prompt, completion) or (None, chat segments) per row of a .jsonl file;
  ``chat``: the tokenizer's chat renderer (:mod:`training.data.chat`), None without a template."""
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
      elif isinstance(row, dict) and 'messages' in row:
        problem = chat_rows.check_messages(row)
        if problem is None and chat is None:
          problem = ("a chat row needs the tokenizer's chat template, and its folder's "
                     'tokenizer_config.json has no chat_template')
        try:
          segments = chat(row['messages']) if problem is None else None
        except DataError as e:
          problem = str(e)
        if problem:
          raise DataError(f'--data {file} line {number}: {problem}')
        yield None, segments
      else:
        got = (f"keys {', '.join(sorted(row))}" if isinstance(row, dict) and row
               else f'a JSON {type(row).__name__}')
        raise DataError(f'--data {file} line {number}: a row needs a string "text", string '
                        f'"prompt" and "completion", or "messages"; got {got}')


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
  chats = [i for i, (p, _) in enumerate(chunk) if p is None]
  if chats:   # a chat row: its template's pieces, each tokenized alone; the template ends it
    pieces = [t for i in chats for t, _ in chunk[i][1]]
    ids = iter(tokenizer.encode_batch(pieces, special=False))
    done = {}
    for i in chats:
      got = [(next(ids), trained) for _, trained in chunk[i][1]]
      done[i] = (np.concatenate([t for t, _ in got]).astype(TOKEN_DTYPE),
                 np.concatenate([np.full(len(t), int(m), np.uint8) for t, m in got]))
    rest = [(i, item) for i, item in enumerate(chunk) if item[0] is not None]
    encoded = dict(zip([i for i, _ in rest], _encode(tokenizer, [item for _, item in rest])))
    for i in range(len(chunk)):
      yield done[i] if i in done else encoded[i]
    return
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


def _build(folder: Path, files: list[Path], jsonl: bool, tokenizer, source: str,
           held_out: bool = False):
  """Tokenizes every document into ``folder``: each split's tokens, mask and offsets, meta.json.

  Document ``i`` goes to validation when ``i % 10 == 9``, or every document with
  ``held_out`` (an ``--eval-data`` file; :func:`load_held_out`) (so a corpus of fewer
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
    chat = chat_rows.renderer(tokenizer) if jsonl else None
    texts = (_rows(f, bar, chat) for f in files) if jsonl else iter([_text_docs(files, bar)])
    for stream in texts:
      for chunk in _chunks(stream, CHUNK_DOCS):
        for tokens, mask in _encode(tokenizer, chunk):
          val = held_out or docs % VAL_EVERY == VAL_EVERY - 1
          streams['val' if val else 'train'].add(tokens, mask)
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

  def packing(self, capacity: int, order_seed: int | None = None) -> row_packing.Packing:
    """Its rows packed whole into windows of ``capacity`` tokens (:mod:`training.data.row_packing`);
    ``order_seed``: rows shuffled by it first (None: in order)."""
    starts, lengths = row_packing.row_bounds(self.starts, len(self))
    whole = row_packing.has_prompt(self.mask, starts)
    order = (None if order_seed is None
             else np.random.default_rng(order_seed).permutation(len(starts)))
    return row_packing.pack(starts, lengths, whole, capacity, order)

  def targets(self) -> int:
    """Tokens the loss counts: in the loss mask and not the first of their row."""
    starts, _ = row_packing.row_bounds(self.starts, len(self))
    return int(np.asarray(self.mask).sum(dtype=np.int64) - np.asarray(self.mask)[starts].sum())

  def long_rows(self, capacity: int) -> tuple[int, int, int]:
    """(rows with a prompt longer than ``capacity``, the longest of them, rows in all)."""
    starts, lengths = row_packing.row_bounds(self.starts, len(self))
    n, longest = row_packing.long_rows(lengths, row_packing.has_prompt(self.mask, starts), capacity)
    return n, longest, len(starts)


def _open_split(folder: Path, name: str, n: int) -> Split:
  if n == 0:
    return Split(np.zeros(0, TOKEN_DTYPE), np.zeros(0, np.uint8), np.zeros(1, np.int64))
  offsets = np.fromfile(folder / f'{name}.offsets', np.int64)
  return Split(np.memmap(folder / f'{name}.tokens', TOKEN_DTYPE, 'r', shape=(n,)),
               np.memmap(folder / f'{name}.mask', np.uint8, 'r', shape=(n,)), offsets[:-1])


def _cut(split: Split, fraction: float = CUT_FRACTION) -> tuple[Split, Split]:
  """Splits one stream by position (the last 10% held out). A row with a prompt is not cut: the
  cut moves to its start, so its completion is never held out without its prompt (a text row
  cut in two becomes two rows)."""
  cut = int(len(split) * fraction)
  starts = split.starts
  at = int(np.searchsorted(starts, cut, side='right')) - 1
  end = int(starts[at + 1]) if at + 1 < len(starts) else len(split)
  if starts[at] < cut and split.mask[starts[at]:end].min(initial=1) == 0:
    cut = int(starts[at])
  val_starts = np.concatenate([[0], starts[starts > cut] - cut]).astype(np.int64)
  return (Split(split.tokens[:cut], split.mask[:cut], starts[starts < cut]),
          Split(split.tokens[cut:], split.mask[cut:], val_starts))


@dataclasses.dataclass(frozen=True)
class TokenData:
  """Train and validation splits of a tokenized corpus, their rows packed into windows, and
  where they came from."""
  train: Split
  val: Split
  source: str
  tokenizer: str
  num_documents: int
  cached: bool
  train_windows: row_packing.Packing
  val_windows: row_packing.Packing
  pad_id: int = 0

  def _check_len(self, seq_len: int):
    if seq_len + 1 != self.train_windows.capacity:
      raise ValueError(f'the rows were packed for --seq-len {self.train_windows.capacity - 1}, '
                       f'not {seq_len}')

  def batch(self, step: int, batch_size: int, seq_len: int, seed: int,
            rows: tuple[int, ...] | None = None) -> dict[str, np.ndarray]:
    """Training windows of ``seq_len + 1`` tokens for ``step``: a pure function of (seed, step).

    ``rows`` (a process's share on a mesh, :meth:`training.step.mesh.Placement.local_rows`): only
    those windows are read from the memory map; the other rows are zeros, which the process
    never hands to a device. Every process draws the same windows, so the batch is the same
    global batch whichever process reads which rows.
    """
    self._check_len(seq_len)
    rng = np.random.default_rng([seed, step])
    which = rng.integers(0, len(self.train_windows), size=batch_size)
    read = lambda w: self.train_windows.windows(self.train.tokens, self.train.mask, w, self.pad_id)
    if rows is None:
      return read(which)
    rows = list(rows)
    got = read(which[rows])
    out = {k: np.zeros((batch_size,) + v.shape[1:], v.dtype) for k, v in got.items()}
    for k, v in got.items():
      out[k][rows] = v
    return out

  def val_batches(self, num_batches: int, batch_size: int, seq_len: int) -> list[dict]:
    """``num_batches`` batches of held-out windows, evenly spaced over the packed held-out rows.

    When they ask for at least as many windows as there are, every window is taken once and
    the last batch is filled up with empty windows (all padding: nothing counted), so the
    loss is over every held-out row (:func:`training.data.text_source.check_eval_batches`
    refuses more batches than that needs).
    """
    self._check_len(seq_len)
    n = len(self.val_windows)
    which = np.linspace(0, n - 1, min(n, num_batches * batch_size)).round().astype(np.int64)
    w = self.val_windows.windows(self.val.tokens, self.val.mask, which, self.pad_id)
    empty = num_batches * batch_size - len(which)
    if empty:
      fill = {'tokens': np.full((empty, seq_len + 1), self.pad_id, np.int32),
              'segment_ids': np.zeros((empty, seq_len + 1), np.int32),
              'positions': np.broadcast_to(np.arange(seq_len + 1, dtype=np.int32),
                                           (empty, seq_len + 1)),
              'loss_mask': np.zeros((empty, seq_len + 1), np.int32)}
      w = {k: np.concatenate([v, fill[k]]) for k, v in w.items()}
    return [{k: v[i * batch_size:(i + 1) * batch_size] for k, v in w.items()}
            for i in range(num_batches)]

  @property
  def packing_line(self) -> str:
    """How the rows were packed: windows, and the share of window tokens that is rows."""
    t, v = self.train_windows, self.val_windows
    return (f'packing: rows whole in windows of {t.capacity} tokens (text rows longer than a '
            f'window cut into pieces): {t.rows:,} train rows in {len(t):,} windows, '
            f'{v.rows:,} held-out rows in {len(v):,}; {t.fraction:.1%} of train window tokens '
            'are rows, the rest padding (masked)')

  @property
  def description(self) -> str:
    return (f"{self.source}: {self.num_documents:,} documents, {len(self.train):,} train / "
            f"{len(self.val):,} val tokens ({self.tokenizer}; "
            f"{'read from the token cache' if self.cached else 'tokenized and cached'})")


def load_tokens(path: str | None, tokenizer, seq_len: int, cache: Path | None = None,
                warn=None, check=None) -> TokenData:
  """Tokenizes (or reads from the cache) the documents at ``path``, splits off validation and
  packs each split's rows into windows of ``seq_len + 1`` tokens.

  Args:
    path: a text file, a ``.jsonl`` file, or a folder of either; None: the Python stdlib source.
    tokenizer: a :mod:`training.data.tokenizer` tokenizer.
    seq_len: the window length: every row with a prompt must be at most ``seq_len + 1`` tokens.
    cache: the cache root (default :func:`cache_root`).
    warn: gets the one line that says a damaged cache entry is rebuilt (default: stderr).
    check: ``check(train_windows, val_windows)`` raises a DataError for splits the run cannot
      use (``--eval-batches`` beyond the held-out windows). Like the size checks here, it runs
      before a new entry is put in the cache: data that is refused leaves no entry.

  Raises:
    DataError: one line: a missing path, a bad row, no documents, too few tokens, a row with a
      prompt longer than a window, a cache folder that cannot be written.
  """
  files, jsonl, source = _files(path)
  if not files:
    raise DataError(f"--data '{source}' holds no files")
  capacity = seq_len + 1
  opened = {}

  def usable(meta: dict, folder: Path):
    total = meta['train_tokens'] + meta['val_tokens']
    if meta['documents'] == 0 or total == 0:
      raise DataError(f"--data '{source}' holds no {'rows' if jsonl else 'text'}")
    train = _open_split(folder, 'train', meta['train_tokens'])
    val = _open_split(folder, 'val', meta['val_tokens'])
    if meta['documents'] < VAL_EVERY:
      train, val = _cut(train)
    if min(train.targets(), val.targets()) == 0:
      raise DataError(f"--data '{source}' is too small: {total:,} tokens; the train and "
                      'held-out splits each need a token the loss counts')
    (n, longest, rows), (n2, longest2, rows2) = train.long_rows(capacity), val.long_rows(capacity)
    if n + n2:
      raise DataError(
          f"--data '{source}': {n + n2:,} of {rows + rows2:,} rows with a prompt are longer than "
          f'a window of --seq-len {seq_len} + 1 = {capacity} tokens (the longest has '
          f'{max(longest, longest2):,}); such a row is packed whole, so that its completion is '
          f'never trained without its prompt: pass --seq-len {max(longest, longest2) - 1} or '
          'more, or shorten those rows')
    opened.update(train=train, val=val, train_windows=train.packing(capacity, order_seed=0),
                  val_windows=val.packing(capacity))
    if check is not None:
      check(len(opened['train_windows']), len(opened['val_windows']))

  root = cache or cache_root()
  key = token_cache.content_key(files, jsonl, tokenizer, source)
  folder, meta, cached = token_cache.open_entry(
      root, key, tokenizer.vocab_size, lambda tmp: _build(tmp, files, jsonl, tokenizer, source),
      warn or (lambda m: print(f'warning: {m}', file=sys.stderr, flush=True)), usable)
  # ``opened`` holds what the check read: the entry's files (a building folder's, since renamed
  # into place or, for a run that lost the race, removed: its maps stay valid and equal).
  return TokenData(opened['train'], opened['val'], source, tokenizer.name, meta['documents'],
                   cached, opened['train_windows'], opened['val_windows'],
                   0 if tokenizer.eot_id is None else int(tokenizer.eot_id))


def byte_level_default(path: str | None, tokenizer) -> bool:
  """True when the run takes :mod:`training.data.byte_text`'s plain byte stream (the README's run)."""
  return isinstance(tokenizer, ByteTokenizer) and not is_jsonl(path)
