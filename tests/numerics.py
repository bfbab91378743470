"""How the tests compare floating-point results (the rationale is in docs/testing.md).

Two computations that are equal in exact arithmetic but add in another order (a
remat policy that recomputes, a chunked loss, PyTorch's kernels, XLA choosing
another vector width on another CPU) differ by rounding. The error of a float32
sum is bounded by ``c * eps * sum(|terms|)``: it scales with the magnitude of the
terms that went in, not with the result. A result can cancel to ~0 while its
terms do not. GPT-2's key-bias gradient, for example, is zero in exact arithmetic
(softmax is invariant to a shift along the key axis), so both sides hold only
noise of the size of the other gradients times eps. A tolerance relative to the
leaf itself then compares noise with noise and fails on some CPUs.

So every comparison here is ``|a - b| <= rtol * (|b| + S)``, where ``S`` is the
largest magnitude in the whole expected tree: the scale of the terms. Pass the
tree of one quantity (gradients, parameters, Adam's first moments) so that ``S``
means something; do not mix quantities of different scale in one call.
Integer and boolean leaves must be equal.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np

EPS32 = float(np.finfo(np.float32).eps)   # 1.19e-7
# 84 eps: see docs/testing.md for the largest error measured across the suite on several
# CPU code paths (REMAT_TEST_ERROR_LOG below records it); a real difference (a wrong mask, a
# dropped term, a stale residual) moves the affected values by far more than that.
RTOL = 1e-5
# If set, every comparison appends its worst |a - b| / (|b| + S) to this JSON-lines file.
_ERROR_LOG = os.environ.get('REMAT_TEST_ERROR_LOG')


def tree_scale(tree) -> float:
  """The largest finite magnitude among the floating-point leaves of ``tree`` (0.0 if none)."""
  leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]
  mags = [float(np.max(np.abs(x))) for x in leaves
          if np.issubdtype(x.dtype, np.inexact) and x.size]
  return max(mags, default=0.0)


def assert_trees_close(actual, expected, rtol: float = RTOL, err_msg: str = ''):
  """Asserts the same tree structure and shapes, and every element within tolerance.

  Float leaves: ``|a - b| <= rtol * (|b| + S)`` with ``S = tree_scale(expected)``.
  Other leaves (integers, booleans): equal.

  Args:
    actual: a pytree of arrays or scalars.
    expected: the reference pytree.
    rtol: the tolerance relative to the tree's scale (and to each element).
    err_msg: prefixed to the failure message.
  """
  got, got_def = jax.tree_util.tree_flatten_with_path(actual)
  want, want_def = jax.tree_util.tree_flatten(expected)
  assert got_def == want_def, f'{err_msg}tree structures differ: {got_def} vs {want_def}'
  scale = tree_scale(expected)
  worst_ratio = 0.0
  for (path, a), b in zip(got, want):
    a, b = np.asarray(a), np.asarray(b)
    where = f'{err_msg}{jax.tree_util.keystr(path)}'
    assert a.shape == b.shape, f'{where}: shape {a.shape} vs {b.shape}'
    if not np.issubdtype(b.dtype, np.inexact):
      np.testing.assert_array_equal(a, b, err_msg=where)
      continue
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    diff = np.abs(a64 - b64)
    bound = np.abs(b64) + scale
    with np.errstate(divide='ignore', invalid='ignore'):
      worst_ratio = max(worst_ratio, float(np.where(diff == 0, 0.0, diff / bound).max(initial=0)))
    bad = ~(diff <= rtol * bound)   # NaN anywhere fails too
    if bad.any():
      worst = np.unravel_index(np.argmax(np.where(bad, diff, -1)), diff.shape) if diff.ndim else ()
      raise AssertionError(
          f'{where}: {int(bad.sum())} of {b.size} elements differ; worst at {worst}: '
          f'{a64[worst]:.6g} vs {b64[worst]:.6g} (|diff| {diff[worst]:.3g}, allowed '
          f'{rtol * (abs(b64[worst]) + scale):.3g} = {rtol:g} * (|expected| + tree scale '
          f'{scale:.3g}))')
  if _ERROR_LOG:
    with open(_ERROR_LOG, 'a') as f:
      f.write(json.dumps({'test': os.environ.get('PYTEST_CURRENT_TEST', ''), 'rtol': rtol,
                          'ratio': worst_ratio}) + '\n')
