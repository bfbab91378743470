"""The layer stack: one parameter tree under every policy, any depth, remat really applied."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from models.gpt import GPT
from numerics import assert_trees_close
from remat import LayerStack, get_policy
from remat.tags import iter_eqns

SPECS = ['none', 'full', 'dots', 'sqrt', 'seg:2', 'full@sqrt', 'minimal@seg:3', '2xfull+none',
         '1xdots+2xfull@seg:2+none']


@pytest.mark.parametrize('spec', SPECS)
def test_param_tree_identical_across_policies(spec, small_config, small_params):
  params = GPT(small_config, spec).init(jax.random.PRNGKey(0), jnp.zeros((1, 16), jnp.int32))['params']
  chex.assert_trees_all_equal_structs(params, small_params)
  chex.assert_trees_all_equal(params, small_params)  # same seed -> same weights
  assert small_params['h']['block']['attn']['query']['kernel'].shape == (5, 32, 32)


def _remat_count(config, spec, params, x):
  jaxpr = jax.make_jaxpr(jax.grad(
      lambda p: GPT(config, spec).apply({'params': p}, x).sum()))(params).jaxpr
  return sum(e.primitive.name in ('checkpoint', 'remat2', 'remat') for e in iter_eqns(jaxpr))


def test_remat_applied_only_when_asked(small_config, small_params, windows):
  x = windows[:, :-1]
  # Under `none` the one checkpoint is the stack's lean rule around the layer (remat/layout.py:
  # elementwise values rebuilt, nothing expensive recomputed); models.layers.gelu_dense, a
  # custom VJP, rebuilds gelu(h) from h in its own backward pass, without a checkpoint.
  assert _remat_count(small_config, 'none', small_params, x) == 1
  assert _remat_count(small_config, 'full', small_params, x) >= 1
  assert _remat_count(small_config, 'sqrt', small_params, x) > 1


class _Affine(nn.Module):
  """y = a * x + b per layer, so the stack's result is checkable by hand."""

  @nn.compact
  def __call__(self, x, rng):
    a = self.param('a', nn.initializers.normal(1.0), ())
    b = self.param('b', nn.initializers.normal(1.0), ())
    return a * x + b, None


class _Net(nn.Module):
  n: int
  spec: str

  @nn.compact
  def __call__(self, x):
    return LayerStack(_Affine, self.n, get_policy(self.spec), name='stack')(x)


@pytest.mark.parametrize('n', [1, 7, 13] + [pytest.param(n, marks=pytest.mark.slow)
                                             for n in (2, 3, 11)])
@pytest.mark.parametrize('spec', ['none', 'sqrt', 'seg:2', 'full@sqrt', 'seg:1'])
def test_any_depth_runs_layers_in_order(n, spec):
  if spec == 'seg:2' and n < 2:
    pytest.skip('segment larger than the stack')
  variables = _Net(n, 'none').init(jax.random.PRNGKey(1), jnp.ones(3))
  a = variables['params']['stack']['block']['a']
  b = variables['params']['stack']['block']['b']
  x = jnp.arange(3.0)
  expected = x
  for i in range(n):
    expected = a[i] * expected + b[i]
  got = _Net(n, spec).apply(variables, x)
  assert_trees_close(got, expected)
  g = jax.grad(lambda v: _Net(n, spec).apply(v, x).sum())(variables)
  g_ref = jax.grad(lambda v: _Net(n, 'none').apply(v, x).sum())(variables)
  assert_trees_close(g, g_ref)


def test_segment_larger_than_stack_fails_closed(small_config, small_params, windows):
  with pytest.raises(ValueError, match='out of range'):
    GPT(small_config, 'seg:9').apply({'params': small_params}, windows[:, :-1])


# --- a user's own linen block ----------------------------------------------------------------

from own_model import DEPTH, TAG, LinenBlock, inputs  # noqa: E402
from remat import PolicyError, StackSignatureError  # noqa: E402


class _Flagged(nn.Module):
  """A block with a mask and a Python flag per call, returning (y, aux)."""

  @nn.compact
  def __call__(self, x, mask, train):
    y = nn.Dense(x.shape[-1])(x) * mask
    return (x + y, jnp.sum(y)) if train else x + y


def test_spec_string_per_call_inputs_and_aux():
  x, mask = jnp.ones((2, 4)), jnp.array([1.0, 0.0, 1.0, 1.0])
  stack = LayerStack(_Flagged, 4, 'full@seg:2')
  variables = stack.init(jax.random.PRNGKey(0), x, mask, False)
  assert variables['params']['block']['Dense_0']['kernel'].shape == (4, 4, 4)
  y, aux = stack.apply(variables, x, mask, True)
  assert aux.shape == (4,)
  assert_trees_close(y, LayerStack(_Flagged, 4, 'none').apply(variables, x, mask, False))


@pytest.mark.parametrize('spec,needle', [
    ('names:fc_1', f'unknown tag(s) fc_1; this model emits: {TAG}'),
    ('seg:20', 'valid sizes for this 16-layer stack are 1..16'),
])
def test_user_block_checked_against_the_policy(spec, needle):
  variables = LayerStack(LinenBlock, DEPTH, 'none').init(jax.random.PRNGKey(0), inputs())
  with pytest.raises(PolicyError) as e:
    LayerStack(LinenBlock, DEPTH, spec).apply(variables, inputs())
  assert needle in str(e.value) and '\n' not in str(e.value)


@pytest.mark.parametrize('args,needle', [
    ((), "missing a required argument: 'mask'"),
    ((1.0, True, 3), 'too many positional arguments'),
])
def test_wrong_block_signature_fails_in_one_line(args, needle):
  with pytest.raises(StackSignatureError) as e:
    LayerStack(_Flagged, 3, 'full').init(jax.random.PRNGKey(0), jnp.ones((2, 4)), *args)
  msg = str(e.value)
  assert needle in msg and 'LayerStack calls block(x[, xs_i], *args' in msg and '\n' not in msg
