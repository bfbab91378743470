"""Loss, optimizer and the jitted train / eval steps (pure functions of their inputs)."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import struct


class TrainState(struct.PyTreeNode):
  """What a checkpoint holds: step counter, parameters, optimizer state."""
  step: jax.Array
  params: Any
  opt_state: Any


def make_optimizer(lr: float, steps: int, warmup_steps: int, weight_decay: float,
                   grad_clip: float) -> optax.GradientTransformation:
  """AdamW with linear warmup, cosine decay to 10% of ``lr``, and global-norm clipping."""
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, lr, max(1, warmup_steps), max(steps, warmup_steps + 1), end_value=lr * 0.1)
  return optax.chain(optax.clip_by_global_norm(grad_clip),
                     optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=weight_decay))


def init_state(model: nn.Module, tx: optax.GradientTransformation, seed: int,
               seq_len: int) -> TrainState:
  """Initial parameters (the same for every remat policy) and optimizer state."""
  params = model.init(jax.random.PRNGKey(seed), jnp.zeros((1, seq_len), jnp.int32))['params']
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))


def lm_loss(model: nn.Module, params, windows, dropout_rng=None) -> jax.Array:
  """Mean next-byte cross-entropy (nats/byte) over windows of ``seq_len + 1`` tokens."""
  logits = model.apply({'params': params}, windows[:, :-1], deterministic=dropout_rng is None,
                       rngs=None if dropout_rng is None else {'dropout': dropout_rng})
  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), windows[:, 1:]).mean()


def make_train_step(model: nn.Module, tx: optax.GradientTransformation, seed: int):
  """Returns ``step(state, windows) -> (state, loss)``; dropout key = fold_in(seed, step)."""
  def train_step(state: TrainState, windows):
    rng = jax.random.fold_in(jax.random.PRNGKey(seed), state.step)
    loss, grads = jax.value_and_grad(lambda p: lm_loss(model, p, windows, rng))(state.params)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    return TrainState(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                      opt_state=opt_state), loss
  return train_step


def abstract_inputs(model: nn.Module, tx: optax.GradientTransformation, batch_size: int,
                    seq_len: int, seed: int = 0):
  """Shapes of the train state and of a batch of windows; nothing is allocated."""
  state = jax.eval_shape(lambda: init_state(model, tx, seed, seq_len))
  return state, jax.ShapeDtypeStruct((batch_size, seq_len + 1), jnp.int32)


def compile_train_step(model: nn.Module, tx: optax.GradientTransformation, seed: int,
                       state, batch):
  """AOT-compiles the train step for (abstract) ``state`` and ``batch``, donating the state."""
  return jax.jit(make_train_step(model, tx, seed), donate_argnums=0).lower(state, batch).compile()


def make_eval_step(model: nn.Module):
  """Returns ``eval(params, windows) -> loss`` without dropout."""
  return jax.jit(lambda params, windows: lm_loss(model, params, windows))
