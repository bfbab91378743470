"""remat.stack_layers / unstack_layers: a per-layer checkpoint loads into a stack, and back."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from numerics import assert_trees_close
from remat import LayerStack, LayoutError, NNXStack, stack_layers, unstack_layers

D, N = 4, 3


class Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    kernel = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ('embed', 'mlp'))
    return x + jnp.tanh(nn.Dense(D, kernel_init=kernel)(x))


class Unrolled(nn.Module):
  """The user's model before the stack: encoderblock_0 .. encoderblock_{N-1}, then a norm."""

  @nn.compact
  def __call__(self, x):
    for i in range(N):
      x = Block(name=f'encoderblock_{i}')(x)
    return nn.LayerNorm(name='encoder_norm')(x)


class Stacked(nn.Module):
  spec: str = 'full'

  @nn.compact
  def __call__(self, x):
    return nn.LayerNorm(name='encoder_norm')(LayerStack(Block, N, self.spec, name='layers')(x))


def test_linen_checkpoint_loads_into_the_stack_and_back():
  x = jax.random.normal(jax.random.PRNGKey(1), (2, D))
  old = Unrolled().init(jax.random.PRNGKey(0), x)['params']
  new = {'encoder_norm': old['encoder_norm'],
         'layers': {'block': stack_layers(old, prefix='encoderblock_')}}
  kernel = new['layers']['block']['Dense_0']['kernel']
  assert kernel.names == ('layers', 'embed', 'mlp') and kernel.value.shape == (N, D, D)
  assert nn.get_partition_spec(new)['layers']['block']['Dense_0']['kernel'] == \
      jax.sharding.PartitionSpec('layers', 'embed', 'mlp')
  assert_trees_close(Stacked().apply({'params': new}, x), Unrolled().apply({'params': old}, x))
  back = unstack_layers(new['layers']['block'], prefix='encoderblock_')
  assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(
      {k: v for k, v in old.items() if k != 'encoder_norm'})
  assert back['encoderblock_1']['Dense_0']['kernel'].names == ('embed', 'mlp')
  assert_trees_close(nn.unbox(back['encoderblock_1']), nn.unbox(old['encoderblock_1']))


class NNXBlock(nnx.Module):
  def __init__(self, rngs):
    self.lin = nnx.Linear(D, D, rngs=rngs)

  def __call__(self, x):
    return x + jnp.tanh(self.lin(x))


def test_nnx_state_of_a_list_of_blocks_loads_into_the_stack():
  blocks = nnx.List([NNXBlock(nnx.Rngs(i)) for i in range(N)])
  x = jnp.ones((2, D))
  want = x
  for b in blocks:
    want = b(want)
  stack = NNXStack(NNXBlock, N, 'full', rngs=nnx.Rngs(9))
  nnx.update(stack.layers, stack_layers(nnx.state(blocks)))   # keys 0..N-1
  assert_trees_close(stack(x), want)
  back = unstack_layers(nnx.state(stack.layers))
  assert_trees_close(back[2], nnx.state(blocks[2]))


def test_plain_lists_round_trip():
  layers = [{'w': jnp.full((D, D), float(i)), 'act': 'gelu'} for i in range(N)]
  stacked = stack_layers(layers)
  assert stacked['w'].shape == (N, D, D) and stacked['act'] == 'gelu'
  assert_trees_close(unstack_layers(stacked)[1]['w'], layers[1]['w'])


@pytest.mark.parametrize('layers,needle', [
    ([{'w': jnp.ones((D, D))}, {'w': jnp.ones((D, 2))}],
     "layer 1's ['w'] is float32[4, 2], layer 0's float32[4, 4]"),
    ([{'w': jnp.ones(D)}, {'v': jnp.ones(D)}], "layer 1's tree differs from layer 0's"),
    ([{'act': 'gelu'}, {'act': 'relu'}], 'leaves that are not arrays must be equal in every layer'),
    ({'block_0': {}, 'block_2': {}}, 'missing layer(s) 1'),
    ({'block_0': {}, 'norm': {}}, "key 'norm' is not PREFIX<i>"),
    ({'a_0': {}, 'b_0': {}}, 'the keys have several prefixes'),
    ([], 'needs at least one layer'),
])
def test_mismatched_layers_are_one_line(layers, needle):
  with pytest.raises(LayoutError) as e:
    stack_layers(layers)
  assert needle in str(e.value) and '\n' not in str(e.value), str(e.value)


def test_unstack_needs_one_leading_axis():
  with pytest.raises(LayoutError) as e:
    unstack_layers({'w': jnp.ones((3, D)), 'b': jnp.ones((2, D))})
  assert 'with one N' in str(e.value) and '\n' not in str(e.value)
