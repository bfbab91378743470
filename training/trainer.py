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

from configs import NamedConfig, load_config
from models.gpt import GPT
from remat.memory import MemoryStats, compiled_memory, format_bytes
from remat.policies import Policy, get_policy
from remat.tags import emitted_tags
from training import steps as st
from training.data import TextData, load_text


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Every setting of a run; built once from the named config plus flags."""
  config: str = 'tiny'
  remat: str = 'sqrt'
  steps: int = 300
  batch_size: int = 16
  seq_len: int = 128
  lr: float = 3e-3
  warmup_steps: int = 30
  weight_decay: float = 0.1
  grad_clip: float = 1.0
  seed: int = 0
  data: str | None = None
  out: str | None = None
  resume: bool = False
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


def resolve(cfg: TrainConfig) -> tuple[NamedConfig, Policy]:
  """Checks the config, the policy (against the model's depth and tags) and the shapes."""
  _check_positive(cfg)
  named = load_config(cfg.config)
  model_cfg = named.model
  if cfg.seq_len > model_cfg.max_len:
    raise RunError(f'--seq-len {cfg.seq_len} exceeds config {named.name} max_len {model_cfg.max_len}')
  if model_cfg.vocab_size < 256:
    raise RunError(f'config {named.name} has vocab_size {model_cfg.vocab_size}; byte data needs >= 256')
  policy = get_policy(cfg.remat, num_layers=model_cfg.num_layers)
  model = GPT(model_cfg, 'none')
  params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32)))
  tags = emitted_tags(lambda p, x: model.apply(p, x), params,
                      jax.ShapeDtypeStruct((1, 8), jnp.int32))
  return named, policy.validate(model_cfg.num_layers, tags)


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
  named, policy = resolve(cfg)
  out = cfg.out_dir
  has_ckpt = (out / 'checkpoints').is_dir() and any((out / 'checkpoints').iterdir())
  if has_ckpt and not cfg.resume:
    raise RunError(f'{out} already holds checkpoints; pass --resume to continue it or --out for a new run')
  if cfg.resume and not has_ckpt:
    raise RunError(f"--resume: no checkpoint in {out / 'checkpoints'}")
  data: TextData = load_text(cfg.data, cfg.seq_len)
  log(f'data: {data.source}: {data.num_files} files, {len(data.train):,} train / '
      f'{len(data.val):,} val bytes')
  log(f'model: {named.name} ({named.description}) | policy: {policy.spec}: {policy.description}')

  model = GPT(named.model, policy)
  tx = st.make_optimizer(cfg.lr, cfg.steps, cfg.warmup_steps, cfg.weight_decay, cfg.grad_clip)
  state_shape, batch_shape = st.abstract_inputs(model, tx, cfg.batch_size, cfg.seq_len, cfg.seed)
  step_fn = st.compile_train_step(model, tx, cfg.seed, state_shape, batch_shape)
  if cfg.memory_report:
    base = step_fn if policy.spec == 'none' else st.compile_train_step(
        GPT(named.model, 'none'), tx, cfg.seed, state_shape, batch_shape)
    log(memory_line(policy, compiled_memory(step_fn), compiled_memory(base)))

  meta = {'config': named.name, 'model': dataclasses.asdict(named.model), 'policy': policy.spec,
          'train': {k: v for k, v in dataclasses.asdict(cfg).items() if k != 'resume'}}
  if cfg.resume:
    state, saved = restore(out, state_shape)
    if saved['config'] != named.name:
      raise RunError(f"--resume: {out} was trained with config {saved['config']}, not {named.name}")
    log(f"resumed step {int(state.step)} (saved under policy {saved['policy']})")
  else:
    state = st.init_state(model, tx, cfg.seed, cfg.seq_len)
  out.mkdir(parents=True, exist_ok=True)
  _drop_rows_after(out / 'metrics.jsonl', int(state.step))
  mngr = _manager(out, cfg.save_every)
  eval_step = st.make_eval_step(model)
  val = data.val_batches(cfg.eval_batches, cfg.batch_size, cfg.seq_len)
  rows = []
  start = int(state.step)
  tokens = cfg.batch_size * cfg.seq_len
  with open(out / 'metrics.jsonl', 'a') as metrics, tqdm(
      total=cfg.steps, initial=start, desc=f'train {policy.spec}', unit='step',
      file=sys.stdout, dynamic_ncols=True, mininterval=0.5) as bar:
    t0 = time.perf_counter()
    for step in range(start, cfg.steps):
      state, loss = step_fn(state, data.batch(step, cfg.batch_size, cfg.seq_len, cfg.seed))
      loss = float(loss)  # waits for the step, so the clock below is honest
      t1 = time.perf_counter()
      row = {'step': step + 1, 'loss': round(loss, 5), 'tokens_per_s': round(tokens / (t1 - t0), 1),
             'policy': policy.spec}
      if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
        row['val_loss'] = round(float(np.mean([float(eval_step(state.params, v)) for v in val])), 5)
      metrics.write(json.dumps(row) + '\n')
      rows.append(row)
      bar.set_postfix(loss=f'{loss:.3f}', val=row.get('val_loss', '-'),
                      tok_s=f"{row['tokens_per_s']:.0f}")
      bar.update()
      _save(mngr, state, meta, force=step + 1 == cfg.steps)
      t0 = time.perf_counter()
  mngr.wait_until_finished()
  mngr.close()
  if rows and 'val_loss' in rows[-1]:
    log(f"done: step {rows[-1]['step']}, train loss {rows[-1]['loss']:.3f}, "
        f"val loss {rows[-1]['val_loss']:.3f} nats/byte; metrics and checkpoints in {out}")
  return rows
