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


def _step(model_cfg, spec: str | Policy, batch_size: int, size: int):
  """Policy, model, optimizer, abstract state and batch, step and loss of one model config."""
  from training import steps as st
  from training.tasks import Task
  task = Task(model_cfg).at_size(size)
  policy = get_policy(spec, num_layers=task.num_layers)
  model = task.model(policy)
  tx = st.make_optimizer(1e-3, 1000, 10, 0.1, 1.0)
  state, batch = st.abstract_inputs(model, tx, batch_size, size)
  # The loss of a training step (dropout on, BatchNorm on batch statistics),
  # as fn(params, (model_state, batch)) for the residual and gradient walks.
  def loss(params, inputs):
    return task.loss(model, params, inputs[0], inputs[1], jax.random.PRNGKey(0))[0]
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


def _real_inputs(model, tx, batch, size: int):
  """The initial train state and a zero batch of ``batch``'s shapes, allocated."""
  from training import steps as st
  zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), batch)
  return st.init_state(model, tx, 0, size), zeros


def local_step(model_cfg, spec: str | Policy, batch_size: int, size: int):
  """The train step compiled for the local backend, with inputs to run it on.

  Returns:
    ``(compiled, state, batch)``: call ``compiled(state, batch) -> (state, loss)``
    (the state is donated, so pass the returned one to the next call).
  """
  from training import steps as st
  _, model, tx, state, batch, _, _ = _step(model_cfg, spec, batch_size, size)
  compiled = st.compile_train_step(model, tx, 0, state, batch)
  return (compiled, *_real_inputs(model, tx, batch, size))


def step_memory(model_cfg, spec: str | Policy, batch_size: int, size: int,
                target: Target) -> MemoryStats:
  """Compiled memory of the train step alone (no FLOP or residual walk)."""
  from training import steps as st
  _, model, tx, state, batch, _, _ = _step(model_cfg, spec, batch_size, size)
  compiled = st.compile_train_step(model, tx, 0, target.place(state), target.place(batch),
                                   target.compiler_options)
  return compiled_memory(compiled, target.name)


def step_flops(model_cfg, spec: str | Policy, batch_size: int, size: int) -> FlopCount:
  """Matmul/conv FLOPs of the train step, recompute included (jaxpr walk, nothing compiled)."""
  _, _, _, state, batch, step, _ = _step(model_cfg, spec, batch_size, size)
  return count_flops(step, state, batch)


def grad_memory(model_cfg, spec: str | Policy, batch_size: int, size: int,
                target: Target) -> MemoryStats:
  """Compiled memory of the loss gradient alone (no optimizer update).

  Parameters are arguments and their gradients outputs, so ``temp`` is the
  activation memory: saved residuals, recompute working sets and transient
  buffers, without the O(N) gradient and optimizer buffers of the train step.
  """
  policy, _, _, state, batch, _, loss = _step(model_cfg, spec, batch_size, size)
  grad = jax.jit(jax.grad(loss))
  compiled = grad.lower(target.place(state.params), target.place((state.model_state, batch))
                        ).compile(compiler_options=target.compiler_options or None)
  return compiled_memory(compiled, target.name)


def measure(model_cfg, spec: str | Policy, batch_size: int, size: int, target: Target,
            run: bool = False, time_steps: int = 5) -> Measurement:
  """Measures a train step (forward, backward, AdamW; state donated) under ``spec``.

  Args:
    model_cfg: a GPTConfig, ViTConfig or ResNetConfig.
    spec: the policy.
    batch_size, size: the batch shape; size is the sequence length (GPT) or
      the image side (vision).
    target: where to compile for (:func:`remat.targets.get_target`).
    run: also time the step (allocates the model; local backend only).
    time_steps: timed steps after 2 warm-up steps.
  """
  from training import steps as st
  policy, model, tx, state, batch, step, loss = _step(model_cfg, spec, batch_size, size)
  compiled = st.compile_train_step(model, tx, 0, target.place(state), target.place(batch),
                                   target.compiler_options)
  seconds = None
  if run:
    if target.sharding is not None:
      raise ValueError(f'--time runs the step, which needs an attached {target.name}; '
                       'time on the local backend (--target cpu) instead')
    seconds = time_step(compiled, *_real_inputs(model, tx, batch, size), time_steps)
  return Measurement(policy.spec, compiled_memory(compiled, target.name),
                     count_flops(step, state, batch),
                     tuple(saved_residuals(loss, state.params, (state.model_state, batch))),
                     seconds)
