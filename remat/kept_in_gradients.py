"""Values a layer saves for its backward step, kept in stacked gradient rows the backward pass writes later.

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
So a value that block b keeps for its backward step can wait in the rows of
any block k <= b (its own included: it is read back at the start of the step
that writes them): :func:`place` plans where, :func:`store` writes the values
there in the forward pass and :func:`load` reads one back in block b's
backward step. Every row is overwritten by its block's gradient, so the
gradients are unchanged. A block under a rule stores whatever it keeps (what
the rule saves is made anyway: the matmul outputs of ``dots``, the input of
``full``); a block with no rule only its input, since XLA may fuse its other
kept values into the backward pass rather than keep them, and storing them
made plans larger (docs/own-model.md). Only a differentiated parameter has rows
(:mod:`remat.unrolled` passes None for the others): rows of a frozen one holding
values would keep its gradient computed. Values offloaded to host memory, or of
another dtype than the gradient's (bfloat16 activations beside float32
parameters), are not stored.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from remat.unrolled_parts import inexact


_SUSPENDED = contextvars.ContextVar('remat_kept_in_gradients_suspended', default=False)


@contextlib.contextmanager
def suspended():
  """Stacks traced inside keep their saved values as plain residuals, not in gradient rows.

  For :func:`remat.residuals.saved_residuals`, which names each saved value by
  where it was made: written into a gradient accumulator it would be one
  untagged buffer. Where the values wait changes the compiled plan, not what is
  saved.
  """
  token = _SUSPENDED.set(True)
  try:
    yield
  finally:
    _SUSPENDED.reset(token)


def active(tree=()) -> bool:
  """Whether saved values may wait in gradient rows here: not inside :func:`suspended`, nor
  where ``tree`` (the stack's values) is traced for several devices (:func:`partitioned`)."""
  return not _SUSPENDED.get() and not partitioned(tree)


def partitioned(tree) -> bool:
  """Whether ``tree``'s values are traced for a program split over several devices.

  Inside ``jax.jit`` with shardings on a mesh of more than one device (FSDP,
  data parallelism), each traced value's type names that mesh. There a
  parameter's gradient rows are split the parameter's way and the saved
  activations the batch's, and XLA's partitioner gathered the activations
  whole into the rows: Llama-3.1-8B's train step, 8 x 8192 tokens over
  ``fsdp=8``, H200 plan, ``none`` planned a peak of 160.02 GiB per device with
  its saved values in gradient rows and 39.41 GiB without (docs/sharding.md).
  """
  for leaf in jax.tree_util.tree_leaves(tree):
    try:
      shape = jax.typeof(leaf).sharding.mesh.shape
    except (AttributeError, TypeError):   # not an array, or a JAX whose types carry no mesh
      continue
    if int(np.prod(list(shape.values()), dtype=np.int64)) > 1:
      return True
  return False


@dataclasses.dataclass(frozen=True)
class Spot:
  """Where a kept value waits: accumulator ``leaf``, flat offset ``start``, its ``shape``."""
  leaf: int
  start: int
  shape: tuple


def place(kept: list[list], inputs: list[list], every: list[bool], accs: list, rows: list) -> dict:
  """Plans a spot for each kept value that fits in gradient rows its block's backward step reads first.

  Block b's backward step reads its kept values before it writes its own rows,
  and every earlier block writes later still, so a value kept by block b may
  wait anywhere in the rows of blocks 0..b of an accumulator of its dtype (a
  value may span several blocks' rows). Blocks are taken in order, each value at
  the lowest free offset of the first accumulator where it fits: block b's room
  is a prefix that only grows with b, so taking them in that order wastes none.

  Args:
    kept: per block, the values its backward step reads (None: not kept).
    inputs: per block, its input's leaves.
    every: per block, whether any value it keeps may wait (a block under a
      rule: what the rule saves is made anyway) or only its input (a block with
      no rule, whose other kept values XLA may fuse into the backward pass
      rather than keep).
    accs: per stacked input leaf, its accumulator (only its shape and dtype are
      read; None for a leaf without a gradient: integers, keys).
    rows: ``rows[k][i]``: block k's items ``(first, count)`` in leaf i.

  Returns:
    ``{(block, position in kept): Spot}``.
  """
  free = {}   # leaf -> its lowest free flat offset
  spots = {}
  for b, values in enumerate(kept):
    for j, value in enumerate(values):
      if value is None or not _storable(value) or not (
          every[b] or any(value is a for a in inputs[b])):
        continue
      size = int(np.prod(jnp.shape(value), dtype=np.int64))
      for i, acc in enumerate(accs):
        if acc is None or acc.dtype != jnp.result_type(value):
          continue
        row = int(np.prod(acc.shape[1:], dtype=np.int64))
        start, end = free.get(i, 0), (rows[b][i][0] + rows[b][i][1]) * row
        if start + size <= end:
          free[i] = start + size
          spots[(b, j)] = Spot(i, start, tuple(jnp.shape(value)))
          break
  return spots


def _storable(value) -> bool:
  # not a value offloaded to host memory: the accumulators are on the device
  space = getattr(jax.typeof(value), 'memory_space', jax.memory.Space.Device)
  return inexact(value) and jnp.size(value) > 0 and space == jax.memory.Space.Device


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
