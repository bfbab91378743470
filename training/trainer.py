"""The training run: checks, data, model state, the compiled step and the run folder, then the loop.

Settings: :mod:`training.run.settings`; the step loop: :mod:`training.loop`; a resume's
checks against the run's record: :mod:`training.run.record_check`.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from models.tasks import Task
from remat.memory import MemoryStats, compiled_memory, format_bytes
from remat.policies import Policy, get_policy
from training.data.text_source import HF_CONFIG_PREFIX, open_text
from models.lora import params as lora_params
from training.run import base as lora_base
from training.run import best as best_lib
from training.run import checkpoints as ckpt
from training.run import resume_check
from training.run import rundir
from training.run import tensorboard
from training.run import tokenizer_copy
from training.run.loss_guard import GuardConfig, LossGuard
from training.loop import disk_full_line, run_loop
from training.run.record_check import check_lora, check_record
from training.run.settings import (  # noqa: F401  (the run's settings, re-exported for callers)
    DivergedError, RunError, TrainConfig, default_config, matching_config,
    resolve)
from training.step import mesh as meshlib
from training.step import held_out_eval as hev
from training.step import train_step as st


def memory_line(policy: Policy, mem: MemoryStats, base: MemoryStats) -> str:
  """The start-up line: compiled temp bytes of the policy's train step next to no remat.

  ``temp`` holds the residuals saved for the backward pass and the recompute
  working set, but also gradient and optimizer temporaries that no policy
  changes (definitions in :mod:`remat.memory`).
  """
  ratio = mem.temp / base.temp if base.temp else float('nan')
  note = ' (host offload is a no-op on the CPU backend: it saves nothing here)' if (
      policy.offloads and mem.backend == 'cpu') else ''
  return (f'memory (XLA {mem.backend} plan of the train step, compile only): temp '
          f'{format_bytes(mem.temp)} with {policy.spec} vs {format_bytes(base.temp)} with none '
          f'({ratio:.0%}); peak {format_bytes(mem.peak)} vs {format_bytes(base.peak)}{note}')


def read_meta(out: Path) -> dict | None:
  """The run record of ``out``'s newest readable checkpoint, else of ``<out>/run.json``, or None.

  ``run.json`` answers when no checkpoint is left (all damaged, or none
  completed yet): the run's settings outlive its checkpoints.
  """
  got = ckpt.read_meta(out)
  if got is not None:
    return got[1]
  record = rundir.read_record(out)
  return record.get('meta') if record else None


def _warn(message: str):
  print(f'train.py: warning: {message}', file=sys.stderr, flush=True)


def train(cfg: TrainConfig, log=print, warn=_warn) -> list[dict]:
  """Runs training; returns the metric rows it wrote to ``<out>/metrics.jsonl``.

  Everything that can be checked is checked before ``--out`` is created or
  anything is compiled; then the run takes ``--out``'s lock and holds it to the
  end. Nothing in ``--out`` is written until every check of the run folder has
  passed (:func:`_train_locked`), so a refused command leaves it as it was.
  ``warn`` gets one-line warnings (a damaged checkpoint passed over).

  Raises:
    RunError: one line; :class:`DivergedError` if the loss or gradients stopped
      being finite.
  """
  place = meshlib.Placement.from_spec(cfg.mesh, cfg.batch_size)  # first: it traces nothing
  named, task, size, policy = resolve(cfg)
  _check_microbatches(cfg, place)
  if not place.is_primary:  # one program, many processes: process 0 speaks for the run
    log = warn = lambda *_: None
  out = cfg.out_dir
  rundir.check_out(out)
  # A folder with a lock file was started by a run, which may have died before its first
  # save: --resume starts that one over. Anything else without checkpoints is a wrong --out.
  if cfg.resume and not ((out / 'checkpoints').is_dir() or (out / rundir.LOCK_NAME).exists()
                         or (out / rundir.RECORD_NAME).exists()):
    raise RunError(f"--resume: no checkpoint in {out / 'checkpoints'}")
  lora = getattr(named.model, 'lora', None)
  # A LoRA run's adapters and base are what its checkpoints are about: a resume must keep the
  # adapters' settings and load the base they trained on, checked before the folder is touched.
  meta = read_meta(out) if cfg.resume else None
  if meta is not None:
    check_lora(meta, named, out)
  base_rec = None
  if lora is not None:
    base_rec = lora_base.record(cfg.init_from, cfg.seed)
    if meta is not None:
      lora_base.check(meta.get('base'), base_rec, out)
  if out.is_dir():   # the run folder's checks, read-only, before data is tokenized or decoded
    check_record(cfg, named, out)   # (again under the lock, which a refusal never needs)
  pretrained = None
  if cfg.init_from and (not cfg.resume or lora is not None):
    from models.hf.finetune import load_pretrained
    # A LoRA model's base is the checkpoint's own model, stored as the run keeps it while it
    # is read; its adapters start fresh.
    pretrained, notes = load_pretrained(
        cfg.init_from, named.arch, named.model if lora is None else
        dataclasses.replace(named.model, lora=None),
        None if lora is None else lora_base.reader(lora, named.arch, named.model.dtype,
                                                   named.model.num_layers, log))
    for note in notes:
      log(f'--init-from: {note}')
  if cfg.config.startswith(HF_CONFIG_PREFIX):
    log(f'model: no shipped config has the shape of {cfg.init_from}; built from its config.json')
  if cfg.tensorboard:
    tensorboard.check_available()
  data = _data(cfg, task, size, log, warn, place)
  best_lib.check_metric(cfg.keep_best, cfg.early_stop,
                        hev.logged_metrics(cfg.eval_generate, task.is_vision, data[3]))
  auto_choice = None
  if policy is None:
    from training.step.autoremat import choose_for_run
    auto_choice, microbatches = choose_for_run(cfg, named, task, size, log, place,
                                               _data_batch(task, data[1]))
    policy = get_policy(auto_choice.spec, num_layers=task.num_layers)
    cfg = dataclasses.replace(cfg, grad_accum=microbatches)
  try:
    out.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise RunError(f"--out '{out}' cannot be created: {e.strerror}") from None
  lock = rundir.RunLock(out) if place.is_primary else None
  if lock is not None:
    lock.acquire()
  try:
    return _train_locked(cfg, named, task, size, policy, pretrained, data, log, warn, place,
                         lock, auto_choice, base_rec)
  finally:
    if lock is not None:
      lock.release()


def _check_microbatches(cfg: TrainConfig, place: meshlib.Placement):
  """``--grad-accum``'s microbatches must split over the mesh's batch shards (one line)."""
  from training.step.accumulate import AccumError, check
  try:
    check(cfg.grad_accum, cfg.batch_size, place.batch_shards)
  except AccumError as e:
    raise RunError(str(e)) from None


# Config fields that change how a model computes (memory, time, rounding), not its weights.
NOT_RECORDED = ('resume', 'restart', 'allow_changed')


def _train_locked(cfg, named, task, size, policy, pretrained, data, log, warn,
                  place: meshlib.Placement, lock: rundir.RunLock | None,
                  auto_choice=None, base_rec=None) -> list[dict]:
  out = cfg.out_dir
  event = 'start'
  saved_step, changed = check_record(cfg, named, out)   # checks only: nothing written yet
  if cfg.restart and place.is_primary:
    moved = rundir.set_previous_aside(out)
    if moved is not None:
      log(f'restart: the previous files of {out} moved to {moved}')
      event = f'restart (previous files in {moved.relative_to(out)})'
  if cfg.resume and saved_step is None:  # the run was killed before its first save completed
    warn(f'no complete checkpoint in {out} (the run ended before its first save); starting '
         "from step 0 with the run's recorded settings")
  batch_at, val, data_meta, held_out = data
  # A config's description speaks of its default data (vit-tiny's procedural shapes): a run on
  # its own --data names the config alone; the data line says what it trains on.
  about = ('' if cfg.data and not cfg.config.startswith(HF_CONFIG_PREFIX)
           else f' ({named.description})')
  log(f'model: {named.name}{about} | dtype: {named.model.dtype} | policy: '
      f'{policy.spec}: {policy.description}')

  model = task.model(policy)
  tx = st.make_optimizer(cfg.lr, cfg.steps, cfg.warmup_steps, cfg.weight_decay, cfg.grad_clip)
  state_shape, task_batch = st.abstract_inputs(model, tx, cfg.batch_size, size, cfg.seed)
  batch_shape = task_batch if task.is_vision else _data_batch(task, val)
  # Restore before compiling: a folder without an intact checkpoint, or one already at
  # --steps, is reported in seconds rather than after the compile.
  saved = {}
  if saved_step is not None:
    state, saved = ckpt.restore(out, place.abstract(state_shape), warn)  # onto this mesh
    if base_rec is not None:   # the checkpoint holds the adapters; the base is loaded again
      state = state.replace(frozen=place.put_state(_frozen_base(pretrained, model, tx, cfg, size,
                                                                log)))
    log(f"resumed step {int(state.step)} (saved under policy {saved['policy']})")
    event = 'resume'
    if changed:
      log('resume: changed on purpose (--allow-changed): ' + ', '.join(
          f'{resume_check.flag(k)} {was} -> {now}' for k, (was, now) in changed.items()))
  elif pretrained is not None:
    state = place.put_state(_pretrained_state(pretrained, tx, model, cfg, size, log))
    log(f'initialised from the Hugging Face checkpoint {cfg.init_from}')
  else:
    state = place.put_state(st.init_state(model, tx, cfg.seed, size))
  if base_rec is not None:
    log(lora_base.describe(state, named.model.lora))
  start = int(state.step)
  if start >= cfg.steps:
    log(f'nothing to do: {out} is at step {start} of --steps {cfg.steps}')
    return []
  offload = None
  if cfg.offload_optimizer:   # checked before the run's first write
    from training.step import offload as offloading
    try:
      offload = offloading.for_run(cfg, st.elementwise_optimizer(
          cfg.lr, cfg.steps, cfg.warmup_steps, cfg.weight_decay), task.num_layers, state_shape,
                                   log)
    except offloading.OffloadError as e:
      raise RunError(str(e)) from None
  if place.is_primary:   # every check has passed: the run writes into --out from here on
    _claim(cfg, out, lock, task.is_vision, fresh=saved_step is None, warn=warn)
  if offload is not None:   # a GPU: the moments move to pinned host memory
    step_fn = offloading.compile_run_step(
        place, st.make_train_step(model, tx, cfg.seed, True, cfg.grad_accum, offload),
        state_shape, batch_shape, offload)
    state = jax.device_put(state, offloading.state_shardings(offload, state_shape, place))
  else:
    step_fn = place.compile_train_step(model, tx, cfg.seed, state_shape, batch_shape,
                                       guard=True, microbatches=cfg.grad_accum)
  if place.mesh is not None:
    log(f'mesh: {place.description}; memory figures are per device')
  if cfg.grad_accum > 1:
    log(f'grad-accum: {cfg.grad_accum} microbatches of {cfg.batch_size // cfg.grad_accum} per '
        f'step of {cfg.batch_size}, one update from their float32 gradient sums')
  if cfg.memory_report:
    base = step_fn if policy.spec == 'none' else place.compile_train_step(
        task.model('none'), tx, cfg.seed, state_shape, batch_shape, guard=True,
        microbatches=cfg.grad_accum)
    log(memory_line(policy, compiled_memory(step_fn), compiled_memory(base)))

  # Changes accepted on resume travel in every later checkpoint's record (and run.json).
  changes = list(saved.get('changes', [])) + (
      [{'step': start, 'settings': changed}] if changed else [])
  meta = {'config': named.name, 'arch': named.arch, 'model': dataclasses.asdict(named.model),
          'policy': policy.spec, 'data': data_meta,
          **({'base': base_rec} if base_rec is not None else {}),
          **({'auto': auto_choice.to_json()} if auto_choice else {}),
          'memory': dataclasses.asdict(compiled_memory(step_fn)),   # the step this run compiled
          'train': {k: v for k, v in dataclasses.asdict(cfg).items() if k not in NOT_RECORDED},
          **({'changes': changes} if changes else {})}
  uniform = math.log(task.config.num_classes if task.is_vision else task.config.vocab_size)
  guard = LossGuard(GuardConfig(cfg.spike_factor, cfg.spike_margin, cfg.spike_patience),
                    rundir.kept_rows(out, start), uniform)
  if saved_step is not None:
    guard.mark(start)  # a restored checkpoint is vouched for by the next healthy step
  record = None
  try:
    try:
      if place.is_primary:
        old = rundir.read_record(out) or {}   # an unreadable one was set aside by _claim
        record = {'meta': meta, 'saved': start if saved_step is not None else None,
                  'history': old.get('history', []) + [
                      {'event': event, 'step': start, 'time': rundir.now(),
                       **({'changed': changed} if changed else {})}]}
        rundir.write_record(out, record)
      metrics = (rundir.MetricsLog(out, start, warn) if place.is_primary
                 else meshlib.NullMetrics())
      mngr = ckpt.manager(out, cfg.save_every, writer=True)
    except OSError as e:
      raise rundir.DiskFullError(disk_full_line(e, out)) if rundir.is_disk_full(e) else e
    try:
      rows = run_loop(cfg, task, size, policy, step_fn, state, batch_at, held_out, model, meta,
                   metrics,
                   mngr, log, warn, place, guard, record)
    finally:
      ckpt.close(mngr)
      metrics.close()
  except (OSError, rundir.DiskFullError) as e:
    if not rundir.is_disk_full(e):
      raise
    raise rundir.DiskFullError(disk_full_line(e, out)) from None
  return rows


def _claim(cfg: TrainConfig, out: Path, lock: rundir.RunLock, vision: bool, fresh: bool, warn):
  """The run's first writes, after every check: its pid in the lock file, an unreadable
  ``run.json`` set aside (its history kept), the tokenizer copy (:mod:`training.run.tokenizer_copy`).
  """
  try:
    lock.claim()
    problem = rundir.record_problem(out)
    if problem:
      kept = rundir.set_record_aside(out)
      warn(f'{out / rundir.RECORD_NAME} cannot be read ({problem}); it is kept as {kept} and '
           'a new run record starts here')
    if not vision:
      tokenizer_copy.write(cfg, out, fresh)   # export and sampling read the run's own copy
  except OSError as e:
    if rundir.is_disk_full(e):
      raise rundir.DiskFullError(disk_full_line(e, out)) from None
    raise


def _data_batch(task: Task, val):
  """The abstract batch of the run's text data (packed windows are a dict with segment ids and
  positions), which the step is compiled and ``--remat=auto`` plans with; None for vision, whose
  batch is the task's own."""
  if task.is_vision:
    return None
  return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), val[0])


def _data(cfg: TrainConfig, task: Task, size: int, log, warn, place: meshlib.Placement):
  """(batch_at(step), validation batches, what the run records about its data, the held-out
  sets evaluated: :class:`training.data.held_out.HeldOutSet`); logs the data."""
  if task.is_vision:
    from training.data.held_out import HeldOutSet
    from training.data.held_out_images import eval_image_sets
    from training.data.vision_source import open_vision_data
    rows = place.local_rows(cfg.batch_size)
    batch_at, val, meta = open_vision_data(cfg, task, size, log, rows)
    return batch_at, val, meta, [HeldOutSet('val', val)] + eval_image_sets(
        cfg, task, size, meta, log, warn, rows)
  return open_text(cfg, size, log, place.local_rows(cfg.batch_size), warn)


def _pretrained_state(variables: dict, tx, model, cfg, size: int, log) -> st.TrainState:
  model_state = {k: jax.tree_util.tree_map(jnp.asarray, v) for k, v in variables.items()
                 if k != 'params'}
  spec = getattr(model.config, 'lora', None)
  if spec is None:
    params = jax.tree_util.tree_map(jnp.asarray, variables['params'])
    return st.TrainState(step=jnp.zeros((), jnp.int32), params=params, model_state=model_state,
                         opt_state=tx.init(params))
  # The checkpoint's own trained part (a vision head) over fresh adapters.
  head = lora_params.split(variables['params'], Task(model.config).arch)[1]
  trained = lora_params.merge(_fresh_adapters(model, cfg.seed, size),
                              jax.tree_util.tree_map(jnp.asarray, head))
  return st.TrainState(step=jnp.zeros((), jnp.int32), params=trained, model_state=model_state,
                       opt_state=tx.init(trained),
                       frozen=_frozen_base(variables, model, tx, cfg, size, log))


def _fresh_adapters(model, seed: int, size: int) -> dict:
  """The trained part of a fresh LoRA model (its adapters), without allocating its random base:
  the init is jitted with only the adapters as outputs, so XLA drops the rest."""
  task = Task(model.config)
  return jax.jit(lambda: lora_params.split(task.init_variables(model, seed, size)[0],
                                           task.arch)[1])()


def _frozen_base(pretrained: dict | None, model, tx, cfg, size: int, log) -> dict:
  """A LoRA run's frozen base: the checkpoint's weights, or the seed's random ones, stored as
  the run keeps them (compute dtype; quantized kernels under QLoRA)."""
  mcfg = model.config
  if pretrained is None:
    return st.init_state(model, tx, cfg.seed, size).frozen
  arch = Task(mcfg).arch
  frozen = lora_params.split(pretrained['params'], arch)[0]
  return lora_base.freeze(frozen, mcfg.lora, arch, mcfg.dtype)

