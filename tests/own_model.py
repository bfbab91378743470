"""A user's own model, written three ways: a residual MLP block in linen, in NNX and in plain JAX.

All three hold the same parameters (``w1 [D, H]``, ``b1 [H]``, ``w2 [H, D]`` per
layer) and compute the same function, so one set of stacked parameters drives
all three front doors and a hand-written ``lax.scan`` with no remat.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

DEPTH, WIDTH, HIDDEN, BATCH = 16, 128, 512, 128
TAG = 'fc1'   # the tag the block emits


def mlp(p, x, scale=1.0):
  """One residual MLP layer; ``scale`` stands for a per-call input (a mask, a flag)."""
  h = checkpoint_name(x @ p['w1'] + p['b1'], TAG)
  return x + scale * (jnp.tanh(h) ** 2 @ p['w2'])


def stacked_params(seed: int = 0):
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  return {'w1': jax.random.normal(k1, (DEPTH, WIDTH, HIDDEN)) / WIDTH ** 0.5,
          'b1': jnp.full((DEPTH, HIDDEN), 0.1),
          'w2': jax.random.normal(k2, (DEPTH, HIDDEN, WIDTH)) / HIDDEN ** 0.5}


def inputs(seed: int = 1):
  return jax.random.normal(jax.random.PRNGKey(seed), (BATCH, WIDTH))


def no_remat_loss(params, x):
  """The reference: a hand-written scan over the layers, no remat anywhere."""
  y, _ = jax.lax.scan(lambda h, p: (mlp(p, h), None), x, params)
  return jnp.sum(y ** 2)


class LinenBlock(nn.Module):
  @nn.compact
  def __call__(self, x, scale=1.0):
    p = {'w1': self.param('w1', nn.initializers.lecun_normal(), (WIDTH, HIDDEN)),
         'b1': self.param('b1', nn.initializers.zeros, (HIDDEN,)),
         'w2': self.param('w2', nn.initializers.lecun_normal(), (HIDDEN, WIDTH))}
    return mlp(p, x, scale)


class NNXBlock(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.w1 = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (WIDTH, HIDDEN)))
    self.b1 = nnx.Param(jnp.zeros((HIDDEN,)))
    self.w2 = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (HIDDEN, WIDTH)))

  def __call__(self, x, scale=1.0):
    return mlp({'w1': self.w1[...], 'b1': self.b1[...], 'w2': self.w2[...]}, x, scale)
