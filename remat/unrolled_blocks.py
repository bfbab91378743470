"""The layouts that are not one scan: 'unrolled', 'loops' and 'groups', as blocks of one Python loop.

Each layout turns a policy over U units (:mod:`remat.segments`: a layer, or a
repeat of a pattern) into :class:`remat.unrolled.Block` s, the pieces of one
Python loop with the derivative of :mod:`remat.unrolled` (gradients written
into the stacked buffers in place):

* ``unrolled``: every unit on its own, in ``jax.checkpoint`` with the rule
  (as ``nn.remat`` on a block of a Python loop; ``prevent_cse=False``, since
  :mod:`remat.unrolled`'s barriers already keep the recompute apart), or for
  ``none`` no checkpoint at all, which leaves XLA's fusion free as in the
  user's own loop; a segment (``sqrt``, ``seg:K``) keeps only its input and
  runs its units again, each under the rule, in the backward pass.
* ``loops``: as ``unrolled``, each unit inside a loop of one iteration, where
  the XLA CPU backend keeps a checkpoint that it drops in straight-line code
  (with :data:`remat.targets.CPU_COMPILER_OPTIONS`); ``none`` keeps what
  :func:`remat.layout.lean_saveable` keeps, since a loop's saved values are
  its outputs.
* ``groups``: consecutive units in scans, the scans joined by the Python loop:
  a segmented policy's segments each one scan that keeps only its input; a
  per-layer rule's units in scans of ~sqrt(U) units
  (:func:`remat.policies.sqrt_segment_size`) that keep what the rule keeps.

A mix's parts become consecutive blocks, each part laid out under its own
policy. A pattern's remainder (a last, shorter repeat) is a block of its own.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from remat import kept_in_gradients, unrolled
from remat.layout import lean_saveable, target_platform
from remat.policies import Policy, sqrt_segment_size
from remat.unrolled import Block

LOOP_LAYOUTS = ('unrolled', 'loops', 'groups')


def _one_iteration(step: Callable) -> Callable:
  """``step`` as a loop of one iteration.

  For a GPU its inputs are loop constants: a parameter slice or layer input
  that the rule saves is then forwarded as the value it is (JAX does so for a
  loop-invariant residual) and :mod:`remat.unrolled` reads it again where it
  lives, where as a stacked ``[1, ...]`` loop input each was a copy kept from
  the forward to the backward pass (the Gemma 3-style decoder of
  tests/public_models/gemma3.py, ``full``, H100 plan: 8.28 -> 5.85 MiB). The XLA
  CPU backend plans the stacked form smaller (the issue-34 ViT, ``full``:
  9.15 MiB stacked, 9.73 MiB as constants), so it keeps it.
  """
  def run(x, view):
    if target_platform() == 'gpu':
      _, (y, ys) = jax.lax.scan(lambda c, _: (c, step(x, view)), None, None, length=1)
    else:
      one = jax.tree_util.tree_map(lambda a: a[None], (x, view))
      _, (y, ys) = jax.lax.scan(lambda c, inp: (c, step(*inp)), None, one)
    return jax.tree_util.tree_map(lambda a: a[0], (y, ys))
  return run


def _in_turn(step: Callable, length: int) -> Callable:
  """``length`` units in a Python loop over their inputs stacked ``[length, ...]``."""
  def run(x, view):
    outs = []
    for i in range(length):
      x, y = step(x, jax.tree_util.tree_map(lambda a, i=i: a[i], view))
      outs.append(y)
    return x, jax.tree_util.tree_map(lambda *a: jnp.stack(a), *outs)
  return run


def _scanned(step: Callable) -> Callable:
  return lambda x, view: jax.lax.scan(step, x, view)


def _part_blocks(unit, start: int, count: int, policy: Policy, layout: str, lean: bool,
                 tail_unit=None, unit_at=None) -> list[Block]:
  """Blocks of ``count`` units from ``start`` under one (unmixed) policy; the last may be a tail.

  ``unit_at(u)``, where given, is unit u's own builder (units of different
  kinds: each block then holds one unit, under a per-layer rule only).
  """
  rule = policy._layer_policy()
  size = policy.segment_size(count)
  uniform = count - (tail_unit is not None)
  cache: dict = {}

  def builder(u):
    if unit_at is not None:
      return unit_at(u)
    return tail_unit if u == start + uniform else unit

  def step(u, flat: bool = True, keep_rule=None):
    make = builder(u)
    if layout == 'loops':
      return _one_iteration(make(rule or (lean_saveable if lean else None), True, flat=True))
    # prevent_cse=False: remat.unrolled passes every block's kept values through an optimization
    # barrier that also takes the incoming cotangent, so XLA cannot merge the recompute with the
    # forward pass; the checkpoint's own barriers would only keep XLA from fusing the recompute
    # into the backward (the issue-34 ViT on the H200 plan, full: 5.59 -> 4.68 MiB, the model's
    # own per-block nn.remat 4.52 MiB).
    return make(keep_rule if keep_rule is not None else rule, False, flat=flat)

  # A block with no checkpoint recomputes nothing: its kept values stay free for XLA's fusion.
  recomputes = layout != 'unrolled' or rule is not None
  # Under no rule the kept values are the layer's own intermediates, which XLA may fuse into the
  # backward pass: storing them too made plans larger (the MLP of tests/test_kept_in_gradients.py,
  # 'none' unrolled; the issue-34 ViT's 'none' as loops, H100 plan: 14.38 -> 14.79 MiB).
  stores_all = rule is not None

  def one(u, keeps):   # a block of one unit
    key = ('one', id(builder(u)), keeps)
    fn = cache.get(key) or cache.setdefault(key, step(u))
    return Block(u, 1, fn, keeps, recomputes, stores_all)

  def several(s, length, keeps):   # a block of units of the same shape
    key = ('several', length, keeps)
    if key not in cache:
      if layout == 'groups':
        cache[key] = _scanned(step(s, flat=False, keep_rule=rule or lean_saveable))
      else:
        cache[key] = _in_turn(step(s), length)
    return Block(s, length, cache[key], keeps, recomputes, stores_all)

  if unit_at is not None:
    assert size is None and layout != 'groups', 'units of different kinds: one block each'
    return [one(u, 'rule') for u in range(start, start + count)]
  if size is None and layout == 'groups':   # a per-layer rule in scans of ~sqrt(U) units
    size, keeps = sqrt_segment_size(max(uniform, 1)), 'rule'
  else:
    keeps = 'rule' if size is None else 'input'
    size = size or 1
  blocks = []
  for s in range(start, start + uniform, size):
    length = min(size, start + uniform - s)
    blocks.append(one(s, keeps) if length == 1 else several(s, length, keeps))
  if tail_unit is not None:
    blocks.append(one(start + uniform, keeps))
  return blocks


def run(unit, x, xs: dict, counts: dict, num_units: int, policy: Policy, layout: str,
        lean: bool = True, tail_unit=None, unit_at=None):
  """Runs U units laid out as ``layout`` says, through :func:`remat.unrolled.run`.

  Args:
    unit: ``unit(rule, prevent_cse, flat=False) -> step(x, {group: view}) -> (x, {group: ys})``.
    x: the carry.
    xs: ``{group: inputs stacked [items, ...]}``.
    counts: ``{group: items per unit}``.
    num_units: U.
    policy: the policy (a mix's parts are laid out in turn; segments count units).
    layout: 'unrolled', 'loops' or 'groups'.
    lean: under ``loops``, keep what :func:`remat.layout.lean_saveable` keeps for ``none``,
      and let kept values wait in gradient rows written later (:mod:`remat.kept_in_gradients`;
      not under ``loops`` on the CPU); False for the references, the user's own loop.
    tail_unit: the last unit's builder when it differs (a pattern's remainder).
    unit_at: ``unit_at(u)``, unit u's own builder, for units of different kinds
      (a pattern's layers, one unit each); ``unit`` is then unused. A per-layer
      rule only, under 'unrolled' or 'loops'.

  Returns:
    ``(x, {group: outputs stacked [items, ...]})``.
  """
  parts = policy.layer_split(num_units) if policy.mixed else [(num_units, policy)]
  blocks, start = [], 0
  for count, part in parts:
    last = start + count == num_units
    blocks += _part_blocks(unit, start, count, part, layout, lean,
                           tail_unit if last else None, unit_at)
    start += count
  # On the CPU storing kept values in gradient rows made plans larger: a one-iteration loop takes
  # its inputs as operands, not constants (the MLP of tests/test_kept_in_gradients.py, 'loops',
  # 'full': 395200 -> 468928 bytes), and XLA copies an accumulator that is read and written
  # (ViT-B/16's train step, 'unrolled', 'full', per-block gradients: 1575 -> 2230 MiB peak).
  # Nor in a program split over devices (kept_in_gradients.partitioned).
  gpu = target_platform() == 'gpu'
  pack = lean and gpu and kept_in_gradients.active((x, xs))
  return unrolled.run(blocks, x, xs, counts, pack=pack, cpu=lean and not gpu)


def run_plain(unit, x, xs, num_units: int, policy: Policy, layout: str, lean: bool = True):
  """:func:`run` for a plain stack: one layer per unit, ``xs`` stacked ``[U, ...]``."""
  def grouped(rule, prevent_cse, flat=False):
    step = unit(rule, prevent_cse, flat=flat)

    def run_one(x, view):
      x, ys = step(x, view[0])
      return x, {0: ys}
    return run_one
  x, ys = run(grouped, x, {0: xs}, {0: [1] * num_units}, num_units, policy, layout, lean)
  return x, ys[0]
