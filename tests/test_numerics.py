"""The shared tolerance (tests/numerics.py): rounding passes on any CPU, real differences fail."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.gpt import GPT
from numerics import EPS32, RTOL, assert_trees_close, tree_scale
from training.step import train_step as st


def test_rtol_is_a_few_dozen_float32_eps():
  assert 50 * EPS32 < RTOL < 100 * EPS32


def test_summation_order_passes():
  x = np.random.default_rng(0).normal(size=(64, 4096)).astype(np.float32)
  forward = x.sum(axis=1)                       # numpy's pairwise order
  backward = np.cumsum(x[:, ::-1], axis=1)[:, -1]  # one long running sum, reversed
  assert not np.array_equal(forward, backward)
  assert_trees_close(forward, backward)


def test_a_leaf_that_cancels_to_noise_passes():
  # GPT-2's key-bias gradient is zero in exact arithmetic: both sides hold noise of the size of
  # eps times the other gradients. A leaf-relative tolerance fails on it; the tree's scale not.
  ref = {'kernel': np.full((4, 4), 0.3, np.float32), 'key_bias': np.full(4, 1e-11, np.float32)}
  got = {'kernel': ref['kernel'], 'key_bias': np.full(4, -3e-9, np.float32)}
  assert_trees_close(got, ref)
  with pytest.raises(AssertionError):
    np.testing.assert_allclose(got['key_bias'], ref['key_bias'], rtol=1e-5)


@pytest.mark.parametrize('where,how', [('small', 2 * RTOL), ('large', 2 * RTOL), ('large', np.nan)])
def test_real_differences_fail(where, how):
  ref = {'large': np.linspace(-2.0, 2.0, 50, dtype=np.float32),
         'small': np.linspace(0.01, 0.02, 5, dtype=np.float32)}
  got = {k: v.copy() for k, v in ref.items()}
  # Twice the allowed difference, on one element.
  got[where][3] += how * (abs(ref[where][3]) + tree_scale(ref))
  with pytest.raises(AssertionError, match=rf"\['{where}'\]: 1 of"):
    assert_trees_close(got, ref)


def test_structure_shape_and_integers_must_match():
  with pytest.raises(AssertionError, match='tree structures differ'):
    assert_trees_close({'a': np.zeros(2)}, {'b': np.zeros(2)})
  with pytest.raises(AssertionError, match='shape'):
    assert_trees_close(np.zeros(2), np.zeros(3))
  with pytest.raises(AssertionError):
    assert_trees_close({'count': np.int32(2)}, {'count': np.int32(1)})
  assert_trees_close({'zeros': np.zeros(3, np.float32)}, {'zeros': np.zeros(3, np.float32)})
  with pytest.raises(AssertionError):   # an all-zero reference leaves no room at all
    assert_trees_close(np.array([1e-30], np.float32), np.zeros(1, np.float32))


def test_gpt_gradients_with_an_injected_difference_fail(small_config, small_params, windows):
  # A loss off by 1 part in 1e4 (a wrong mask, a dropped term are far larger) moves every
  # gradient by that fraction: the comparison the policy tests use must see it.
  key = jax.random.PRNGKey(42)
  grad = lambda scale: jax.jit(jax.grad(
      lambda p: scale * st.lm_loss(GPT(small_config, 'full'), p, windows, key)))(small_params)
  reference = jax.jit(jax.grad(
      lambda p: st.lm_loss(GPT(small_config, 'none'), p, windows, key)))(small_params)
  assert_trees_close(grad(jnp.float32(1.0)), reference)
  with pytest.raises(AssertionError):
    assert_trees_close(grad(jnp.float32(1.0 + 1e-4)), reference)
