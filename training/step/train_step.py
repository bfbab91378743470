"""Optimizer, train state and the jitted train / eval steps (pure functions of their inputs)."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import struct

from models.lora import params as lora_params
from models.tasks import Task


class TrainState(struct.PyTreeNode):
  """A run's state: step counter, trained parameters, model state, optimizer state, frozen base.

  ``model_state`` holds non-trained variables such as BatchNorm ``batch_stats``
  (``{}`` for models without them). In a LoRA run (``config.lora``) ``params``
  holds what trains (the adapters; a vision model's head) and ``frozen`` the
  base (:mod:`models.lora.params`): it gets no gradient and no optimizer state,
  and a checkpoint holds everything but it (:mod:`training.run.checkpoints`);
  otherwise ``frozen`` is None.
  """
  step: jax.Array
  params: Any
  model_state: Any
  opt_state: Any
  frozen: Any = None

  def model_params(self):
    """The whole parameter tree the model applies (the base joined to what trains)."""
    return lora_params.merge(self.frozen, self.params)


def lr_schedule(lr: float, steps: int, warmup_steps: int) -> optax.Schedule:
  """Linear warmup from 0 to ``lr``, then cosine decay to 10% of it at ``steps``; the update of
  step ``s`` (0-based: the row of step ``s + 1``) uses ``schedule(s)``."""
  return optax.warmup_cosine_decay_schedule(
      0.0, lr, max(1, warmup_steps), max(steps, warmup_steps + 1), end_value=lr * 0.1)


class LrTable:
  """``table(step)``: the learning rate of a step, computed :data:`BLOCK` steps at a time.

  One schedule call per step costs milliseconds of dispatch (1 s over the README's 200 steps); a
  jitted call per block of steps costs that once.
  """
  BLOCK = 1024

  def __init__(self, schedule: optax.Schedule):
    self._values = jax.jit(jax.vmap(schedule))
    self._block = (-1, None)

  def __call__(self, step: int) -> float:
    k = step // self.BLOCK
    if self._block[0] != k:
      import numpy as np
      self._block = (k, np.asarray(self._values(jnp.arange(k * self.BLOCK, (k + 1) * self.BLOCK))))
    return float(self._block[1][step % self.BLOCK])


def make_optimizer(lr: float, steps: int, warmup_steps: int, weight_decay: float,
                   grad_clip: float) -> optax.GradientTransformation:
  """AdamW with :func:`lr_schedule`, and global-norm clipping."""
  return optax.chain(clip_by_global_norm(grad_clip),
                     elementwise_optimizer(lr, steps, warmup_steps, weight_decay))


def elementwise_optimizer(lr: float, steps: int, warmup_steps: int,
                          weight_decay: float) -> optax.GradientTransformation:
  """:func:`make_optimizer` after its clip: AdamW with its schedule, element by element.

  ``--offload-optimizer`` (:mod:`training.step.offload`) applies it a slice at a time.
  """
  return optax.adamw(lr_schedule(lr, steps, warmup_steps), b1=0.9, b2=0.95,
                     weight_decay=weight_decay)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
  """``optax.clip_by_global_norm`` as a multiply by one scalar, ``min(1, max_norm / norm)``.

  The same clipping (equal within float32 rounding; empty state as optax's), but
  each clipped gradient is ``g * scale``, which XLA fuses into both of Adam's
  moment updates, instead of optax's per-element ``g / norm * max_norm``: XLA
  does not duplicate a divide into two consumers, so that form materialises a
  second, clipped copy of every gradient (the size of the parameters) during
  the update.
  """
  def update_fn(updates, state, params=None):
    del params
    norm = optax.tree.norm(updates)
    scale = jnp.minimum(1.0, max_norm / norm)   # 1 when the norm is 0 (max_norm / 0 = inf)
    return jax.tree_util.tree_map(lambda g: g * scale.astype(g.dtype), updates), state
  return optax.GradientTransformation(optax.init_empty_state, update_fn)


def _task(model: nn.Module) -> Task:
  return Task(model.config)


def init_state(model: nn.Module, tx: optax.GradientTransformation, seed: int,
               size: int) -> TrainState:
  """Initial variables (the same for every remat policy) and optimizer state.

  ``size`` is the sequence length (GPT) or image side (vision). A LoRA model's
  random base is split off and frozen (:func:`start_state`).
  """
  params, model_state = _task(model).init_variables(model, seed, size)
  return start_state(model, tx, params, model_state)


def start_state(model: nn.Module, tx: optax.GradientTransformation, params,
                model_state) -> TrainState:
  """The step-0 state of ``params``: with ``config.lora``, the base split off and frozen
  (compute dtype, kernels quantized under QLoRA) and the optimizer on the rest."""
  frozen, spec = None, getattr(model.config, 'lora', None)
  if spec is not None:
    task = _task(model)
    frozen, params = lora_params.split(params, task.arch)
    frozen = lora_params.freeze(frozen, spec, task.arch, model.config.dtype)
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, model_state=model_state,
                    opt_state=tx.init(params), frozen=frozen)


def lm_loss(model: nn.Module, params, windows, dropout_rng=None) -> jax.Array:
  """Mean next-byte cross-entropy (nats/byte) of a GPT over windows of ``seq_len + 1`` tokens."""
  return _task(model).loss(model, params, {}, windows, dropout_rng)[0]


def make_train_step(model: nn.Module, tx: optax.GradientTransformation, seed: int,
                    guard: bool = False, microbatches: int = 1, offload=None):
  """Returns ``step(state, batch) -> (state, loss)``; dropout key = fold_in(seed, step).

  With ``guard``, the step returns ``(state, stats)`` instead, ``stats`` being
  ``[loss, gradient global norm]`` (one small array, fetched in one transfer),
  and a step whose loss or gradient norm is not finite leaves parameters, model
  state and optimizer state as they were (only the step counter moves), so a
  caller may skip it or stop with the last good state.

  With ``microbatches`` K > 1 the batch's gradient is accumulated over K
  microbatches in a loop inside the step (:mod:`training.step.accumulate`;
  ``--grad-accum``): the same update, activations sized by ``B / K``.

  With ``offload`` (a :class:`training.step.offload.Offload` of ``tx``'s parts),
  the update streams the optimizer state from host memory a slice at a time
  (``--offload-optimizer``): the same update.
  """
  task = _task(model)

  def train_step(state: TrainState, batch):
    rng = jax.random.fold_in(jax.random.PRNGKey(seed), state.step)
    # Only the trained part is differentiated: a LoRA base gets no gradient at all.
    loss_of = lambda p, s, b, key: task.loss(model, lora_params.merge(state.frozen, p), s, b, key)
    if microbatches == 1:
      (loss, (model_state, _)), grads = jax.value_and_grad(
          lambda p: loss_of(p, state.model_state, batch, rng), has_aux=True)(state.params)
    else:
      from training.step.accumulate import accumulated_value_and_grad
      loss, model_state, grads = accumulated_value_and_grad(
          loss_of, state.params, state.model_state, batch, microbatches, rng)
    if offload is not None:
      from training.step.offload import apply_gradients_streamed
      return apply_gradients_streamed(offload, state, loss, grads, model_state, guard)
    return apply_gradients(tx, state, loss, grads, model_state, guard)
  return train_step


def apply_gradients(tx: optax.GradientTransformation, state: TrainState, loss, grads,
                    model_state, guard: bool):
  """The step's update from its loss and gradients: ``(new state, loss or stats)``.

  The new state is ``state.replace(...)``, so a LoRA run's ``frozen`` base is
  carried through unchanged. ``guard``: see :func:`make_train_step`.
  """
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  new = state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                      model_state=model_state, opt_state=opt_state)
  if not guard:
    return new, loss
  # One reduction to a scalar (the clip reduces the same gradients; XLA may share the two).
  grad_norm = optax.tree.norm(grads)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  keep = lambda n, o: jax.tree_util.tree_map(lambda a, b: jnp.where(finite, a, b), n, o)
  return new.replace(params=keep(new.params, state.params),
                     model_state=keep(new.model_state, state.model_state),
                     opt_state=keep(new.opt_state, state.opt_state)), jnp.stack(
                         [loss.astype(jnp.float32), grad_norm.astype(jnp.float32)])


def measured_step(model: nn.Module, tx: optax.GradientTransformation, seed: int,
                  guard: bool = False, dropout_seed: int = 0, microbatches: int = 1,
                  offload=None):
  """The train step as :func:`remat.measure` takes it (:class:`remat.measuring.TrainStep`).

  The loss it differentiates is ``loss(params, (frozen, model_state, batch))``
  in training mode (dropout keyed by ``dropout_seed``): a LoRA run's frozen base
  is an input of the loss, not a differentiated parameter.

  ``microbatches`` and ``offload`` are :func:`make_train_step`'s. With
  ``microbatches`` K > 1 the loss's batch is one microbatch (``B / K`` rows):
  the residuals are what the backward pass keeps at a time. With ``offload``
  the TrainStep carries its own compile
  (:func:`training.step.offload.compile_for_target`), with the streamed
  optimizer state in host memory.
  """
  from remat.measuring import TrainStep
  task = _task(model)

  def loss(params, inputs):
    frozen, model_state, batch = inputs
    return task.loss(model, lora_params.merge(frozen, params), model_state, batch,
                     jax.random.PRNGKey(dropout_seed))[0]

  def args(state, batch):
    if microbatches > 1:
      batch = jax.tree_util.tree_map(
          lambda a: jax.ShapeDtypeStruct((a.shape[0] // microbatches, *a.shape[1:]), a.dtype),
          batch)
    return loss_inputs(state, batch)

  step = make_train_step(model, tx, seed, guard, microbatches=microbatches, offload=offload)
  if offload is None:
    return TrainStep(step, loss, args)
  from training.step import offload as ol
  return TrainStep(step, loss, args,
                   lambda example, target: ol.compile_for_target(step, *example, offload, target))


def weight_bytes(state: TrainState) -> int:
  """Bytes of every weight a forward pass reads: the trained parameters and a frozen base (LoRA)."""
  return sum(a.size * a.dtype.itemsize
             for a in jax.tree_util.tree_leaves((state.params, state.frozen)))


def loss_inputs(state: TrainState, batch):
  """``(params, (frozen, model_state, batch))``: the arguments of :func:`measured_step`'s loss."""
  return state.params, (state.frozen, state.model_state, batch)


def abstract_inputs(model: nn.Module, tx: optax.GradientTransformation, batch_size: int,
                    size: int, seed: int = 0):
  """Shapes of the train state and of a batch; nothing is allocated."""
  state = jax.eval_shape(lambda: init_state(model, tx, seed, size))
  return state, _task(model).batch_shape(batch_size, size)


def compile_train_step(model: nn.Module, tx: optax.GradientTransformation, seed: int,
                       state, batch, compiler_options: dict | None = None, guard: bool = False,
                       microbatches: int = 1):
  """AOT-compiles the train step for (abstract) ``state`` and ``batch``, donating the state.

  ``compiler_options`` default to :func:`remat.targets.compiler_options` of the
  local backend (on CPU they keep one-iteration loops, so their remat holds).
  ``guard``, ``microbatches``: see :func:`make_train_step`.
  """
  from remat.targets import compiler_options as local_options
  options = local_options() if compiler_options is None else compiler_options
  step = jax.jit(make_train_step(model, tx, seed, guard, microbatches), donate_argnums=0)
  return step.lower(state, batch).compile(compiler_options=options or None)


def make_eval_step(model: nn.Module):
  """Returns ``eval(params, model_state, batch) -> (loss, metrics)`` in inference mode.

  ``params`` is the whole tree (:meth:`TrainState.model_params`).
  """
  task = _task(model)

  def eval_step(params, model_state, batch):
    loss, (_, metrics) = task.loss(model, params, model_state, batch)
    return loss, metrics
  return jax.jit(eval_step)
