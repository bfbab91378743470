"""A segment's layers run in turn (remat.segments.in_turn), not as a scan inside the segment.

The user's 16-layer residual MLP (tests/own_model.py) under segmented policies, against the
same segments forced back to an inner scan (``AUTO_UNROLL_MAX`` set to 1, so that no segment
is short enough to run in turn). Gradients equal to no remat under every policy family are
tests/test_gradients.py's and tests/test_layouts.py's; here the plans and the recompute.
"""

import jax
import jax.numpy as jnp
import pytest

from remat import scan_layers, segments, stored_segments
from remat.measuring import step_flops, step_memory
from tests.own_model import BATCH, DEPTH, HIDDEN, WIDTH, inputs, mlp, stacked_params
from tests.stack_cases import eqns

ARGS = (stacked_params(), inputs())


def loss(spec):
  return lambda p, x: jnp.sum(scan_layers(mlp, p, x, policy=spec) ** 2)


@pytest.mark.parametrize('spec', ['sqrt', 'seg:2', 'full@sqrt', 'dots@sqrt'])
def test_in_turn_plans_less_than_the_inner_scan(spec, monkeypatch):
  in_turn = step_memory(loss(spec), *ARGS).temp
  monkeypatch.setattr(segments, 'AUTO_UNROLL_MAX', 1)
  # Measured (MiB of temp): sqrt 4.82 against 6.89, seg:2 3.32 against 4.51, full@sqrt 3.64
  # against 5.46, dots@sqrt 3.13 against 6.89.
  assert in_turn < 0.8 * step_memory(loss(spec), *ARGS).temp


def test_the_segment_output_matmul_is_not_recomputed(monkeypatch):
  """sqrt: 4 segments of 4 layers. Run in turn, each segment's recompute drops its last layer's
  second matmul (``[B, H] @ [H, D]``), which only the segment's output needs."""
  in_turn = step_flops(loss('sqrt'), *ARGS)
  monkeypatch.setattr(segments, 'AUTO_UNROLL_MAX', 1)
  scanned = step_flops(loss('sqrt'), *ARGS)
  assert scanned.exact and in_turn.exact
  assert scanned.flops - in_turn.flops == (DEPTH // 4) * 2 * BATCH * HIDDEN * WIDTH


def _nested_scans(jaxpr) -> bool:
  """A scan over more than one step inside another scan's body (a layer in turn may be a loop of
  one iteration: the ``loops`` layout)."""
  return any(e.primitive.name == 'scan' and e.params['length'] > 1
             for outer in eqns(jaxpr) if outer.primitive.name == 'scan'
             for e in eqns(outer.params['jaxpr'].jaxpr))


@pytest.mark.parametrize('spec, limit, nested', [
    ('seg:2', 8, False), ('seg:8', 8, False),   # 8 and 2 segments: each runs its layers in turn
    ('stage', 8, True), ('seg:16', 8, True),    # one segment: a scan of one iteration over a scan
    ('seg:12', 8, True),                        # one segment and a remainder: scans
    ('seg:4', 3, True),                         # segments longer than AUTO_UNROLL_MAX: scans
])
def test_which_segments_run_in_turn(spec, limit, nested, monkeypatch):
  monkeypatch.setattr(segments, 'AUTO_UNROLL_MAX', limit)
  jaxpr = jax.make_jaxpr(jax.grad(loss(spec)))(*ARGS).jaxpr
  assert _nested_scans(jaxpr) == nested


@pytest.mark.gpu_plan
@pytest.mark.parametrize('spec', ['sqrt', 'dots@sqrt'])
def test_in_turn_plans_less_on_the_h100_plan(spec, monkeypatch):
  # This MLP's segments take remat.stored_segments on a GPU plan (tests/test_stored_segments.py);
  # a model whose units save far more than their rows keeps checkpointed segments, as here.
  monkeypatch.setattr(stored_segments, 'pays_off', lambda *a: False)
  in_turn = step_memory(loss(spec), *ARGS, target='h100').temp
  monkeypatch.setattr(segments, 'AUTO_UNROLL_MAX', 1)
  # Measured (MiB of temp): sqrt 6.71 against 8.14, dots@sqrt 6.64 against 8.14.
  assert in_turn < step_memory(loss(spec), *ARGS, target='h100').temp
