"""A stack's units as a Python loop whose gradient is written into the stacked buffers in place.

A model written with per-layer parameters (``block_0 ... block_{N-1}``) and a
Python loop writes each layer's weight gradient into that layer's own buffer
as soon as the backward pass reaches it. A stack keeps its parameters stacked
``[N, ...]``, so a plain Python loop over the stack reads layer i as a slice,
and JAX's transpose of each slice is a full ``[N, ...]`` buffer of zeros with
that layer's gradient in it; the N of them are summed at the end. XLA keeps
them apart: on the issue-34 ViT (width 128, 8 layers, batch 8, H200 plan) the
loop with per-layer ``nothing_saveable`` planned 37.23 MiB where the same model
with per-layer parameters planned 7.40 MiB, and the loop without checkpoints
took 10 minutes to compile.

:func:`run` gives such a loop its own derivative instead: the forward pass runs
the blocks in order and keeps, per block, what its rule keeps (the leaves of
``jax.vjp`` of the block, the checkpoint's policy applied inside it), or for a
segment only its input; the backward pass runs the blocks in reverse and writes
each block's gradient into one ``[N, ...]`` accumulator with a
``dynamic_update_slice`` before the next block's backward starts, so XLA
updates it in place. A kept value that is one of the stack's own inputs (a
parameter slice, a dropout key, a value every layer shares) is not kept but
read again where it lives, and one that is a per-layer output (a U-Net's skip)
is read back from the stacked outputs. Everything else (what the rule saves,
what is recomputed, the gradients) is what the same layers give in the user's
loop. Like any ``jax.custom_vjp`` it supports reverse-mode differentiation
only. Traced inside ``jax.vmap``, the loop runs once on the whole batch, each
block vmapped, so shared parameters get one gradient as outside ``vmap``.

Inputs come in *groups* (a plain stack has one; a pattern one per layer kind),
each stacked ``[items, ...]`` with a number of items per unit: one layer per
unit for a plain stack, a kind's layers in one repeat of a pattern.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.custom_batching
import jax.numpy as jnp
import numpy as np

from remat import kept_in_gradients
from remat.unrolled_parts import (barrier, batched, hoist, inexact, materialise, matmul_operands,
                                  plus_zero, primal_values, residual_origins, zero_after,
                                  zero_cotangent)


@dataclasses.dataclass(frozen=True)
class Block:
  """Consecutive units run as one piece of the loop.

  Attributes:
    start: the first unit.
    length: how many units.
    fn: ``fn(x, {group: inputs}) -> (x, {group: outputs})``. For one unit, a
      group's inputs are its items of that unit, ``[c, ...]``, or the one
      item's without that axis when ``c`` is 1; for several units (which must
      have the same counts) ``[length, c, ...]`` or ``[length, ...]``. Outputs
      are shaped as the inputs. Groups with no item in the block are left out.
    keeps: 'rule': the forward pass keeps what ``jax.vjp`` of ``fn`` keeps (the
      rule's checkpoints are inside ``fn``); 'input': only the block's input,
      and ``fn`` runs again in the backward pass (a checkpointed segment).
    recomputes: the backward pass recomputes something of the block (a rule
      or a segment); False for a block with no checkpoint, whose kept values
      XLA may still fuse into the backward pass rather than keep.
    stores_all: every value the block keeps may wait in gradient rows
      (:mod:`remat.kept_in_gradients`), as what a rule saves is made anyway;
      False for a block with no rule, which stores only its input.
  """
  start: int
  length: int
  fn: Callable
  keeps: str = 'rule'
  recomputes: bool = True
  stores_all: bool = True


class _Items:
  """Where each block's items are in the stacked groups, and how its ``fn`` sees them."""

  def __init__(self, blocks, counts: dict):
    self.blocks, self.counts = blocks, counts
    self.offsets = {g: np.concatenate([[0], np.cumsum(c)]).astype(int) for g, c in counts.items()}

  def span(self, b: Block, g) -> tuple[int, int, tuple[int, ...]]:
    """(first item, items, the shape fn sees in front of an item's own) of group g in block b."""
    c = self.counts[g][b.start:b.start + b.length]
    first, n = int(self.offsets[g][b.start]), int(sum(c))
    if b.length == 1:
      return first, n, (() if c[0] == 1 else (n,))
    assert len(set(c)) == 1, 'a block of several units needs the same items per unit'
    return first, n, ((b.length,) if c[0] == 1 else (b.length, c[0]))

  def take(self, tree: dict, b: Block, in_place: dict | None = None, zero=None) -> dict:
    """Block b's view of ``{group: stacked}``.

    A leaf that a matmul reads (``in_place``: ``{group: leaf numbers}``, from
    :func:`remat.unrolled_parts.matmul_operands`) stays a slice at a constant
    offset: the GPU's matmul fusions read that in place, where they would first
    copy a slice at a dynamic offset (the issue-34 ViT, 8 layers, ``full``, H100
    plan: 4.40 -> 4.53 MiB of ``temp``). Any other leaf (a bias, a norm's
    scale, a dropout key) is read at an offset XLA cannot fold to a constant,
    so the fusions that read it are the same in every block and XLA's GPU
    compiler builds their kernel once (the same ViT: 9.1 -> 7.8 s of compile
    with vectors alone, the plan byte for byte the same). Without
    ``in_place`` (the cotangents of per-unit outputs), a leaf of more than
    one dimension per item stays a constant slice.

    ``zero`` (:func:`remat.unrolled_parts.zero_after`), where given, offsets
    every read instead: each is then a new value that waits for the data the
    zero was made from (the XLA CPU form of :func:`remat.unrolled.run`).
    """
    out = {}
    for g, t in tree.items():
      first, n, lead = self.span(b, g)
      if n:
        at = jnp.int32(first)
        # Opaque to constant folding. With the zero, clamped to [first, first]: with first + zero
        # alone ViT-B/16's train step under 'full' planned as under 'none' (CPU, unrolled: 1829
        # against 1575 MiB peak), XLA somehow seeing through it to the forward pass's reads.
        at = (jax.lax.optimization_barrier(at) if zero is None
              else jax.lax.clamp(at, at + zero, at))
        leaves, tdef = jax.tree_util.tree_flatten(t)
        keep = () if zero is not None else in_place.get(g, ()) if in_place is not None else [
            j for j, a in enumerate(leaves) if a.ndim > 2]
        out[g] = jax.tree_util.tree_unflatten(tdef, [
            (a[first:first + n] if j in keep else jax.lax.dynamic_slice_in_dim(a, at, n)
             ).reshape(lead + a.shape[1:]) for j, a in enumerate(leaves)])
    return out

  def flat(self, piece, b: Block, g):
    """A block's outputs (or cotangents) of group g as ``[items, ...]``."""
    _, n, lead = self.span(b, g)
    return jax.tree_util.tree_map(lambda a: a.reshape((n,) + a.shape[len(lead):]), piece)

  def item(self, b: Block, g) -> int | None:
    """The one stacked item of group g in a block of one unit with one item, else None."""
    first, n, lead = self.span(b, g)
    return first if n == 1 and lead == () else None


def run(blocks: list[Block], x, xs: dict, counts: dict, pack: bool = True, cpu: bool = False):
  """Runs ``blocks`` (a partition of the units, in order) with the derivative above.

  Args:
    blocks: the loop's pieces, covering units 0..U-1 in order.
    x: the carry.
    xs: ``{group: inputs stacked [items, ...]}`` (parameters, keys, per-layer inputs).
    counts: ``{group: items of each unit}``, U numbers per group.
    pack: let the values that blocks keep wait in gradient rows written later
      (:mod:`remat.kept_in_gradients`); False for the references, which stand
      for the user's own loop.
    cpu: the form for the XLA CPU backend, which drops ``optimization_barrier``
      (so ``jax.checkpoint`` in straight-line code is undone there, its
      recompute merged with the forward pass) and copies a whole accumulator
      that a loop both reads and writes. Each block's reads of the stacked
      inputs (and, where it recomputes, of its kept values) are offset by, or
      added to, a zero made from the block's input (forward) or incoming
      cotangent (backward)
      (:func:`remat.unrolled_parts.zero_after`): new values that XLA can
      neither merge with the forward pass's nor compute early. Each block's
      gradient is a buffer of its own, joined into the ``[N, ...]`` gradient
      at the end (unless ``pack`` stores kept values in the accumulators), as
      in a model with per-layer parameters. False for the references.

  Returns:
    ``(x, ys)``: ``ys`` is ``{group: outputs stacked [items, ...]}``.
  """
  items = _Items(blocks, counts)
  converted, consts, which = [], [], []
  shape_x, seen, in_place = x, {}, {}
  for b in blocks:  # hoist what each block closes over, so custom_vjp sees it as an input
    view = jax.eval_shape(lambda xs: items.take(xs, b), xs)
    key = (id(b.fn), jax.tree_util.tree_structure(view),
           tuple(jnp.shape(a) for a in jax.tree_util.tree_leaves(view)))
    if key not in seen:
      seen[key] = len(consts)
      conv, k, closed = hoist(b.fn, shape_x, view)
      converted.append(conv)
      consts.append(k)
      # the leaves any block's matmuls read (by group, leaf number): Items.take keeps them in place
      group = leaf_groups(view)
      within = [group[:i].count(g) for i, g in enumerate(group)]   # leaf number in its group
      first = len(jax.tree_util.tree_leaves(shape_x))
      for i in matmul_operands(closed, set(range(first, first + len(group)))):
        in_place.setdefault(group[i - first], set()).add(within[i - first])
    w = seen[key]
    which.append(w)
    shape_x = jax.eval_shape(converted[w], shape_x, view, *consts[w])[0]
  meta = {}   # filled while the forward pass is traced: each block's kept values, by origin

  def _zero(tree):
    """The CPU form's zero made from ``tree`` (None on other backends or with nothing to wait on)."""
    return zero_after(tree) if cpu and jax.tree_util.tree_leaves(tree) else None

  def _differentiated(accs):
    """The accumulators of differentiated leaves (``meta['grads']``); None for the others."""
    return [a if g else None for a, g in zip(accs, meta['grads'])]

  def call(w):
    return lambda c, s, k: converted[w](c, s, *k)

  def stack_ys(pieces):
    out = {}
    for g in xs:
      parts = [items.flat(p[g], b, g) for p, b in zip(pieces, blocks) if g in p]
      out[g] = parts[0] if len(parts) == 1 else jax.tree_util.tree_map(
          lambda *a: jnp.concatenate(a), *parts)
    return out

  def plain(x, xs, consts):
    pieces = []
    for b, w in zip(blocks, which):
      x, ys_b = converted[w](x, items.take(xs, b, in_place), *consts[w])
      pieces.append(ys_b)
    return x, stack_ys(pieces)

  def forward(x, xs, consts):
    # Only a differentiated leaf gets gradient rows: a frozen one (a LoRA base weight) gets no
    # gradient, and rows holding kept values would make XLA compute it (a frozen [8, 256, 256]
    # weight beside its adapter, full, H100 plan: 3.41 -> 5.25 MB of temp).
    (x, xs, consts), flags = primal_values((x, xs, consts))
    first = len(jax.tree_util.tree_leaves(x))
    meta['grads'] = flags[first:first + len(jax.tree_util.tree_leaves(xs))]
    pieces, kept, layouts = [], [], []
    inputs = []   # per block, its input's leaves (what a block with no rule may store)
    for b, w in zip(blocks, which):
      view = items.take(xs, b, in_place, _zero(x))
      inputs.append(jax.tree_util.tree_leaves(x))
      if b.keeps == 'input':   # its input's leaves: a carry may be a pytree
        kept.append(jax.tree_util.tree_leaves(x))
        meta['carry'] = jax.tree_util.tree_structure(x)
        layouts.append(None)
        x, ys_b = converted[w](x, view, *consts[w])
        pieces.append(ys_b)
        continue
      (x, ys_b), pull = jax.vjp(call(w), x, view, consts[w])
      leaves, tree = jax.tree_util.tree_flatten(pull)
      known = ([(('s', j), a) for j, a in enumerate(jax.tree_util.tree_leaves(view))]
               + [(('k', j), a) for j, a in enumerate(jax.tree_util.tree_leaves(consts[w]))])
      where, mine = residual_origins(leaves, known)
      kept.append(mine)
      layouts.append((tree, where))
      pieces.append(ys_b)
    # A kept value that is a per-unit output (a layer that returns its output as a skip) is read
    # back from the stacked outputs rather than kept twice.
    outputs = {}   # id of an output leaf -> (group, leaf number, stacked item)
    for p, b in zip(pieces, blocks):
      for g, t in p.items():
        i = items.item(b, g)
        if i is not None:
          for lj, a in enumerate(jax.tree_util.tree_leaves(t)):
            outputs.setdefault(id(a), (a, (g, lj, i)))
    for bi, mine in enumerate(kept):
      if layouts[bi] is None:
        continue
      tree, where = layouts[bi]
      moved, remap = [], {}
      for j, leaf in enumerate(mine):
        hit = outputs.get(id(leaf))
        if hit is not None and hit[0] is leaf:
          remap[j] = ('y', hit[1])
        else:
          remap[j] = ('r', len(moved))
          moved.append(leaf)
      kept[bi] = moved
      layouts[bi] = (tree, [remap[o[1]] if o[0] == 'r' else o for o in where])
    meta['layouts'] = layouts
    ys = stack_ys(pieces)
    acc = None
    if pack:   # kept values wait in gradient rows written later (remat.kept_in_gradients)
      zeros = _differentiated(zero_accumulators(xs))   # XLA drops them when nothing is stored
      rows = [[items.span(b, g)[:2] for g in leaf_groups(xs)] for b in blocks]
      meta['spots'] = kept_in_gradients.place(
          kept, inputs, [b.stores_all for b in blocks], zeros, rows)
      if meta['spots']:
        acc, kept = kept_in_gradients.store(zeros, kept, meta['spots'])
    return (x, ys), (xs, consts, ys, kept, acc)

  def backward(res, cts):
    xs, consts, ys, kept, acc = res
    kept = list(kept)
    ct_x, ct_ys = materialise(cts)
    xs_leaves, xs_def = jax.tree_util.tree_flatten(xs)
    floats = [inexact(a) for a in xs_leaves]
    # The gradient accumulators, one per float leaf (holding kept values, when the forward pass
    # made them), and which leaves are each group's.
    apart = cpu and acc is None   # each block's gradient its own buffer until the end
    acc = (list(acc) if acc is not None else [None] * len(xs_leaves) if apart
           else _differentiated(zero_accumulators(xs)))
    parts = [{} if g and f else None for g, f in zip(meta['grads'], floats)] if apart else None
    spots = meta.get('spots', {})
    groups = leaf_groups(xs)
    mine = {g: [i for i, h in enumerate(groups) if h == g] for g in xs}
    ct_k = [[jnp.zeros_like(a) if inexact(a) else None for a in k] for k in consts]
    ys_leaves = {g: jax.tree_util.tree_leaves(t) for g, t in ys.items()}
    # The stacked inputs pass through the barriers too, so that each block's slices of them in the
    # backward pass are new values: XLA would otherwise merge them with the forward pass's slices
    # and keep those, a copy of the stack's parameters, from the forward pass to the backward (the
    # Gemma 3-style decoder of tests/public_models/gemma3.py, full, H100 plan: 1.50 MiB; the
    # issue-34 ViT's 8 layers under full: 4.68 -> 4.40 MiB temp, its per-block habit 4.52).
    if blocks[-1].recomputes or blocks[-1].keeps == 'input':
      ct_x, kept[-1], xs = barrier((ct_x, kept[-1], xs))
    else:
      ct_x, xs = barrier((ct_x, xs))
    for bi in reversed(range(len(blocks))):
      b, w = blocks[bi], which[bi]
      zero = _zero(ct_x)
      view = items.take(xs, b, in_place, zero)
      # Only where something is recomputed, which XLA would otherwise merge with the forward
      # pass. Tied too, a block with no rule planned less but ran slowly: XLA fused each kept
      # residual-stream sum, a chain of adds back through the layers, into the backward pass's
      # fusions (ViT-B/16's train step, 'none': 1834 against 1995 MiB peak, 7.7 against 4.6 s).
      if zero is not None and (b.recomputes or b.keeps == 'input'):
        kept[bi] = plus_zero(kept[bi], zero)
      if meta['layouts'][bi] is None:   # a segment: run it again from its input, then back
        start = [a if (bi, j) not in spots else kept_in_gradients.load(acc, spots[(bi, j)])
                 for j, a in enumerate(kept[bi])]
        start = jax.tree_util.tree_unflatten(meta['carry'], start)
        _, pull = jax.vjp(call(w), start, view, consts[w])
      else:
        tree, where = meta['layouts'][bi]
        s_leaves, k_leaves = jax.tree_util.tree_leaves(view), consts[w]
        leaves = []
        for kind, j in where:
          if kind == 'r':
            at = spots.get((bi, j))
            leaves.append(kept[bi][j] if at is None else kept_in_gradients.load(acc, at))
          elif kind == 's':
            leaves.append(s_leaves[j])
          elif kind == 'k':
            leaves.append(k_leaves[j])
          else:   # ('y', (group, leaf, item)): a per-unit output, read back from the outputs
            g, lj, i = j
            leaves.append(ys_leaves[g][lj][i] if zero is None
                          else plus_zero(ys_leaves[g][lj][i], zero))
        pull = jax.tree_util.tree_unflatten(tree, leaves)
      ct_x, ct_view, ct_kb = pull((ct_x, items.take(ct_ys, b)))
      for g, t in ct_view.items():
        first = items.span(b, g)[0]
        for i, ct in zip(mine[g], jax.tree_util.tree_leaves(items.flat(t, b, g))):
          if apart and parts[i] is not None:
            parts[i][first] = ct.astype(jnp.result_type(xs_leaves[i]))
          elif acc[i] is not None:
            acc[i] = jax.lax.dynamic_update_slice_in_dim(acc[i], ct.astype(acc[i].dtype), first, 0)
      for i, g in enumerate(jax.tree_util.tree_leaves(ct_kb)):
        if ct_k[w][i] is not None:
          ct_k[w][i] = ct_k[w][i] + g
      # The next block's backward, its recompute included, waits for this block's gradient to be
      # written: otherwise XLA's scheduler may leave every block's gradient pieces (split-K
      # partial sums included) live until the end of the backward pass, or start recomputing the
      # next block while this one's working set is live (the issue-34 ViT, full: 18.27 -> 11.73
      # MiB with the first, one layer's attention working set less with the second).
      # The barrier over the next block's kept values also keeps XLA from merging its recompute
      # with the forward pass (which would keep the forward's values instead): the job of
      # jax.checkpoint's prevent_cse, so the blocks' checkpoints need not do it too.
      if bi and (blocks[bi - 1].recomputes or blocks[bi - 1].keeps == 'input'):
        ct_x, acc, kept[bi - 1], xs = barrier((ct_x, acc, kept[bi - 1], xs))
      else:
        ct_x, acc, xs = barrier((ct_x, acc, xs))
    if apart:
      acc = [None if p is None else _joined(p, x0) for p, x0 in zip(parts, xs_leaves)]
    ct_xs = [a if f and a is not None else zero_cotangent(x0)
             for a, f, x0 in zip(acc, floats, xs_leaves)]
    ct_consts = [[g if g is not None else zero_cotangent(a) for g, a in zip(gs, k)]
                 for gs, k in zip(ct_k, consts)]
    return ct_x, jax.tree_util.tree_unflatten(xs_def, ct_xs), ct_consts

  def inside(x, xs, consts):
    # JAX's own derivative of the loop (each layer's gradient a zero-padded [N, ...] buffer), a
    # segment in jax.checkpoint: for per-example stacked inputs under jax.vmap, where the
    # derivative above would run per example.
    pieces = []
    for b, w in zip(blocks, which):
      f = converted[w] if b.keeps == 'rule' else jax.checkpoint(
          converted[w], policy=jax.checkpoint_policies.nothing_saveable)
      x, ys_b = f(x, items.take(xs, b, in_place), *consts[w])
      pieces.append(ys_b)
    return x, stack_ys(pieces)

  fn = jax.custom_vjp(plain)
  fn.defvjp(forward, backward, symbolic_zeros=True)
  if not batched((x, xs, consts)):
    return fn(x, xs, consts)
  # Inside jax.vmap a custom_vjp's backward runs per example, so the shared parameters would get
  # per-example gradients, [batch, N, ...]. custom_vmap hands the batched arrays to _batched_run
  # instead, which runs this loop once on the whole batch, each block vmapped. (Only inside a
  # vmap: JAX cannot differentiate a custom_vmap outside one.)
  per_example = jax.custom_batching.custom_vmap(fn)
  per_example.def_vmap(lambda size, in_batched, x, xs, consts: _batched_run(
      blocks, which, converted, items, inside, pack, cpu, size, in_batched, x, xs, consts))
  return per_example(x, xs, consts)


def _batched_run(blocks, which, converted, items, inside, pack, cpu, size, in_batched, x, xs,
                 consts):
  """:func:`run` on a batch: ``custom_vmap``'s rule for a stack traced inside ``jax.vmap``.

  With shared stacked inputs (the parameters) each block becomes ``jax.vmap`` of
  itself over the carry and any batched value it closes over, and the loop runs
  once with the derivative above: one gradient for the parameters, summed over
  the batch. Per-example stacked inputs get JAX's own derivative, vmapped.
  """
  b_x, b_xs, b_k = in_batched
  axes = lambda flags: jax.tree_util.tree_map(lambda f: 0 if f else None, flags)
  everything = lambda out: (out, jax.tree_util.tree_map(lambda _: True, out))
  if any(jax.tree_util.tree_leaves(b_xs)):
    return everything(jax.vmap(inside, in_axes=(axes(b_x), axes(b_xs), axes(b_k)),
                               axis_size=size)(x, xs, consts))

  def per_block(b, w, first):
    # After the first block every leaf of the carry is batched (vmap's outputs all are).
    f = jax.vmap(converted[w], in_axes=(axes(b_x) if first else 0, None, *axes(b_k[w])),
                 axis_size=size)

    def fn(x, view):
      x, ys = f(x, view, *consts[w])
      # the batch axis after the block's items, where the stacked outputs keep theirs
      return x, {g: jax.tree_util.tree_map(
          lambda a, k=len(items.span(b, g)[2]): jnp.moveaxis(a, 0, k), t) for g, t in ys.items()}
    return fn

  made = {}   # blocks that share a function share its vmapped one (traced once, as before)
  vblocks = [dataclasses.replace(b, fn=made.get((w, i == 0)) or made.setdefault(
      (w, i == 0), per_block(b, w, i == 0))) for i, (b, w) in enumerate(zip(blocks, which))]
  x, ys = run(vblocks, x, xs, items.counts, pack, cpu)
  return everything((x, jax.tree_util.tree_map(lambda a: jnp.moveaxis(a, 1, 0), ys)))


def _joined(parts: dict, like):
  """A leaf's gradient from its blocks' pieces, ``{first item: [items, ...]}``, in item order.

  The blocks partition the units, so the pieces cover every row of ``like``.
  """
  pieces = [parts[first] for first in sorted(parts)]
  assert sum(np.shape(p)[0] for p in pieces) == np.shape(like)[0], 'pieces miss rows'
  return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces)


def zero_accumulators(xs: dict) -> list:
  """A zero gradient accumulator per float leaf of ``xs`` (None for integer and key leaves)."""
  return [jnp.zeros(jnp.shape(a), jnp.result_type(a)) if inexact(a) else None
          for a in jax.tree_util.tree_leaves(xs)]


def leaf_groups(xs: dict) -> list:
  """The group of each leaf of ``{group: stacked inputs}``, in leaf order."""
  return [p[0].key for p, _ in jax.tree_util.tree_flatten_with_path(xs)[0]]
