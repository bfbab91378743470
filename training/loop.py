"""The step loop of a run: steps, metrics rows, held-out evaluation, checkpoints and the loss guard.

:func:`run_loop` trains from the state's step to ``cfg.steps``: each row goes to
``metrics.jsonl`` (and TensorBoard) before any checkpoint that holds its step,
checkpoints are written only after a healthy step (:mod:`training.run.loss_guard`),
and a stop (divergence, spikes, a full disk) ends in one line naming the last
good checkpoint. :mod:`training.trainer` builds everything the loop takes.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from training.data.text_source import byte_stream, tokenizer_for_run
from training.run import best as best_lib
from training.run import checkpoints as ckpt
from training.run import rundir
from training.run import tensorboard
from training.run.loss_guard import LossGuard
from training.run.settings import DivergedError
from training.step import held_out_eval as hev
from training.step import train_step as st


def disk_full_line(e: BaseException, out: Path) -> str:
  """One line: which path is full, and which checkpoint is intact."""
  what = None
  while e is not None and what is None:
    if isinstance(e, rundir.DiskFullError):
      what = str(e)
    elif isinstance(e, OSError) and e.filename:
      what = f'no space left on device writing {e.filename}'
    e = e.__cause__ or e.__context__
  kept = ckpt.steps(out)
  intact = (f'checkpoint {kept[0]} in {ckpt.folder(out)} is intact: free space there and rerun '
            'with --resume' if kept else 'no checkpoint was written yet: free space there and '
            'rerun')
  return f"{what or f'no space left on device in {out}'}; {intact}"


def run_loop(cfg, task, size, policy, step_fn, state, batch_at, held_out, model, meta, metrics, mngr,
          log, warn, place, guard: LossGuard, record: dict | None) -> list[dict]:
  out = cfg.out_dir
  eval_step = st.make_eval_step(model)
  # Weights from the host's copy of each batch, before placing.
  sets = [(h, [place.put_batch(b) for b in h.batches], [hev.counted(b) for b in h.batches])
          for h in held_out]
  tokenizer = None if task.is_vision else tokenizer_for_run(cfg)[0]
  generations = out / 'generations.jsonl' if place.is_primary else None
  rows = []
  start = int(state.step)
  lr_at = st.LrTable(st.lr_schedule(cfg.lr, cfg.steps, cfg.warmup_steps))   # each update's rate
  board = tensorboard.Writer(out) if cfg.tensorboard and place.is_primary else None
  keeper = (best_lib.Keeper(out, cfg.keep_best, cfg.early_stop, rundir.kept_rows(out, start))
            if cfg.keep_best else None)
  bad_in_row = 0
  # Throughput unit: tokens for GPT and Llama (bytes in a byte-level run), images for vision.
  unit, per_step = ('img', cfg.batch_size) if task.is_vision else ('tok', cfg.batch_size * size)
  with tqdm(total=cfg.steps, initial=start, desc=f'train {policy.spec}', unit='step',
            file=sys.stdout, dynamic_ncols=True, mininterval=0.5,
            disable=not place.is_primary) as bar:
    t0 = time.perf_counter()
    for step in range(start, cfg.steps):
      state, stats = step_fn(state, place.put_batch(batch_at(step)))
      loss, grad_norm = (float(x) for x in np.asarray(stats))  # waits: the clock is honest
      t1 = time.perf_counter()
      finite = math.isfinite(loss) and math.isfinite(grad_norm)
      row = {'step': step + 1, 'loss': round(loss, 5), 'grad_norm': round(grad_norm, 5),
             'lr': float(f'{lr_at(step):.6g}'),
             f'{"images" if task.is_vision else "tokens"}_per_s': round(per_step / (t1 - t0), 1),
             'policy': policy.spec, **({} if task.is_vision else {'tokens': (step + 1) * per_step})}
      bad_in_row = 0 if finite else bad_in_row + 1
      spike = not guard.observe(step + 1, loss) and finite
      if not finite:
        row['skipped'] = bad_in_row <= cfg.skip_nonfinite  # else the run stops at this row
      else:
        if spike:
          row['spike'] = True
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
          row.update(hev.evaluate_sets(cfg.eval_generate, task, eval_step, state, sets,
                                       tokenizer, step + 1, generations))
      metrics.write(row)
      if board is not None:
        board.write(row)
      rows.append(row)
      if keeper is not None and cfg.keep_best in row:
        with ckpt.deferred_interrupts(interrupted_again):
          keeper.after_eval(step + 1, row, state, meta, metrics)
      if bad_in_row > cfg.skip_nonfinite:
        metrics.sync()
        raise DivergedError(diverged_line(step + 1, loss, grad_norm, cfg) + kept_line(guard, out))
      if guard.stop:
        metrics.sync()
        raise DivergedError(guard.stop_line(step + 1, loss) + kept_line(guard, out))
      if bad_in_row:
        warn(f'step {step + 1}: loss {loss:g}, gradient norm {grad_norm:g}: not finite; update '
             f'skipped ({bad_in_row} in a row, --skip-nonfinite {cfg.skip_nonfinite})')
      if spike:
        warn(guard.spike_line(step + 1, loss))
      bar.set_postfix(loss=f'{loss:.3f}', val=row.get('val_loss', '-'),
                      **{f'{unit}_s': f'{per_step / (t1 - t0):.0f}'})
      bar.update()
      stopped = keeper is not None and keeper.best.stop   # --early-stop: the last step
      last = step + 1 == cfg.steps or stopped
      # A checkpoint is written only after a healthy step (training/run/loss_guard.py); other saves
      # wait for the next. The final state's held-out loss, computed with it, may vouch for it.
      due = last or mngr.should_save(step + 1)
      if due and last and not (guard.last_healthy or guard.healthy(row.get('val_loss'))):
        metrics.sync()
        raise DivergedError(f'step {step + 1}, the last: loss {loss:g} is not healthy; the final '
                            f'state was not saved{kept_line(guard, out)}')
      if due and (guard.last_healthy or last):
        metrics.sync()  # rows first: a checkpoint never holds a step whose row can be lost
        with ckpt.deferred_interrupts(interrupted_again):  # a save completes, then an interrupt
          try:
            ckpt.save(mngr, state, meta, force=last)
          except ckpt.CheckpointError as e:
            raise DivergedError(f'{e}{kept_line(guard, out)}') from None
          guard.mark(step + 1)
          if record is not None:
            rundir.write_record(out, {**record, 'saved': step + 1})
      t0 = time.perf_counter()
      if stopped:
        log(keeper.best.stop_line(step + 1))
        break
  mngr.wait_until_finished()
  if keeper is not None:
    keeper.close()
  if board is not None:
    board.close()
  problem = guard.end_problem() if rows else None
  if problem:
    raise DivergedError(problem)
  if rows and 'val_loss' in rows[-1]:
    last = rows[-1]
    what = (f"val loss {last['val_loss']:.3f}, val accuracy {last['val_accuracy']:.1%}"
            if task.is_vision else f"val loss {last['val_loss']:.3f} nats/"
            f"{'byte' if tokenizer_for_run(cfg)[0].name == 'bytes' else 'token'}" + (
                '' if byte_stream(cfg) else ' (the mean over the tokens the loss counts, '
                'completions, of whole held-out rows)'))
    log(f"done: step {last['step']}, train loss {last['loss']:.3f}, {what}; "
        f"metrics and checkpoints in {out}")
  return rows


def interrupted_again():
  """A second interrupt during a save: one line, and exit at once. The interpreter's teardown
  would let orbax's writer threads report the abandoned save (421 lines); the rows are on disk
  (synced before the save) and the save's temporary folder is removed by the next run."""
  sys.stdout.flush()
  print('train.py: interrupted again during a save; the save was abandoned (its temporary '
        'folder is no checkpoint); rerun with --resume to continue from the last checkpoint',
        file=sys.stderr, flush=True)
  os._exit(130)


def kept_line(guard: LossGuard, out: Path) -> str:
  """The end of a stop's error line: the suspect checkpoint set aside, the last good one named."""
  note = ''
  suspect = guard.suspect
  if suspect is not None and suspect in ckpt.steps(out):
    note = (f'; checkpoint {suspect} was set aside to {ckpt.set_aside(out, suspect)} (no healthy '
            'step followed it)')
  kept = ckpt.steps(out)
  if not kept:
    return (f'{note}; no checkpoint passed the guard: lower --lr (or --grad-clip) and start over '
            'with --restart')
  if not math.isfinite(guard.config.factor):   # nothing vouched for it: do not call it good
    return (f'{note}; checkpoint {kept[0]} in {out} is the newest, but with the loss guard off '
            '(--spike-factor inf) it may hold a blown-up state: check its losses in '
            'metrics.jsonl before continuing from it with --resume and a lower --lr '
            '(--allow-changed lr)')
  return (f'{note}; checkpoint {kept[0]} in {out} is the last good one: continue from it with '
          '--resume and a lower --lr (--allow-changed lr) or --grad-clip (--allow-changed grad_clip)')


def diverged_line(step: int, loss: float, grad_norm: float, cfg) -> str:
  skipped = (f' after {cfg.skip_nonfinite} skipped steps in a row (--skip-nonfinite)'
             if cfg.skip_nonfinite else '')
  return (f'diverged at step {step}: loss {loss:g}, gradient norm {grad_norm:g}{skipped}; '
          'stopped without saving')
