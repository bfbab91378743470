"""A scan over a stack's units whose saved values wait in the rows of the gradient it writes later.

A ``lax.scan`` under a per-layer rule keeps what the rule saves as ``[U, ...]``
loop outputs, allocated whole before the backward loop, and writes the
parameters' gradient into ``[U, ...]`` buffers allocated whole too: for a
while both are live in full. In the user's per-block model each layer's
gradient is a buffer of its own that XLA lends to other values until it is
written, which is most of why the per-block ``nn.remat`` habit planned less than
the scan (issue 34).

:func:`run` gives the scan its own derivative. The forward scan writes each
unit's saved values into that unit's rows of the gradient accumulators (one
``[U, row]`` buffer per float parameter leaf, carried through the loop
and updated in place); a value may span several leaves' rows of one dtype, and
a value of another float dtype is stored as its bits (bfloat16 activations in
float32 gradient rows, two to an element). The reverse scan
reads unit u's values back out of its rows at the start of its step and writes
unit u's gradient over them at its end. Rows of units the reverse scan has not
reached yet still hold their values; rows it has passed hold gradients. What
does not fit (a unit's saved values larger than its parameters) stays a
``[U, ...]`` loop output as in the plain scan, flat (XLA relaid a stack of the
value's own shape out whole for the backward loop, holding it twice), and a
value larger than the room left fills it and keeps only its remainder there;
a value that is one of the unit's own inputs (a parameter slice) or a
closed-over value is read again where it lives. The gradients are the plain
scan's: each unit's backward step is ``jax.vjp`` of the same step.

Like any ``jax.custom_vjp`` it supports reverse-mode differentiation only; the
stacks call it only where that is what runs (:func:`applies`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

from remat import backward_order, kept_in_gradients
from remat.kept_in_gradients import _storable
from remat.layout import target_platform
from remat.unrolled_parts import (batched, hoist, inexact, materialise, primal_values,
                                  residual_origins, zero_cotangent)

try:   # JAX's own pass; without it (a JAX that moved it) the output is left to XLA to drop
  from jax._src.interpreters.partial_eval import dce_jaxpr as _dce_jaxpr
except ImportError:   # pragma: no cover
  _dce_jaxpr = None


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Where each residual leaf of a unit's VJP comes from, and the accumulators in use.

  ``where[j]``: ``('s', n)`` the unit's input leaf n; ``('k', n)`` closed-over
  value n; ``('a', (((leaf, offset, size), ...), shape, dtype, rest))`` pieces in
  the unit's rows of accumulators of one dtype (offsets within the row; the
  value's bits where that dtype is another), followed by loop output ``rest``
  (the flat remainder that did not fit; None when all of it did); ``('o', (n, shape))``
  loop output n, flat (``shape``: the value's).
  """
  tree: object
  where: tuple
  used: frozenset
  saved: int      # bytes of the unit's own saved values
  spill: tuple    # the unit's loop outputs (ShapeDtypeStructs, flat), in order


def applies(x, xs) -> bool:
  """Whether :func:`run` serves a scan over ``xs``: it has a float leaf to write rows into.

  On a GPU target only: XLA's CPU backend, whose default layout is this scan,
  copies a whole accumulator in the backward loop to read a unit's values while
  it writes the unit's gradient (ViT-B/16's train step under ``full``: 536 ->
  588 MiB of ``temp``), where its GPU pipeline writes in place.
  Inside ``jax.vmap`` the stack keeps JAX's own derivative: a ``custom_vjp``'s
  backward would run per example and give per-example parameter gradients.
  Not in a program split over several devices
  (:func:`remat.kept_in_gradients.partitioned`).
  Inside :func:`remat.kept_in_gradients.suspended` it is the plain scan.
  """
  leaves = jax.tree_util.tree_leaves(xs)
  rows = any(inexact(a) and np.ndim(a) >= 1 and np.shape(a)[0] > 1 for a in leaves)
  return (rows and target_platform() == 'gpu' and kept_in_gradients.active((x, xs))
          and not batched((x, xs)))


def run(step: Callable, x, xs, in_order: bool = False):
  """``lax.scan(step, x, xs)`` with the derivative above.

  Args:
    step: ``step(x, xs_u) -> (x, ys_u)``, one unit with its rule's checkpoint
      inside (``prevent_cse=False`` is safe: the loop stays a loop).
    x: the carry.
    xs: per-unit inputs stacked ``[U, ...]`` (parameters, keys, layer inputs).
    in_order: write each gradient row as soon as it is computed (:func:`unit_backward`).

  Returns:
    ``(x, ys)`` with ``ys`` stacked ``[U, ...]``.
  """
  xs_leaves, xs_def = jax.tree_util.tree_flatten(xs)
  units = int(np.shape(xs_leaves[0])[0])
  first = jax.tree_util.tree_unflatten(xs_def, [a[0] for a in xs_leaves])
  converted, consts, _ = hoist(step, x, first)
  rows = row_sizes(xs_leaves)

  def unit(x, v, k):
    return converted(x, v, *k)

  residuals = functools.partial(unit_residuals, unit)

  meta = {}   # the forward pass's plan, for the backward pass

  def plain(x, xs, k):
    return jax.lax.scan(lambda c, v: unit(c, v, k), x, xs)

  def forward(x, xs, k):
    # Only a differentiated leaf has gradient rows: a frozen one (a LoRA base weight) gets no
    # gradient, and rows holding saved values would make XLA compute it.
    (x, xs, k), grads = differentiated(x, xs, k, rows)
    plan = meta['plan'] = _plan(lambda: residuals(x, first, k), xs_leaves,
                                [r if g else 0 for r, g in zip(rows, grads)])
    meta['grads'] = grads
    accs = [jnp.zeros((units, r), a.dtype) if i in plan.used else None
            for i, (a, r) in enumerate(zip(xs_leaves, rows))]

    def body(carry, inp):
      x, accs, k = carry
      u, v = inp
      (x, ys), _, where, mine = residuals(x, v, k)
      lined_up(where, plan)   # with the plan traced outside the loop
      accs, others = store(accs, plan, mine, u)
      return (x, accs, k), (ys, others)

    (x, accs, _), (ys, others) = jax.lax.scan(body, (x, accs, k), (jnp.arange(units), xs))
    return (x, ys), (xs, k, accs, others)

  def backward(res, cts):
    xs, k, accs, others = res
    plan, grads = meta['plan'], meta['grads']
    ct_x, ct_ys = materialise(cts)
    accs, ct_k = backward_start(accs, rows, xs_leaves, grads, k)

    def body(carry, inp):
      ct_x, accs, ct_k, k = carry
      u, v, ct_y, own = inp
      ct_x, accs, ct_k = unit_backward(plan, ct_x, accs, ct_k, u, v, k, own, ct_y, in_order)
      return (ct_x, accs, ct_k, k), None

    (ct_x, accs, ct_k, _), _ = jax.lax.scan(
        body, (ct_x, accs, ct_k, k), (jnp.arange(units), xs, ct_ys, others), reverse=True)
    return (ct_x, *backward_end(accs, ct_k, xs_leaves, xs_def, k))

  fn = jax.custom_vjp(plain)
  fn.defvjp(forward, backward, symbolic_zeros=True)
  return fn(x, xs, consts)


def _plan(trace: Callable, xs_leaves: list, rows: list) -> _Plan:
  """Traces one unit's VJP and places its saved values in the unit's rows, largest room first."""
  box = {}

  def shapes():
    _, tree, where, mine = trace()
    box['tree'], box['where'] = tree, where
    box['storable'] = [_storable(a) for a in mine]
    return mine
  mine = jax.eval_shape(shapes)
  free = [0] * len(rows)
  where, used, spill = [], set(), []
  for origin in box['where']:
    if origin[0] != 'r':
      where.append(origin)
      continue
    value = mine[origin[1]]
    count = int(np.prod(value.shape, dtype=np.int64))
    spot = None
    # the accumulators of one dtype, the value's own first, then any other float dtype whose
    # elements hold a whole number of the value's (or the reverse): stored as their bit pattern.
    # A value larger than the room left fills it and keeps only its remainder as a loop output,
    # so no row that could hold saved values stays empty while they wait.
    for dtype in sorted({jnp.result_type(a) for a in xs_leaves if inexact(a)},
                        key=lambda d: d != value.dtype):
      size = _elements(count, value.dtype, dtype)
      fits = [i for i, a in enumerate(xs_leaves)
              if rows[i] > free[i] and jnp.result_type(a) == dtype]
      if size is not None and fits:
        spot = (dtype, size, fits)
        break
    if not box['storable'][origin[1]] or spot is None:
      where.append(('o', (len(spill), tuple(value.shape))))
      spill.append(jax.ShapeDtypeStruct((count,), value.dtype))
      continue
    dtype, size, fits = spot
    pieces, done = [], 0
    for i in sorted(fits, key=lambda i: free[i] - rows[i]):
      take = min(size - done, rows[i] - free[i])
      pieces.append((i, free[i], take))
      free[i] += take
      used.add(i)
      done += take
      if done == size:
        break
    rest = None
    if done < size:
      rest = len(spill)
      spill.append(jax.ShapeDtypeStruct((size - done,), dtype))
    where.append(('a', (tuple(pieces), tuple(value.shape), value.dtype, rest)))
  return _Plan(box['tree'], tuple(where), frozenset(used),
               sum(a.size * a.dtype.itemsize for a in mine), tuple(spill))


def row_sizes(xs_leaves: list) -> list:
  """Elements in one unit's row of each stacked leaf's gradient (0 for a leaf without one)."""
  return [int(np.prod(np.shape(a)[1:], dtype=np.int64)) if inexact(a) else 0 for a in xs_leaves]


def differentiated(x, xs, k, rows: list):
  """A ``custom_vjp`` forward's ``(x, xs, k)`` values, and which ``xs`` leaves have gradient rows.

  Only a differentiated leaf has rows: a frozen one (a LoRA base weight) gets no
  gradient, and rows holding saved values would make XLA compute it.
  """
  (x, xs, k), flags = primal_values((x, xs, k))
  flags = flags[len(jax.tree_util.tree_leaves(x)):][:len(rows)]
  return (x, xs, k), [f and r > 0 for f, r in zip(flags, rows)]


def lined_up(where: tuple, plan: _Plan) -> None:
  """Asserts that a unit's residuals, traced again inside a loop, are the ones ``plan`` placed."""
  assert [w if w[0] in 'sk' else 'r' for w in where] == [
      w if w[0] in 'sk' else 'r' for w in plan.where], where


def backward_start(accs: list, rows: list, xs_leaves: list, grads: list, k):
  """The backward loop's accumulators (zeros for rows no saved value used) and zero ``k`` gradients."""
  units = int(np.shape(xs_leaves[0])[0])
  accs = [a if a is not None else (jnp.zeros((units, r), jnp.result_type(l)) if g else None)
          for a, r, l, g in zip(accs, rows, xs_leaves, grads)]
  return accs, [jnp.zeros_like(a) if inexact(a) else None for a in jax.tree_util.tree_leaves(k)]


def unit_backward(plan: _Plan, ct_x, accs: list, ct_k: list, u, v, k, own: list, ct_y,
                  in_order: bool = False):
  """Unit ``u``'s backward step: its VJP (:func:`pull`), its gradient over its rows, ``k``'s summed.

  ``in_order``: each gradient leaf is written over its row as soon as it is
  computed, and the rest of the step waits for it
  (:func:`remat.backward_order.write_when_final`).
  """
  if in_order:
    ct_x, ct_v, ct_kk, accs, done = _pull_in_order(plan, accs, u, v, k, own, ct_x, ct_y)
  else:
    ct_x, ct_v, ct_kk = pull(plan, accs, u, v, k, own)((ct_x, ct_y))
    done = set()
  ct_k = [None if a is None else a + g for a, g in zip(ct_k, jax.tree_util.tree_leaves(ct_kk))]
  return ct_x, write(accs, ct_v, u, skip=done), ct_k


def _pull_in_order(plan: _Plan, accs: list, u, v, k, own: list, ct_x, ct_y):
  """:func:`pull` called on ``(ct_x, ct_y)``, each gradient leaf written into its row when computed.

  Returns ``(ct_x, ct_v, ct_kk, accs, the accumulators already written)``.
  """
  have = [i for i, a in enumerate(accs) if a is not None]
  args, tree = jax.tree_util.tree_flatten(([accs[i] for i in have], u, v, k, own, (ct_x, ct_y)))
  box = {}

  def backward(*leaves):
    given, u, v, k, own, cts = jax.tree_util.tree_unflatten(tree, list(leaves))
    full = list(accs)
    for i, a in zip(have, given):
      full[i] = a
    out = pull(plan, full, u, v, k, own)(cts)
    leaves, box['tree'] = jax.tree_util.tree_flatten(out)
    return leaves

  cts = len(jax.tree_util.tree_leaves((ct_x, ct_y)))
  # the output is (ct_x, ct_v, ct_kk): ct_x has ct_x's leaves, then one leaf per xs leaf
  rows = {len(jax.tree_util.tree_leaves(ct_x)) + i: n for n, i in enumerate(have)}
  outs, written = backward_order.write_when_final(
      backward, args, rows, lambda acc, g: _row_written(acc, g, u),
      set(range(len(args) - cts, len(args))))
  accs = list(accs)
  for n, acc in written.items():
    accs[have[n]] = acc
  ct_x, ct_v, ct_kk = jax.tree_util.tree_unflatten(box['tree'], outs)
  return ct_x, ct_v, ct_kk, accs, {have[n] for n in written}


def backward_end(accs: list, ct_k: list, xs_leaves: list, xs_def, k):
  """``(gradient of xs, gradients of k)`` from the written accumulators."""
  ct_xs = [a.reshape(np.shape(l)) if a is not None else zero_cotangent(l)
           for a, l in zip(accs, xs_leaves)]
  ct_consts = [g if g is not None else zero_cotangent(a)
               for g, a in zip(ct_k, jax.tree_util.tree_leaves(k))]
  return jax.tree_util.tree_unflatten(xs_def, ct_xs), ct_consts


def unit_residuals(unit: Callable, x, v, k):
  """``(output, its VJP's tree, where each residual leaf comes from, the unit's own residuals)``.

  ``unit(x, v, k)``; origins as in :class:`_Plan`, ``('r', n)`` for the
  unit's own residual n.
  """
  out, vjp = jax.vjp(unit, x, v, k)
  leaves, tree = jax.tree_util.tree_flatten(vjp)
  known = ([(('s', n), a) for n, a in enumerate(jax.tree_util.tree_leaves(v))]
           + [(('k', n), a) for n, a in enumerate(jax.tree_util.tree_leaves(k))])
  where, mine = residual_origins(leaves, known)
  return out, tree, where, mine


def unit_saved(unit: Callable, x, v, k) -> tuple[list, list]:
  """:func:`unit_residuals`' origins and own residuals, without the unit's output.

  The residuals are traced alone and cut to what they need (JAX's dead-code
  elimination of the jaxpr), so a matmul that only the output reads is neither
  traced nor counted (:mod:`remat.flops` walks the jaxpr JAX hands to XLA).
  """
  box = {}

  def saved(x, v, k):
    _, _, box['where'], mine = unit_residuals(unit, x, v, k)
    return mine
  closed = jax.make_jaxpr(saved)(x, v, k)
  jaxpr = closed.jaxpr
  if _dce_jaxpr is not None:
    jaxpr, _ = _dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars), instantiate=True)
  run_saved = jax.extend.core.jaxpr_as_fun(jax.extend.core.ClosedJaxpr(jaxpr, closed.consts))
  return box['where'], list(run_saved(*jax.tree_util.tree_leaves((x, v, k))))


def store(accs: list, plan: _Plan, mine: list, u) -> tuple[list, list]:
  """Writes unit ``u``'s saved values ``mine`` where ``plan`` places them.

  Returns:
    ``(accs, others)``: the accumulators, and the unit's loop outputs (the
    values, or remainders, that do not fit in its rows), flat, in order.
  """
  accs, others = list(accs), {}
  for (kind, at), value in zip([w for w in plan.where if w[0] in ('a', 'o')], mine):
    if kind == 'o':
      others[at[0]] = value.reshape(-1)
      continue
    accs, left = put(accs, _in_unit(at[0]), value, u)
    if at[3] is not None:
      others[at[3]] = left
  return accs, [others[n] for n in sorted(others)]


def _in_unit(pieces: tuple) -> tuple:
  """A plan's pieces ``(leaf, offset, size)`` in one unit's rows, as :func:`put` takes them."""
  return tuple((leaf, 0, offset, size) for leaf, offset, size in pieces)


def put(accs: list, pieces: tuple, value, start) -> tuple[list, jax.Array]:
  """Writes ``value``'s bits into rows from unit ``start`` on; returns ``(accs, its flat rest)``.

  ``pieces``: ``(leaf, unit after start, offset in its row, size)``, in order.
  """
  flat, done = _to_bits(value, accs[pieces[0][0]].dtype).reshape(1, -1), 0
  for leaf, unit, offset, size in pieces:
    accs[leaf] = jax.lax.dynamic_update_slice(
        accs[leaf], flat[:, done:done + size], (start + unit if unit else start, offset))
    done += size
  return accs, flat[0, done:]


def get(accs: list, pieces: tuple, shape, dtype, start, rest=None):
  """The value :func:`put` wrote from unit ``start`` on (``rest``: its flat part elsewhere)."""
  parts = [jax.lax.dynamic_slice(accs[leaf], (start + unit if unit else start, offset), (1, size))
           for leaf, unit, offset, size in pieces]
  if rest is not None:
    parts.append(rest.reshape(1, -1))
  flat = (parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)).reshape(-1)
  return _from_bits(flat, dtype, shape)


def pull(plan: _Plan, accs: list, u, v, k, own: list) -> Callable:
  """Unit ``u``'s VJP, its saved values read back from its rows, ``v`` (its inputs), ``k`` and
  ``own`` (its loop outputs from :func:`store`); call it before the unit's gradient is written."""
  v_leaves, k_leaves = jax.tree_util.tree_leaves(v), jax.tree_util.tree_leaves(k)
  leaves = []
  for kind, at in plan.where:
    if kind == 's':
      leaves.append(v_leaves[at])
    elif kind == 'k':
      leaves.append(k_leaves[at])
    elif kind == 'o':
      leaves.append(own[at[0]].reshape(at[1]))
    else:
      leaves.append(get(accs, _in_unit(at[0]), at[1], at[2], u,
                        None if at[3] is None else own[at[3]]))
  return jax.tree_util.tree_unflatten(plan.tree, leaves)


def write(accs: list, ct_v, u, skip=frozenset()) -> list:
  """Writes unit ``u``'s gradient ``ct_v`` over its rows of the accumulators it has (not ``skip``)."""
  accs = list(accs)
  for i, g in enumerate(jax.tree_util.tree_leaves(ct_v)):
    if accs[i] is not None and i not in skip:
      accs[i] = _row_written(accs[i], g, u)
  return accs


def _row_written(acc, g, u):
  """``acc`` with unit ``u``'s row overwritten by the gradient leaf ``g``."""
  return jax.lax.dynamic_update_slice(acc, g.reshape(1, -1).astype(acc.dtype), (u, 0))


def _elements(count: int, dtype, acc_dtype) -> int | None:
  """How many ``acc_dtype`` elements hold ``count`` of ``dtype`` (None: sizes that do not divide)."""
  size, acc = np.dtype(dtype).itemsize, np.dtype(acc_dtype).itemsize
  if not (jnp.issubdtype(dtype, jnp.floating) and jnp.issubdtype(acc_dtype, jnp.floating)):
    return count if np.dtype(dtype) == np.dtype(acc_dtype) else None
  if acc >= size and acc % size == 0:
    return -(-count // (acc // size))
  if size % acc == 0:
    return count * (size // acc)
  return None


def _to_bits(value, acc_dtype):
  """``value`` flat, as ``acc_dtype`` elements holding its bits (padded to a whole element)."""
  flat = value.reshape(-1)
  size, acc = value.dtype.itemsize, np.dtype(acc_dtype).itemsize
  if value.dtype == acc_dtype:
    return flat
  if acc > size:
    per = acc // size
    flat = jnp.pad(flat, (0, -flat.size % per))
    return jax.lax.bitcast_convert_type(flat.reshape(-1, per), acc_dtype)
  return jax.lax.bitcast_convert_type(flat, acc_dtype).reshape(-1)


def _from_bits(flat, dtype, shape):
  """The value of ``dtype`` and ``shape`` whose bits :func:`_to_bits` wrote into ``flat``."""
  count = int(np.prod(shape, dtype=np.int64))
  size, acc = np.dtype(dtype).itemsize, flat.dtype.itemsize
  if flat.dtype == dtype:
    return flat.reshape(shape)
  if acc > size:
    return jax.lax.bitcast_convert_type(flat, dtype).reshape(-1)[:count].reshape(shape)
  return jax.lax.bitcast_convert_type(flat.reshape(-1, size // acc), dtype).reshape(shape)
