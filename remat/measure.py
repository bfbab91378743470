"""Measure one policy's train step: compiled memory, residuals, FLOPs and (optionally) time.

Everything except time is compile-only on abstract inputs, so shapes far larger
than the machine can be planned; a later memory-budget policy can call
:func:`measure` once per candidate.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp

from remat.flops import FlopCount, count_flops
from remat.memory import MemoryStats, compiled_memory
from remat.policies import Policy, get_policy
from remat.residuals import Residual, saved_residuals
from remat.targets import Target


@dataclasses.dataclass(frozen=True)
class Measurement:
  """What one policy's train step costs (definitions in remat.memory / flops / residuals)."""
  spec: str
  memory: MemoryStats
  flops: FlopCount
  residuals: tuple[Residual, ...]
  step_seconds: float | None = None

  @property
  def residual_bytes(self) -> int:
    return sum(r.nbytes for r in self.residuals)


def _gpt_step(model_cfg, spec: str | Policy, batch_size: int, seq_len: int):
  from models.gpt import GPT
  from training import steps as st
  if seq_len > model_cfg.max_len:
    raise ValueError(f'--seq-len {seq_len} exceeds the model max_len {model_cfg.max_len}')
  policy = get_policy(spec, num_layers=model_cfg.num_layers)
  model = GPT(model_cfg, policy)
  tx = st.make_optimizer(1e-3, 1000, 10, 0.1, 1.0)
  state, batch = st.abstract_inputs(model, tx, batch_size, seq_len)
  loss = lambda params, windows: st.lm_loss(model, params, windows, jax.random.PRNGKey(0))
  return policy, model, tx, state, batch, st.make_train_step(model, tx, 0), loss


def time_step(compiled, state, batch, steps: int = 5, warmup: int = 2) -> float:
  """Median seconds of ``steps`` runs of a compiled (state-donating) train step after warm-up."""
  times = []
  for i in range(warmup + steps):
    t = time.perf_counter()
    state, loss = compiled(state, batch)
    jax.block_until_ready(loss)
    if i >= warmup:
      times.append(time.perf_counter() - t)
  return statistics.median(times)


def step_memory(model_cfg, spec: str | Policy, batch_size: int, seq_len: int,
                target: Target) -> MemoryStats:
  """Compiled memory of the train step alone (no FLOP or residual walk)."""
  from training import steps as st
  _, model, tx, state, batch, _, _ = _gpt_step(model_cfg, spec, batch_size, seq_len)
  compiled = st.compile_train_step(model, tx, 0, target.place(state), target.place(batch))
  return compiled_memory(compiled, target.name)


def step_flops(model_cfg, spec: str | Policy, batch_size: int, seq_len: int) -> FlopCount:
  """Matmul/conv FLOPs of the train step, recompute included (jaxpr walk, nothing compiled)."""
  _, _, _, state, batch, step, _ = _gpt_step(model_cfg, spec, batch_size, seq_len)
  return count_flops(step, state, batch)


def grad_memory(model_cfg, spec: str | Policy, batch_size: int, seq_len: int,
                target: Target) -> MemoryStats:
  """Compiled memory of the loss gradient alone (no optimizer update).

  Parameters are arguments and their gradients outputs, so ``temp`` is the
  activation memory: saved residuals, recompute working sets and transient
  buffers, without the O(N) gradient and optimizer buffers of the train step.
  """
  policy, _, _, state, batch, _, loss = _gpt_step(model_cfg, spec, batch_size, seq_len)
  grad = jax.jit(jax.grad(loss))
  compiled = grad.lower(target.place(state.params), target.place(batch)).compile()
  return compiled_memory(compiled, target.name)


def measure(model_cfg, spec: str | Policy, batch_size: int, seq_len: int, target: Target,
            run: bool = False, time_steps: int = 5) -> Measurement:
  """Measures the GPT train step (forward, backward, AdamW; state donated) under ``spec``.

  Args:
    model_cfg: a :class:`models.gpt.GPTConfig`.
    spec: the policy.
    batch_size, seq_len: the batch shape.
    target: where to compile for (:func:`remat.targets.get_target`).
    run: also time the step (allocates the model; local backend only).
    time_steps: timed steps after 2 warm-up steps.
  """
  from training import steps as st
  policy, model, tx, state, batch, step, loss = _gpt_step(model_cfg, spec, batch_size, seq_len)
  compiled = st.compile_train_step(model, tx, 0, target.place(state), target.place(batch))
  seconds = None
  if run:
    if target.sharding is not None:
      raise ValueError(f'--time runs the step, which needs an attached {target.name}; '
                       'time on the local backend (--target cpu) instead')
    real_state = st.init_state(model, tx, 0, seq_len)
    windows = jnp.zeros(batch.shape, batch.dtype)
    seconds = time_step(compiled, real_state, windows, time_steps)
  return Measurement(policy.spec, compiled_memory(compiled, target.name),
                     count_flops(step, state, batch),
                     tuple(saved_residuals(loss, state.params, batch)), seconds)
