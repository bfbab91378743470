"""A segmented scan whose backward pass rebuilds each segment into the gradient rows it writes.

A segmenting (``sqrt``, ``seg:K``, ``RULE@sqrt``) as a scan over segments in
``jax.checkpoint`` saves only each segment's input, and its backward step
rebuilds the segment under the per-layer rule. On a GPU plan that step also
read the segment's ``[K, ...]`` slice of every parameter into a buffer of its
own and built the segment's ``[K, ...]`` gradient apart from the stack's,
before writing it into the stack's gradient: two segments' worth of
parameters beside the gradient. Llama-3.2-1B's train step (batch 1 x 2048,
bfloat16, H100 plan) planned 7.06 GiB of ``temp`` under ``sqrt`` against 5.19
under ``none`` (docs/own-model.md).

:func:`run` gives the segmented stack one derivative over its units, like
:mod:`remat.stored_scan` does for a per-layer rule. The forward pass runs the
units and writes each segment's input into the rows of the gradient
accumulators of that segment's units (``[U, row]`` per float parameter leaf).
The backward pass takes the segments in reverse; for each it reads the input
back, reruns the segment's units one at a time, writing what the per-layer
rule saves for each unit into that unit's rows (the segment's input is no
longer needed there; the last unit's output, which nothing reads, is not
computed), then runs the units' backward steps in reverse, each
reading its values out of its rows and writing its gradient over them. What
does not fit in the rows stays a loop output, as in :mod:`remat.stored_scan`.
A remainder segment (U % K units) is the last segment, shorter. Each unit's
backward step is ``jax.vjp`` of the same unit, so the gradients are the plain
scan's, and only one unit's parameters are read at a time.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from remat import stored_scan
from remat.stored_scan import _plan, get, put
from remat.unrolled_parts import hoist, materialise, zero_after


def applies(x, xs) -> bool:
  """Whether :func:`run` serves a segmented stack over ``xs``: as :func:`remat.stored_scan.applies`."""
  return stored_scan.applies(x, xs)


def _span(pieces: tuple, row: dict) -> tuple:
  """A segment plan's pieces ``(leaf, offset, size)``, offsets within the segment's rows, cut at
  unit rows: ``(leaf, unit in segment, offset in its row, size)``."""
  out = []
  for leaf, offset, size in pieces:
    while size:
      unit, at = divmod(offset, row[leaf])
      take = min(size, row[leaf] - at)
      out.append((leaf, unit, at, take))
      offset, size = offset + take, size - take
  return tuple(out)


def _put(spill: list, others: list, j) -> list:
  """``spill`` with unit ``j``'s loop outputs ``others`` written into row ``j``."""
  return [jax.lax.dynamic_update_index_in_dim(b, o, j, 0) for b, o in zip(spill, others)]


def _beyond_rows(plan, xs_leaves: list) -> int:
  """Bytes of a unit's saved values that do not wait in its rows (loop outputs)."""
  return plan.saved - sum(n * np.dtype(xs_leaves[leaf].dtype).itemsize
                          for kind, at in plan.where if kind == 'a' for leaf, _, n in at[0])


def pays_off(step: Callable, x, xs, size: int) -> bool:
  """Whether :func:`run` should plan less than segments in ``jax.checkpoint``, by the bytes each adds.

  Checkpointed segments hold a segment's parameters twice beside the stack's
  gradient (the slice read out of the stack, the segment's gradient built
  apart): ``2 * size`` units' rows. :func:`run` holds none of that, but what a
  unit saves beyond its rows waits as a loop output and each backward step
  reads its unit's part out as a copy of its own. Measured on the H100 plan
  (docs/own-model.md): ViT-B/16's train step at batch 8 (a unit saves 48 MB, 19
  of them beyond its 28 MB of rows) plans 1664 -> 1504 MiB under ``sqrt``; our
  ``vit-tiny`` at 8 layers (6.4 MB saved, 5.6 beyond its 0.3 MB of rows)
  planned 21.21 -> 26.00 MiB, so it keeps the checkpointed segments.
  """
  xs_leaves, xs_def = jax.tree_util.tree_flatten(xs)
  first = jax.tree_util.tree_unflatten(xs_def, [a[0] for a in xs_leaves])
  converted, consts, _ = hoist(step, x, first)
  unit = lambda x, v, k: converted(x, v, *k)
  rows = stored_scan.row_sizes(xs_leaves)
  plan = _plan(lambda: stored_scan.unit_residuals(unit, x, first, consts), xs_leaves, rows)
  row_bytes = sum(r * np.dtype(a.dtype).itemsize for r, a in zip(rows, xs_leaves))
  return _beyond_rows(plan, xs_leaves) <= 2 * size * row_bytes


def run(step: Callable, x, xs, size: int, in_order: bool = True):
  """``lax.scan(step, x, xs)`` checkpointed in segments of ``size`` units, with the derivative above.

  Args:
    step: ``step(x, xs_u) -> (x, ys_u)``, one unit with the per-layer rule's
      checkpoint inside (``prevent_cse=False`` is safe: the loops stay loops).
    x: the carry; its shape stays the same.
    xs: per-unit inputs stacked ``[U, ...]`` (parameters, keys, layer inputs).
    size: units per segment (a last segment of ``U % size`` follows).
    in_order: a unit's backward step writes each gradient row as soon as it is
      computed (:mod:`remat.backward_order`), where no float leaf is frozen.

  Returns:
    ``(x, ys)`` with ``ys`` stacked ``[U, ...]``.
  """
  xs_leaves, xs_def = jax.tree_util.tree_flatten(xs)
  units = int(np.shape(xs_leaves[0])[0])
  full, rest = divmod(units, size)
  first = jax.tree_util.tree_unflatten(xs_def, [a[0] for a in xs_leaves])
  converted, consts, _ = hoist(step, x, first)
  rows = stored_scan.row_sizes(xs_leaves)
  row = dict(enumerate(rows))
  x_def = jax.tree_util.tree_structure(x)
  x_shapes = [(np.shape(a), jnp.result_type(a)) for a in jax.tree_util.tree_leaves(x)]

  def unit(x, v, k):
    return converted(x, v, *k)

  residuals = functools.partial(stored_scan.unit_residuals, unit)

  def take(tree, u):
    return jax.tree_util.tree_map(lambda a: jax.lax.dynamic_index_in_dim(a, u, keepdims=False),
                                  tree)

  def plain(x, xs, k):
    return jax.lax.scan(lambda c, v: unit(c, v, k), x, xs)

  def inputs_plan(length, grads):
    """Where a segment of ``length`` units keeps its input: rows of its units, else a loop output."""
    trace = lambda: (None, None, [('r', n) for n in range(len(x_shapes))],
                     [jnp.zeros(shape, dtype) for shape, dtype in x_shapes])
    plan = _plan(trace, xs_leaves, [r * length if g else 0 for r, g in zip(rows, grads)])
    return [(kind, (_span(at[0], row),) + at[1:]) if kind == 'a' else (kind, at)
            for kind, at in plan.where], plan.used

  meta = {}   # the forward pass's plans, for the backward pass

  def keep_input(accs, where, x, start):
    outs = []
    for (kind, at), value in zip(where, jax.tree_util.tree_leaves(x)):
      if kind == 'o':
        outs.append(value.reshape(-1))
        continue
      accs, left = put(accs, at[0], value, start)
      outs.append(left if at[3] is not None else None)
    return accs, outs

  def read_input(accs, where, outs, start):
    leaves = []
    for (kind, at), out, (shape, dtype) in zip(where, outs, x_shapes):
      leaves.append(out.reshape(shape) if kind == 'o'
                    else get(accs, at[0], at[1], at[2], start, out))
    return jax.tree_util.tree_unflatten(x_def, leaves)

  def forward(x, xs, k):
    (x, xs, k), grads = stored_scan.differentiated(x, xs, k, rows)
    meta['grads'] = grads
    meta['plan'] = _plan(lambda: residuals(x, first, k), xs_leaves,
                         [r if g else 0 for r, g in zip(rows, grads)])
    where, used = meta['main'] = inputs_plan(size, grads) if full else ([], frozenset())
    where_rest, used_rest = meta['rest'] = inputs_plan(rest, grads) if rest else ([], frozenset())
    accs = [jnp.zeros((units, r), a.dtype) if i in used | used_rest else None
            for i, (a, r) in enumerate(zip(xs_leaves, rows))]

    # Units are read one at a time out of the whole stack: a slice of it would be a copy.
    def units_from(x, start, length):
      return jax.lax.scan(lambda c, j: unit(c, take(xs, start + j), k), x, jnp.arange(length))

    def body(carry, s):
      x, accs = carry
      accs, outs = keep_input(list(accs), where, x, s * size)
      x, ys = units_from(x, s * size, size)
      return (x, accs), (ys, outs)

    ys, kept = None, None
    if full:
      (x, accs), (ys, kept) = jax.lax.scan(body, (x, accs), jnp.arange(full))
      ys = jax.tree_util.tree_map(lambda a: a.reshape((full * size,) + a.shape[2:]), ys)
    kept_rest = None
    if rest:
      accs, kept_rest = keep_input(list(accs), where_rest, x, full * size)
      x, ys_rest = units_from(x, full * size, rest)
      ys = ys_rest if ys is None else jax.tree_util.tree_map(
          lambda a, b: jnp.concatenate([a, b]), ys, ys_rest)
    return (x, ys), (xs, k, accs, kept, kept_rest)

  def segment_backward(ct_x, accs, ct_k, k, xs, ct_ys, x, start, length):
    """One segment's backward step: its units rerun into their rows, then their VJPs in reverse."""
    plan = meta['plan']

    def rerun(carry, j):
      x, accs, spill = carry
      u = start + j
      (x, _), _, where, mine = residuals(x, take(xs, u), k)
      stored_scan.lined_up(where, plan)   # with the plan traced in the forward pass
      accs, others = stored_scan.store(accs, plan, mine, u)
      return (x, accs, _put(spill, others, j)), None

    # What does not fit in the rows waits in buffers of all `length` units, written in place;
    # made from the segment's incoming cotangent, so that XLA allocates them no earlier (as
    # constant zeros they were allocated with the loss gradient: llama-tiny's stage with its
    # last layer rebuilt apart, H100 plan, 48.35 MiB of temp against 46.09).
    zero = zero_after(ct_x)
    spill = [jnp.full((length,) + a.shape, zero.astype(a.dtype)) for a in plan.spill]
    # The last unit's output is not needed (the next segment's input is kept): its saved values
    # alone are computed, after the loop (stored_scan.unit_saved). Not where a unit saves more
    # beyond its rows than its rows hold: there, in straight-line code, XLA held more of the
    # unit's values beside the loop outputs (Llama-3.2-1B --lora 16, whose rows are the
    # adapters', batch 2 x 2048, H100 plan, sqrt: 1.25 -> 1.32 GiB). Nor in a segment of two
    # units, whose loop of one iteration XLA inlines: the two units in straight-line code planned
    # more (the 16-layer MLP of tests/own_model.py, seg:2: 2.63 -> 5.63 MiB, the rows copied;
    # 3.44 with the segment input read through an optimization barrier). The loop rebuilds the
    # last unit whole there.
    row_bytes = sum(r * np.dtype(a.dtype).itemsize
                    for r, a, g in zip(rows, xs_leaves, meta['grads']) if g)
    peel = length != 2 and _beyond_rows(plan, xs_leaves) <= row_bytes
    head = length - 1 if peel else length
    if head:
      (x, accs, spill), _ = jax.lax.scan(rerun, (x, accs, spill), jnp.arange(head))
    if head < length:
      where, mine = stored_scan.unit_saved(unit, x, take(xs, start + head), k)
      stored_scan.lined_up(where, plan)
      accs, others = stored_scan.store(accs, plan, mine, start + head)
      spill = _put(spill, others, head)
    # Each gradient row written as soon as it is computed (remat.backward_order), unless some of
    # the float leaves are frozen: there the rows (a LoRA model's adapters') hold little, and the
    # barriers made XLA copy the unit's spilled values out of their buffers (Llama-3.2-1B
    # --lora 16, batch 2 x 2048, H100 plan, full@sqrt: 519.61 -> 580.65 MiB with them).
    ordered = in_order and all(g for r, g in zip(rows, meta['grads']) if r)

    def back(carry, inp):
      ct_x, accs, ct_k = carry
      j, own = inp
      u = start + j
      return stored_scan.unit_backward(plan, ct_x, accs, ct_k, u, take(xs, u), k, own,
                                       take(ct_ys, u), in_order=ordered), None

    (ct_x, accs, ct_k), _ = jax.lax.scan(back, (ct_x, accs, ct_k), (jnp.arange(length), spill),
                                         reverse=True)
    return ct_x, accs, ct_k

  def backward(res, cts):
    xs, k, accs, kept, kept_rest = res
    grads = meta['grads']
    ct_x, ct_ys = materialise(cts)
    accs, ct_k = stored_scan.backward_start(accs, rows, xs_leaves, grads, k)
    if rest:   # the last segment ran last
      x = read_input(accs, meta['rest'][0], kept_rest, full * size)
      ct_x, accs, ct_k = segment_backward(ct_x, list(accs), ct_k, k, xs, ct_ys, x, full * size,
                                          rest)
    if full:
      where = meta['main'][0]

      def body(carry, inp):
        ct_x, accs, ct_k = carry
        s, outs = inp
        x = read_input(accs, where, outs, s * size)
        ct_x, accs, ct_k = segment_backward(ct_x, list(accs), ct_k, k, xs, ct_ys, x, s * size,
                                            size)
        return (ct_x, accs, ct_k), None

      (ct_x, accs, ct_k), _ = jax.lax.scan(body, (ct_x, accs, ct_k), (jnp.arange(full), kept),
                                           reverse=True)
    return (ct_x, *stored_scan.backward_end(accs, ct_k, xs_leaves, xs_def, k))

  fn = jax.custom_vjp(plain)
  fn.defvjp(forward, backward, symbolic_zeros=True)
  return fn(x, xs, consts)
