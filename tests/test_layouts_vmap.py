"""A stack traced inside ``jax.vmap`` (the Equinox habit: a per-example model, vmapped over the batch).

Under every layout the gradients equal the scan's, with the parameters shared
or per example, with a batched integer mask and a batched float closed over by
the layer, with dropout keys shared or per example, under two nested vmaps, and
through the linen and NNX front doors (``jax.vmap`` of ``apply``, ``nnx.vmap``). The layer-by-layer layouts run their
loop once on the whole batch (``jax.custom_batching.custom_vmap``), so the
vmapped stack plans exactly what the same stack over the batch plans; before,
the loop fell back to JAX's own derivative of the unrolled layers, which on the
H100 plan took a 6-layer MLP's ``full`` from 1.38 to 4.75 MiB.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from numerics import assert_trees_close
from remat import LayerStack, NNXStack, scan_layers
from remat.measuring import step_memory
from test_layouts import NBlock   # the NNX block of the layout tests (same D, H)

N, B, T, D, H = 4, 3, 5, 8, 16
LAYOUTS = ('unrolled', 'loops', 'groups')
SPECS = ('none', 'full', 'dots', 'sqrt', '2xfull+none')


def params(n=N):
  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  return {'w1': jax.random.normal(k1, (n, D, H)) / D ** 0.5,
          'w2': jax.random.normal(k2, (n, H, D)) / H ** 0.5}


def layer(p, x, mask, scale):
  """One example's layer: ``x`` [T, D], ``mask`` [T] bool, ``scale`` a float, both closed over."""
  h = jnp.tanh(x @ p['w1']) * scale
  return x + jnp.where(mask[:, None], h @ p['w2'], 0.0)


XS = jax.random.normal(jax.random.PRNGKey(1), (B, T, D))
MASKS = jnp.arange(T)[None, :] < jnp.array([5, 3, 1])[:, None]
SCALES = jnp.array([0.5, 1.0, 2.0])


def loss(p, spec, layout, shared=True):
  def one(x, mask, scale, p):
    return scan_layers(lambda q, y: layer(q, y, mask, scale), p, x, policy=spec, layout=layout)
  out = jax.vmap(one, in_axes=(0, 0, 0, None if shared else 0))(XS, MASKS, SCALES, p)
  return jnp.sum(out ** 2)


def grads(spec, layout, shared=True):
  p = params() if shared else jax.tree_util.tree_map(lambda a: jnp.stack([a] * B), params())
  return jax.jit(jax.grad(loss), static_argnums=(1, 2, 3))(p, spec, layout, shared)


@pytest.mark.parametrize('spec', SPECS)
def test_vmapped_stack_gradients_equal_the_scans(spec):
  want = grads(spec, 'scan')
  for layout in LAYOUTS:
    assert_trees_close(grads(spec, layout), want, err_msg=f'{spec} {layout}: ')


@pytest.mark.parametrize('spec', ['full', 'dots'])
def test_per_example_parameters_under_vmap(spec):
  """Parameters batched too (an ensemble): JAX's own derivative of the loop, vmapped."""
  want = grads(spec, 'scan', shared=False)
  for layout in LAYOUTS:
    assert_trees_close(grads(spec, layout, shared=False), want, err_msg=f'{spec} {layout}: ')


def test_nested_vmaps():
  def total(p, layout):
    per_x = lambda x: scan_layers(lambda q, y: layer(q, y, MASKS[0], 1.0), p, x, policy='full',
                                  layout=layout)
    return jnp.sum(jax.vmap(jax.vmap(per_x))(jnp.stack([XS, 2 * XS])) ** 2)
  want = jax.grad(total)(params(), 'scan')
  for layout in LAYOUTS:
    assert_trees_close(jax.jit(jax.grad(total), static_argnums=1)(params(), layout), want,
                       err_msg=layout)


def _plans(target):
  """``temp`` of the 6-layer MLP's gradient, vmapped per example and written over the batch."""
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
  ps = (jax.random.normal(k1, (6, 64, 256)) * 0.1, jax.random.normal(k2, (6, 256, 64)) * 0.1)
  xs = jax.random.normal(k3, (8, 32, 64))
  mlp = lambda w, h: h + jnp.tanh(h @ w[0]) @ w[1]
  out = {}
  for spec in ('none', 'full', 'dots'):
    for layout in ('unrolled', 'loops'):
      stack = lambda p, x: scan_layers(mlp, p, x, policy=spec, layout=layout)
      vmapped = lambda p, x: jnp.mean(jax.vmap(lambda e: stack(p, e))(x) ** 2)
      batched = lambda p, x: jnp.mean(stack(p, x) ** 2)
      out[spec, layout] = (step_memory(vmapped, ps, xs, target=target).temp,
                           step_memory(batched, ps, xs, target=target).temp)
  return out


def test_vmapped_stack_plans_as_the_stack_over_the_batch_on_cpu():
  for key, (vmapped, batched) in _plans('cpu').items():
    assert vmapped == batched, key


@pytest.mark.gpu_plan
def test_vmapped_stack_plans_as_the_stack_over_the_batch_on_h100():
  for key, (vmapped, batched) in _plans('h100').items():
    assert vmapped == batched, key


def test_dropout_keys_shared_and_per_example():
  """A key shared by the batch (the stack's per-layer keys unbatched) and one key per example
  (batched per-layer keys: the fallback); both give the scan's gradients."""
  def layer(p, x, rng):
    keep = jax.random.bernoulli(rng, 0.8, x.shape)
    return x + jnp.where(keep, jnp.tanh(x @ p['w1']) @ p['w2'], 0.0) / 0.8

  keys = jax.random.split(jax.random.PRNGKey(7), B)

  def grads_of(layout, per_example):
    def total(p):
      one = lambda x, key: scan_layers(layer, p, x, rng=key, policy='full', layout=layout)
      out = jax.vmap(one, in_axes=(0, 0 if per_example else None))(
          XS, keys if per_example else keys[0])
      return jnp.sum(out ** 2)
    return jax.jit(jax.grad(total))(params())
  for per_example in (False, True):
    want = grads_of('scan', per_example)
    for layout in LAYOUTS:
      assert_trees_close(grads_of(layout, per_example), want, err_msg=f'{layout} {per_example}')


class Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    return x + nn.Dense(D)(jnp.tanh(nn.Dense(H)(x)))


def test_linen_stack_under_vmap_of_apply():
  init = LayerStack(Block, N, 'none').init(jax.random.PRNGKey(0), XS[0])['params']

  def grads_of(spec, layout):
    stack = LayerStack(Block, N, spec, layout=layout)
    total = lambda p: jnp.sum(jax.vmap(lambda x: stack.apply({'params': p}, x))(XS) ** 2)
    return jax.jit(jax.grad(total))(init)
  for spec in ('full', 'dots'):
    want = grads_of(spec, 'scan')
    for layout in LAYOUTS:
      assert_trees_close(grads_of(spec, layout), want, err_msg=f'{spec} {layout}: ')


def test_nnx_stack_under_nnx_vmap():
  def grads_of(layout):
    stack = NNXStack(NBlock, N, 'full', rngs=nnx.Rngs(0), layout=layout)
    total = lambda m: jnp.sum(nnx.vmap(lambda m, x: m(x), in_axes=(None, 0))(m, XS) ** 2)
    return nnx.state(nnx.grad(total)(stack), nnx.Param)
  want = grads_of('scan')
  for layout in LAYOUTS:
    assert_trees_close(grads_of(layout), want, err_msg=layout)
