"""Every policy gives the loss, gradients and optimizer step of no remat (dropout on)."""

import jax
import jax.numpy as jnp
import optax
import pytest

from models.gpt import GPT, TAGS
from numerics import assert_trees_close
from remat.policies import registered_specs
from remat.tags import emitted_tags
from training.step import train_step as st

# The small model has 5 layers: sqrt -> segments of 2 with a remainder of 1; seg:3 -> 3 + 2.
SEGMENTED = ['sqrt', 'seg:2', 'seg:3', 'seg:5', 'seg:1', 'full@sqrt', 'dots@seg:3',
             'dots_no_batch@sqrt', 'names:context,mlpwi@seg:2', 'save_qkv_proj@seg:4',
             'offload:out_proj@sqrt']
ALL = registered_specs(model_tags=TAGS) + SEGMENTED + ['stage', 'full@stage']
DROPOUT = jax.random.PRNGKey(42)


def _value_and_grad(config, spec, params, windows):
  model = GPT(config, spec)
  return jax.jit(jax.value_and_grad(lambda p: st.lm_loss(model, p, windows, DROPOUT)))(params)


@pytest.fixture(scope='module')
def reference(small_config, small_params, windows):
  return _value_and_grad(small_config, 'none', small_params, windows)


# One spec of each kind in the default suite (a rule, a tag list, a preset, an offload, each
# segmenting, a rule on segments, a mix of rules, a tag list on segments, the convnet rule on
# a transformer); the whole matrix with -m slow.
DEFAULT = {'full', 'dots', 'dots_no_batch', 'minimal', 'qkv_proj_offloaded', 'sqrt', 'seg:3',
           'full@sqrt', 'names:context,mlpwi@seg:2', 'offload:out_proj@sqrt', 'stage', 'convs'}


@pytest.mark.parametrize('spec', [s if s in DEFAULT else pytest.param(s, marks=pytest.mark.slow)
                                  for s in ALL if s != 'none'])
def test_loss_and_gradients_match_none(spec, small_config, small_params, windows, reference):
  loss, grads = _value_and_grad(small_config, spec, small_params, windows)
  ref_loss, ref_grads = reference
  assert_trees_close(loss, ref_loss)
  assert_trees_close(grads, ref_grads)


def test_dropout_is_on(small_config, small_params, windows, reference):
  deterministic = st.lm_loss(GPT(small_config), small_params, windows)
  assert abs(float(deterministic) - float(reference[0])) > 1e-4
  other = st.lm_loss(GPT(small_config), small_params, windows, jax.random.PRNGKey(7))
  assert abs(float(other) - float(reference[0])) > 1e-4


def _one_step(config, spec, params, windows):
  tx = st.make_optimizer(1e-3, 10, 2, 0.1, 1.0)
  state = st.TrainState(jnp.zeros((), jnp.int32), params, {}, tx.init(params))
  return jax.jit(st.make_train_step(GPT(config, spec), tx, seed=3))(state, windows)


@pytest.fixture(scope='module')
def reference_step(small_config, small_params, windows):
  return _one_step(small_config, 'none', small_params, windows)


# One optimizer step per policy kind is covered by the gradient cases above; full and minimal here,
# the rest with -m slow.
@pytest.mark.parametrize('spec', ['full', 'minimal'] + [
    pytest.param(s, marks=pytest.mark.slow) for s in ('sqrt', 'full@seg:3', 'offload:query_proj')])
def test_one_optimizer_step_matches_none(spec, small_config, small_params, windows, reference_step):
  state, loss = _one_step(small_config, spec, small_params, windows)
  ref_state, ref_loss = reference_step
  assert_trees_close(loss, ref_loss)
  assert_trees_close(state.params, ref_state.params)
  # Adam's moments one at a time: nu ~ g^2 is far smaller than mu ~ g.
  for moment in ('mu', 'nu'):
    assert_trees_close(*(optax.tree_utils.tree_get(s.opt_state, moment)
                         for s in (state, ref_state)), err_msg=f'{moment}: ')


def test_model_emits_documented_tags(small_config, small_params, windows):
  tags = emitted_tags(lambda p, x: GPT(small_config).apply({'params': p}, x),
                      small_params, windows[:, :-1])
  assert tags == set(TAGS)
