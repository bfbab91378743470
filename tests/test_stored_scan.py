"""The scan whose saved values wait in the gradient rows it writes later (remat.stored_scan).

It serves GPU targets: the gradient tests trace for one (``compiling_for('gpu')``)
and run on the CPU. The same gradients as the plain scan (inside
``kept_in_gradients.suspended()``) under every policy family, for the stacked
parameters and for a value every layer closes over; a smaller H100 plan where the
saved values fit in the rows; the placement (spanning leaves, a value larger
than the room left spilling its remainder into a loop output, another dtype as
its bits); the residual report, which names the values as saved, and
``remat.explain``, which counts the rows as gradients; and where it is not used
(CPU, vmap, one unit).
"""

import jax
import jax.numpy as jnp
import pytest

from numerics import assert_trees_close
from remat import explain, kept_in_gradients, scan_layers, stored_scan
from remat.layout import compiling_for
from remat.measuring import step_memory
from remat.residuals import by_tag, saved_residuals

L, B, D, H = 8, 64, 32, 64


def _args():
  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  return ((jax.random.normal(k1, (L, D, H)) * 0.1, jax.random.normal(k2, (L, H, D)) * 0.1),
          jax.random.normal(jax.random.PRNGKey(1), (B, D)))


def _layer(w, h, scale):
  u = jax.ad_checkpoint.checkpoint_name(h @ w[0], 'up')
  return h + jnp.tanh(u * scale) @ w[1]


def _loss(spec):
  def loss(params, x, scale):
    return jnp.mean(scan_layers(_layer, params, x, scale, policy=spec, layout='scan') ** 2)
  return loss


@pytest.mark.parametrize('spec', ['none', 'full', 'dots', 'names:up', 'sqrt', 'seg:2'])
def test_gradients_equal_the_plain_scan(spec):
  params, x = _args()
  scale = jnp.float32(0.7)   # closed over by every layer: its gradient sums the layers'
  grad = jax.grad(_loss(spec), argnums=(0, 2))   # not jitted: each call traces under its context
  with compiling_for('gpu'):
    assert stored_scan.applies(x, params)
    stored = grad(params, x, scale)
  with kept_in_gradients.suspended():
    plain = grad(params, x, scale)
  # The same jax.vjp of each layer in both; only where the saved values wait differs, and XLA
  # may fuse the two programs' elementwise work differently: float32 rounding (numerics.py).
  assert_trees_close(stored, plain)


@pytest.mark.gpu_plan
@pytest.mark.parametrize('spec', ['full', 'dots', 'none'])
def test_h100_plan_smaller_than_the_plain_scan(spec):
  params, x = _args()
  args = (params, x, jnp.float32(0.7))
  # a layer's input (B x D = 2048 floats) and its `up` (B x H = 4096) fit in its rows (2 x D x H =
  # 4096 floats), so they no longer need [L, ...] loop outputs of their own beside the gradient
  stored = step_memory(_loss(spec), *args, target='h100').temp
  with kept_in_gradients.suspended():
    plain = step_memory(_loss(spec), *args, target='h100').temp
  assert stored < plain, (stored, plain)


def _where(layer, params, x):
  """The placement of one unit's saved values (stored_scan's plan) for ``layer(h, w)``."""
  leaves = jax.tree_util.tree_leaves(params)
  rows = [a[0].size for a in leaves]
  first = jax.tree_util.tree_map(lambda a: a[0], params)

  def trace():
    out, pull = jax.vjp(layer, x, first)
    got, tree = jax.tree_util.tree_flatten(pull)
    known = [(('s', n), a) for n, a in enumerate(jax.tree_util.tree_leaves(first))]
    where, mine = stored_scan.residual_origins(got, known)
    return out, tree, where, mine
  return stored_scan._plan(trace, leaves, rows).where


def test_plan_spans_leaves_and_spills_what_does_not_fit():
  w = (jnp.zeros((L, 4, 6)), jnp.zeros((L, 6, 4)))   # rows of 24 floats in each leaf
  h = jnp.zeros((5, 4))                               # 20 floats
  saves = lambda names: jax.checkpoint(
      lambda h, w: jnp.tanh(jax.ad_checkpoint.checkpoint_name(h @ w[0], 'a')) @ w[1],
      policy=jax.checkpoint_policies.save_only_these_names(*names))
  # full: the input (20 floats) in the roomiest leaf's row; the weights are read where they are
  where = _where(saves(()), w, h)
  stored = [a for kind, a in where if kind == 'a']
  assert stored == [(((0, 0, 20),), (5, 4), jnp.float32, None)], where
  assert {a for kind, a in where if kind == 's'} == {0, 1}
  # with `a` (30 floats) saved too, the two need 50 floats and the rows hold 48: the input takes
  # 20 of the first row, `a` the other row and the 4 floats left in the first, and keeps its last
  # 2 floats as loop output 0 (no row stays empty while values wait)
  stored = {a[1]: a for kind, a in _where(saves(('a',)), w, h) if kind == 'a'}
  assert set(stored) == {(5, 4), (5, 6)}, stored
  assert stored[(5, 4)][3] is None and stored[(5, 6)][3] == 0, stored
  assert [sum(size for _, _, size in a[0]) for a in (stored[(5, 4)], stored[(5, 6)])] == [20, 28]
  pieces = sorted(p for a in stored.values() for p in a[0])
  assert [(leaf, off) for leaf, off, _ in pieces] == [(0, 0), (0, 20), (1, 0)], pieces
  # a bfloat16 value beside float32 gradients is stored as its bits: 21 values in 11 elements
  half = jax.checkpoint(lambda h, w: jnp.tanh(h @ w[0].astype(jnp.bfloat16)).astype(
      jnp.float32) @ w[1], policy=jax.checkpoint_policies.nothing_saveable)
  odd = jnp.zeros((3, 7), jnp.bfloat16)
  stored = [a for kind, a in _where(half, (jnp.zeros((L, 7, 6)), w[1]), odd) if kind == 'a']
  assert stored == [(((0, 0, 11),), (3, 7), jnp.bfloat16, None)], stored


@pytest.mark.parametrize('dtype,acc,elements', [(jnp.bfloat16, jnp.float32, 8),
                                                 (jnp.float16, jnp.float32, 8),
                                                 (jnp.float32, jnp.bfloat16, 30)])
def test_bits_round_trip(dtype, acc, elements):
  value = jax.random.normal(jax.random.PRNGKey(3), (3, 5)).astype(dtype)   # 15 values: odd
  bits = stored_scan._to_bits(value, acc)
  assert bits.dtype == acc and bits.size == elements == stored_scan._elements(15, dtype, acc)
  back = stored_scan._from_bits(bits, dtype, (3, 5))
  assert back.dtype == dtype and bool(jnp.all(back == value))


def test_gradients_equal_with_bfloat16_activations():
  params, x = _args()
  layer = lambda w, h: h + (jnp.tanh(h.astype(jnp.bfloat16) @ w[0].astype(jnp.bfloat16))
                            @ w[1].astype(jnp.bfloat16)).astype(jnp.float32)
  loss = lambda p, x: jnp.mean(scan_layers(layer, p, x, policy='dots', layout='scan') ** 2)
  # Without XLA's excess precision: with it, bfloat16 element-wise work stays in float32 within a
  # fusion (a matmul's output converted and added is not rounded to bfloat16 first), so where the
  # fusions end decides the rounding, and the backward pass's barriers (remat.backward_order) end
  # some (4 bfloat16 ulps apart here). Without it both programs round every bfloat16 value.
  options = {'xla_allow_excess_precision': False}
  with compiling_for('gpu'):
    stored = jax.jit(jax.grad(loss), compiler_options=options)(params, x)
  with kept_in_gradients.suspended():
    plain = jax.jit(jax.grad(loss), compiler_options=options)(params, x)
  assert_trees_close(stored, plain)


def test_residual_report_names_the_values_as_saved():
  params, x = _args()
  with compiling_for('gpu'):
    names = by_tag(saved_residuals(_loss('names:up'), params, x, jnp.float32(0.7)))
  assert names.get('up') == L * B * H * 4, names


def test_not_used_on_the_cpu_inside_vmap_or_for_one_unit():
  params, x = _args()
  with compiling_for('cpu'):
    assert not stored_scan.applies(x, params)
  with compiling_for('gpu'):
    assert stored_scan.applies(x, params)
    assert not stored_scan.applies(x, jax.tree_util.tree_map(lambda a: a[:1], params))
    seen = []
    jax.vmap(lambda x: seen.append(stored_scan.applies(x, params)) or x)(x)
    assert seen == [False]
    with kept_in_gradients.suspended():
      assert not stored_scan.applies(x, params)


def test_public_model_gradients_equal_the_plain_scan():
  # a model written by others under the lean rule of `none`, which saves the most kinds of value
  from tests.public_models import deep_case
  case = deep_case('gemma')
  stacked = case.stack(case.params)
  loss = lambda: jax.grad(case.stacked('none'))(stacked, case.batch)
  with compiling_for('gpu'):   # auto: the scan, its saved values in gradient rows
    stored = loss()
  with compiling_for('cpu'):   # auto: the plain scan
    plain = loss()
  assert_trees_close(stored, plain)


@pytest.mark.gpu_plan
def test_explain_counts_the_rows_as_gradients():
  # The rows are the weight gradients the backward loop writes (those of layers it has not
  # reached hold their saved values): `remat.explain` files them as gradients, `[L, D * H]`,
  # not as the loop's working set.
  params, x = _args()
  e = explain(lambda p: _loss(p.spec), params, x, jnp.float32(0.7), policy='full',
                    target='h100')
  rows = [b for b in e.buffers if b.shape == f'f32[{L},{D * H}]']
  assert rows and {b.category for b in rows} == {'gradients'}, e.summary()


@pytest.mark.gpu_plan
def test_the_auto_search_plans_the_gpu_layout():
  # remat.auto's search compiles for the target as remat.measure does: the stacks choose their
  # layout for the GPU, not for this machine's CPU backend (it had planned the plain scan).
  from remat.auto_search import plan
  from remat.targets import get_target
  params, x = _args()
  args = (params, x, jnp.float32(0.7))
  target = get_target('h100')
  searched = plan(_loss('full'), args, target).temp
  assert searched == step_memory(_loss('full'), *args, target=target).temp
  with kept_in_gradients.suspended():
    plain = step_memory(_loss('full'), *args, target=target).temp
  assert searched < plain, (searched, plain)
