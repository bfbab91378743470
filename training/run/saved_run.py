"""Reading a finished (or stopped) run back: its record, model config and latest weights.

What ``training.export`` and ``training.sample`` start from: the best step of a
run that kept one (``--keep-best``, :mod:`training.run.best`), else the latest;
``which`` picks either. Nothing in the
run folder is changed: a damaged newest checkpoint is passed over with a
warning (the trainer's ``--resume`` is what sets such checkpoints aside).

A LoRA run's checkpoint holds its adapters; its frozen base is loaded again
from the folder its record names (or rebuilt from its seed) and checked
against the recorded digest (:mod:`training.run.base`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax

from configs import ARCHS
from models.lora import params as lora_params
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
    task: the model family with its config (as trained: dtype and adapters included).
    variables: ``{'params': ..., **model_state}``, host numpy arrays: the whole
      tree (a LoRA run's base and adapters), or for ``load_run(..., base=False)``
      of a LoRA run the trained part alone.
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

  @property
  def lora(self):
    """The run's adapters (:class:`models.lora.spec.LoraSpec`), or None for a full fine-tune."""
    return getattr(self.task.config, 'lora', None)

def load_run(run_dir, warn=lambda _: None, which: str | None = None, base: bool = True,
             base_from=None, log=lambda _: None) -> SavedRun:
  """The newest intact checkpoint of ``run_dir``, or its best step (module docstring).

  Args:
    run_dir: a train.py run's ``--out`` folder.
    warn: gets one-line warnings (a damaged checkpoint passed over).
    which: 'best', 'last', or None: 'best' when the run kept one.
    base: for a LoRA run, also load its frozen base (else only the adapters).
    base_from: the base's folder when it has moved since training (None: the recorded one).
    log: gets progress lines (quantizing a QLoRA base).

  Raises:
    RunReadError: one line: no such folder, no checkpoint, none intact, no best step kept,
      or a LoRA base that is missing or not the one the run trained on.
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
  # (Two steps at least: a one-step schedule with no warm-up has no decay to build.)
  tx = st.make_optimizer(1e-3, max(2, int(train.get('steps', 2))), 0, 0.0, 1.0)
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
  params = host.params
  if getattr(config, 'lora', None) is not None and base:
    params = lora_params.merge(_base(run_path, meta, task, base_from, log), params)
  return SavedRun(run_path, int(host.step), meta, task,
                  {'params': params, **dict(host.model_state)}, which)


def _base(path: Path, meta: dict, task: Task, base_from, log) -> dict:
  """A LoRA run's frozen base, loaded as it trained on it and checked against its record."""
  from training.run import base as lora_base
  from training.run.settings import RunError
  rec = meta.get('base') or {}
  folder = base_from or rec.get('init_from')
  config = task.config
  try:
    now = lora_base.record(folder, rec.get('seed', 0))
    lora_base.check(meta.get('base'), now, str(path), what=str(path))
  except (RunError, ValueError) as e:
    raise RunReadError(str(e)) from None
  if folder is None:   # a random base: the seed's, as the run built it
    model = task.model('none')
    tx = st.make_optimizer(1e-3, 2, 0, 0.0, 1.0)
    size = task.default_size if task.is_vision else min(config.max_len, 8)
    return jax.device_get(st.init_state(model, tx, rec.get('seed', 0), size).frozen)
  from models.hf.finetune import load_pretrained
  pretrained, _ = load_pretrained(folder, task.arch, dataclasses.replace(config, lora=None),
                                  lora_base.reader(config.lora, task.arch, config.dtype,
                                                   config.num_layers, log))
  frozen = lora_params.split(pretrained['params'], task.arch)[0]
  return jax.device_get(lora_base.freeze(frozen, config.lora, task.arch, config.dtype))
