"""The one implementation of a policy over a stack: the per-layer rule inside, segments outside.

Every front door (:func:`remat.scan_layers`, :class:`remat.LayerStack`,
:class:`remat.NNXStack`, :mod:`remat.eqx`) reduces its stack to
:func:`run_units`: a ``lax.scan`` over *units* whose per-unit slices
(parameters, dropout keys, mutable state) are stacked ``[U, ...]``. A unit is
one layer, or one repeat of a pattern of layer kinds (:mod:`remat.patterns`);
either way the unit is built by ``unit(rule, prevent_cse)``, which applies the
per-layer rule to *each layer inside it*. The policy decides the loop nest:

* per layer: one scan over the units, each layer in ``jax.checkpoint`` with
  the rule; ``none`` keeps every value an expensive operation produced and
  rebuilds the cheap elementwise ones in the backward pass
  (:func:`remat.layout.lean_saveable`), as XLA's fusion does in an unrolled
  model, where a plain scan would materialise all of them as ``[U, ...]`` loop
  outputs;
* segmented (``sqrt``, ``seg:K``, ``stage``): a scan over U // K segments,
  each in ``jax.checkpoint(policy=nothing_saveable)`` so only its input is
  saved, the per-layer rule (for ``none`` the lean one) applied to every layer
  inside it, then one remainder segment of U % K units. Where there are
  several segments of at most :data:`remat.layout.AUTO_UNROLL_MAX` units, a
  segment runs its units in turn (:func:`in_turn`), else as a scan;
* a mix (``4xfull+none``): consecutive runs of units, each as above under its
  own part.

On a GPU plan the per-layer scan keeps what it saves in the gradient rows its
backward loop writes later (:mod:`remat.stored_scan`), and a segmented stack
rebuilds each segment into those rows (:mod:`remat.stored_segments`), unless
its units save far more than their rows hold
(:func:`remat.stored_segments.pays_off`): then the scan over checkpointed
segments keeps each segment's input in its rows. The gradients are the plain
scan's.

Nothing else wraps a unit, so a rule is never overridden by an outer
checkpoint: a pattern's repeat under ``full`` saves what ``full`` saves for
each of its layers, exactly as the same layers would without the pattern.

``prevent_cse=False`` only inside a loop of length > 1; a loop of one
iteration (a one-unit stack, a remainder, a ``stage`` segment) is still a
length-1 scan with ``prevent_cse=True``. XLA's while-loop simplifier inlines
such loops, after which the CPU backend drops their checkpoints unless the
step is compiled with :data:`remat.targets.CPU_COMPILER_OPTIONS`
(docs/own-model.md has the measurements); GPU pipelines keep them.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from remat import shared_outputs, stored_scan, stored_segments, unrolled_blocks
from remat.layout import AUTO_UNROLL_MAX, lean_saveable, target_platform
from remat.policies import Policy

_nothing = jax.checkpoint_policies.nothing_saveable

# unit(rule, prevent_cse, flat=False) -> step(x, xs_u) -> (x, ys_u): one unit, the rule (a
# jax.checkpoint policy, or None for no checkpoint) applied to each of its layers; flat: no loop
# inside the unit (a pattern's run of one kind is then its layers in turn, not an inner scan).
Unit = Callable[..., Callable]


def checkpointed(step: Callable, rule: Callable | None, prevent_cse: bool) -> Callable:
  """``step`` under ``jax.checkpoint`` with ``rule``; ``step`` itself for None."""
  return step if rule is None else jax.checkpoint(step, policy=rule, prevent_cse=prevent_cse)


def layer_unit(step: Callable) -> Unit:
  """The unit of a plain stack: one layer, ``step(x, xs_i) -> (x, ys_i)``."""
  return lambda rule, prevent_cse, flat=False: checkpointed(step, rule, prevent_cse)


def _first(tree):
  return jax.tree_util.tree_map(lambda a: a[0], tree)


def _add_axis(tree):
  return jax.tree_util.tree_map(lambda a: a[None], tree)


def _run_one(body: Callable, x, xs):
  """One unit as a length-1 scan over x itself (not a carry), so it may change x's shape."""
  _, (y, ys) = jax.lax.scan(lambda c, inp: (c, body(*inp)), None, (_add_axis(x), xs))
  return _first(y), ys


def _split_stacked(tree, num_units: int, size: int):
  """[U, ...] leaves -> ([U//K, K, ...], [U%K, ...]) leaves."""
  full = num_units // size
  cut = full * size
  main = jax.tree_util.tree_map(lambda a: a[:cut].reshape((full, size) + a.shape[1:]), tree)
  tail = jax.tree_util.tree_map(lambda a: a[cut:], tree)
  return main, tail


def run_units(unit: Unit, x, xs, num_units: int, policy: Policy):
  """Runs U units in order as ``policy`` says: the per-layer rule inside, segments outside.

  Args:
    unit: ``unit(rule, prevent_cse, flat=False)`` builds one unit's step
      ``step(x, xs_u) -> (x, ys_u)`` with ``rule`` applied to each layer in it
      (:func:`layer_unit` for a plain stack).
    x: the carry (the activations). With U == 1 the unit may change its shape.
    xs: a pytree of per-unit inputs stacked ``[U, ...]`` (may be empty).
    num_units: U.
    policy: the policy; its segment sizes and mix counts count units. A
      segment larger than U is one segment of U (the front doors check the
      size first unless told not to).

  Returns:
    ``(x, ys)`` as from ``lax.scan``: ``ys`` stacked ``[U, ...]``.
  """
  if policy.mixed:
    return _run_mix(unit, x, xs, num_units, policy)
  layer_rule = policy._layer_policy()
  # `none` keeps what no fusion could rebuild cheaply: see remat/layout.py for why and the bytes.
  rule = layer_rule or lean_saveable
  size = policy.segment_size(num_units)
  if num_units == 1:
    if size is not None:  # one segment of one unit: saves only its input
      body = jax.checkpoint(unit(layer_rule, True), policy=_nothing, prevent_cse=True)
    else:
      body = unit(rule, True)
    return _run_one(body, x, xs)
  if size is None:
    # prevent_cse=False is safe only inside a loop that stays a loop; XLA inlines length-1 ones.
    shares = shared_outputs.shared_leaves(unit(None, True), x, _first(xs))
    if shares:  # per-layer outputs that are the carry: kept once (remat/shared_outputs.py)
      return shared_outputs.scan(unit(rule, False), x, xs, num_units, shares)
    if stored_scan.applies(x, xs):   # saved values wait in gradient rows (remat/stored_scan.py)
      # Each row written as soon as it is computed (remat/backward_order.py); not where saved
      # values go to host memory, whose copies back XLA then made earlier (GPT-2 small's train
      # step, 8 x 1024, H200 plan, qkv_proj_offloaded: 1.43 -> 1.56 GiB of temp).
      return stored_scan.run(unit(rule, False), x, xs, in_order=not policy.offloads)
    return jax.lax.scan(unit(rule, False), x, xs)
  full, rest = divmod(num_units, size)
  if stored_segments.applies(x, xs):   # GPU: each segment rebuilt into its gradient rows
    step = unit(rule, False)
    if stored_segments.pays_off(step, x, xs, size):
      return stored_segments.run(step, x, xs, size, in_order=not policy.offloads)
  main, tail = _split_stacked(xs, num_units, size)

  def segment(length: int, prevent_cse: bool) -> Callable:
    if full > 1 and 1 < length <= AUTO_UNROLL_MAX:   # the layers in turn: see in_turn's note
      run = lambda x, seg_xs: in_turn(unit, x, seg_xs, length, policy)
    else:
      run = lambda x, seg_xs: jax.lax.scan(unit(rule, length == 1), x, seg_xs)
    return jax.checkpoint(run, policy=_nothing, prevent_cse=prevent_cse)

  # Segments are a loop even when there is one (a `stage`), so that with
  # CPU_COMPILER_OPTIONS the CPU backend keeps its checkpoint too.
  if full > 1 and stored_scan.applies(x, main):   # a segment's input waits in its gradient rows
    # Rows written at the end of a segment's step: written as each was computed, the segment's
    # recompute and backward planned more (the public ViT, sqrt, H100 plan: 5.56 -> 6.26 MiB).
    x, ys = stored_scan.run(segment(size, prevent_cse=False), x, main)
  else:
    x, ys = jax.lax.scan(segment(size, prevent_cse=full == 1), x, main)
  ys = jax.tree_util.tree_map(lambda a: a.reshape((full * size,) + a.shape[2:]), ys)
  if rest:
    x, ys_rest = jax.lax.scan(segment(rest, prevent_cse=True), x, _add_axis(tail))
    ys = jax.tree_util.tree_map(lambda a, b: jnp.concatenate([a, b[0]]), ys, ys_rest)
  return x, ys


def in_turn(unit: Unit, x, xs, length: int, policy: Policy):
  """A segment's ``length`` units as :mod:`remat.unrolled`'s Python loop, each under the rule.

  As an inner scan, a segment's recompute read each layer's parameters once
  and kept what it read until that layer's backward step (on the CPU a copy:
  the segment's ``[K, ...]`` slice of every parameter), and wrote the
  segment's gradient into ``[K, ...]`` stacks. :func:`remat.unrolled.run`
  reads a layer's parameters again in its backward step and frees each
  layer's kept values after it, and JAX drops from the recompute the last
  matmul that only the segment's output needs. ViT-B/16's train step (batch
  8, peak of the plan): ``sqrt`` 1784 -> 1689 MiB on the CPU, 1743 -> 1664 on
  the H100 plan (docs/own-model.md has the rest).

  The layers run as ``loops``, each in a loop of one iteration, which keeps
  its checkpoint: as plain straight-line layers, XLA merged the matmuls of a
  layer's recompute and backward on a GPU (our ``vit-tiny``, 8 layers,
  ``sqrt``, H100 plan: 30.47 MiB of ``temp``, 21.21 as loops) and planned more
  for four of the six public models of tests/public_models on the CPU (the
  big_vision ViT's ``sqrt``: 9.90 MiB, 8.86 as loops). Under ``dots`` on the
  CPU they run as ``unrolled``, which planned less than the inner scan on the
  five public models whose plans changed, and less than loops on four (the
  ViT's ``dots@sqrt``: 7.22 against 8.32 MiB; the exception, the U-Net: 65.69
  against 63.87), as the ``unrolled`` layout does under ``dots`` for a whole
  stack. Units are unrolled, so only segments of at most
  :data:`remat.layout.AUTO_UNROLL_MAX` units run in turn.
  """
  rule_spec, at, _ = policy.spec.partition('@')   # 'dots@sqrt' -> dots; 'sqrt' is none@sqrt
  per_layer = dataclasses.replace(policy, segment=None, spec=rule_spec if at else 'none')
  straight = target_platform() != 'gpu' and per_layer.rule in ('dots', 'dots_no_batch')
  return unrolled_blocks.run_plain(unit, x, xs, length, per_layer,
                                   'unrolled' if straight else 'loops')


def _run_mix(unit: Unit, x, xs, num_units: int, policy: Policy):
  """A mix: consecutive runs of units, each a :func:`run_units` under its own part.

  Each run reads its slice of the stacked ``xs``, so the parameter tree is the
  same as under any other policy; the price is that XLA assembles the stack's
  gradient from the runs' pieces, a copy the size of the stack's parameters
  (as for a remainder segment), which the compiled plan shows.
  """
  start, outs = 0, []
  for count, part in policy.layer_split(num_units):
    run_xs = jax.tree_util.tree_map(lambda a, s=start, c=count: a[s:s + c], xs)
    x, ys = run_units(unit, x, run_xs, count, part)
    outs.append(ys)
    start += count
  if len(outs) == 1:
    return x, outs[0]
  return x, jax.tree_util.tree_map(lambda *a: jnp.concatenate(a), *outs)

