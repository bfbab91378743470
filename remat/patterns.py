"""A repeating pattern of layer kinds as one stack: Gemma 3's five local + one global layers.

Real models interleave layers that differ: Gemma 3 repeats five sliding-window
(local) layers and one global layer, hybrid models alternate attention and
recurrent or dense and MoE blocks. Each kind has its own function and its own
parameters, stacked ``[n_kind, ...]`` in layer order, and layer ``i`` is of
kind ``pattern[i % len(pattern)]``; N need not be a multiple of the pattern (a
remainder runs the pattern's first ``N % P`` layers).

The front doors (:func:`remat.scan_layers`, :class:`remat.LayerStack`,
:class:`remat.NNXStack`) run such a stack through :func:`run_stack`, which
hands one *repeat* of the pattern to :func:`remat.scan_layers.segmented_scan`
as one step. So the unit of a segmenting (``sqrt``, ``seg:K``, ``stage``) and of
a mix's counts (``2xfull+none``) is one repeat of the pattern, while the
per-layer rule (``full``, ``dots``, ``names:...``) applies to every layer inside
a repeat. A stack without a pattern is handed to ``segmented_scan`` unchanged.
The parameter tree is the same under every policy: only the steps reshape it.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Hashable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from remat.policies import Policy
from remat.scan_layers import StackSignatureError, segmented_scan


def check_pattern(pattern: Sequence[Hashable], kinds: Sequence[Hashable], what: str) -> tuple:
  """The pattern as a tuple, checked against the kinds given; one-line error otherwise."""
  if isinstance(pattern, (str, bytes)) or not isinstance(pattern, Sequence) or not pattern:
    raise StackSignatureError(f'{what}: pattern must be a non-empty sequence of layer kinds '
                              f"such as ('local',) * 5 + ('global',), got {pattern!r:.60}")
  pattern = tuple(pattern)
  missing = [k for k in dict.fromkeys(pattern) if k not in kinds]
  unused = [k for k in kinds if k not in pattern]
  if missing or unused:
    raise StackSignatureError(
        f'{what}: the pattern uses kinds {_names(dict.fromkeys(pattern))} and the stack was '
        f'given kinds {_names(kinds)}' + (f'; missing: {_names(missing)}' if missing else '')
        + (f'; not in the pattern: {_names(unused)}' if unused else ''))
  return pattern


def _names(kinds) -> str:
  return ', '.join(repr(k) for k in kinds)


def kind_counts(pattern: tuple, num_layers: int) -> dict[Hashable, int]:
  """Layers of each kind in a stack of N: ``{'local': 22, 'global': 4}`` for Gemma 3's 26."""
  counts = collections.Counter(pattern[i % len(pattern)] for i in range(num_layers))
  return {k: counts[k] for k in dict.fromkeys(pattern)}


def layers_for(counts: Mapping[Hashable, int], pattern: tuple) -> int:
  """N from the layers of each kind, checked against the pattern; one-line error otherwise."""
  n = sum(counts.values())
  want = kind_counts(pattern, n)
  if dict(counts) != want:
    raise StackSignatureError(
        f'the pattern {pattern!r:.80} over {n} layers has {_counts(want)} layers of each kind; '
        f'the stacked parameters hold {_counts(counts)}')
  return n


def _counts(counts) -> str:
  return ', '.join(f'{k!r}: {v}' for k, v in counts.items())


def num_units(pattern: tuple | None, num_layers: int) -> int:
  """What a segmenting counts: layers; with a pattern, its repeats (and a remainder)."""
  if pattern is None:
    return num_layers
  return -(-num_layers // len(pattern))


def kind_indices(pattern: tuple, num_layers: int) -> dict[Hashable, np.ndarray]:
  """Layer numbers of each kind, in order (to hand layer i's dropout key to its kind)."""
  kinds = [pattern[i % len(pattern)] for i in range(num_layers)]
  return {k: np.array([i for i, kk in enumerate(kinds) if kk == k]) for k in dict.fromkeys(pattern)}


def run_stack(steps: Callable | Mapping[Hashable, Callable], x, xs, num_layers: int,
              policy: Policy, pattern: tuple | None = None):
  """Runs a stack: ``segmented_scan`` without a pattern, one repeat of it per step with one.

  Args:
    steps: ``step(x, xs_i) -> (x, ys_i)``; with a pattern, a mapping kind -> step.
    x: the carry.
    xs: per-layer inputs stacked ``[N, ...]``; with a pattern, a mapping kind ->
      inputs stacked ``[n_kind, ...]`` in layer order.
    num_layers: N.
    policy: the policy (its segmenting and mix counts are in repeats of the pattern).
    pattern: the kind of layer i is ``pattern[i % len(pattern)]``; None for one kind.

  Returns:
    ``(x, ys)``: ``ys`` stacked ``[N, ...]``, or a mapping kind -> ``[n_kind, ...]``.
  """
  if pattern is None:
    return segmented_scan(steps, x, xs, num_layers, policy)
  period = collections.Counter(pattern)
  reps, rem = divmod(num_layers, len(pattern))
  head = pattern[:rem]
  main = {k: jax.tree_util.tree_map(
      lambda a, c=period[k]: a[:reps * c].reshape((reps, c) + a.shape[1:]), xs[k]) for k in period}
  tail = {k: jax.tree_util.tree_map(lambda a, c=period[k]: a[reps * c:], xs[k])
          for k in dict.fromkeys(head)}
  units = reps + (1 if rem else 0)
  parts = policy.layer_split(units) if policy.mixed else [(units, policy)]
  start, main_ys, tail_ys = 0, [], None
  for count, part in parts:
    rule = part._layer_policy()
    # The rule is applied per layer inside a repeat; segmented_scan sees only the segmenting.
    outer = dataclasses.replace(part, rule='none', tags=(), preset='')
    n_main = max(0, min(count, reps - start))
    if n_main:
      part_xs = jax.tree_util.tree_map(lambda a, s=start, c=n_main: a[s:s + c], main)
      x, ys = segmented_scan(_repeat(steps, pattern, rule, n_main == 1), x, part_xs, n_main, outer)
      main_ys.append(ys)
    if count > n_main:  # this part ends with the remainder, run as one more unit
      one = jax.tree_util.tree_map(lambda a: a[None], tail)
      x, ys = segmented_scan(_repeat(steps, head, rule, True), x, one, 1, outer)
      tail_ys = jax.tree_util.tree_map(lambda a: a[0], ys)
    start += count
  ys = {}
  for k, c in period.items():
    pieces = [jax.tree_util.tree_map(lambda a: a.reshape((-1,) + a.shape[2:]), ys_[k])
              for ys_ in main_ys]
    if tail_ys is not None and k in tail_ys:
      pieces.append(tail_ys[k])
    ys[k] = pieces[0] if len(pieces) == 1 else jax.tree_util.tree_map(
        lambda *a: jnp.concatenate(a), *pieces)
  return x, ys


def _repeat(steps: Mapping[Hashable, Callable], kinds: tuple, rule, prevent_cse: bool) -> Callable:
  """One repeat of the pattern as one step; each layer under the per-layer ``rule``."""
  layer = {k: s if rule is None else jax.checkpoint(s, policy=rule, prevent_cse=prevent_cse)
           for k, s in steps.items()}

  def step(x, unit_xs: dict[Hashable, Any]):
    used = collections.Counter()
    outs = {k: [] for k in dict.fromkeys(kinds)}
    for kind in kinds:
      j = used[kind]
      used[kind] += 1
      x, y = layer[kind](x, jax.tree_util.tree_map(lambda a, j=j: a[j], unit_xs[kind]))
      outs[kind].append(y)
    return x, {k: jax.tree_util.tree_map(lambda *a: jnp.stack(a), *v) for k, v in outs.items()}
  return step
