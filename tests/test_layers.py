"""Transformer pieces with written-out derivatives (models/layers.py).

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

from models.layers import LayerNorm, attention, dropout, gelu_exact, gelu_tanh
from remat.residuals import saved_residuals

RNG = np.random.default_rng(0)


def _normal(*shape, scale=1.0, shift=0.0):
  return jnp.asarray(RNG.normal(size=shape) * scale + shift, jnp.float32)


def _close(a, b, rtol=1e-5):
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    np.testing.assert_allclose(x, y, rtol=rtol, atol=rtol * float(jnp.max(jnp.abs(y))))


@pytest.mark.parametrize('ours, approximate', [(gelu_tanh, True), (gelu_exact, False)])
def test_gelu_rules(ours, approximate):
  x = jnp.linspace(-6, 6, 257, dtype=jnp.float32)
  plain = lambda x: jax.nn.gelu(x, approximate=approximate)
  np.testing.assert_array_equal(ours(x), plain(x))
  _close(jax.grad(lambda x: jnp.sum(jnp.sin(ours(x))))(x),
         jax.grad(lambda x: jnp.sum(jnp.sin(plain(x))))(x))
  # One array for the derivative (the slope), against several for the formula.
  w = _normal(16, 16)
  keep = lambda f: [r for r in saved_residuals(lambda w, x: jnp.sum(f(x @ w) @ w), w, x[:16])]
  assert len(keep(ours)) == 2, keep(ours)          # the slope, and gelu(x) for the second matmul
  assert len(keep(plain)) > 2


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
  from training import steps as st
  cfg = GPTConfig(vocab_size=64, max_len=24, num_layers=2, num_heads=2, d_model=16)
  params = GPT(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, 24), jnp.int32))['params']
  windows = jnp.zeros((3, 25), jnp.int32)
  loss = lambda p, w: st.lm_loss(GPT(cfg, policy), p, w, jax.random.PRNGKey(0))
  shapes = [r.shape for r in saved_residuals(loss, params, windows)]
  assert shapes and not any(s[-2:] == (24, 24) for s in shapes), shapes
