"""The jaxpr FLOP walker is exact on hand-computable functions."""

import jax
import jax.numpy as jnp
import pytest

from remat.flops import count_flops

M, K = 8, 16
F_ONE = 2 * M * K * K  # one [M, K] x [K, K] matmul


def _chain(ws, x):
  for w in ws:
    x = jnp.tanh(x @ w)
  return x.sum()


@pytest.fixture
def args():
  return [jnp.ones((K, K))] * 3, jnp.ones((M, K))


def test_forward(args):
  assert count_flops(_chain, *args).flops == 3 * F_ONE


def test_grad_is_three_forwards(args):
  # d/dx and d/dW of each matmul cost one matmul each.
  assert count_flops(jax.grad(_chain, argnums=(0, 1)), *args).flops == 3 * 3 * F_ONE


def test_full_remat_adds_one_forward(args):
  remat = jax.checkpoint(_chain, policy=jax.checkpoint_policies.nothing_saveable)
  assert count_flops(jax.grad(remat, argnums=(0, 1)), *args).flops == 4 * 3 * F_ONE


def test_dots_saveable_adds_nothing(args):
  remat = jax.checkpoint(_chain, policy=jax.checkpoint_policies.dots_saveable)
  assert count_flops(jax.grad(remat, argnums=(0, 1)), *args).flops == 3 * 3 * F_ONE


def test_scan_multiplies_by_length():
  def f(w, x):
    return jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=5)[0].sum()
  assert count_flops(f, jnp.ones((K, K)), jnp.ones((M, K))).flops == 5 * F_ONE
  assert count_flops(jax.grad(f, argnums=(0, 1)), jnp.ones((K, K)), jnp.ones((M, K))).flops == 15 * F_ONE


def test_nested_remat_recomputes_twice():
  w = jnp.ones((K, K))
  inner = jax.checkpoint(lambda x: jnp.tanh(x @ w))
  # w is a constant, so each matmul's backward is one matmul (dx). The inner matmul runs in
  # the forward, the outer recompute and the inner recompute (3x), the outer one twice.
  outer = jax.checkpoint(lambda x: jnp.tanh(inner(x) @ w).sum())
  assert count_flops(jax.grad(outer), jnp.ones((M, K))).flops == (3 + 2 + 2) * F_ONE


def test_conv():
  x = jnp.ones((2, 3, 8, 8))      # NCHW
  k = jnp.ones((4, 3, 3, 3))      # OIHW
  f = lambda x, k: jax.lax.conv_general_dilated(x, k, (1, 1), 'SAME')
  assert count_flops(f, x, k).flops == 2 * (2 * 4 * 8 * 8) * (3 * 3 * 3)


def test_gpt_recompute_ratios():
  from configs import load_config
  from bench.zoo import step_flops
  cfg = load_config('tiny').model
  flops = {s: step_flops(cfg, s, 2, 32).flops for s in ('none', 'everything', 'dots', 'full', 'full@sqrt')}
  # No matmul is recomputed: dots saves the projections and the attention context;
  # the attention's backward pass recomputes q.k^T under every policy, none included.
  assert flops['everything'] == flops['none'] == flops['dots']
  assert 1.2 < flops['full'] / flops['none'] < 1.34        # at most one extra forward
  assert flops['full@sqrt'] > flops['full']                # a second recompute inside segments
