"""Where an unrolled stack reads its stacked inputs at a constant offset, and where at an opaque one.

XLA's GPU compiler builds one kernel per distinct fusion and reuses it for
identical ones; a slice at a constant offset is folded into the fusion that
reads it, so a block's fusions differ from every other block's. The unrolled
loop therefore reads at an opaque offset whatever no matmul reads (biases,
norm scales, whatever their rank), and keeps a constant slice only for the
matrices a matmul reads in place (at an opaque offset XLA would first copy one
layer's weights). These tests pin down which
is which: :func:`remat.unrolled_parts.matmul_operands` on small functions, and
the slices in the traced gradient of a stack traced for a GPU. Traced for the
XLA CPU backend, every read is at an offset made from the data
(tests/test_unrolled_cpu.py).
"""

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name

from numerics import assert_trees_close
from remat import scan_layers
from remat.layout import compiling_for
from remat.unrolled_parts import matmul_operands
from stack_cases import eqns

N, D, H, B = 4, 8, 16, 2


def _marked(fn, *args):
  return matmul_operands(jax.make_jaxpr(fn)(*args), set(range(1, len(args))))


def test_a_weight_reaching_a_matmul_alone_is_marked_a_bias_is_not():
  x, w, b, s = jnp.ones((B, D)), jnp.ones((H, D)), jnp.ones(H), jnp.ones(H)
  # transposed and scaled, the weight still reaches the matmul on its own; the bias meets x @ w
  assert _marked(lambda x, w, b, s: (x @ (2.0 * w).T + b) * s, x, w, b, s) == {1}


def test_weights_joined_before_a_matmul_are_all_marked():
  x, a, b = jnp.ones((B, D)), jnp.ones((D, 4)), jnp.ones((4, H))
  # a LoRA-style product of two parameters, and a concatenation of q/k/v matrices
  assert _marked(lambda x, a, b: x @ (a @ b), x, a, b) == {1, 2}
  assert _marked(lambda x, a, b: x @ jnp.concatenate([a, a], 1), x, a, b) == {1}


def test_a_value_that_met_the_activations_no_longer_marks():
  x, w = jnp.ones((B, D)), jnp.ones((B, D))
  # (x + w) @ ... : w met x before the matmul, so XLA would not read w itself in place there
  assert _marked(lambda x, w: (x + w) @ jnp.ones((D, H)), x, w) == set()


def test_followed_into_checkpoints_and_jit_and_conservative_in_a_cond():
  x, w, v = jnp.ones((B, D)), jnp.ones((D, H)), jnp.ones(H)
  inner = jax.checkpoint(lambda x, w: jnp.tanh(x @ w))
  assert _marked(lambda x, w, v: jax.jit(inner)(x, w) * v, x, w, v) == {1}
  # a body that cannot be followed marks every parameter-only value it is given
  branchy = lambda x, w, v: jax.lax.cond(x.sum() > 0, lambda w, v: x @ w + v, lambda w, v: x @ w,
                                          w, v)
  assert _marked(branchy, x, w, v) == {1, 2}


def _mlp(p, x):
  h = checkpoint_name(x @ p['w1'] + p['b1'], 'fc1')
  return x + jnp.tanh(h * p['g'].reshape(H)) @ p['w2']


def _params():
  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  return {'w1': jax.random.normal(k1, (N, D, H)) / D ** 0.5, 'b1': jnp.full((N, H), 0.1),
          'g': jnp.ones((N, 2, H // 2)), 'w2': jax.random.normal(k2, (N, H, D)) / H ** 0.5}


@pytest.mark.parametrize('spec', ['full', 'dots', 'none'])
def test_stack_reads_matrices_at_constant_offsets_and_the_rest_opaquely(spec):
  x = jnp.ones((B, D))
  loss = lambda p: jnp.sum(scan_layers(_mlp, p, x, policy=spec, layout='unrolled') ** 2)
  # the loop's own reads and writes (the stack's checks also trace layer 0, which XLA drops)
  with compiling_for('gpu'):
    traced = jax.make_jaxpr(jax.grad(loss))(_params()).jaxpr
  mine = [e for e in eqns(traced)
          if any(f.file_name.endswith('remat/unrolled.py')
                 for f in e.source_info.traceback.frames)]
  shapes = lambda prim: [tuple(e.invars[0].aval.shape) for e in mine if e.primitive.name == prim]
  # the scale has two dimensions per layer, as a q/k/v bias [heads, head_dim] has, and no
  # matmul reads it: the rank alone does not make a leaf a matrix
  matrices, vectors = {(N, D, H), (N, H, D)}, {(N, H), (N, 2, H // 2)}
  # every block reads each matrix as a constant slice, and never at an opaque offset
  assert sum(s in matrices for s in shapes('slice')) >= 2 * N
  assert not matrices & set(shapes('dynamic_slice'))
  # the other leaves (bias, scale) are read at an opaque offset, never as a constant slice
  assert sum(s in vectors for s in shapes('dynamic_slice')) >= 2 * N
  assert not vectors & set(shapes('slice'))
  # and the gradients are the scan's
  want = jax.grad(lambda p: jnp.sum(scan_layers(_mlp, p, x, policy=spec) ** 2))(_params())
  with compiling_for('gpu'):
    got = jax.grad(loss)(_params())
  assert_trees_close(got, want, err_msg=spec)
