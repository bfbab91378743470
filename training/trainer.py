"""The training run: validation of settings, memory line, loop, metrics and checkpoints."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from tqdm import tqdm

from configs import DEFAULT_CONFIG, NamedConfig, config_names, load_config
from remat.memory import MemoryStats, compiled_memory, format_bytes
from remat.policies import Policy, get_policy
from training import steps as st
from training.data import load_text
from training.images import load_images
from training.tasks import Task


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Every setting of a run; built once from the named config plus flags.

  ``seq_len`` applies to GPT configs, ``image_size`` to vision configs (None:
  the model config's image size). ``model``, if set, is the arch the config
  must have.
  """
  config: str = 'tiny'
  remat: str = 'sqrt'
  model: str | None = None
  steps: int = 300
  batch_size: int = 16
  seq_len: int = 128
  image_size: int | None = None
  lr: float = 3e-3
  warmup_steps: int = 30
  weight_decay: float = 0.1
  grad_clip: float = 1.0
  seed: int = 0
  data: str | None = None
  out: str | None = None
  resume: bool = False
  init_from: str | None = None
  eval_every: int = 50
  eval_batches: int = 8
  save_every: int = 100
  memory_report: bool = True

  @property
  def out_dir(self) -> Path:
    if self.out:
      return Path(self.out)
    safe = ''.join(c if c.isalnum() or c in '-_.' else '_' for c in self.remat)
    return Path('runs') / f'{self.config}-{safe}'


class RunError(ValueError):
  """A setting that cannot be used; the message is one line."""


def _check_positive(cfg: TrainConfig):
  for name in ('steps', 'batch_size', 'seq_len', 'eval_every', 'eval_batches', 'save_every'):
    if getattr(cfg, name) < 1:
      raise RunError(f'--{name.replace("_", "-")} must be >= 1, got {getattr(cfg, name)}')
  if cfg.warmup_steps < 0:
    raise RunError(f'--warmup-steps must be >= 0, got {cfg.warmup_steps}')
  if not cfg.lr > 0:
    raise RunError(f'--lr must be > 0, got {cfg.lr}')


def resolve(cfg: TrainConfig) -> tuple[NamedConfig, Task, int, Policy]:
  """Checks the config, the shapes and the policy (against the model's depth and tags).

  Returns:
    (named config, task, size, policy); size is the sequence length (GPT) or
    the image side (vision).
  """
  _check_positive(cfg)
  named = load_config(cfg.config)
  if cfg.model is not None and cfg.model != named.arch:
    raise RunError(f"--model {cfg.model} does not match config {named.name} (a {named.arch} "
                   f"model); {cfg.model} configs: {', '.join(config_names(cfg.model))}")
  task = Task(named.model)
  model_cfg = named.model
  if task.is_vision:
    size = cfg.image_size or model_cfg.image_size
    if task.arch == 'vit' and size != model_cfg.image_size:
      raise RunError(f'--image-size {size} does not fit config {named.name}: its positions are '
                     f'learned for {model_cfg.image_size}x{model_cfg.image_size}; pick a config '
                     f"of that size ({', '.join(config_names('vit'))})")
    if task.arch == 'resnet' and size < 32:
      raise RunError(f'--image-size must be >= 32 for a ResNet, got {size}')
  else:
    if cfg.image_size is not None:
      raise RunError(f'--image-size applies to vit and resnet configs; {named.name} is a gpt '
                     'config (use --seq-len)')
    size = cfg.seq_len
    if size > model_cfg.max_len:
      raise RunError(f'--seq-len {size} exceeds config {named.name} max_len {model_cfg.max_len}')
    if model_cfg.vocab_size < 256:
      raise RunError(f'config {named.name} has vocab_size {model_cfg.vocab_size}; '
                     'byte data needs >= 256')
  policy = get_policy(cfg.remat, num_layers=task.num_layers)
  return named, task, size, policy.validate(task.num_layers, task.emitted_tags(size))


def default_config(model: str | None) -> str:
  """The config a run uses when only ``--model`` (or nothing) is given."""
  if model is None:
    return TrainConfig.config
  if model not in DEFAULT_CONFIG:
    raise RunError(f"unknown --model '{model}'; valid: {', '.join(DEFAULT_CONFIG)}")
  return DEFAULT_CONFIG[model]


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


def _manager(out: Path, save_every: int) -> ocp.CheckpointManager:
  opts = ocp.CheckpointManagerOptions(save_interval_steps=save_every, max_to_keep=2,
                                      enable_async_checkpointing=False)
  return ocp.CheckpointManager(out.resolve() / 'checkpoints', options=opts,
                               item_names=('state', 'meta'))


def _save(mngr, state, meta, force=False):
  mngr.save(int(state.step), force=force, args=ocp.args.Composite(
      state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))


def restore(out: Path, state_shape, step: int | None = None):
  """Restores (state, meta) from ``out``'s latest (or given) checkpoint."""
  mngr = _manager(out, 1)
  step = mngr.latest_step() if step is None else step
  if step is None:
    raise RunError(f"--resume: no checkpoint in {out / 'checkpoints'}")
  got = mngr.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(state_shape), meta=ocp.args.JsonRestore()))
  mngr.close()
  return got.state, got.meta


def read_meta(out: Path) -> dict | None:
  """The settings recorded in ``out``'s latest checkpoint, or None if it has none."""
  if not (out / 'checkpoints').is_dir():
    return None
  mngr = _manager(out, 1)
  step = mngr.latest_step()
  meta = None if step is None else mngr.restore(
      step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
  mngr.close()
  return meta


def _drop_rows_after(path: Path, step: int):
  # A resumed run re-does the steps after its checkpoint; their old rows go.
  if path.exists():
    kept = [l for l in path.read_text().splitlines() if l and json.loads(l)['step'] <= step]
    path.write_text(''.join(l + '\n' for l in kept))


def train(cfg: TrainConfig, log=print) -> list[dict]:
  """Runs training; returns the metric rows it wrote to ``<out>/metrics.jsonl``."""
  named, task, size, policy = resolve(cfg)
  out = cfg.out_dir
  has_ckpt = (out / 'checkpoints').is_dir() and any((out / 'checkpoints').iterdir())
  if has_ckpt and not cfg.resume:
    raise RunError(f'{out} already holds checkpoints; pass --resume to continue it or --out for a new run')
  if cfg.resume and not has_ckpt:
    raise RunError(f"--resume: no checkpoint in {out / 'checkpoints'}")
  pretrained = None
  if cfg.init_from and not cfg.resume:
    from models.hf import load_hf
    pretrained = load_hf(cfg.init_from, expect_arch=named.arch, config=named.model)[2]
  batch_at, val = _data(cfg, task, size, log)
  log(f'model: {named.name} ({named.description}) | policy: {policy.spec}: {policy.description}')

  model = task.model(policy)
  tx = st.make_optimizer(cfg.lr, cfg.steps, cfg.warmup_steps, cfg.weight_decay, cfg.grad_clip)
  state_shape, batch_shape = st.abstract_inputs(model, tx, cfg.batch_size, size, cfg.seed)
  step_fn = st.compile_train_step(model, tx, cfg.seed, state_shape, batch_shape)
  if cfg.memory_report:
    base = step_fn if policy.spec == 'none' else st.compile_train_step(
        task.model('none'), tx, cfg.seed, state_shape, batch_shape)
    log(memory_line(policy, compiled_memory(step_fn), compiled_memory(base)))

  meta = {'config': named.name, 'arch': named.arch, 'model': dataclasses.asdict(named.model),
          'policy': policy.spec,
          'train': {k: v for k, v in dataclasses.asdict(cfg).items() if k != 'resume'}}
  if cfg.resume:
    state, saved = restore(out, state_shape)
    if saved['config'] != named.name:
      raise RunError(f"--resume: {out} was trained with config {saved['config']}, not {named.name}")
    log(f"resumed step {int(state.step)} (saved under policy {saved['policy']})")
  elif pretrained is not None:
    state = _pretrained_state(pretrained, tx)
    log(f'initialised from the Hugging Face checkpoint {cfg.init_from}')
  else:
    state = st.init_state(model, tx, cfg.seed, size)
  out.mkdir(parents=True, exist_ok=True)
  _drop_rows_after(out / 'metrics.jsonl', int(state.step))
  mngr = _manager(out, cfg.save_every)
  eval_step = st.make_eval_step(model)
  rows = []
  start = int(state.step)
  # Throughput unit: tokens (bytes) for GPT, images for vision.
  unit, per_step = ('img', cfg.batch_size) if task.is_vision else ('tok', cfg.batch_size * size)
  with open(out / 'metrics.jsonl', 'a') as metrics, tqdm(
      total=cfg.steps, initial=start, desc=f'train {policy.spec}', unit='step',
      file=sys.stdout, dynamic_ncols=True, mininterval=0.5) as bar:
    t0 = time.perf_counter()
    for step in range(start, cfg.steps):
      state, loss = step_fn(state, batch_at(step))
      loss = float(loss)  # waits for the step, so the clock below is honest
      t1 = time.perf_counter()
      row = {'step': step + 1, 'loss': round(loss, 5),
             f'{"images" if task.is_vision else "tokens"}_per_s': round(per_step / (t1 - t0), 1),
             'policy': policy.spec}
      if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
        row.update(_evaluate(eval_step, state, val))
      metrics.write(json.dumps(row) + '\n')
      rows.append(row)
      bar.set_postfix(loss=f'{loss:.3f}', val=row.get('val_loss', '-'),
                      **{f'{unit}_s': f'{per_step / (t1 - t0):.0f}'})
      bar.update()
      _save(mngr, state, meta, force=step + 1 == cfg.steps)
      t0 = time.perf_counter()
  mngr.wait_until_finished()
  mngr.close()
  if rows and 'val_loss' in rows[-1]:
    last = rows[-1]
    what = (f"val loss {last['val_loss']:.3f}, val accuracy {last['val_accuracy']:.1%}"
            if task.is_vision else f"val loss {last['val_loss']:.3f} nats/byte")
    log(f"done: step {last['step']}, train loss {last['loss']:.3f}, {what}; "
        f"metrics and checkpoints in {out}")
  return rows


def _data(cfg: TrainConfig, task: Task, size: int, log):
  """(batch_at(step), validation batches) for the task; logs what the data is."""
  if task.is_vision:
    mc = task.config
    data = load_images(size, min(10, mc.num_classes), mc.channels)
    batch_at = lambda step: _image_batch(data.batch(step, cfg.batch_size, cfg.seed))
    val = [_image_batch(b) for b in data.val_batches(cfg.eval_batches, cfg.batch_size)]
    log(f'data: {data.source}: a fresh training batch every step, {len(val) * cfg.batch_size} '
          'held-out images')
    return batch_at, val
  data = load_text(cfg.data, size)
  log(f'data: {data.source}: {data.num_files} files, {len(data.train):,} train / '
        f'{len(data.val):,} val bytes')
  batch_at = lambda step: data.batch(step, cfg.batch_size, size, cfg.seed)
  return batch_at, data.val_batches(cfg.eval_batches, cfg.batch_size, size)


def _pretrained_state(variables: dict, tx) -> st.TrainState:
  params = jax.tree_util.tree_map(jnp.asarray, variables['params'])
  model_state = {k: jax.tree_util.tree_map(jnp.asarray, v) for k, v in variables.items()
                 if k != 'params'}
  return st.TrainState(step=jnp.zeros((), jnp.int32), params=params, model_state=model_state,
                       opt_state=tx.init(params))


def matching_config(path: str) -> str:
  """The shipped config whose model shape equals that of the Hugging Face checkpoint at ``path``.

  Raises:
    RunError: one line, naming the checkpoint's shape when no shipped config has it.
  """
  from models.hf import load_hf_config
  arch, hf_cfg = load_hf_config(path)
  for name in config_names(arch):
    ours = load_config(name).model
    # A ResNet's image_size is only its default training side, not part of its shape.
    if ours == (dataclasses.replace(hf_cfg, image_size=ours.image_size)
                if arch == 'resnet' else hf_cfg):
      return name
  raise RunError(f'--init-from {path}: no shipped {arch} config has its shape ({hf_cfg}); '
                 'pass --config NAME of a config with that shape')


def _image_batch(pair):
  images, labels = pair
  return {'images': jnp.asarray(images), 'labels': jnp.asarray(labels)}


def _evaluate(eval_step, state, val) -> dict:
  """Mean validation loss (and accuracy for vision) over the held-out batches."""
  results = [eval_step(state.params, state.model_state, b) for b in val]
  out = {'val_loss': round(float(np.mean([float(l) for l, _ in results])), 5)}
  for name in results[0][1]:
    out[f'val_{name}'] = round(float(np.mean([float(m[name]) for _, m in results])), 5)
  return out
