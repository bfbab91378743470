"""A user's own model, written in plain JAX: a residual MLP of L layers in ``lax.scan``.

Nothing of the model zoo: the tests measure it with ``remat.measure`` and
``python -m remat.report --fn user_mlp:factory``. Each layer is
``h + tanh(h @ w1) @ w2`` with its two matmul outputs tagged ``up`` and ``down``.
"""

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

L, B, D, H = 16, 64, 32, 128   # layers, batch, width, hidden width (4 D: activations dominate)


def build(policy):
  """The loss under ``policy``: each scanned layer in jax.checkpoint with its rule (or not)."""
  def layer(h, w):
    w1, w2 = w
    up = checkpoint_name(h @ w1, 'up')
    return h + checkpoint_name(jnp.tanh(up) @ w2, 'down'), None
  layer = policy.checkpoint(layer, prevent_cse=False)   # unchanged under none

  def loss(params, x):
    h, _ = jax.lax.scan(layer, x, params)
    return jnp.mean(h ** 2)
  return loss


def untouched(params, x):
  """The user's model as written before remat: a Python loop over the layers, nothing checkpointed."""
  h = x
  for i in range(L):
    w1, w2 = params[0][i], params[1][i]
    h = h + jnp.tanh(h @ w1) @ w2
  return jnp.mean(h ** 2)


def reference():
  """What ``--reference user_mlp:reference`` calls: the untouched loss on the same arguments."""
  return untouched


def untouched_own(layers, x):
  """The untouched model on its own tree: a list of per-layer (w1, w2), as it was written."""
  h = x
  for w1, w2 in layers:
    h = h + jnp.tanh(h @ w1) @ w2
  return jnp.mean(h ** 2)


def own_args():
  """Abstract (per-layer params, x) for :func:`untouched_own`."""
  f32 = jnp.float32
  layers = [(jax.ShapeDtypeStruct((D, H), f32), jax.ShapeDtypeStruct((H, D), f32))
            for _ in range(L)]
  return layers, jax.ShapeDtypeStruct((B, D), f32)


def reference_own():
  """What ``--reference user_mlp:reference_own`` calls: the untouched loss and its own arguments."""
  return untouched_own, own_args()


def example_args():
  """Abstract (params, x): nothing is allocated."""
  f32 = jnp.float32
  params = (jax.ShapeDtypeStruct((L, D, H), f32), jax.ShapeDtypeStruct((L, H, D), f32))
  return params, jax.ShapeDtypeStruct((B, D), f32)


def factory():
  """What ``--fn user_mlp:factory`` calls."""
  return build, example_args()


def not_a_pair():
  return build
