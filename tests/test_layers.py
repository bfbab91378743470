"""Transformer pieces with written-out derivatives (models/layers.py; dropout: models/dropout.py).

Each must give the values of the plain JAX/Flax formula (bit for bit where the
forward pass uses the same operations) and its gradients within float32
rounding, and keep fewer arrays for the backward pass: that saving is checked on
the traced residuals, which is what the rules were written for.
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.attention import attention
from models.dropout import dropout
from models.layers import GeluDense, LayerNorm, NormDense, gelu_slope
from numerics import assert_trees_close
from remat.residuals import saved_residuals

RNG = np.random.default_rng(0)


def _normal(*shape, scale=1.0, shift=0.0):
  return jnp.asarray(RNG.normal(size=shape) * scale + shift, jnp.float32)


def _close(a, b):
  """Each element of a tuple (of gradients w.r.t. different arguments) within tolerance."""
  for x, y in zip(a, b) if isinstance(b, tuple) else ((a, b),):
    assert_trees_close(x, y)


@pytest.mark.parametrize('approximate', [True, False])
def test_gelu_dense_rule(approximate):
  # nn.Dense of jax.nn.gelu: same parameters, same values, gradients within rounding, and
  # only the input h kept for the backward pass (the plain ops keep gelu(h) and more).
  h = _normal(3, 5, 16, scale=2.0)
  ours = GeluDense(8, approximate)
  plain = lambda v, h: nn.Dense(8).apply(v, jax.nn.gelu(h, approximate=approximate))
  variables = ours.init(jax.random.PRNGKey(0), h)
  assert (jax.tree_util.tree_map(jnp.shape, variables)
          == jax.tree_util.tree_map(jnp.shape, nn.Dense(8).init(jax.random.PRNGKey(0), h)))
  variables = jax.tree_util.tree_map(lambda p: p + _normal(*p.shape), variables)
  np.testing.assert_array_equal(ours.apply(variables, h), plain(variables, h))
  loss = lambda f: lambda v, h: jnp.sum(jnp.sin(f(v, h)))
  _close(jax.grad(loss(ours.apply), argnums=(0, 1))(variables, h),
         jax.grad(loss(plain), argnums=(0, 1))(variables, h))
  # A linear loss keeps only what the layer itself needs; h depends on a parameter.
  linear = lambda f: lambda p, h: jnp.sum(f(p['v'], h * p['a']))
  params = {'v': variables, 'a': jnp.float32(1.5)}
  wide = lambda f: [r.shape for r in saved_residuals(linear(f), params, h) if r.shape == h.shape]
  assert len(wide(ours.apply)) == 1 and len(wide(plain)) >= 2, (wide(ours.apply), wide(plain))


@pytest.mark.parametrize('approximate', [True, False])
def test_gelu_dense_backward_over_row_chunks(approximate):
  # 4 x 96 = 384 rows: three chunks of BACKWARD_ROWS (128); the gradients sum over them.
  from models.chunking import BACKWARD_ROWS, row_chunks
  assert BACKWARD_ROWS == 128 and row_chunks(384) == 3 and row_chunks(1576) == 8
  h = _normal(4, 96, 16, scale=2.0)
  ours = GeluDense(8, approximate)
  plain = lambda v, h: nn.Dense(8).apply(v, jax.nn.gelu(h, approximate=approximate))
  variables = jax.tree_util.tree_map(lambda p: p + _normal(*p.shape),
                                     ours.init(jax.random.PRNGKey(0), h))
  loss = lambda f: lambda v, h: jnp.sum(jnp.sin(f(v, h)))
  _close(jax.grad(loss(ours.apply), argnums=(0, 1))(variables, h),
         jax.grad(loss(plain), argnums=(0, 1))(variables, h))


@pytest.mark.parametrize('approximate', [True, False])
def test_gelu_slope(approximate):
  x = jnp.linspace(-6, 6, 257, dtype=jnp.float32)
  _close(gelu_slope(x, approximate),
         jax.vmap(jax.grad(lambda x: jax.nn.gelu(x, approximate=approximate)))(x))


def test_norm_dense_rule():
  # LayerNorm(parts=True) + NormDense equal nn.LayerNorm + nn.Dense in values and gradients
  # and keep one [.., D] array (x_hat) where the plain pair keeps several; two matmuls
  # reading the same LayerNorm share it.
  x = _normal(3, 5, 16, scale=3.0, shift=1.0)

  class Ours(nn.Module):
    @nn.compact
    def __call__(self, x):
      n = LayerNorm(1e-5, parts=True, name='ln')(x)
      return NormDense(8, name='a')(n) * NormDense(8, name='b')(n)

  class Plain(nn.Module):
    @nn.compact
    def __call__(self, x):
      n = nn.LayerNorm(1e-5, name='ln')(x)
      return nn.Dense(8, name='a')(n) * nn.Dense(8, name='b')(n)

  variables = Ours().init(jax.random.PRNGKey(0), x)
  assert (jax.tree_util.tree_map(jnp.shape, variables)
          == jax.tree_util.tree_map(jnp.shape, Plain().init(jax.random.PRNGKey(0), x)))
  variables = jax.tree_util.tree_map(lambda p: p + _normal(*p.shape, scale=0.1), variables)
  _close(Ours().apply(variables, x), Plain().apply(variables, x))
  loss = lambda m: lambda v, x: jnp.sum(jnp.sin(m.apply(v, x)))
  _close(jax.grad(loss(Ours()), argnums=(0, 1))(variables, x),
         jax.grad(loss(Plain()), argnums=(0, 1))(variables, x))
  linear = lambda m: lambda p, x: jnp.sum(m.apply(p['v'], x * p['a']) * p['w'])
  params = {'v': variables, 'a': jnp.float32(1.5), 'w': jnp.float32(0.5)}
  wide = lambda m: [r.shape for r in saved_residuals(linear(m), params, x) if r.shape == x.shape]
  assert len(wide(Ours())) == 1 and len(wide(Plain())) >= 2, (wide(Ours()), wide(Plain()))


@pytest.mark.parametrize('eps', [1e-12, 1e-5])
def test_layer_norm_matches_flax(eps):
  x = _normal(4, 7, 33, scale=3.0, shift=1.0)
  ours, flax_ln = LayerNorm(eps), nn.LayerNorm(eps)
  variables = flax_ln.init(jax.random.PRNGKey(0), x)
  assert (jax.tree_util.tree_structure(variables)
          == jax.tree_util.tree_structure(ours.init(jax.random.PRNGKey(0), x)))
  variables = jax.tree_util.tree_map(lambda p: p + _normal(*p.shape), variables)
  np.testing.assert_array_equal(ours.apply(variables, x), flax_ln.apply(variables, x))
  w = jnp.cos(jnp.arange(33.0))
  loss = lambda m: lambda v, x: jnp.sum(jnp.sin(m.apply(v, x)) * w)
  _close(jax.grad(loss(ours), argnums=(0, 1))(variables, x),
         jax.grad(loss(flax_ln), argnums=(0, 1))(variables, x))
  # x_hat and 1/std (plus the scale), where Flax's formula keeps four [.., D] arrays.
  # The input depends on a parameter, as inside a model, and the loss is linear: only
  # LayerNorm's own residuals are kept.
  linear = lambda m: lambda p, x: jnp.sum(m.apply(p['ln'], x * p['a']) * w)
  params = {'ln': variables, 'a': jnp.float32(1.5)}
  wide = lambda m: [r for r in saved_residuals(linear(m), params, x) if r.shape == x.shape]
  assert len(wide(ours)) == 1 and len(wide(flax_ln)) >= 3, (wide(ours), wide(flax_ln))


def _plain_attention(q, k, v, causal, rate, rng):
  # Heads-first matmuls, as ours (the summation order, and so the bits, follow the layout).
  q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
  scores = jnp.einsum('bhqd,bhkd->bhqk', q, k) / math.sqrt(q.shape[-1])
  if causal:
    t = q.shape[2]
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, jnp.finfo(scores.dtype).min)
  probs = dropout(jax.nn.softmax(scores, axis=-1), rate, deterministic=rate == 0.0, rng=rng)
  return jnp.einsum('bhqk,bhkd->bhqd', probs, v).transpose(0, 2, 1, 3)


@pytest.mark.parametrize('causal', [False, True])
@pytest.mark.parametrize('rate', [0.0, 0.2])
def test_attention_matches_autodiff(causal, rate):
  q, k, v, w = (_normal(2, 9, 3, 8) for _ in range(4))
  key = jax.random.PRNGKey(3)
  ours = lambda q, k, v: attention(q, k, v, causal=causal, dropout_rate=rate, deterministic=False,
                                   rng=key)
  plain = lambda q, k, v: _plain_attention(q, k, v, causal, rate, key)
  np.testing.assert_array_equal(ours(q, k, v), plain(q, k, v))
  loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v) * w)
  _close(jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2)))(q, k, v),
         jax.grad(loss(plain), argnums=(0, 1, 2))(q, k, v))
  # Nothing of the [B, H, T, T] probabilities is kept: q, k and v alone.
  # q, k, v depend on the differentiated weights, as in a model.
  wq = lambda f: lambda a, q, k, v: jnp.sum(f(q * a, k * a, v * a) * w)
  kept = lambda f: [r.shape for r in saved_residuals(wq(f), jnp.float32(1.5), q, k, v)]
  assert all(s[-1] != 9 for s in kept(ours)), kept(ours)
  assert (2, 3, 9, 9) in kept(plain), kept(plain)


def test_attention_needs_key_for_dropout():
  q = _normal(1, 4, 1, 8)
  with pytest.raises(ValueError, match='needs a key'):
    attention(q, q, q, causal=True, dropout_rate=0.1, deterministic=False, rng=None)
  np.testing.assert_array_equal(
      attention(q, q, q, causal=True, dropout_rate=0.1, deterministic=True, rng=None),
      _plain_attention(q, q, q, True, 0.0, None))


@pytest.mark.parametrize('policy', ['dots', 'everything', 'none'])
def test_no_policy_saves_attention_scores(policy):
  # A GPT under `dots` kept the [B, H, T, T] scores (dot_general outputs) while `none`
  # kept none of them; the scores call is opaque to policies, so neither does.
  from models.gpt import GPT, GPTConfig
  from training.step import train_step as st
  cfg = GPTConfig(vocab_size=64, max_len=24, num_layers=2, num_heads=2, d_model=16)
  params = GPT(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, 24), jnp.int32))['params']
  windows = jnp.zeros((3, 25), jnp.int32)
  loss = lambda p, w: st.lm_loss(GPT(cfg, policy), p, w, jax.random.PRNGKey(0))
  shapes = [r.shape for r in saved_residuals(loss, params, windows)]
  assert shapes and not any(s[-2:] == (24, 24) for s in shapes), shapes
