"""The XLA CPU form of the unrolled layouts (remat.unrolled.run with ``cpu=True``).

The CPU backend drops ``optimization_barrier`` (so a checkpoint's recompute in
straight-line code is merged with the forward pass, and a block's reads of the
stacked parameters with the forward pass's) and copies an accumulator that a
loop reads and writes. Traced for it, each block reads at offsets made from its
input or incoming cotangent (:func:`remat.unrolled_parts.zero_after`) and keeps
its gradient in a buffer of its own until the end. These tests pin down that the
zero is exact and survives XLA's simplifier, that the reads wait for the data,
and that the form plans less on the CPU backend than the GPU form does there.
Gradients across layouts are tests/test_layouts.py's.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from remat import unrolled_blocks
from remat.measuring import step_memory
from remat.unrolled_parts import plus_zero, zero_after
from stack_cases import D, H, L, eqns, mlp_args, mlp_loss


@pytest.mark.parametrize('value', [
    np.array([np.nan, 1.0], np.float32), np.array([np.inf], np.float32),
    np.array([-np.inf], np.float32), np.array([-0.0], np.float32),
    np.array([3e38], np.float32), np.array([1e-45], np.float32),
    np.array([np.nan], jnp.bfloat16), np.array([-7], np.int32), np.array([True]),
    np.array([np.nan + 1j], np.complex64)])
def test_zero_after_is_zero_for_every_value(value):
  assert int(jax.jit(zero_after)(value)) == 0
  x = jnp.array([np.nan, -np.inf, 2.5, -0.0], jnp.float32)
  got = np.asarray(jax.jit(plus_zero)(x, zero_after(value)))
  np.testing.assert_array_equal(got[:3], np.asarray(x)[:3])   # NaN, inf and values unchanged


def test_a_read_at_a_clamped_offset_survives_the_cpu_compiler():
  """What the form relies on: XLA does not fold the clamp to a constant offset (it does fold
  ``first + zero``), so the read stays a dynamic slice that waits for ``a``."""
  def read(a, stack):
    at = jnp.int32(2)
    return jax.lax.dynamic_slice_in_dim(stack, jax.lax.clamp(at, at + zero_after(a), at), 1)
  text = jax.jit(read).lower(jnp.ones(3), jnp.ones((4, 5))).compile().as_text()
  assert 'clamp' in text and 'dynamic-slice' in text


@pytest.mark.parametrize('spec', ['full', 'none'])
def test_every_read_of_the_stack_is_at_an_offset_made_from_the_data(spec):
  traced = jax.make_jaxpr(jax.grad(mlp_loss(spec, 'unrolled')))(*mlp_args()).jaxpr
  mine = [e for e in eqns(traced) if any(f.file_name.endswith('remat/unrolled.py')
                                          for f in e.source_info.traceback.frames)]
  shapes = lambda prim: [tuple(e.invars[0].aval.shape) for e in mine if e.primitive.name == prim]
  matrices = {(L, D, H), (L, H, D)}
  assert not matrices & set(shapes('slice'))
  # each matrix read by every block in the forward and the backward pass
  assert sum(s in matrices for s in shapes('dynamic_slice')) == 2 * 2 * L
  assert len(shapes('clamp')) >= 2 * L


def _temps(layout, spec, monkeypatch):
  cpu = step_memory(mlp_loss(spec, layout), *mlp_args(), target='cpu').temp
  with monkeypatch.context() as m:   # the GPU form (stored kept values, barriers), on this backend
    m.setattr(unrolled_blocks, 'target_platform', lambda: 'gpu')
    gpu = step_memory(mlp_loss(spec, layout), *mlp_args(), target='cpu').temp
  return cpu, gpu


@pytest.mark.parametrize('layout,spec', [('unrolled', s) for s in ('none', 'full', 'dots', 'sqrt')]
                         + [('loops', s) for s in ('none', 'full', 'dots')])
def test_cpu_form_plans_less_than_the_gpu_form_on_cpu(layout, spec, monkeypatch):
  """At the commit that added this test, in bytes of ``temp`` (CPU form / GPU form): unrolled
  213000 / 311304 (none), 139264 / 180232 (full), 221192 / 286720 (dots), 163840 / 204808 (sqrt);
  loops 403784 / 501768, 280064 / 403392, 403784 / 493896. Not ``sqrt`` under ``loops``, where
  the GPU form's loop constants plan less (445768 against 437128)."""
  cpu, gpu = _temps(layout, spec, monkeypatch)
  assert cpu < gpu, (cpu, gpu)


def test_unrolled_checkpoints_hold_on_cpu():
  none = step_memory(mlp_loss('none', 'unrolled'), *mlp_args(), target='cpu').temp
  for spec in ('full', 'sqrt'):
    assert step_memory(mlp_loss(spec, 'unrolled'), *mlp_args(), target='cpu').temp < none, spec
