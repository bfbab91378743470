"""Saved values waiting in the stacked gradient's unwritten rows (remat.kept_in_gradients).

The plan: any value a block under a rule keeps, only the input of a block with
no rule, in the rows of blocks up to its own (lowest free offset first), only of
the same dtype, and only where it fits. The effect: the same gradients,
and a plan no larger than without it on the H100 plan (where an earlier
version, reading the value straight out of the flat accumulator, led XLA to a
matmul with a 4 MiB workspace: 4.25 MB of ``temp`` against 92 KB for this MLP
under ``unrolled`` and ``full``). Stacks store only when traced for a GPU (on
the CPU backend they keep each block's gradient apart instead:
tests/test_unrolled_cpu.py), so these tests trace for one.
"""

import jax
import jax.numpy as jnp
import pytest

from numerics import assert_trees_close
from remat import kept_in_gradients, scan_layers
from remat.layout import compiling_for
from remat.measuring import step_memory
from stack_cases import mlp_args, mlp_loss


def _without_storing(monkeypatch):
  monkeypatch.setattr(kept_in_gradients, 'place', lambda *a, **k: {})


def test_place_lowest_free_offset_in_rows_written_after_the_read():
  x0, x1, x2, big = (jnp.zeros((4, 8)) for _ in range(4))
  half = jnp.zeros((4, 8), jnp.bfloat16)
  accs = [jax.ShapeDtypeStruct((3, 8, 4), jnp.float32), None]   # rows of 32 floats per block
  rows = [[(0, 1), (0, 1)], [(1, 1), (1, 1)], [(2, 1), (2, 1)]]
  kept = [[x0, None], [x1, big], [x2, half]]
  inputs, every = [[x0], [x1], [x2, half]], [False, True, True]
  spots = kept_in_gradients.place(kept, inputs, every, accs, rows)
  # block 0's input in its own rows (read before they are written); block 1's input in the rest of
  # blocks 0..1's rows, where its other value (it has a rule, so any value may wait) finds no room;
  # block 2's in its own rows; not a bfloat16 value beside float32 gradients, nothing where no
  # gradient is
  assert spots == {(0, 0): kept_in_gradients.Spot(0, 0, (4, 8)),
                   (1, 0): kept_in_gradients.Spot(0, 32, (4, 8)),
                   (2, 0): kept_in_gradients.Spot(0, 64, (4, 8))}
  # a value larger than one block's rows spans several, within the rows of blocks 0..b
  wide = jnp.zeros((12, 8))   # 96 floats: blocks 0..2's rows at once
  assert kept_in_gradients.place([[None], [None], [wide]], [[]] * 3, [True] * 3, accs, rows) == {
      (2, 0): kept_in_gradients.Spot(0, 0, (12, 8))}
  assert kept_in_gradients.place([[None], [wide]], [[]] * 2, [True] * 2, accs, rows) == {}
  # a block with no rule stores only its input
  assert kept_in_gradients.place([[x0, x1]], [[x1]], [False], accs, rows) == {
      (0, 1): kept_in_gradients.Spot(0, 0, (4, 8))}


@pytest.mark.parametrize('layout', ['unrolled', 'loops'])
def test_same_gradients_with_and_without_storing(layout, monkeypatch):
  stored = []
  place = kept_in_gradients.place
  monkeypatch.setattr(kept_in_gradients, 'place', lambda *a: stored.append(place(*a)) or stored[-1])
  for spec in ('full', 'dots', 'sqrt', 'none'):
    with compiling_for('gpu'):   # the GPU form, run on this backend
      got = jax.jit(jax.grad(mlp_loss(spec, layout)))(*mlp_args())
      with monkeypatch.context() as m:
        _without_storing(m)
        want = jax.jit(jax.grad(mlp_loss(spec, layout)))(*mlp_args())
    assert_trees_close(got, want, err_msg=f'{spec} {layout}')
  assert any(stored), 'nothing was stored'


def _temps(target, monkeypatch, cases):
  out = {}
  for layout, spec in cases:
    stored = step_memory(mlp_loss(spec, layout), *mlp_args(), target=target).temp
    with monkeypatch.context() as m:
      _without_storing(m)
      out[layout, spec] = (stored, step_memory(mlp_loss(spec, layout), *mlp_args(), target=target).temp)
  return out


@pytest.mark.gpu_plan
def test_h100_plan_no_larger(monkeypatch):
  temps = _temps('h100', monkeypatch, [(lay, s) for lay in ('unrolled', 'loops')
                                       for s in ('full', 'dots', 'none', 'sqrt')])
  for key, (stored, without) in temps.items():
    assert stored <= without, key
  assert temps['loops', 'full'][0] < temps['loops', 'full'][1]


def test_a_frozen_leaf_gets_no_rows(monkeypatch):
  """A leaf nobody differentiates (a LoRA base weight) has no accumulator to store into: rows
  holding kept values would make XLA compute its gradient (the frozen [8, 256, 256] weight beside
  its adapter, unrolled, full, H100 plan: 5.25 MB of temp with its rows, 4.20 without)."""
  given = []
  place = kept_in_gradients.place
  monkeypatch.setattr(kept_in_gradients, 'place',
                      lambda kept, inputs, every, accs, rows: given.append(accs) or place(
                          kept, inputs, every, accs, rows))
  (w0, w1), x = mlp_args()
  layer = lambda w, h: h + jnp.tanh(h @ w[0]) @ w[1]
  loss = lambda frozen: lambda w0, w1: jnp.mean(scan_layers(
      layer, (jax.lax.stop_gradient(w0) if frozen else w0, w1), x, policy='full',
      layout='unrolled') ** 2)
  with compiling_for('gpu'):
    jax.make_jaxpr(jax.grad(loss(True), argnums=1))(w0, w1)
    assert [a is None for a in given[-1]] == [True, False]
    jax.make_jaxpr(jax.grad(loss(False), argnums=(0, 1)))(w0, w1)
    assert [a is None for a in given[-1]] == [False, False]
    # and the adapter's gradient is the one without storing
    grad = lambda: jax.grad(loss(True), argnums=1)(w0, w1)
    stored = grad()
    with kept_in_gradients.suspended():
      assert_trees_close(stored, grad())
