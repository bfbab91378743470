"""The language models' data source: which tokenizer a run uses and which text module feeds it.

One place decides, from a run's settings, how text becomes batches:

* no tokenizer and no ``.jsonl`` data: :mod:`training.data.byte_text`'s byte stream (the
  README's run, unchanged);
* otherwise :mod:`training.data.packed_text`: documents tokenized once into a cache
  and packed into windows with segment ids, positions and a loss mask.

The tokenizer is ``--tokenizer`` when given, else the ``--init-from`` folder's
``tokenizer.json`` when it has one, else bytes (:func:`tokenizer_for_run`).
A fresh model's vocabulary is sized to its tokenizer; a pretrained model's
embedding must hold every id the tokenizer makes.

Also here: ``--config hf:PATH`` (what ``--init-from`` falls back to when no
shipped config has the checkpoint's shape): a model config read from a
Hugging Face folder's ``config.json`` (:func:`load_named`).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path

from configs import NamedConfig, load_config
from training.data import DataError
from training.data.byte_text import load_text
from training.data.held_out import HeldOutSet, load_held_out, prompts_and_completions
from training.data.packed_text import byte_level_default, load_tokens
from training.data.tokenizer import (TOKENIZER_FILE, ByteTokenizer, HFTokenizer, find_tokenizer,
                                     load_tokenizer)
from training.run import bounds

HF_CONFIG_PREFIX = 'hf:'
# Where a run folder keeps a copy of its tokenizer (training.export and training.sample read it;
# training/run/tokenizer_copy.py writes it).
RUN_TOKENIZER_DIR = 'tokenizer'


class SourceError(ValueError):
  """A setting of the text source that cannot be used; the message is one line."""


def load_named(name: str) -> NamedConfig:
  """A shipped config by name, or ``hf:PATH``: the model config of a Hugging Face folder.

  Raises:
    ValueError: one line (an unknown config, or a ``config.json`` we cannot build).
  """
  if not name.startswith(HF_CONFIG_PREFIX):
    return load_config(name)
  from models.hf.load import load_hf_config
  path = name[len(HF_CONFIG_PREFIX):]
  arch, model = load_hf_config(path)
  return NamedConfig(name, arch, f'built from {Path(path) / "config.json"}', model, {})


@functools.lru_cache(maxsize=8)
def _tokenizer(path: str | None):
  return load_tokenizer(path)


def tokenizer_path(cfg) -> str | None:
  """The tokenizer a run uses: ``--tokenizer``, else ``--init-from``'s, else None (bytes)."""
  if cfg.tokenizer is not None:
    return cfg.tokenizer
  if cfg.init_from and find_tokenizer(cfg.init_from) is not None and Path(cfg.init_from).is_dir():
    return str(Path(cfg.init_from) / TOKENIZER_FILE)
  return None


def tokenizer_for_run(cfg, named: NamedConfig | None = None):
  """``(tokenizer, named)``: the run's tokenizer and ``named`` with a vocabulary that fits it.

  A model trained from scratch gets the tokenizer's vocabulary size; a model
  initialised from a checkpoint keeps its embedding, which must hold the
  tokenizer's largest id.

  Raises:
    ValueError: one line, for a tokenizer that cannot be read or does not fit.
  """
  tok = _tokenizer(tokenizer_path(cfg))
  if named is None:
    return tok, None
  vocab = named.model.vocab_size
  if isinstance(tok, ByteTokenizer):
    if vocab < 256:
      raise SourceError(f'config {named.name} has vocab_size {vocab}; byte data needs >= 256')
    return tok, named
  if not cfg.init_from:
    if vocab != tok.vocab_size:
      named = dataclasses.replace(
          named, model=dataclasses.replace(named.model, vocab_size=tok.vocab_size))
    return tok, named
  if tok.vocab_size > vocab:
    raise SourceError(f'tokenizer {tok.name} has {tok.vocab_size} tokens, more than the '
                      f'{vocab} rows of the embedding of {cfg.init_from}; use the tokenizer the '
                      'checkpoint was trained with')
  return tok, named


def byte_stream(cfg) -> bool:
  """True when the run reads :mod:`training.data.byte_text`'s byte stream (loss in nats/byte)."""
  return byte_level_default(cfg.data, tokenizer_for_run(cfg)[0])


def open_text(cfg, size: int, log, rows: tuple[int, ...] | None = None, warn=None):
  """(batch_at(step), validation batches, what the run records about its data) of a
  language-model run; logs what the data is. ``rows``: this process's share of each batch on a
  mesh (None: all); a token corpus reads only those windows from its memory map. ``warn``: the
  line saying a damaged token-cache entry is rebuilt."""
  tok = tokenizer_for_run(cfg)[0]
  if byte_level_default(cfg.data, tok):
    data = load_text(cfg.data, size)
    check_eval_batches(cfg, size, max(0, len(data.val) - size),
                       f'the held-out split of {data.source} ({len(data.val):,} tokens)', 1)
    log(f'data: {data.source}: {data.num_files} files, {len(data.train):,} train / '
        f'{len(data.val):,} val bytes')
    batch_at = lambda step: data.batch(step, cfg.batch_size, size, cfg.seed)
    val = data.val_batches(cfg.eval_batches, cfg.batch_size, size)
    return batch_at, val, {}, [HeldOutSet('val', val)] + _eval_sets(cfg, tok, size, log, warn)
  if isinstance(tok, HFTokenizer):
    log(f'tokenizer: {tok.name} ({tok.vocab_size:,} ids; documents end with '
        f'{tok.eot_token!r} = {tok.eot_id})')
  data = load_tokens(cfg.data, tok, size, warn=warn, check=lambda _, val: _held_out_memory(
      cfg, size, val))
  log(f'data: {data.description}')
  log(data.packing_line)
  held = len(data.val_windows)
  batches = held_out_batches(cfg, held)
  log(f'held-out: {batches} batch{"es" if batches > 1 else ""} of {cfg.batch_size} windows, '
      + ('every held-out row' if batches * cfg.batch_size >= held else
         f'{batches * cfg.batch_size:,} of the {held:,} held-out windows (--eval-batches)'))
  batch_at = lambda step: data.batch(step, cfg.batch_size, size, cfg.seed, rows)
  val = data.val_batches(batches, cfg.batch_size, size)
  sets = [HeldOutSet('val', val, prompts_and_completions(data.val, cfg.eval_generate))]
  return (batch_at, val,
          {'tokenizer': getattr(tok, 'name', str(tok)), 'description': data.description,
           'packed_fraction': round(data.train_windows.fraction, 4)},
          sets + _eval_sets(cfg, tok, size, log, warn))


def _eval_sets(cfg, tok, size: int, log, warn) -> list[HeldOutSet]:
  """The ``--eval-data`` sets: every row of each file, packed whole (one line each)."""
  sets = []
  for name, path in zip(eval_names(cfg.eval_data), cfg.eval_data):
    held = load_held_out(path, tok, size, warn=warn)
    sets.append(HeldOutSet(name, held.batches(cfg.batch_size),
                           prompts_and_completions(held.split, cfg.eval_generate)))
    log(f'eval data: {path}: {held.windows.rows:,} rows in {len(held.windows):,} windows, '
        f'every one evaluated (metrics {name}_*)')
  return sets


def eval_names(paths) -> list[str]:
  """Metric prefixes of ``--eval-data`` paths: ``eval_<stem>``, numbered when stems repeat."""
  stems = [re.sub(r'[^A-Za-z0-9_]+', '_', Path(p).stem).strip('_') or 'data' for p in paths]
  return [f'eval_{s}' if stems.count(s) == 1 else f'eval_{s}_{i + 1}' for i, s in enumerate(stems)]


def held_out_batches(cfg, windows: int) -> int:
  """Held-out batches of packed rows: ``--eval-batches``, or fewer when fewer hold every
  held-out window (the last one filled up with empty windows,
  ``TokenData.val_batches`` of :mod:`training.data.packed_text`)."""
  return max(1, min(cfg.eval_batches, -(-windows // cfg.batch_size)))


def _held_out_memory(cfg, seq_len: int, windows: int):
  """The held-out batches of packed rows fit in memory (:func:`bounds.check_held_out_memory`)."""
  try:
    bounds.check_held_out_memory(held_out_batches(cfg, windows), cfg.batch_size,
                                 (seq_len + 1) * bounds.LM_BYTES_PER_TOKEN)
  except bounds.BoundsError as e:
    raise DataError(str(e)) from None


def check_eval_batches(cfg, seq_len: int, distinct: int, held_out: str, bytes_per_token: int):
  """``--eval-batches`` up to the data: no more held-out windows than the held-out split has
  distinct windows (``distinct``; evenly spaced ones would repeat), and all of them in memory
  at once. ``held_out`` names the split in the error line.

  Raises:
    DataError: one line naming the flag and the largest value the data allows.
  """
  asked = cfg.eval_batches * cfg.batch_size
  most = distinct // cfg.batch_size
  if cfg.eval_batches > most:
    fix = (f'pass --eval-batches {most} or fewer'
           if most else
           f'pass --batch-size {distinct} or less, or more data')
    raise DataError(f'--eval-batches {cfg.eval_batches} x --batch-size {cfg.batch_size} asks for '
                    f'{asked:,} held-out windows of {seq_len + 1} tokens; there are {distinct:,} '
                    f'in {held_out}: {fix}')
  try:
    bounds.check_held_out_memory(cfg.eval_batches, cfg.batch_size,
                                 (seq_len + 1) * bytes_per_token)
  except bounds.BoundsError as e:
    raise DataError(str(e)) from None


def run_tokenizer(run_dir: Path):
  """The tokenizer a run folder was trained with (its saved copy; bytes when it has none)."""
  saved = Path(run_dir) / RUN_TOKENIZER_DIR / TOKENIZER_FILE
  return load_tokenizer(saved if saved.is_file() else None)
