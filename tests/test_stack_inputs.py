"""How real layers plug into a stack (issue 37's friction list): per-layer inputs by keyword,
per-layer numbers, per-layer outputs that are the carry (a U-Net's skips), layer kinds of a
per-layer checkpoint, mesh-partitioned parameters, and errors that say how to adapt a layer."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import remat
from numerics import assert_trees_close
from remat import LayerStack, StackSignatureError, scan_layers
from remat.measuring import step_memory

D, N = 16, 6


def _w(n=N, d=D, seed=0):
  return {'w': jax.random.normal(jax.random.PRNGKey(seed), (n, d, d)) / d ** 0.5}


# --- per-layer inputs by keyword: a U-Net up block takes its skip as enc= ----------------------

def up(p, x, temb, enc=None):
  """A block whose per-layer skip is the keyword enc; temb is the same for every layer."""
  return x + jnp.tanh(x @ p['w'] + enc) * temb


def test_xs_kwargs_binds_by_name():
  params, x = _w(), jnp.ones((3, D))
  skips, temb = jax.random.normal(jax.random.PRNGKey(1), (N, 3, D)), jnp.full((D,), 0.5)
  want = x
  for i in range(N):
    want = up({'w': params['w'][i]}, want, temb, enc=skips[i])
  for spec in ('none', 'full', 'sqrt'):
    got = scan_layers(up, params, x, temb, xs_kwargs={'enc': skips}, policy=spec)
    assert_trees_close(got, want, err_msg=spec)


class UpBlock(nn.Module):
  @nn.compact
  def __call__(self, x, temb, *, enc):
    return x + nn.Dense(D)(jnp.concatenate([x, enc], -1)) * temb


def test_xs_kwargs_linen_and_the_errors():
  x, temb = jnp.ones((3, D)), jnp.full((D,), 0.5)
  skips = jnp.ones((N, 3, D))
  stack = LayerStack(UpBlock, N, 'full')
  variables = stack.init(jax.random.PRNGKey(0), x, temb, xs_kwargs={'enc': skips})
  assert stack.apply(variables, x, temb, xs_kwargs={'enc': skips}).shape == x.shape
  with pytest.raises(StackSignatureError) as e:   # a name the block does not take
    stack.apply(variables, x, temb, xs_kwargs={'skip': skips})
  assert '\n' not in str(e.value) and "xs_kwargs names 'skip'" in str(e.value)
  assert 'its keyword parameters: self, x, temb, enc' in str(e.value)
  with pytest.raises(StackSignatureError) as e:   # the skip handed positionally
    stack.apply(variables, x, temb, xs=skips)
  msg = str(e.value)
  assert '\n' not in msg and 'does not fit' in msg and 'xs_kwargs={name: stacked}' in msg
  with pytest.raises(StackSignatureError, match='every leaf of xs_kwargs has leading axis 5'):
    stack.apply(variables, x, temb, xs_kwargs={'enc': skips[:5]})


def test_a_per_layer_input_on_the_wrong_parameter_names_the_stack():
  """The skip bound positionally to the block's next parameter fails inside; the note says how."""
  def block(p, x, skip_or_scale, enc=None):
    return x + jnp.concatenate([x, skip_or_scale], -1) @ p['w2']
  params = {'w2': jnp.ones((N, 2 * D, D))}
  with pytest.raises(TypeError) as e:
    scan_layers(block, params, jnp.ones((3, D)), xs=jnp.ones((N, 7)))
  notes = ' '.join(getattr(e.value, '__notes__', []))
  if hasattr(e.value, 'add_note'):
    assert 'raised in layer 0 of scan_layers' in notes and 'xs_kwargs' in notes


# --- per-layer numbers: a stochastic-depth ramp --------------------------------------------------

def scaled(p, x, rate):
  return x + (1.0 - rate) * jnp.tanh(x @ p['w'])


def test_a_list_of_per_layer_numbers_is_stacked():
  params, x = _w(), jnp.ones((3, D))
  ramp = [0.1 * i for i in range(N)]
  want = x
  for i in range(N):
    want = scaled({'w': params['w'][i]}, want, ramp[i])
  assert_trees_close(scan_layers(scaled, params, x, xs=ramp, policy='full'), want)
  assert_trees_close(scan_layers(scaled, params, x, xs_kwargs={'rate': ramp}), want)


# --- per-layer outputs that are the carry: kept once --------------------------------------------

def down(p, x):
  y = x + jnp.tanh(x @ p['w'])
  return y, y          # each layer's output is also its per-layer output (a U-Net skip)


def down_input(p, x):
  y = x + jnp.tanh(x @ p['w'])
  return y, x          # or its input


def down_copy(p, x):
  y = x + jnp.tanh(x @ p['w'])
  return y, y * 1.0    # a new value: the plain scan's derivative


def down_input_copy(p, x):
  y = x + jnp.tanh(x @ p['w'])
  return y, x * 1.0


def unet(layer, spec):
  def loss(p, x):
    h, skips = scan_layers(layer, p['down'], x, policy=spec)
    y = scan_layers(up, p['up'], h, 1.0, xs_kwargs={'enc': skips}, policy=spec)
    return jnp.sum(y ** 2)
  return loss


@pytest.mark.parametrize('spec', ['none', 'full', 'dots', 'sqrt'])
def test_shared_outputs_give_the_same_gradients(spec):
  params = {'down': _w(), 'up': _w(seed=1)}
  x = jax.random.normal(jax.random.PRNGKey(2), (3, D))
  for layer, copy in ((down, down_copy), (down_input, down_input_copy)):
    want = jax.grad(unet(copy, 'none'))(params, x)
    assert_trees_close(jax.jit(jax.grad(unet(layer, spec)))(params, x), want,
                       err_msg=f'{layer.__name__} {spec}')


def test_shared_outputs_are_kept_once():
  """The skips are the saved layer inputs: one [N, B, D] stack less than the plain derivative."""
  params = {'down': _w(n=8, d=128), 'up': _w(n=8, d=128, seed=1)}
  x = jnp.ones((256, 128))
  skips = 8 * x.nbytes
  for spec in ('none', 'full'):
    shared = step_memory(unet(down, spec), params, x).temp
    copied = step_memory(unet(down_copy, spec), params, x).temp
    assert shared <= copied - skips // 2, (spec, shared, copied)


# --- a per-layer checkpoint with a pattern of kinds ----------------------------------------------

def test_stack_layers_by_kind():
  pattern = ('local',) * 5 + ('global',)
  index = remat.kind_indices(pattern, 14)
  assert index['global'].tolist() == [5, 11]
  assert index['local'].tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12, 13]
  layers = {f'layers_{i}': {'w': np.full((2,), float(i))} for i in range(14)}
  stacked = remat.stack_layers(layers, prefix='layers_', pattern=pattern)
  assert stacked['global']['w'][:, 0].tolist() == [5.0, 11.0]
  assert stacked['local']['w'].shape == (12, 2)
  back = remat.unstack_layers(stacked, pattern=pattern, prefix='layers_')
  assert_trees_close(back, layers)


# --- the small ones -------------------------------------------------------------------------------

def test_str_of_a_policy_is_its_spec():
  assert str(remat.get_policy('full@sqrt')) == 'full@sqrt'
  assert f"{remat.get_policy('4xfull+none')}" == '4xfull+none'


class MeshPartitioned(nn.Module):
  @nn.compact
  def __call__(self, x):
    kernel = nn.with_partitioning(nn.initializers.lecun_normal(), (None, 'model'))
    return x + jnp.tanh(nn.Dense(D, kernel_init=kernel)(x))


def test_mesh_partitioned_parameters_with_partition_name_none():
  """nn.with_partitioning names mesh axes: the layer axis must stay unsharded (None)."""
  x = jnp.ones((2, D))
  stack = LayerStack(MeshPartitioned, 4, 'full', partition_name=None)
  variables = stack.init(jax.random.PRNGKey(0), x)
  spec = nn.get_partition_spec(variables)['params']['block']['Dense_0']['kernel']
  assert spec == jax.sharding.PartitionSpec(None, None, 'model')
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1), ('model',))
  sharded = jax.device_put(nn.unbox(variables), nn.get_sharding(variables, mesh))
  assert_trees_close(jax.jit(stack.apply)(sharded, x), stack.apply(variables, x))


def test_a_swapped_return_is_named():
  def block(p, x):
    return jnp.mean(x), x + jnp.tanh(x @ p['w'])   # (aux, y): the wrong order
  with pytest.raises(StackSignatureError) as e:
    scan_layers(block, _w(), jnp.ones((3, D)))
  assert '\n' not in str(e.value) and 'it returns (aux, y)' in str(e.value)
