"""Pieces shared by dense and blockwise attention.

Shape checks, the grouped-query head layout and its einsum, and the empty
cotangent of segment ids: :mod:`models.attention` (the entry point, dense and
cuDNN attention) and :mod:`models.blockwise_attention` both use them. They
live in a module of their own so that neither of those imports the other's
internals and there is no import cycle.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _check_shapes(q, k, v):
  if q.ndim != 4 or k.shape != v.shape or k.ndim != 4:
    raise ValueError(f'attention wants q [B, T, H, Dh] and k, v [B, T, Hkv, Dh], got '
                     f'{q.shape}, {k.shape}, {v.shape}')
  (b, t, h, d), (bk, tk, hkv, dk) = q.shape, k.shape
  if (b, t, d) != (bk, tk, dk) or h % hkv:
    raise ValueError(f'attention: q {q.shape} and k/v {k.shape} must agree on B, T and Dh, '
                     f'and the query heads must be a multiple of the key/value heads')


def _groups(q, hkv: int):
  """[B, T, H, Dh] -> [B, Hkv, G, T, Dh]: heads first, query head h = n * G + g."""
  b, t, h, d = q.shape
  return q.reshape(b, t, hkv, h // hkv, d).transpose(0, 2, 3, 1, 4)


def _ungroup(x):
  """[B, Hkv, G, T, Dh] -> [B, T, H, Dh]."""
  b, n, g, t, d = x.shape
  return x.transpose(0, 3, 1, 2, 4).reshape(b, t, n * g, d)


def _heads(x):
  """[B, T, Hkv, Dh] <-> [B, Hkv, T, Dh].

  The matmuls run with (B, H) leading: XLA CPU's batched matmul is several
  times slower when the batch dimensions are not the leading ones (the
  forward pass of ViT-B/16 attention at batch 8: 74 ms against 16 ms).
  """
  return x.transpose(0, 2, 1, 3)


def _einsum(expr: str, x, y, **kwargs):
  """``jnp.einsum`` over grouped heads (``g`` the group axis) that drops a group axis of size 1.

  Without groups (``Hkv == H``) the dense path then runs the very matmuls it
  ran before grouped-query attention existed, with the same bits: XLA CPU's
  summation order can change with an extra unit axis.
  """
  ins, out = expr.split('->')
  a, b = ins.split(',')
  g = 'g'
  if (g in a and x.shape[a.index(g)] == 1) or (g in b and y.shape[b.index(g)] == 1):
    squeeze = lambda z, s: jnp.squeeze(z, s.index(g)) if g in s else z
    res = jnp.einsum(f"{a.replace(g, '')},{b.replace(g, '')}->{out.replace(g, '')}",
                     squeeze(x, a), squeeze(y, b), **kwargs)
    return jnp.expand_dims(res, out.index(g)) if g in out else res
  return jnp.einsum(expr, x, y, **kwargs)


def _int_zeros(segs):
  """The (empty) cotangent of integer segment ids, or None without them."""
  return None if segs is None else np.zeros(segs.shape, jax.dtypes.float0)
