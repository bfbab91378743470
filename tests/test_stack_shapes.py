"""Real model shapes through the three front doors: per-layer xs/ys (a KV cache), patterns of
layer kinds (Gemma 3's local/global), partitioned linen parameters, NNX Rngs (issue 23)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from numerics import assert_trees_close
from remat import LayerStack, NNXStack, scan_layers

D = 8
SPECS = ['none', 'full', 'dots', 'sqrt', 'seg:1', 'full@sqrt', '1xfull+none']
GEMMA = ('local',) * 5 + ('global',)


def _w(key, *shape):
  return jax.random.normal(key, shape) / shape[-2] ** 0.5


# --- per-layer inputs and outputs: a KV cache --------------------------------------------------

def cached_layer(p, x, cache):
  """Writes this layer's key into its cache slot 0 and attends over the cache: (y, new cache)."""
  k = x @ p['wk']
  cache = cache.at[:, 0].set(k)
  scores = jnp.einsum('bd,btd->bt', x @ p['wq'], cache)
  return x + jnp.einsum('bt,btd->bd', jax.nn.softmax(scores), cache), cache


def _cache_case(n=5, b=2, t=3):
  ks = jax.random.split(jax.random.PRNGKey(0), 4)
  params = {'wq': _w(ks[0], n, D, D), 'wk': _w(ks[1], n, D, D)}
  return params, jax.random.normal(ks[2], (b, D)), jax.random.normal(ks[3], (n, b, t, D))


def _cache_by_hand(params, x, cache):
  new = []
  for i in range(cache.shape[0]):
    x, c = cached_layer(jax.tree_util.tree_map(lambda a: a[i], params), x, cache[i])
    new.append(c)
  return x, jnp.stack(new)


@pytest.mark.parametrize('spec', ['full'] + [pytest.param(s, marks=pytest.mark.slow)
                                              for s in ('none', 'seg:2', '2xfull+none')])
def test_scan_layers_per_layer_cache(spec):
  params, x, cache = _cache_case()
  want = _cache_by_hand(params, x, cache)
  assert_trees_close(scan_layers(cached_layer, params, x, xs=cache, policy=spec), want)
  loss = lambda p, c, f: jnp.sum(f(p, c)[0] ** 2) + jnp.sum(f(p, c)[1] ** 2)
  got = jax.grad(loss, argnums=(0, 1))(
      params, cache, lambda p, c: scan_layers(cached_layer, p, x, xs=c, policy=spec))
  assert_trees_close(got, jax.grad(loss, argnums=(0, 1))(
      params, cache, lambda p, c: _cache_by_hand(p, x, c)), err_msg=f'{spec}: ')


class LinenCached(nn.Module):
  @nn.compact
  def __call__(self, x, cache, scale):
    p = {'wq': self.param('wq', nn.initializers.lecun_normal(), (D, D)),
         'wk': self.param('wk', nn.initializers.lecun_normal(), (D, D))}
    y, cache = cached_layer(p, x, cache)
    return x + scale * (y - x), cache


class NNXCached(nnx.Module):
  def __init__(self, rngs):
    self.wq = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (D, D)))
    self.wk = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (D, D)))

  def __call__(self, x, cache, scale):
    y, cache = cached_layer({'wq': self.wq[...], 'wk': self.wk[...]}, x, cache)
    return x + scale * (y - x), cache


@pytest.mark.parametrize('spec', ['full@sqrt', pytest.param('none', marks=pytest.mark.slow)])
def test_linen_and_nnx_per_layer_cache(spec):
  params, x, cache = _cache_case()
  want = _cache_by_hand(params, x, cache)
  stack = LayerStack(LinenCached, 5, spec)
  variables = stack.init(jax.random.PRNGKey(0), x, 1.0, xs=cache)
  assert variables['params']['block']['wq'].shape == (5, D, D)
  got = stack.apply({'params': {'block': params}}, x, 1.0, xs=cache)
  assert_trees_close(got, want, err_msg=f'linen {spec}: ')
  nstack = NNXStack(NNXCached, 5, spec, rngs=nnx.Rngs(0))
  nstack.layers.wq[...] = params['wq']
  nstack.layers.wk[...] = params['wk']
  assert_trees_close(nstack(x, 1.0, xs=cache), want, err_msg=f'nnx {spec}: ')


# --- a repeating pattern of layer kinds: Gemma 3's five local + one global ----------------------

def local_layer(p, x):
  """A 'local' layer: its own parameter shapes and function."""
  return x + jnp.tanh(x @ p['w']) * p['g']


def global_layer(p, x):
  return x + jnp.sin(x @ p['w1']) @ p['w2'], jnp.mean(x)   # with a per-layer output


def _pattern_params(n_local, n_global):
  ks = jax.random.split(jax.random.PRNGKey(1), 3)
  return {'local': {'w': _w(ks[0], n_local, D, D), 'g': jnp.full((n_local, D), 0.5)},
          'global': {'w1': _w(ks[1], n_global, D, 2 * D), 'w2': _w(ks[2], n_global, 2 * D, D)}}


def _pattern_by_hand(params, x, n):
  used, aux = {'local': 0, 'global': 0}, []
  for i in range(n):
    kind = GEMMA[i % len(GEMMA)]
    p = jax.tree_util.tree_map(lambda a, j=used[kind]: a[j], params[kind])
    used[kind] += 1
    if kind == 'local':
      x = local_layer(p, x)
    else:
      x, a = global_layer(p, x)
      aux.append(a)
  return x, jnp.stack(aux)


@pytest.mark.parametrize('n,counts,specs', [
    (8, (7, 1), ['1xfull+seg:1']),      # a remainder of 2: a mix, a segment, the remainder
    pytest.param(14, (12, 2), SPECS, marks=pytest.mark.slow),
    pytest.param(12, (10, 2), SPECS, marks=pytest.mark.slow)])    # no remainder
def test_scan_layers_pattern_gives_the_loop_by_hand(n, counts, specs):
  params = _pattern_params(*counts)
  x = jax.random.normal(jax.random.PRNGKey(2), (3, D))
  fns = {'local': local_layer, 'global': global_layer}
  want = jax.value_and_grad(lambda p: jnp.sum(_pattern_by_hand(p, x, n)[0] ** 2))(params)
  y, aux = scan_layers(fns, params, x, pattern=GEMMA, policy='full')
  assert set(aux) == {'local', 'global'} and aux['local'] is None
  assert_trees_close(aux['global'], _pattern_by_hand(params, x, n)[1])
  for spec in specs:
    loss = lambda p: jnp.sum(scan_layers(fns, p, x, pattern=GEMMA, policy=spec)[0] ** 2)
    assert_trees_close(jax.jit(jax.value_and_grad(loss))(params), want, err_msg=f'{spec}: ')


def test_pattern_applies_the_rule_to_every_layer():
  """full under a pattern saves each layer's input, not one per repeat (2 x 96 bytes here)."""
  from remat.residuals import saved_residuals
  params, x = _pattern_params(10, 2), jnp.ones((3, D))
  fns = {'local': local_layer, 'global': global_layer}
  def kept(spec):
    loss = lambda p, x: jnp.sum(scan_layers(fns, p, x, pattern=GEMMA, policy=spec)[0])
    return sum(r.nbytes for r in saved_residuals(loss, params, x))
  assert kept('full') >= 12 * x.nbytes   # 10 + 2 layers, each one's input kept
  assert kept('seg:2') < kept('full')    # one segment of both repeats: only its input is kept


class LinenLocal(nn.Module):
  @nn.compact
  def __call__(self, x):
    return local_layer({'w': self.param('w', nn.initializers.lecun_normal(), (D, D)),
                        'g': self.param('g', nn.initializers.ones, (D,))}, x)


class LinenGlobal(nn.Module):
  width: int = 2 * D

  @nn.compact
  def __call__(self, x):
    return global_layer({'w1': self.param('w1', nn.initializers.lecun_normal(), (D, self.width)),
                         'w2': self.param('w2', nn.initializers.lecun_normal(), (self.width, D))},
                        x)


def test_linen_pattern_one_tree_under_every_policy():
  x = jax.random.normal(jax.random.PRNGKey(2), (3, D))
  classes = {'local': LinenLocal, 'global': LinenGlobal}
  make = lambda spec: LayerStack(classes, 8, spec, pattern=GEMMA,
                                 block_kwargs={'global': {'width': 2 * D}})
  variables = make('none').init(jax.random.PRNGKey(0), x)
  shapes = jax.tree_util.tree_map(jnp.shape, variables['params'])
  assert shapes == {'local': {'w': (7, D, D), 'g': (7, D)},
                    'global': {'w1': (1, D, 2 * D), 'w2': (1, 2 * D, D)}}
  for spec in ('full@sqrt',):
    assert jax.tree_util.tree_map(jnp.shape, make(spec).init(jax.random.PRNGKey(0), x)) == \
        jax.tree_util.tree_map(jnp.shape, variables)
  want_y, want_aux = _pattern_by_hand(variables['params'], x, 8)
  for spec in ('none', 'full@sqrt'):
    y, aux = make(spec).apply(variables, x)
    assert_trees_close((y, aux['global']), (want_y, want_aux), err_msg=f'{spec}: ')


class NNXLocal(nnx.Module):
  def __init__(self, rngs):
    self.w = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (D, D)))
    self.g = nnx.Param(jnp.ones((D,)))

  def __call__(self, x):
    return local_layer({'w': self.w[...], 'g': self.g[...]}, x)


class NNXGlobal(nnx.Module):
  def __init__(self, rngs):
    self.w1 = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (D, 2 * D)))
    self.w2 = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (2 * D, D)))

  def __call__(self, x):
    return global_layer({'w1': self.w1[...], 'w2': self.w2[...]}, x)


def test_nnx_pattern():
  x = jax.random.normal(jax.random.PRNGKey(2), (3, D))
  stacks = {spec: NNXStack({'local': NNXLocal, 'global': NNXGlobal}, 8, spec, pattern=GEMMA,
                           rngs=nnx.Rngs(0)) for spec in ('none', 'seg:2')}
  ref = stacks['none']
  assert ref.layers['local'].w[...].shape == (7, D, D)
  params = {'local': {'w': ref.layers['local'].w[...], 'g': ref.layers['local'].g[...]},
            'global': {'w1': ref.layers['global'].w1[...], 'w2': ref.layers['global'].w2[...]}}
  want_y, want_aux = _pattern_by_hand(params, x, 8)
  grads = {}
  for spec, stack in stacks.items():
    y, aux = stack(x)
    assert_trees_close((y, aux['global']), (want_y, want_aux), err_msg=f'{spec}: ')
    grads[spec] = nnx.state(nnx.grad(lambda m: jnp.sum(m(x)[0] ** 2))(stack), nnx.Param)
  for spec in grads:
    assert_trees_close(grads[spec], grads['none'], err_msg=f'{spec}: ')


# --- logically partitioned parameters ------------------------------------------------------------

class Partitioned(nn.Module):
  @nn.compact
  def __call__(self, x):
    dense = nn.Dense(D, kernel_init=nn.with_logical_partitioning(
        nn.initializers.lecun_normal(), ('embed', 'mlp')))
    return x + jnp.tanh(dense(x))


def test_partition_names_survive_the_stack():
  x = jnp.ones((2, D))
  stack = LayerStack(Partitioned, 4, 'full@sqrt')
  variables = stack.init(jax.random.PRNGKey(0), x)
  specs = nn.get_partition_spec(variables)
  assert specs['params']['block']['Dense_0']['kernel'] == jax.sharding.PartitionSpec(
      'layers', 'embed', 'mlp')
  # Mesh sharding from the logical names works on the stacked tree and the stack runs on it.
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ('data', 'model'))
  rules = (('layers', None), ('embed', 'data'), ('mlp', 'model'))
  shardings = nn.logical_to_mesh_sharding(specs, mesh, rules)
  sharded = jax.device_put(nn.unbox(variables), shardings)
  kernel = sharded['params']['block']['Dense_0']['kernel']
  assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, 'data', 'model')
  want = LayerStack(Partitioned, 4, 'none').apply(variables, x)
  assert_trees_close(jax.jit(stack.apply)(sharded, x), want)
  assert_trees_close(stack.apply(variables, x), want)   # boxed variables apply too


# --- NNX Rngs: dropout under every policy, split per layer ---------------------------------------

class StoredDropout(nnx.Module):
  """Keeps its own Rngs, as NNX examples write dropout."""

  def __init__(self, rngs):
    self.lin = nnx.Linear(D, D, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)

  def __call__(self, x):
    return x + self.drop(self.lin(x))


class CallDropout(nnx.Module):
  """Takes its Rngs at call time."""

  def __init__(self, rngs):
    self.lin = nnx.Linear(D, D, rngs=rngs)
    self.drop = nnx.Dropout(0.5)

  def __call__(self, x, rngs):
    return x + self.drop(self.lin(x), rngs=rngs)


@pytest.mark.parametrize('block,specs', [
    (StoredDropout, ('none', 'seg:2')), (CallDropout, ('none', 'full@sqrt')),
    pytest.param(StoredDropout, ('none', 'full', 'seg:2', 'full@sqrt'), marks=pytest.mark.slow),
    pytest.param(CallDropout, ('none', 'full', 'seg:2', 'full@sqrt'), marks=pytest.mark.slow)])
def test_nnx_rngs_dropout_equal_under_every_policy(block, specs):
  x = jnp.ones((2, D))
  kw = lambda: {'rngs': nnx.Rngs(dropout=5)} if block is CallDropout else {}
  out = {}
  for spec in specs:
    stack = NNXStack(block, 4, spec, rngs=nnx.Rngs(params=0, dropout=1))
    grads = nnx.grad(lambda m: jnp.sum(m(x, **kw()) ** 2))(stack)
    out[spec] = (stack(x, **kw()), nnx.state(grads, nnx.Param))
  for spec in out:
    assert_trees_close(out[spec], out['none'], err_msg=f'{spec}: ')
  # Dropout was really applied: without it (eval mode) the output differs.
  stack = NNXStack(block, 4, 'none', rngs=nnx.Rngs(params=0, dropout=1))
  stack.eval()
  assert not np.allclose(stack(x, **kw()), out['none'][0])
