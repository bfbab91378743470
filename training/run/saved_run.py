"""Reading a finished (or stopped) run back: its record, model config and latest weights.

What ``training.export`` and ``training.sample`` start from: the best step of a
run that kept one (``--keep-best``, :mod:`training.run.best`), else the latest;
``which`` picks either. Nothing in the
run folder is changed: a damaged newest checkpoint is passed over with a
warning (the trainer's ``--resume`` is what sets such checkpoints aside).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax

from configs import ARCHS
from models.tasks import Task
from training.run import checkpoints as ckpt
from training.step import train_step as st


class RunReadError(ValueError):
  """A run folder that cannot be read back; the message is one line."""


@dataclasses.dataclass(frozen=True)
class SavedRun:
  """A run's record and latest weights.

  Attributes:
    path: the run folder.
    step: the checkpoint's step.
    meta: the run record (config name, arch, model fields, policy, settings).
    task: the model family with its config (as trained: dtype included).
    variables: ``{'params': ..., **model_state}``, host numpy arrays.
  """
  path: Path
  step: int
  meta: dict
  task: Task
  variables: dict[str, Any]
  which: str = 'last'

  @property
  def described(self) -> str:
    """``step N`` and, for a best step, by which metric and what the last step is."""
    best = self.meta.get('best') or {}
    if self.which != 'best' or not best:
      return f'step {self.step}'
    last = ckpt.steps(self.path)
    then = f'; the last is step {last[0]}' if last and last[0] != self.step else ''
    return (f"step {self.step} (the best by {best.get('metric')} = {best.get('value'):g}, "
            f'--keep-best{then})')


def load_run(run_dir, warn=lambda _: None, which: str | None = None) -> SavedRun:
  """The newest intact checkpoint of ``run_dir``, or its best step (module docstring).

  Args:
    which: 'best', 'last', or None: 'best' when the run kept one.

  Raises:
    RunReadError: one line: no such folder, no checkpoint, none intact, or no best step kept.
  """
  from training.run.best import best_dir
  run_path = Path(run_dir)
  if not run_path.is_dir():
    raise RunReadError(f"no run folder at '{run_path}'; give the --out folder of a train.py run")
  if which is None:
    which = 'best' if ckpt.steps(best_dir(run_path)) else 'last'
  if which == 'best' and not ckpt.steps(best_dir(run_path)):
    raise RunReadError(f"'{run_path}' kept no best step (no {best_dir(run_path) / 'checkpoints'}):"
                       " train with --keep-best METRIC, or pass --checkpoint last")
  path = best_dir(run_path) if which == 'best' else run_path
  if not ckpt.steps(path):
    raise RunReadError(f"'{path}' has no checkpoint (no {path / 'checkpoints'} with a saved "
                       'step); train first, or give the --out folder of a run that saved one')
  got = ckpt.read_meta(path)
  if got is None:
    raise RunReadError(f"'{path}': no checkpoint's run record can be read (damaged checkpoints)")
  meta = got[1]
  arch = meta.get('arch')
  if arch not in ARCHS or not isinstance(meta.get('model'), dict):
    raise RunReadError(f"'{path}': the run record names no model this version knows "
                       f"(arch {arch!r})")
  try:
    config = ARCHS[arch](**meta['model'])
  except (TypeError, ValueError) as e:
    raise RunReadError(f"'{path}': the recorded model config does not build: "
                       f'{str(e).splitlines()[0]}') from None
  task = Task(config)
  train = meta.get('train', {})
  # The optimizer's state has the same tree whatever its settings; only its shape is needed.
  tx = st.make_optimizer(1e-3, int(train.get('steps', 1)), 0, 0.0, 1.0)
  size = task.default_size if task.is_vision else min(task.config.max_len, 8)
  state_shape, _ = st.abstract_inputs(task.model('none'), tx, 1, size)
  one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  state_shape = jax.tree_util.tree_map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one), state_shape)
  passed_over = []   # said only if a checkpoint restores; else the error line names them all
  try:
    state, meta = ckpt.restore(path, state_shape, passed_over.append, set_aside=False,
                               what=str(path))
  except ckpt.CheckpointError as e:
    raise RunReadError(str(e)) from None
  for line in passed_over:
    warn(line)
  host = jax.device_get(state)
  return SavedRun(run_path, int(host.step), meta, task,
                  {'params': host.params, **dict(host.model_state)}, which)
