"""Layouts (scan, unrolled, loops, groups): one parameter tree, the same gradients, under every spec.

A layout changes how a stack's layers become a program, never what they compute:
the gradients under every layout equal the scan's under every policy family
(per-layer rules, segments with and without a remainder, rules inside segments,
mixes, patterns with a remainder), through each front door, with dropout keys,
per-layer inputs and outputs, a U-Net's skips and mutable state.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from numerics import assert_trees_close
from remat import LayerStack, NNXStack, PolicyError, scan_layers
from remat.layout import (LAYOUTS, choose_layout, compiling_for, per_block_reference,
                          unrolled_reference)
from remat.policies import get_policy

N, D, H, B = 6, 8, 16, 4
LAYOUTS_RUN = [lay for lay in LAYOUTS if lay != 'auto']
SPECS = ['none', 'full', 'dots', 'names:fc1', 'offload:fc1', 'sqrt', 'full@sqrt', 'seg:4',
         'stage', '2xfull+none', '4xdots+seg:2']


def mlp(p, x, scale=1.0):
  h = checkpoint_name(x @ p['w1'] + p['b1'], 'fc1')
  return x + scale * jnp.tanh(h) @ p['w2']


def params(n=N, seed=0):
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  return {'w1': jax.random.normal(k1, (n, D, H)) / D ** 0.5, 'b1': jnp.full((n, H), 0.1),
          'w2': jax.random.normal(k2, (n, H, D)) / H ** 0.5}


X = jax.random.normal(jax.random.PRNGKey(1), (B, D))


def plain_grads(spec, layout, p=None, **kw):
  loss = lambda p: jnp.sum(scan_layers(mlp, p, X, 0.5, policy=spec, layout=layout, **kw) ** 2)
  return jax.jit(jax.grad(loss))(params() if p is None else p)


@pytest.mark.parametrize('spec', SPECS)
def test_gradients_equal_across_layouts(spec):
  want = plain_grads(spec, 'scan')
  for layout in LAYOUTS_RUN[1:]:
    assert_trees_close(plain_grads(spec, layout), want, err_msg=f'{spec} {layout}: ')


@pytest.mark.parametrize('spec', ['none', 'full', 'dots', 'names:fc1', 'sqrt', '2xfull+none'])
def test_auto_for_a_gpu_equals_the_scan(spec):
  """'auto' traced for a GPU (unrolled for a per-layer rule, loops for none): the scan's gradients."""
  with compiling_for('gpu'):
    got = plain_grads(spec, 'auto')
  assert_trees_close(got, plain_grads(spec, 'scan'), err_msg=f'{spec}: ')


def test_auto_is_the_scan_on_cpu():
  """On the CPU backend (which drops checkpoints in straight-line code) auto plans as before: the scan."""
  for spec in SPECS:
    assert choose_layout(get_policy(spec), N, platform='cpu') == 'scan'
  assert choose_layout(get_policy('dots'), 64, platform='gpu') == 'scan'   # compile time


def test_auto_on_a_gpu_per_rule_pattern_and_inner_loop():
  """On a GPU plan: unrolled for a per-layer rule, loops for none and patterns, the scan for none and
  full where a layer has a loop of its own or the scan stores its saved values in gradient rows,
  and for dots where it stores them and no layer loops (docs/own-model.md has the measurements
  behind each)."""
  pick = lambda spec, **kw: choose_layout(get_policy(spec), N, platform='gpu', **kw)
  assert [pick(s) for s in ('full', 'dots', 'names:fc1', 'none')] == \
      ['unrolled', 'unrolled', 'unrolled', 'loops']
  assert [pick(s, pattern=True) for s in ('full', 'dots', 'none')] == ['loops'] * 3
  for spec in ('full', 'none'):
    assert pick(spec, inner_loop=True) == 'scan'
    assert pick(spec, pattern=True, inner_loop=lambda: True) == 'scan'
  assert pick('dots', inner_loop=True) == 'unrolled'
  assert pick('dots', pattern=True, inner_loop=True) == 'loops'
  # where the scan keeps its saved values in gradient rows (one kind of layer, outside vmap):
  # the scan for none, full and dots (dots only for a layer without a loop of its own), not for
  # another rule or a pattern
  assert [pick(s, stored=True) for s in ('full', 'none', 'dots', 'names:fc1')] == \
      ['scan', 'scan', 'scan', 'unrolled']
  assert pick('dots', stored=True, inner_loop=lambda: True) == 'unrolled'
  assert [pick(s, pattern=True, stored=lambda: True) for s in ('full', 'none')] == ['loops'] * 2
  # a rule that offloads: the scan, whose stacked residuals XLA moves to host memory (it moved
  # few of the unrolled layers' in tests/test_explain.py's llama-tiny, H200 plan)
  assert [pick(s, pattern=p) for s in ('offload:fc1', 'qkv_proj_offloaded')
          for p in (False, True)] == ['scan'] * 4
  asked = []
  assert choose_layout(get_policy('full'), N, platform='cpu',
                       inner_loop=lambda: asked.append(1) or True) == 'scan'
  assert not asked   # the layer is traced only where the answer matters


def test_has_loop_finds_loops_at_any_depth():
  from remat.layout import has_loop
  assert not has_loop(mlp, _first(params()), X)
  looped = lambda p, x: jax.lax.scan(lambda c, _: (mlp(p, c), None), x, None, length=2)[0]
  assert has_loop(jax.checkpoint(looped), _first(params()), X)
  assert has_loop(lambda p, x: jax.lax.fori_loop(0, 2, lambda i, c: mlp(p, c), x),
                  _first(params()), X)

  @jax.custom_vjp
  def looped_backward(x):
    return jnp.tanh(x)
  looped_backward.defvjp(lambda x: (jnp.tanh(x), x), lambda x, g: (
      jax.lax.fori_loop(0, 2, lambda i, c: c * (1 - jnp.tanh(x) ** 2), g),))
  assert has_loop(lambda p, x: mlp(p, looped_backward(x)), _first(params()), X)


def _first(tree):
  return jax.tree_util.tree_map(lambda a: a[0], tree)


@pytest.mark.parametrize('spec', ['none', 'full', 'dots'])
def test_auto_for_a_gpu_with_an_inner_loop_or_a_pattern_equals_the_scan(spec):
  """The layouts auto picks on a GPU plan for a looped layer (scan) and a pattern (loops)."""
  def looped(p, x):
    return jax.lax.scan(lambda c, _: (mlp(p, c), None), x, None, length=2)[0]
  with compiling_for('gpu'):
    got = jax.jit(jax.grad(lambda p: jnp.sum(scan_layers(looped, p, X, policy=spec,
                                                         layout='auto') ** 2)))(params())
  want = jax.jit(jax.grad(lambda p: jnp.sum(scan_layers(looped, p, X, policy=spec,
                                                        layout='scan') ** 2)))(params())
  assert_trees_close(got, want, err_msg=f'{spec}: ')
  p = {'local': {'w': jax.random.normal(jax.random.PRNGKey(3), (10, D, D)) * 0.3},
       'global': {'w1': jax.random.normal(jax.random.PRNGKey(4), (2, D, H)) * 0.3,
                  'w2': jax.random.normal(jax.random.PRNGKey(5), (2, H, D)) * 0.3}}

  def grads(layout):
    loss = lambda p: jnp.sum(scan_layers({'local': local, 'global': global_}, p, X,
                                         pattern=('local',) * 5 + ('global',), policy=spec,
                                         layout=layout) ** 2)
    return jax.jit(jax.grad(loss))(p)
  with compiling_for('gpu'):
    got = grads('auto')
  assert_trees_close(got, grads('scan'), err_msg=f'pattern {spec}: ')


def test_unknown_layout_is_one_line():
  with pytest.raises(PolicyError) as e:
    scan_layers(mlp, params(), X, policy='full', layout='unroled')
  assert 'valid: auto, scan, unrolled, loops, groups' in str(e.value)
  assert '\n' not in str(e.value)


def local(p, x):
  return x + jnp.tanh(x @ p['w'])


def global_(p, x):
  return x + jnp.sin(x @ p['w1']) @ p['w2']


@pytest.mark.parametrize('spec', ['none', 'full', 'dots', 'sqrt', 'full@seg:2', '1xfull+none'])
def test_pattern_with_a_remainder_equal_across_layouts(spec):
  k1, k2 = jax.random.split(jax.random.PRNGKey(2))
  p = {'local': {'w': jax.random.normal(k1, (11, D, D)) * 0.3},   # 13 layers: 2 repeats + 1
       'global': {'w1': jax.random.normal(k1, (2, D, H)) * 0.3,
                  'w2': jax.random.normal(k2, (2, H, D)) * 0.3}}
  pattern = ('local',) * 5 + ('global',)

  def grads(layout):
    loss = lambda p: jnp.sum(scan_layers({'local': local, 'global': global_}, p, X,
                                         pattern=pattern, policy=spec, layout=layout) ** 2)
    return jax.jit(jax.grad(loss))(p)
  want = grads('scan')
  for layout in LAYOUTS_RUN[1:]:
    assert_trees_close(grads(layout), want, err_msg=f'{spec} {layout}: ')


def test_keys_and_per_layer_inputs_and_outputs():
  """Dropout keys, xs in and a per-layer output out, and a layer that returns its output as a skip."""
  def layer(p, x, cache, rng):
    keep = jax.random.bernoulli(rng, 0.8, x.shape)
    y = jnp.where(keep, mlp(p, x), 0.0) / 0.8 + cache
    return y, (y, jnp.mean(y))   # the output itself (a skip) and a number

  cache = jax.random.normal(jax.random.PRNGKey(4), (N, B, D))
  key = jax.random.PRNGKey(5)

  def run(spec, layout):
    def loss(p, cache):
      y, (skips, m) = scan_layers(layer, p, X, xs=cache, rng=key, policy=spec, layout=layout)
      return jnp.sum(y ** 2) + jnp.sum(jnp.sin(skips)) + jnp.sum(m)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params(), cache)
  for spec in ('none', 'full', 'sqrt'):
    want = run(spec, 'scan')
    for layout in LAYOUTS_RUN[1:]:
      assert_trees_close(run(spec, layout), want, err_msg=f'{spec} {layout}: ')


@pytest.mark.parametrize('spec', ['none', 'full', 'sqrt', 'full@seg:2', '2xfull+none'])
def test_a_pytree_carry_under_every_layout_for_a_gpu(spec):
  """A carry of two arrays of different shapes: a segment's saved input is a pytree, stored leaf by
  leaf in gradient rows (GPU trace; its tuple was passed whole to the row planner before)."""
  def layer(p, carry):
    x, total = carry
    y = mlp(p, x)
    return y, total + jnp.mean(y, axis=-1)

  def grads(layout):
    def loss(p, x):
      y, total = scan_layers(layer, p, (x, jnp.zeros((B,))), policy=spec, layout=layout)
      return jnp.sum(y ** 2) + jnp.sum(total ** 3)
    return jax.jit(jax.grad(loss, argnums=(0, 1)))(params(), X)
  want = grads('scan')
  with compiling_for('gpu'):
    for layout in LAYOUTS:
      assert_trees_close(grads(layout), want, err_msg=f'{spec} {layout}: ')


class Block(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool = True):
    h = nn.Dense(H)(x)
    h = nn.BatchNorm(use_running_average=not train, momentum=0.5)(h)
    return x + nn.Dense(D)(jnp.tanh(h))


@pytest.mark.parametrize('spec', ['none', 'full', 'sqrt'])
def test_linen_one_tree_and_batch_stats_under_every_layout(spec):
  init = LayerStack(Block, N, 'none').init(jax.random.PRNGKey(0), X)
  outs = {}
  for layout in LAYOUTS_RUN:
    stack = LayerStack(Block, N, spec, layout=layout)
    assert jax.tree_util.tree_structure(stack.init(jax.random.PRNGKey(0), X)) == \
        jax.tree_util.tree_structure(init)

    def loss(p, stack=stack):
      y, state = stack.apply({'params': p, 'batch_stats': init['batch_stats']}, X,
                             mutable=['batch_stats'])
      return jnp.sum(y ** 2), state
    outs[layout] = jax.jit(jax.grad(loss, has_aux=True))(init['params'])
  for layout in LAYOUTS_RUN[1:]:
    assert_trees_close(outs[layout], outs['scan'], err_msg=f'{spec} {layout}: ')


class NBlock(nnx.Module):
  def __init__(self, rngs):
    self.fc1 = nnx.Linear(D, H, rngs=rngs)
    self.fc2 = nnx.Linear(H, D, rngs=rngs)

  def __call__(self, x):
    return x + self.fc2(jnp.tanh(self.fc1(x)))


@pytest.mark.parametrize('spec', ['full', 'seg:4'])
def test_nnx_equal_across_layouts(spec):
  grads = {}
  for layout in LAYOUTS_RUN:
    stack = NNXStack(NBlock, N, spec, rngs=nnx.Rngs(0), layout=layout)
    grads[layout] = nnx.state(nnx.grad(lambda m: jnp.sum(m(X) ** 2))(stack), nnx.Param)
  for layout in LAYOUTS_RUN[1:]:
    assert_trees_close(grads[layout], grads['scan'], err_msg=f'{spec} {layout}: ')


def test_references_compute_the_model():
  want = plain_grads('none', 'scan')
  with unrolled_reference():
    assert_trees_close(plain_grads('full@sqrt', 'groups'), want)
  for rule in ('full', 'dots', 'names:fc1'):
    with per_block_reference(rule):
      assert_trees_close(plain_grads('sqrt', 'scan'), want, err_msg=f'{rule}: ')


@pytest.mark.parametrize('rule', ['sqrt', 'full@seg:2', '2xfull+none'])
def test_per_block_reference_takes_a_rule_only(rule):
  with pytest.raises(PolicyError) as e:
    with per_block_reference(rule):
      pass
  assert 'per-layer rule' in str(e.value) and '\n' not in str(e.value)
