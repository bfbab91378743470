"""The mistakes of issue 23, each a one-line error naming what was expected, in every front door:
a num_layers that disagrees with the stacked leaves, swapped layer_fn arguments, unstacked
(per-layer) state handed to a stack, per-layer inputs of the wrong depth, a pattern that does
not match the stacked kinds."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from remat import LayerStack, NNXStack, StackSignatureError, scan_layers

D = 4


def _one_line(excinfo, *needles):
  msg = str(excinfo.value)
  assert '\n' not in msg, msg
  for needle in needles:
    assert needle in msg, msg


def layer(p, x):
  return jnp.tanh(x @ p['w'] + p['b'])


def _params(n):
  return {'w': jnp.ones((n, D, D)) * 0.1, 'b': jnp.zeros((n, D))}


class Dense(nn.Module):
  @nn.compact
  def __call__(self, x):
    return jnp.tanh(nn.Dense(D)(x))


class NNXDense(nnx.Module):
  def __init__(self, rngs):
    self.lin = nnx.Linear(D, D, rngs=rngs)

  def __call__(self, x):
    return jnp.tanh(self.lin(x))


MISMATCH = ('the stack has num_layers=6 but every leaf of', 'has leading axis 8',
            'a 6-layer stack needs every leaf stacked [6, ...]')


@pytest.mark.parametrize('spec', ['none', 'sqrt', 'seg:3'])
def test_num_layers_mismatch_scan_layers(spec):
  # Was silently accepted, and how many layers ran depended on the spec (8 or 6).
  with pytest.raises(StackSignatureError) as e:
    scan_layers(layer, _params(8), jnp.ones((2, D)), policy=spec, num_layers=6)
  _one_line(e, *MISMATCH, 'stacked_params')


@pytest.mark.parametrize('spec', ['none', 'sqrt'])
def test_num_layers_mismatch_linen(spec):
  x = jnp.ones((2, D))
  variables = LayerStack(Dense, 8, 'none').init(jax.random.PRNGKey(0), x)
  with pytest.raises(StackSignatureError) as e:
    LayerStack(Dense, 6, spec).apply(variables, x)
  _one_line(e, *MISMATCH, 'params/block')


def test_num_layers_mismatch_nnx():
  stack = NNXStack(NNXDense, 6, 'sqrt', rngs=nnx.Rngs(0))
  nnx.update(stack.layers, nnx.state(NNXStack(NNXDense, 8, 'none', rngs=nnx.Rngs(0)).layers))
  with pytest.raises(StackSignatureError) as e:
    stack(jnp.ones((2, D)))
  _one_line(e, *MISMATCH, 'stack.layers params')


def test_swapped_layer_fn_arguments():
  # Was "JAX does not support string indexing" (or "'DynamicJaxprTracer' object is not callable").
  with pytest.raises(StackSignatureError) as e:
    scan_layers(lambda x, p: jnp.tanh(x @ p['w']), _params(3), jnp.ones((2, D)), policy='full')
  _one_line(e, 'scan_layers calls layer_fn(params, x', 'runs with its first two arguments '
            'swapped: it takes x before params')


def test_unstacked_params_scan_layers():
  # One layer's parameters without the leading [N] axis: was a shape error deep in the layer.
  with pytest.raises(StackSignatureError) as e:
    scan_layers(layer, {'w': jnp.ones((D, D)), 'b': jnp.zeros((D,))}, jnp.ones((2, D)),
                policy='full', num_layers=3)
  _one_line(e, 'a 3-layer stack needs every leaf stacked [3, ...]')
  with pytest.raises(StackSignatureError) as e:   # N read from the leaves: the mixed axes say it
    scan_layers(layer, {'w': jnp.ones((5, D, D)), 'b': jnp.zeros((5, D)), 'g': jnp.ones(D)},
                jnp.ones((2, D)))
  _one_line(e, "stacked_params['g'] has shape [4]", 'the others [5, ...]', 'remat.stack_layers')


def test_unstacked_state_nnx():
  # NNX state of one layer loaded into the stack: was an einsum error.
  stack = NNXStack(NNXDense, 3, 'full', rngs=nnx.Rngs(0))
  nnx.update(stack.layers, nnx.state(NNXDense(nnx.Rngs(1))))
  with pytest.raises(StackSignatureError) as e:
    stack(jnp.ones((2, D)))
  _one_line(e, 'stack.layers params', 'stacked [3, ...]')


def test_unstacked_params_linen():
  x = jnp.ones((2, D))
  one = Dense().init(jax.random.PRNGKey(0), x)['params']
  with pytest.raises(StackSignatureError) as e:
    LayerStack(Dense, 3, 'full').apply({'params': {'block': one}}, x)
  _one_line(e, 'params/block', 'stacked [3, ...]')


def test_xs_of_the_wrong_depth():
  with pytest.raises(StackSignatureError) as e:
    scan_layers(lambda p, x, c: layer(p, x) + c, _params(3), jnp.ones((2, D)),
                xs=jnp.ones((4, 2, D)))
  _one_line(e, 'every leaf of xs has leading axis 4', 'stacked [3, ...]')


def test_pattern_that_does_not_match_the_kinds():
  fns = {'local': layer, 'global': layer}
  params = {'local': _params(5), 'global': _params(2)}
  with pytest.raises(StackSignatureError) as e:
    scan_layers(fns, params, jnp.ones((2, D)), pattern=('local', 'glob'))
  _one_line(e, "missing: 'glob'", "not in the pattern: 'global'")
  with pytest.raises(StackSignatureError) as e:
    scan_layers(fns, params, jnp.ones((2, D)), pattern=('local',) * 5 + ('global',))
  _one_line(e, "over 7 layers has 'local': 6, 'global': 1", "hold 'local': 5, 'global': 2")
