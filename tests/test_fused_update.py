"""remat.fused_update: the optimizer applied layer by layer in the backward pass.

Checked against the ordinary step (``jax.value_and_grad`` then ``tx.update``) on a
plain-JAX residual MLP stack: the same loss and, for an elementwise optimizer,
the same new parameters and optimizer state under every kind of policy; a
global-norm clip becomes a per-unit clip; and the compiled plan drops the
stacked gradient buffer.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import remat
from remat.update_in_backward import FusedUpdateError
from remat.targets import compiler_options

N, B, D, F = 7, 16, 32, 64


def _params(seed=0):
  k = jax.random.split(jax.random.PRNGKey(seed), 5)
  outer = {'embed': jax.random.normal(k[0], (D, D)) * 0.2, 'head': jax.random.normal(k[1], (D, 3)) * 0.2}
  stacked = {'w1': jax.random.normal(k[2], (N, D, F)) * 0.2, 'w2': jax.random.normal(k[3], (N, F, D)) * 0.2,
             'b': jax.random.normal(k[4], (N, D)) * 0.1}
  return outer, stacked


def _batch():
  k = jax.random.split(jax.random.PRNGKey(7), 2)
  return jax.random.normal(k[0], (B, D)), jax.random.randint(k[1], (B,), 0, 3)


def pre(outer, x, labels):
  return jnp.tanh(x @ outer['embed'])


def layer(p, h):
  return h + jnp.tanh(jnp.sin(h @ p['w1']) @ p['w2'] + p['b'])


def post(outer, h, x, labels):
  return optax.softmax_cross_entropy_with_integer_labels(h @ outer['head'], labels).mean()


def _ordinary(outer, stacked, tx, batch):
  """Reference: the ordinary step over the whole tree."""
  params = (outer, stacked)
  value, grads = jax.value_and_grad(lambda p: _ordinary_loss(p[0], p[1], batch))(params)
  state = tx.init(params)
  updates, state = tx.update(grads, state, params)
  return optax.apply_updates(params, updates), value


TX = optax.adamw(1e-2, b1=0.9, b2=0.95, weight_decay=0.1)


@pytest.mark.parametrize('spec', ['none', 'full', 'dots', 'sqrt', 'seg:3', 'full@sqrt'])
def test_fused_step_equals_the_ordinary_step(spec):
  outer, stacked = _params()
  batch = _batch()
  fused = remat.fused_update(pre, layer, post, TX, policy=spec)
  state = fused.init(outer, stacked)
  new_outer, new_stacked, new_state, loss = jax.jit(fused.step)(outer, stacked, state, *batch)
  (want_outer, want_stacked), want_loss = _ordinary(outer, stacked, TX, batch)
  # float32 throughout; the two programs differ in operation order only (a scan's sums,
  # Adam's sqrt of small second moments), so 1e-5 relative: orders above rounding noise and
  # far below the first step's change of each weight (lr 1e-2).
  np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
  chex.assert_trees_all_close(new_outer, want_outer, rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(new_stacked, want_stacked, rtol=1e-5, atol=1e-6)
  # the optimizer state is the ordinary layout: a second ordinary step could read it
  chex.assert_trees_all_equal_structs(new_state, fused.init(outer, stacked))
  assert int(new_state[1][0].count) == 1 and int(new_state[0][0].count) == 1


def test_global_norm_clip_becomes_a_clip_per_layer():
  outer, stacked = _params()
  batch = _batch()
  clip = 1e-3   # below every layer's gradient norm, so every layer is clipped
  tx = optax.chain(optax.clip_by_global_norm(clip), optax.sgd(1.0))
  fused = remat.fused_update(pre, layer, post, tx, policy='full')
  _, new_stacked, _, _ = jax.jit(fused.step)(outer, stacked, fused.init(outer, stacked), *batch)
  grads = jax.grad(lambda s: _ordinary_loss(outer, s, batch))(stacked)
  for i in range(N):
    g = jax.tree_util.tree_map(lambda a: a[i], grads)
    norm = optax.tree.norm(g)
    assert norm > clip
    want = jax.tree_util.tree_map(lambda p, d: p[i] - d * clip / norm, stacked, g)
    got = jax.tree_util.tree_map(lambda a: a[i], new_stacked)
    # each layer moved by exactly `clip` (its own norm), not by its share of a global clip
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-7)
    moved = optax.tree.norm(jax.tree_util.tree_map(jnp.subtract, got,
                                                     jax.tree_util.tree_map(lambda a: a[i], stacked)))
    np.testing.assert_allclose(moved, clip, rtol=1e-4)


def _ordinary_loss(outer, stacked, batch):
  h = pre(outer, *batch)
  h = jax.lax.scan(lambda c, p: (layer(p, c), None), h, stacked)[0]
  return post(outer, h, *batch)


def _temp(fn, *args, target='cpu'):
  if target != 'cpu':
    from remat.measuring import TrainStep, step_memory
    return step_memory(TrainStep(fn, lambda *a: 0.0, lambda *a: a), *args, target=target).temp
  c = jax.jit(fn, donate_argnums=(0,)).lower(*args).compile(compiler_options=compiler_options() or None)
  m = c.memory_analysis()
  return m.temp_size_in_bytes


@pytest.mark.parametrize('target', ['cpu', pytest.param('h200', marks=pytest.mark.gpu_plan)])
def test_no_stacked_gradient_buffer_in_the_plan(target):
  # Wide layers and a small batch: the weight gradients dominate the step's temporaries.
  n, d, f = 16, 256, 1024
  k = jax.random.split(jax.random.PRNGKey(1), 2)
  stacked = {'w1': jax.ShapeDtypeStruct((n, d, f), jnp.float32),
             'w2': jax.ShapeDtypeStruct((n, f, d), jnp.float32), 'b': jax.ShapeDtypeStruct((n, d), jnp.float32)}
  outer = {'embed': jax.ShapeDtypeStruct((d, d), jnp.float32), 'head': jax.ShapeDtypeStruct((d, 3), jnp.float32)}
  x = jax.ShapeDtypeStruct((4, d), jnp.float32)
  labels = jax.ShapeDtypeStruct((4,), jnp.int32)
  fused = remat.fused_update(pre, layer, post, TX, policy='full')
  state = jax.eval_shape(fused.init, outer, stacked)

  def fused_step(carry, x, labels):
    return fused.step(*carry, x, labels)

  def ordinary(carry, x, labels):
    params, opt = carry
    value, grads = jax.value_and_grad(lambda p: _ordinary_loss(p[0], p[1], (x, labels)))(params)
    updates, opt = TX.update(grads, opt, params)
    return optax.apply_updates(params, updates), opt, value

  stack_bytes = sum(np.prod(a.shape) * 4 for a in jax.tree_util.tree_leaves(stacked))
  layer_bytes = stack_bytes // n
  t_fused = _temp(fused_step, (outer, stacked, state), x, labels, target=target)
  t_ordinary = _temp(ordinary, ((outer, stacked), jax.eval_shape(TX.init, (outer, stacked))), x,
                     labels, target=target)
  # The ordinary step holds the whole [N, ...] gradient (16 layers' bytes). The fused one holds
  # one layer's gradient and one parameter's new values and Adam moments at a time (measured:
  # 5.07 against 34.75 MiB on XLA CPU, 6.07 against 35.79 MiB on the H200 plan, where XLA
  # inlines the one-iteration update loops), so it saves at least 4 layers' bytes.
  assert t_ordinary >= stack_bytes, (t_ordinary, stack_bytes)
  assert t_ordinary - t_fused >= 4 * layer_bytes, (t_ordinary, t_fused, layer_bytes)
  assert t_fused <= 8 * layer_bytes, (t_fused, layer_bytes)


def test_errors_are_one_line():
  outer, stacked = _params()
  with pytest.raises(remat.PolicyError, match='is a mix'):
    remat.fused_update(pre, layer, post, TX, policy='2xfull+none')
  # a factored optimizer keeps per-layer state that is not [N, ...] leading
  tx = optax.adafactor(1e-2, min_dim_size_to_factor=8)
  fused = remat.fused_update(pre, layer, post, tx, policy='full')
  with pytest.raises(FusedUpdateError, match=r'neither per layer \(\[7, \.\.\.\]') as e:
    jax.jit(fused.step)(outer, stacked, fused.init(outer, stacked), *_batch())
  assert '\n' not in str(e.value)
  bad = dict(stacked, b=stacked['b'][:3])
  fused = remat.fused_update(pre, layer, post, TX)
  with pytest.raises(FusedUpdateError, match='same leading layer axis') as e:
    jax.jit(fused.step)(outer, bad, fused.init(outer, bad), *_batch())
  assert '\n' not in str(e.value)


def test_read_after_ties_only_inside_the_fused_backward():
  from remat.update_in_backward import _in_backward
  x, g = jnp.ones((3, 4)), jnp.full((2,), jnp.nan)
  assert remat.read_after(x, g) is x          # an ordinary step is left as it was
  with _in_backward():
    jaxpr = jax.make_jaxpr(lambda a, b: remat.read_after(a, b))(x, g)
    tied = [jax.jit(remat.read_after)(x, jnp.full((2,), v)) for v in (3.0, jnp.nan, jnp.inf)]
  # inside, x depends on g (one add of a zero made from g[0]), and its value is unchanged for
  # every g, NaN and inf included (0 * g[0] was NaN there)
  assert any(e.primitive.name == 'add' for e in jaxpr.eqns)
  for t in tied:
    np.testing.assert_array_equal(t, x)
