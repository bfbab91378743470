"""A unit's backward pass that writes each gradient row as soon as it is computed (remat.backward_order).

``write_when_final`` on its own: the same outputs, each listed output written
into its buffer right after the equation that computes it, and the rest of the
backward work held behind an ``optimization_barrier`` until then. In the
stored scan (remat.stored_scan): a two-matmul layer's second weight gradient is
written before the matmul that carries the cotangent to the first, the
gradients stay the plain scan's (tests/test_stored_scan.py checks every
policy family), and on the H100 plan of a public ViT the scan plans less than
with the rows written at the end of each step.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from remat import backward_order, scan_layers, stored_scan
from remat.layout import compiling_for
from remat.measuring import step_memory
from remat.tags import iter_eqns


def _backward(w0, w1, h, ct):
  """The hand-written backward pass of ``tanh(h @ w0) @ w1``: (dh, dw0, dw1)."""
  a = jnp.tanh(h @ w0)
  dw1 = a.T @ ct
  da = (ct @ w1.T) * (1 - a * a)
  return [da @ w0.T, h.T @ da, dw1]


def _args():
  k = jax.random.split(jax.random.PRNGKey(0), 4)
  return [jax.random.normal(k[0], (4, 6)), jax.random.normal(k[1], (6, 3)),
          jax.random.normal(k[2], (5, 4)), jax.random.normal(k[3], (5, 3))]


def _add(buffer, value):
  return buffer + value


def test_outputs_unchanged_and_each_written_when_computed():
  w0, w1, h, ct = _args()
  want = _backward(w0, w1, h, ct)
  # dw0 is written into w0's place and dw1 into w1's (the buffers here are the weights themselves)
  outs, written = backward_order.write_when_final(
      _backward, [w0, w1, h, ct], rows={1: 0, 2: 1}, write=_add, cotangents={3})
  for got, expected in zip(outs, want):
    np.testing.assert_array_equal(got, expected)
  assert set(written) == {0, 1}
  np.testing.assert_array_equal(written[0], w0 + want[1])
  np.testing.assert_array_equal(written[1], w1 + want[2])


def test_later_backward_work_waits_for_the_write():
  w0, w1, h, ct = _args()

  def traced(*args):
    outs, written = backward_order.write_when_final(
        _backward, list(args), rows={2: 1}, write=_add, cotangents={3})
    return outs, written[1]
  eqns = jax.make_jaxpr(traced)(w0, w1, h, ct).jaxpr.eqns
  names = [e.primitive.name for e in eqns]
  dots = [i for i, n in enumerate(names) if n == 'dot_general']
  barrier = names.index('optimization_barrier')
  # tanh(h @ w0) and dw1 = a.T @ ct come first; w1's row is written (the add) and held with the
  # cotangent-derived values at the barrier; ct @ w1.T, h.T @ da and da @ w0.T read them after it
  assert names.count('optimization_barrier') == 1, names
  assert [i < barrier for i in dots] == [True, True, False, False, False], names
  assert 'add' in names[dots[1]:barrier], names
  held = eqns[barrier]
  assert any(v.aval.shape == ct.shape for v in held.invars), 'the cotangent waits at the barrier'


def _layer(w, h):
  return h + jnp.tanh(h @ w[0]) @ w[1]


def test_stored_scan_writes_the_second_weight_before_the_first_input_gradient():
  k = jax.random.split(jax.random.PRNGKey(1), 3)
  params = (jax.random.normal(k[0], (4, 8, 16)) * 0.1, jax.random.normal(k[1], (4, 16, 8)) * 0.1)
  x = jax.random.normal(k[2], (32, 8))
  loss = lambda p, x: jnp.mean(scan_layers(_layer, p, x, policy='full', layout='scan') ** 2)
  with compiling_for('gpu'):
    assert stored_scan.applies(x, params)
    jaxpr = jax.make_jaxpr(jax.grad(loss))(params, x).jaxpr
  loops = [e for e in iter_eqns(jaxpr) if e.primitive.name == 'scan' and e.params['reverse']]
  body = loops[-1].params['jaxpr'].jaxpr
  names = [e.primitive.name for e in iter_eqns(body)]
  barriers = [i for i, n in enumerate(names) if n == 'optimization_barrier']
  dots = [i for i, n in enumerate(names) if n == 'dot_general']
  # the layer's backward in the loop body, one barrier per weight, each right after its row write:
  # h @ w0 (recomputed under full) and dw1; then ct @ w1.T and dw0; then the input's da @ w0.T
  assert len(barriers) == 2, names
  assert [sum(b0 < d < b1 for d in dots) for b0, b1 in
          zip([-1] + barriers, barriers + [len(names)])] == [2, 2, 1], names
  for b0, b1 in zip([-1] + barriers, barriers):
    assert 'dynamic_update_slice' in names[max(b0, 0):b1], names


@pytest.mark.gpu_plan
@pytest.mark.slow
@pytest.mark.parametrize('spec', ['full', 'dots'])
def test_public_vit_plans_less_with_rows_written_when_computed(spec, monkeypatch):
  from tests.public_models import deep_case
  case = deep_case('vit')
  stacked = case.stack(case.params)
  monkeypatch.setattr('remat.layout.choose_layout', lambda *a, **k: 'scan')
  in_order = step_memory(case.stacked(spec), stacked, case.batch, target='h100').temp
  run = stored_scan.run
  monkeypatch.setattr(stored_scan, 'run', lambda step, x, xs, in_order=False: run(step, x, xs))
  at_the_end = step_memory(case.stacked(spec), stacked, case.batch, target='h100').temp
  # measured at this commit: full 3.15 against 4.01 MiB, dots 14.80 against 15.86 (jax 0.10.2)
  assert in_order < 0.95 * at_the_end, (in_order, at_the_end)


@pytest.mark.parametrize('spec', ['none', 'full', 'dots'])
def test_gradients_equal_the_plain_scan_with_a_loop_inside_the_layer(spec):
  # a layer whose backward runs a loop of its own: its weight gradient is known only when the
  # loop ends, and is written then
  from numerics import assert_trees_close
  from remat import kept_in_gradients

  def looped(w, h):
    return jax.lax.scan(lambda c, _: (_layer(w, c), None), h, None, length=2)[0]
  k = jax.random.split(jax.random.PRNGKey(2), 3)
  params = (jax.random.normal(k[0], (4, 8, 16)) * 0.3, jax.random.normal(k[1], (4, 16, 8)) * 0.3)
  x = jax.random.normal(k[2], (32, 8))
  loss = lambda p, x: jnp.mean(scan_layers(looped, p, x, policy=spec, layout='scan') ** 2)
  with compiling_for('gpu'):
    stored = jax.grad(loss, argnums=(0, 1))(params, x)
  with kept_in_gradients.suspended():
    plain = jax.grad(loss, argnums=(0, 1))(params, x)
  # the same operations in another order, in float32 (tests/numerics.py)
  assert_trees_close(stored, plain)
