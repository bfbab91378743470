"""Held-out evaluation: the loss of each held-out set and, with ``--eval-generate N``, greedy
generation on N of its prompts.

A run evaluates its ``--data``'s held-out split (metrics ``val_*``) and each
``--eval-data`` file or image folder (``eval_<name>_*``, the name being its stem;
an image folder: :mod:`training.data.held_out_images`). The
loss of a set is the mean over the tokens its loss counts (for prompt/completion
rows, the completion and its end-of-text token) of every evaluated row: each
batch's mean weighted by its count (:func:`counted`).

Generation (:func:`models.kv_decode.greedy_generate`, a KV cache) continues
each of the first N rows' prompts greedily, for at most the longest reference
completion plus one token (its end-of-text), and scores it:

* ``exact_match``: the share of rows whose generation, up to the first
  end-of-text token, is the reference completion, token for token (the model
  also stopped where the reference stops);
* ``token_accuracy``: the share of the references' tokens (with their
  end-of-text) that the generation has at the same position.

Each evaluated row is written to ``<out>/generations.jsonl`` (step, set,
prompt, reference, generated, exact), so what the model says can be read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
  from training.data.held_out import HeldOutSet


def counted(batch) -> float:
  """How many targets a held-out batch's loss is a mean over: for packed windows the labels in
  the loss mask and in their input's row (:meth:`models.tasks.Task._lm_loss`); for an
  ``--eval-data`` image folder's batch its images (the rows of weight 1); else 1 (each batch of
  the validation split's images, or of byte windows, counts the same)."""
  if isinstance(batch, dict) and 'loss_mask' in batch:
    segs = np.asarray(batch['segment_ids'])
    targets = np.asarray(batch['loss_mask'])[:, 1:] > 0
    return float((targets & (segs[:, 1:] == segs[:, :-1])).sum())
  if isinstance(batch, dict) and 'weights' in batch:
    return float(np.asarray(batch['weights']).sum())
  return 1.0


def evaluate_loss(eval_step, state, placed: list, weights: list[float], prefix: str) -> dict:
  """``<prefix>_loss`` (and vision's ``<prefix>_accuracy``): each batch's mean weighted by its
  targets, so packed text reports the mean over the counted tokens of the evaluated rows."""
  results = [eval_step(state.model_params(), state.model_state, b) for b in placed]
  w = np.asarray(weights, np.float64)
  mean = lambda xs: float(np.sum(np.asarray([float(x) for x in xs]) * w) / max(w.sum(), 1.0))
  out = {f'{prefix}_loss': round(mean(l for l, _ in results), 5)}
  for name in results[0][1]:
    out[f'{prefix}_{name}'] = round(mean(m[name] for _, m in results), 5)
  return out


def score(generated: list[list[int]], references: list[list[int]], eot_id: int | None):
  """(exact match share, token accuracy, per-row (kept ids, exact)) of raw greedy outputs."""
  rows, hits, total = [], 0, 0
  for got, ref in zip(generated, references):
    target = ref + ([] if eot_id is None else [eot_id])
    hits += sum(a == b for a, b in zip(got, target))
    total += len(target)
    kept = got[:got.index(eot_id)] if eot_id is not None and eot_id in got else (
        got if eot_id is not None else got[:len(ref)])
    rows.append((kept, kept == ref))
  exact = sum(e for _, e in rows) / max(1, len(rows))
  return exact, hits / max(1, total), rows


def generate_metrics(arch: str, config, params, held: HeldOutSet, tokenizer, step: int,
                     log_file: Path | None) -> dict:
  """``<name>_exact_match`` and ``<name>_token_accuracy`` of greedy generation on the set's
  prompts (module docstring); each row appended to ``log_file`` when given."""
  from models.kv_decode import greedy_generate
  if not held.prompts:
    return {}
  prompts = [p for p, _ in held.prompts]
  refs = [r[:-1] if tokenizer.eot_id is not None and r and r[-1] == tokenizer.eot_id else r
          for _, r in held.prompts]
  room = min(config.max_len - len(p) for p in prompts)
  new = max(1, min(max(len(r) for r in refs) + 1, room))
  raw = greedy_generate(arch, config, params, prompts, new, None)
  exact, accuracy, rows = score(raw, refs, tokenizer.eot_id)
  if log_file is not None:
    with open(log_file, 'a') as f:
      for p, r, (kept, same) in zip(prompts, refs, rows):
        f.write(json.dumps({'step': step, 'set': held.name, 'prompt': tokenizer.decode(p),
                            'reference': tokenizer.decode(r), 'generated': tokenizer.decode(kept),
                            'exact': same}) + '\n')
  return {f'{held.name}_exact_match': round(exact, 5),
          f'{held.name}_token_accuracy': round(accuracy, 5)}


def evaluate_sets(eval_generate: int, task, eval_step, state, sets, tokenizer, step: int,
                  generations: Path | None) -> dict:
  """Each held-out set's loss (``val_*``, ``eval_<name>_*``) and, with ``--eval-generate``, its
  generation metrics. ``sets``: (set, its placed batches, their weights: :func:`counted`)."""
  row = {}
  for held, placed, weights in sets:
    row.update(evaluate_loss(eval_step, state, placed, weights, held.name))
    if eval_generate and held.prompts:
      row.update(generate_metrics(task.arch, task.config, state.model_params(), held, tokenizer,
                                  step, generations))
  return row


def logged_metrics(eval_generate: int, vision: bool, held_out) -> list[str]:
  """The held-out metrics a run logs (what ``--keep-best`` may name)."""
  names = []
  for held in held_out:
    names.append(f'{held.name}_loss')
    if vision:
      names.append(f'{held.name}_accuracy')
    if eval_generate and held.prompts:
      names += [f'{held.name}_exact_match', f'{held.name}_token_accuracy']
  return names
