"""``--keep-best METRIC`` and ``--early-stop PATIENCE``: the best held-out step, kept apart.

At every evaluation the run compares METRIC (a held-out metric it logs:
``val_loss``, ``val_accuracy``, ``val_exact_match``, ``eval_<name>_loss``, ...)
with the best so far: lower is better for a ``*_loss``, higher for the rest.
A better value saves the state to ``<out>/best/checkpoints/<step>`` (one step
kept, apart from the rotation of ``<out>/checkpoints``, with the same digest
and checks: :mod:`training.run.checkpoints`); ``training.export`` and
``training.sample`` take it by default and say which step it is.

With ``--early-stop P`` the run stops after P evaluations in a row without a
better value, saving its last state as it would at ``--steps``. A resumed
run reads the best value and the evaluations since it from ``metrics.jsonl``.
"""

from __future__ import annotations

import math
from pathlib import Path

from training.run import checkpoints as ckpt

BEST_NAME = 'best'   # <out>/best/checkpoints/<step>


def best_dir(out: Path) -> Path:
  """The run folder whose ``checkpoints`` hold the best step (what :mod:`checkpoints` reads)."""
  return Path(out) / BEST_NAME


def lower_is_better(metric: str) -> bool:
  return metric.endswith('_loss')


def check_metric(metric: str | None, patience: int | None, logged: list[str]):
  """Refuses a METRIC the run does not log, and ``--early-stop`` without one.

  Raises:
    ValueError: one line listing the metrics the run logs.
  """
  if patience is not None and metric is None:
    raise ValueError('--early-stop needs --keep-best METRIC: the held-out metric it watches '
                     f"(this run logs {', '.join(logged)})")
  if metric is not None and metric not in logged:
    raise ValueError(f"--keep-best {metric}: this run logs no such held-out metric; it logs "
                     f"{', '.join(logged)}")


class Best:
  """The best value of one metric over a run's evaluations, and the evaluations since it.

  Args:
    metric: the metric's name in the metric rows.
    patience: ``--early-stop`` (None: never stop).
    rows: the metric rows the run kept so far (a resume); those with the metric count.
  """

  def __init__(self, metric: str, patience: int | None, rows: list[dict] = ()):
    self.metric, self.patience = metric, patience
    self.value, self.step, self.since = None, None, 0
    for row in rows:
      if self.metric in row:
        self.observe(row['step'], row)

  def better(self, value) -> bool:
    if value is None or not math.isfinite(value):
      return False
    if self.value is None:
      return True
    return value < self.value if lower_is_better(self.metric) else value > self.value

  def observe(self, step: int, row: dict) -> bool:
    """Takes an evaluation's row; True when it is the new best (the caller saves it)."""
    value = row.get(self.metric)
    if self.better(value):
      self.value, self.step, self.since = value, step, 0
      return True
    self.since += 1
    return False

  @property
  def stop(self) -> bool:
    return self.patience is not None and self.since >= self.patience

  def stop_line(self, step: int) -> str:
    return (f'early stop at step {step}: {self.metric} has not improved for {self.since} '
            f'evaluations (--early-stop {self.patience}); the best, {self.value:g} at step '
            f'{self.step}, is kept in {BEST_NAME}/')

  def record(self) -> dict:
    """What the best checkpoint's meta says about it."""
    return {'metric': self.metric, 'value': self.value, 'step': self.step}


class Keeper:
  """A run's ``--keep-best``: the :class:`Best` tracker and the manager of ``<out>/best``."""

  def __init__(self, out: Path, metric: str, patience: int | None, rows: list[dict]):
    self.best = Best(metric, patience, rows)
    self.mngr = ckpt.manager(best_dir(out), writer=True, keep=1)

  def after_eval(self, step: int, row: dict, state, meta: dict, metrics) -> bool:
    """Saves ``state`` when ``row`` holds a new best (its row synced first); True if it did."""
    if not self.best.observe(step, row):
      return False
    metrics.sync()
    ckpt.save(self.mngr, state, {**meta, 'best': self.best.record()}, force=True)
    return True

  def close(self):
    ckpt.close(self.mngr)
