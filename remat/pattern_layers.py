"""A pattern's layers laid out one by one (or run by run) under a per-layer rule, off the scan.

:func:`remat.patterns.run_stack` under the ``unrolled``, ``loops`` and
``groups`` layouts hands a per-layer rule here: each layer of the pattern is a
block of :mod:`remat.unrolled`'s loop (:func:`run_layers`), or each run of
consecutive layers of one kind is one scan (:func:`run_runs`), so the backward
pass works one layer at a time, as the user's per-block ``nn.remat`` does.
Segments and mixes keep a repeat of the pattern as their unit
(:mod:`remat.unrolled_blocks`). Kinds are numbered 0..K-1 by the caller.
"""

from __future__ import annotations

from typing import Callable

import jax

from remat import unrolled, unrolled_blocks
from remat.layout import lean_saveable
from remat.policies import Policy
from remat.segments import Unit, checkpointed


def run_layers(steps, x, xs, num_layers: int, policy: Policy, pattern: tuple, layout: str,
                lean: bool):
  """A per-layer rule, unrolled: each layer its own block, as in the user's per-block loop.

  A repeat as one block would keep its layers' saved values together and
  leave XLA free to recompute all of them at once in the backward pass (a
  block's recompute is one straight-line piece); one block per layer puts
  :mod:`remat.unrolled`'s barrier between layers, so the backward pass
  recomputes and differentiates one layer at a time, as ``nn.remat`` on each
  block does.
  """
  kinds, counts = _kinds(pattern, num_layers)
  builders = {k: _layer_of(steps[k], k) for k in counts}
  return unrolled_blocks.run(None, x, xs, counts, num_layers, policy, layout, lean,
                             unit_at=lambda u: builders[kinds[u]])


def run_runs(steps, x, xs, num_layers: int, policy: Policy, pattern: tuple):
  """A per-layer rule as runs of one kind: each run of consecutive layers of a kind one scan.

  Gemma 3's pattern over 12 layers is four blocks of :mod:`remat.unrolled`'s
  loop: five local layers scanned, the global layer, five local layers
  scanned, the global layer. Each layer is in ``jax.checkpoint`` with the rule
  (for ``none`` the lean rule, since a scan's saved values are its outputs), so
  the backward pass works one layer at a time; and, unlike a scan over
  repeats, no gradient or saved value is stacked per repeat and copied between
  the loop and its layers' own stacks.
  """
  rule = policy._layer_policy()
  kinds, counts = _kinds(pattern, num_layers)
  blocks, start, cache = [], 0, {}
  while start < num_layers:
    kind, length = kinds[start], 1
    while start + length < num_layers and kinds[start + length] == kind:
      length += 1
    key = (kind, length > 1)
    if key not in cache:
      cache[key] = (_run_of(steps[kind], kind, rule or lean_saveable) if length > 1
                    else _layer_of(steps[kind], kind)(rule, False))
    blocks.append(unrolled.Block(start, length, cache[key], 'rule', rule is not None or length > 1,
                                  rule is not None))
    start += length
  return unrolled.run(blocks, x, xs, counts)


def _kinds(pattern: tuple, num_layers: int) -> tuple[list, dict]:
  """Each layer's kind, and per kind the items of each layer (1 where it is that kind, else 0)."""
  kinds = [pattern[i % len(pattern)] for i in range(num_layers)]
  return kinds, {k: [int(kind == k) for kind in kinds] for k in dict.fromkeys(pattern)}


def _run_of(step: Callable, kind, rule) -> Callable:
  """Consecutive layers of one kind as a scan over their ``[length, ...]`` inputs."""
  layer = checkpointed(step, rule, False)

  def run(x, view):
    x, ys = jax.lax.scan(layer, x, view[kind])
    return x, {kind: ys}
  return run


def _layer_of(step: Callable, kind) -> Unit:
  """One layer of kind ``kind`` as a unit whose inputs and outputs are keyed by kind."""
  def unit(rule, prevent_cse: bool, flat: bool = False) -> Callable:
    layer = checkpointed(step, rule, prevent_cse)

    def run(x, view):
      x, y = layer(x, view[kind])
      return x, {kind: y}
    return run
  return unit
