"""A segmented stack rebuilt, segment by segment, into the gradient rows it writes (remat.stored_segments).

It serves GPU targets: the gradient tests trace for one (``compiling_for('gpu')``)
and run on the CPU, against the checkpointed segments (inside
``kept_in_gradients.suspended()``, which turns the GPU-only paths off). Both
run ``jax.vjp`` of the same units; only where the saved values wait differs.
"""

import jax
import jax.numpy as jnp
import pytest

from numerics import assert_trees_close
from remat import kept_in_gradients, scan_layers, stored_segments
from remat.layout import compiling_for
from remat.measuring import step_memory

L, D, H = 8, 32, 64   # rows of 2 * D * H = 4096 floats per layer


def _args(batch=64, dtype=jnp.float32):
  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  return ((jax.random.normal(k1, (L, D, H)) * 0.1, jax.random.normal(k2, (L, H, D)) * 0.1),
          jax.random.normal(jax.random.PRNGKey(1), (batch, D)).astype(dtype))


def _layer(w, h, scale):
  u = jax.ad_checkpoint.checkpoint_name(h.astype(jnp.float32) @ w[0], 'up')
  return (h + jnp.tanh(u * scale) @ w[1]).astype(h.dtype)


def _loss(spec):
  def loss(params, x, scale):
    y = scan_layers(_layer, params, x, scale, policy=spec, layout='scan')
    return jnp.mean(y.astype(jnp.float32) ** 2)
  return loss


@pytest.fixture
def runs(monkeypatch):
  """How many stacks :func:`remat.stored_segments.run` served."""
  count = []
  run = stored_segments.run
  monkeypatch.setattr(stored_segments, 'run', lambda *a, **k: count.append(1) or run(*a, **k))
  return count


def _both(loss, args, argnums=(0, 2)):
  grad = jax.grad(loss, argnums=argnums)   # not jitted: each call traces under its context
  with compiling_for('gpu'):
    stored = grad(*args)
  with kept_in_gradients.suspended():
    plain = grad(*args)
  return stored, plain


# sqrt of 8 layers: segments of 2 (rebuilt whole); seg:3: two and a remainder of 2; stage: one
# segment; seg:5 and seg:7: remainders of 3 and 1 (a segment of other than two units, whose
# values fit its rows, rebuilds its last unit's saved values alone, after the loop)
@pytest.mark.parametrize('spec', ['sqrt', 'seg:3', 'stage', 'full@sqrt', 'dots@sqrt',
                                  'names:up@sqrt', 'seg:5', 'seg:7'])
def test_gradients_equal_the_checkpointed_segments(spec, runs):
  params, x = _args()
  stored, plain = _both(_loss(spec), (params, x, jnp.float32(0.7)))
  assert runs, 'the segmented stack did not take the stored segments'
  # XLA may fuse the two programs' elementwise work differently: float32 rounding (numerics.py)
  assert_trees_close(stored, plain)


@pytest.mark.parametrize('spec', ['full@sqrt', 'seg:4'])
def test_a_segment_input_larger_than_its_rows_spills(spec, runs, monkeypatch):
  # 512 x 32 = 16384 floats of input against a segment's 2 x 4096 floats of rows: 8192 of them
  # wait in the rows, the rest as a loop output. seg:4: each unit's saved values (the input and
  # the 512 x 64 'up') do not fit its rows either, so the loop rebuilds all four units (pays_off
  # would keep the checkpointed segments there)
  monkeypatch.setattr(stored_segments, 'pays_off', lambda *a: True)
  params, x = _args(batch=512)
  stored, plain = _both(_loss(spec), (params, x, jnp.float32(0.7)))
  assert runs
  assert_trees_close(stored, plain)


@pytest.mark.parametrize('spec, recomputed', [
    ('sqrt', 4 * (3 * 2 + 1)),        # 4 segments of 4: three layers rerun, the last's first matmul
    ('seg:3', 5 * (2 * 2 + 1) + 1),   # 5 segments of 3 and a remainder of 1
    ('full@sqrt', 4 * (3 * 2 + 4)),   # and each layer's first matmul again in its backward step
    ('seg:2', 8 * 2 * 2),             # a segment of two is rebuilt whole (remat.stored_segments)
])
def test_the_rebuild_skips_what_only_a_segment_output_needs(spec, recomputed, runs):
  """The user's 16-layer MLP (tests/own_model.py: ``relu(x @ w1 + b1) @ w2``), traced for a GPU:
  the last layer of a segment is rebuilt for its saved values alone, without its second matmul,
  which only the segment's output (not needed in the backward pass) reads. Exact counts, in
  ``[B, D] @ [D, H]``-sized matmuls; no remat runs 16 layers x 2 matmuls x 3 (forward, two in
  the backward pass)."""
  from remat.measuring import step_flops
  from tests.own_model import BATCH, DEPTH, HIDDEN, WIDTH, inputs, mlp, stacked_params
  loss = lambda p, x: jnp.sum(scan_layers(mlp, p, x, policy=spec) ** 2)
  with compiling_for('gpu'):
    count = step_flops(loss, stacked_params(), inputs())
  assert runs and count.exact
  assert count.flops == (DEPTH * 2 * 3 + recomputed) * 2 * BATCH * WIDTH * HIDDEN


def test_a_unit_that_saves_more_beyond_its_rows_than_they_hold_is_rebuilt_whole(runs, monkeypatch):
  # seg:4 of 8 layers (2 segments of 4). At a batch of 32 a unit saves its input and 'up' (1024 +
  # 2048 floats), which fit its 4096 floats of rows: the last unit is rebuilt without its second
  # matmul. At 512 (16384 + 32768 floats) the loop rebuilds all four units, output included
  from remat.measuring import step_flops
  monkeypatch.setattr(stored_segments, 'pays_off', lambda *a: True)
  for batch, recomputed in ((32, 2 * (3 * 2 + 1)), (512, 2 * 4 * 2)):
    params, x = _args(batch=batch)
    with compiling_for('gpu'):
      count = step_flops(_loss('seg:4'), params, x, jnp.float32(0.7))
    assert count.exact
    assert count.flops == (L * 2 * 3 + recomputed) * 2 * batch * D * H, batch
  assert runs


@pytest.mark.parametrize('spec', ['sqrt', 'seg:4'])   # seg:4: the last unit rebuilt apart
def test_bfloat16_carry_and_input_gradient_only(spec, runs):
  # a bfloat16 carry is kept as bits in float32 rows; differentiated for the input alone, no
  # parameter leaf has rows and the segment inputs wait as loop outputs
  params, x = _args(dtype=jnp.bfloat16)
  for argnums in ((0, 1), (1,)):
    stored, plain = _both(_loss(spec), (params, x, jnp.float32(0.7)), argnums)
    # Equal on this machine; elsewhere a float32 sum fused in another order can round a
    # bfloat16 carry the other way: one bfloat16 ulp (2**-8 of the value), room for a few.
    assert_trees_close(stored, plain, rtol=1e-2)
  assert runs


def test_span_cuts_pieces_at_unit_rows():
  # 30 elements from offset 10 of a segment whose units have rows of 16: the rest of unit 0's
  # row, all of unit 1's, 8 of unit 2's
  assert stored_segments._span(((0, 10, 30),), {0: 16}) == (
      (0, 0, 10, 6), (0, 1, 0, 16), (0, 2, 0, 8))


def test_pays_off_by_the_bytes_each_form_adds():
  params, x = _args()
  step = lambda policy: lambda h, w: (jax.checkpoint(_layer, policy=policy)(w, h, 0.7), None)
  nothing = jax.checkpoint_policies.nothing_saveable
  everything = jax.checkpoint_policies.everything_saveable
  # full: a unit saves its input (2048 floats), which fits its rows
  assert stored_segments.pays_off(step(nothing), x, params, 2)
  # everything at a batch of 4096: a unit saves ~800K floats beyond its 4096 floats of rows,
  # more than the 2 x 2 x 4096 that checkpointed segments hold twice
  _, wide = _args(batch=4096)
  assert not stored_segments.pays_off(step(everything), wide, params, 2)


@pytest.mark.gpu_plan
@pytest.mark.parametrize('spec', ['sqrt', 'full@sqrt', 'stage'])
def test_h100_plan_smaller_than_the_checkpointed_segments(spec, monkeypatch):
  args = (*_args(), jnp.float32(0.7))
  stored = step_memory(_loss(spec), *args, target='h100').temp
  monkeypatch.setattr(stored_segments, 'pays_off', lambda *a: False)
  checkpointed = step_memory(_loss(spec), *args, target='h100').temp
  assert stored < checkpointed, (stored, checkpointed)


@pytest.mark.gpu_plan
def test_sqrt_plans_less_than_full_where_the_values_fit():
  # The user's 16-layer MLP (tests/own_model.py), H100 plan: each segment's rebuild waits in its
  # rows, so sqrt holds no more than the gradient and one layer (1.88 MiB; 6.71 as checkpointed
  # segments) and plans below full (2.88 MiB), as Llama-3.2-1B at one sequence (docs/own-model.md),
  # and below none (2.63 MiB): the last layer of a segment is rebuilt without its output matmul
  from tests.own_model import inputs, mlp, stacked_params
  loss = lambda spec: lambda p, x: jnp.sum(scan_layers(mlp, p, x, policy=spec) ** 2)
  args = (stacked_params(), inputs())
  temp = {spec: step_memory(loss(spec), *args, target='h100').temp
          for spec in ('sqrt', 'full', 'none')}
  assert temp['sqrt'] < temp['full'] and temp['sqrt'] < temp['none'], temp
