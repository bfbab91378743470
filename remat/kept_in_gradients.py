"""Saved layer inputs kept in the rows of the stacked gradient that the backward pass writes later.

In the user's per-block model each layer's weight gradient is an output buffer
of its own, written when the backward pass reaches that layer, and XLA's buffer
assignment lends an output's bytes to other values until it is written: most
of the saved layer inputs live in the gradient buffers of layers whose backward
step has not run yet. A stack's gradient is one ``[N, ...]`` buffer per
parameter, live from the first layer's backward step, so its saved inputs
stayed in ``temp`` (docs/own-model.md: the Gemma-style decoder's ``full``
planned 1.21x its per-block habit on the H100 plan for that reason).

:mod:`remat.unrolled` writes block k's gradient into its rows of each
accumulator at the end of block k's backward step, after every later block's.
So a layer input that block b > k keeps for its backward pass can wait in block
k's rows: :func:`place` plans where (first fit, nearest earlier block first,
same dtype), :func:`store` writes the inputs there in the forward pass and
:func:`load` reads one back in block b's backward step, before block k's
gradient overwrites it. Every row is overwritten by its block's gradient, so the
gradients are unchanged. Only the block's *input* is stored: storing the matmul
outputs that ``dots`` and the lean ``none`` keep as well changed no ``dots`` plan
of the Gemma-style and Gemma 3-style decoders and moved their ``none`` both ways
(H100 plan: 18.99 -> 19.17 MiB and 30.47 -> 29.58 MiB).
Values of another dtype than the gradient's (bfloat16 activations beside float32
parameters) are not stored.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from remat.unrolled_parts import inexact


@dataclasses.dataclass(frozen=True)
class Spot:
  """Where a kept value waits: accumulator ``leaf``, flat offset ``start``, its ``shape``."""
  leaf: int
  start: int
  shape: tuple


def place(kept: list[list], inputs: list[list], accs: list, rows: list) -> dict:
  """Plans a spot for each kept block input that fits in an earlier block's gradient rows.

  Args:
    kept: per block, the values its backward step reads (None: not kept).
    inputs: per block, its input's leaves (only those are stored).
    accs: per stacked input leaf, its accumulator's ``jax.ShapeDtypeStruct``
      (None for a leaf without a gradient: integers, keys).
    rows: ``rows[k][i]``: block k's items ``(first, count)`` in leaf i.

  Returns:
    ``{(block, position in kept): Spot}``.
  """
  free = {}   # (block, leaf) -> the next free flat offset in the block's rows of the leaf
  spots = {}
  for b in range(1, len(kept)):
    for j, value in enumerate(kept[b]):
      if value is None or not any(value is a for a in inputs[b]) or not _storable(value):
        continue
      size = int(np.prod(jnp.shape(value), dtype=np.int64))
      spot = _first_fit(b, size, jnp.result_type(value), accs, rows, free)
      if spot is not None:
        spots[(b, j)] = Spot(spot[0], spot[1], tuple(jnp.shape(value)))
  return spots


def _storable(value) -> bool:
  return inexact(value) and jnp.size(value) > 0


def _first_fit(b: int, size: int, dtype, accs, rows, free):
  for k in range(b - 1, -1, -1):   # the nearest earlier block first
    for i, acc in enumerate(accs):
      if acc is None or acc.dtype != dtype:
        continue
      first, count = rows[k][i]
      row = int(np.prod(acc.shape[1:], dtype=np.int64))
      start = free.get((k, i), first * row)
      if count and start + size <= (first + count) * row:
        free[(k, i)] = start + size
        return i, start
  return None


def store(accs: list, kept: list[list], spots: dict) -> tuple[list, list[list]]:
  """Writes each planned value into its accumulator; returns (accumulators, kept without them)."""
  accs, kept = list(accs), [list(k) for k in kept]
  for (b, j), spot in spots.items():
    acc = accs[spot.leaf]
    flat = jax.lax.dynamic_update_slice(acc.reshape(-1), kept[b][j].reshape(-1), (spot.start,))
    accs[spot.leaf] = flat.reshape(acc.shape)
    kept[b][j] = None
  return accs, kept


def load(accs: list, spot: Spot):
  """The value stored at ``spot`` (read before that block's gradient is written).

  The optimization barrier makes it a buffer of its own: read straight out of the
  flat accumulator, it led XLA's GPU compiler to a matmul with a 4 MiB workspace
  (``remat.explain``: an ``s8[4194304]`` buffer; tests/test_kept_in_gradients.py's
  MLP, ``unrolled``, ``full``, H100 plan: 4.25 MB of ``temp`` against 92 KB
  without storing, 84 KB with the barrier).
  """
  size = int(np.prod(spot.shape, dtype=np.int64))
  flat = accs[spot.leaf].reshape(-1)
  value = jax.lax.slice(flat, (spot.start,), (spot.start + size,)).reshape(spot.shape)
  return jax.lax.optimization_barrier(value)
