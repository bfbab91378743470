"""The Flax NNX front door: construction, per-call inputs, mutable state, one-line errors."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from numerics import assert_trees_close
from own_model import DEPTH, TAG, WIDTH, NNXBlock, inputs
from remat import NNXStack, PolicyError, StackSignatureError


def _one_line(excinfo, needle):
  msg = str(excinfo.value)
  assert needle in msg and '\n' not in msg, msg


def test_params_are_stacked_and_per_call_inputs_pass_through():
  stack = NNXStack(NNXBlock, DEPTH, 'full@sqrt', rngs=nnx.Rngs(0))
  assert stack.layers.w1[...].shape == (DEPTH, WIDTH, 512)
  # Each layer initialised from its own key.
  assert not jnp.allclose(stack.layers.w1[...][0], stack.layers.w1[...][1])
  ref = NNXStack(NNXBlock, DEPTH, 'none', rngs=nnx.Rngs(0))
  x = inputs()
  assert_trees_close(stack(x, 0.5), ref(x, 0.5))
  grads = [nnx.grad(lambda m: jnp.sum(m(x, 0.5) ** 2))(m) for m in (stack, ref)]
  assert_trees_close(nnx.state(grads[0], nnx.Param), nnx.state(grads[1], nnx.Param))


class _Norm(nnx.Module):
  """A block with mutable state (BatchNorm statistics) and a dropout key."""

  def __init__(self, rngs):
    self.lin = nnx.Linear(8, 8, rngs=rngs)
    self.bn = nnx.BatchNorm(8, use_running_average=False, rngs=rngs)

  def __call__(self, x, rng):
    y = self.bn(self.lin(x))
    if rng is not None:
      y = jnp.where(jax.random.bernoulli(rng, 0.9, y.shape), y, 0.0)
    return x + y


def test_mutable_state_and_dropout_are_equal_across_segmentings():
  x = jax.random.normal(jax.random.PRNGKey(0), (4, 8))
  out = {}
  for spec in ('none', 'full', 'seg:2', 'full@sqrt'):
    stack = NNXStack(_Norm, 5, spec, rngs=nnx.Rngs(1))
    y = stack(x, rng=jax.random.PRNGKey(2))
    out[spec] = (y, stack.layers.bn.mean[...])
  assert not jnp.allclose(out['none'][1], 0.0)   # the running means were updated
  for spec in out:
    assert_trees_close(out[spec], out['none'], err_msg=f'{spec}: ')


@pytest.mark.parametrize('spec,needle', [
    ('names:fc_1', f'unknown tag(s) fc_1; this model emits: {TAG}'),
    ('seg:20', 'valid sizes for this 16-layer stack are 1..16'),
])
def test_policy_checked_against_the_stack(spec, needle):
  with pytest.raises(PolicyError) as e:
    NNXStack(NNXBlock, DEPTH, spec, rngs=nnx.Rngs(0))(inputs())
  _one_line(e, needle)


def test_wrong_signature_fails_in_one_line():
  stack = NNXStack(NNXBlock, 2, 'full', rngs=nnx.Rngs(0))
  with pytest.raises(StackSignatureError) as e:
    stack(inputs(), 1.0, 2.0)
  _one_line(e, 'NNXStack calls block(x[, xs_i], *args[, rng=key]')
