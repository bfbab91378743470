"""A repeating pattern of layer kinds as one stack: Gemma 3's five local + one global layers.

Real models interleave layers that differ: Gemma 3 repeats five sliding-window
(local) layers and one global layer, hybrid models alternate attention and
recurrent or dense and MoE blocks. Each kind has its own function and its own
parameters, stacked ``[n_kind, ...]`` in layer order, and layer ``i`` is of
kind ``pattern[i % len(pattern)]``; N need not be a multiple of the pattern (a
remainder runs the pattern's first ``N % P`` layers).

The front doors (:func:`remat.scan_layers`, :class:`remat.LayerStack`,
:class:`remat.NNXStack`, :func:`remat.eqx.scan_module`) run such a stack
through :func:`run_stack`, which hands one *repeat* of the pattern to
:func:`remat.segments.run_units` as one unit, the same core as a plain stack's
(one layer per unit). So the unit of a segmenting (``sqrt``, ``seg:K``,
``stage``) and of a mix's counts (``2xfull+none``) is one repeat of the
pattern, while the per-layer rule (``full``, ``dots``, ``names:...``, and for
``none`` the lean rule) applies to every layer inside a repeat, and nothing
wraps the repeat itself. Kinds are any hashable values (strings, enums);
:func:`kind_indices` says which layer of the stack each kind's slice i is.
The parameter tree is the same under every policy: only the steps reshape it.
"""

from __future__ import annotations

import collections
import collections.abc
import dataclasses
import enum
from typing import Any, Callable, Hashable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from remat.policies import Policy, sqrt_segment_size
from remat import pattern_layers, stored_scan, unrolled_blocks
from remat.layout import active_reference, has_loop, lean_saveable, resolve_layout
from remat.segments import Unit, checkpointed, layer_unit, run_units
from remat.stack_checks import StackSignatureError


def check_pattern(pattern: Sequence[Hashable], kinds: Sequence[Hashable], what: str) -> tuple:
  """The pattern as a tuple, checked against the kinds given; one-line error otherwise."""
  if isinstance(pattern, (str, bytes)) or not isinstance(pattern, Sequence) or not pattern:
    raise StackSignatureError(f'{what}: pattern must be a non-empty sequence of layer kinds '
                              f"such as ('local',) * 5 + ('global',), got {pattern!r:.60}")
  pattern = tuple(pattern)
  for k in pattern:
    if not isinstance(k, collections.abc.Hashable):
      raise StackSignatureError(f'{what}: pattern kinds must be hashable (strings, enum members), '
                                f'got {type(k).__name__} {k!r:.40}')
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


def kind_name(kind: Hashable) -> str:
  """The name a kind's variables are stored under: a string itself, an enum member its ``name``.

  Any other hashable kind is named ``str(kind)``. The linen and NNX stacks
  store each kind's stacked variables under this name (``<stack>/<name>``,
  ``stack.layers[name]``); the plain-JAX front door keys by the kinds themselves.
  """
  if isinstance(kind, str):
    return kind
  if isinstance(kind, enum.Enum):
    return kind.name
  return str(kind)


def kind_names(kinds, what: str) -> dict[Hashable, str]:
  """Each kind's :func:`kind_name`, checked to be distinct; one-line error otherwise."""
  names = {k: kind_name(k) for k in kinds}
  seen = {}
  for k, name in names.items():
    if name in seen:
      raise StackSignatureError(f'{what}: kinds {seen[name]!r} and {k!r} are both named '
                                f"{name!r}; give the kinds distinct names (strings or enum members)")
    seen[name] = k
  return names


def by_kind(mapping: Mapping | None, kinds, what: str, door: str) -> dict:
  """A per-kind mapping given by the user (``xs``, ``xs_kwargs``) keyed by kind, None where absent.

  Keys may be the kinds themselves or their :func:`kind_name` (an enum member's
  name), so a mapping of strings works for enum kinds too; one-line error for
  anything else.
  """
  if mapping is None:
    return {k: None for k in kinds}
  names = {kind_name(k): k for k in kinds}
  if not isinstance(mapping, Mapping) or any(k not in kinds and k not in names for k in mapping):
    raise StackSignatureError(f'{door} with a pattern takes {what} as a mapping kind -> inputs '
                              f'stacked [n_kind, ...], with kinds among '
                              f'{", ".join(repr(k) for k in kinds)}')
  return {k: mapping.get(k, mapping.get(kind_name(k))) for k in kinds}


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


def kind_indices(pattern: Sequence[Hashable], num_layers: int) -> dict[Hashable, np.ndarray]:
  """Which layer of the stack each kind's slice i is: ``{kind: layer numbers, in order}``.

  Layer ``i`` is of kind ``pattern[i % len(pattern)]``, and a kind's stacked
  parameters hold its layers in stack order, so the kind's slice ``j`` is
  layer ``kind_indices(pattern, N)[kind][j]`` of the model. For Gemma 3's
  pattern over 12 layers: ``{'local': [0 1 2 3 4 6 7 8 9 10], 'global': [5 11]}``.
  :func:`remat.stack_layers` with ``pattern=`` uses it to stack a per-layer
  checkpoint by kind.
  """
  pattern = tuple(pattern)
  kinds = [pattern[i % len(pattern)] for i in range(num_layers)]
  return {k: np.array([i for i, kk in enumerate(kinds) if kk == k], dtype=np.int64)
          for k in dict.fromkeys(pattern)}


def run_stack(steps: Callable | Mapping[Hashable, Callable], x, xs, num_layers: int,
              policy: Policy, pattern: tuple | None = None, layout: str = 'scan'):
  """Runs a stack: one layer per unit without a pattern, one repeat of it per unit with one.

  Under the ``scan`` layout both go through :func:`remat.segments.run_units`,
  which applies the per-layer rule to every layer of a unit and segments over
  units, so a pattern honours every spec exactly as a plain stack does; the
  other layouts through :mod:`remat.unrolled_blocks`: under a per-layer rule a
  pattern's layers are then blocks of their own (``unrolled``, ``loops``) or
  runs of one kind (``groups``), as in the user's per-block loop; segments and
  mixes keep repeats as units. Inside
  :func:`remat.layout.unrolled_reference` or
  :func:`remat.layout.per_block_reference` the stack is the user's Python loop
  under the reference's rule, whatever ``policy`` and ``layout`` say.

  Args:
    steps: ``step(x, xs_i) -> (x, ys_i)``; with a pattern, a mapping kind -> step.
    x: the carry.
    xs: per-layer inputs stacked ``[N, ...]``; with a pattern, a mapping kind ->
      inputs stacked ``[n_kind, ...]`` in layer order.
    num_layers: N.
    policy: the policy (its segmenting and mix counts are in repeats of the pattern).
    pattern: the kind of layer i is ``pattern[i % len(pattern)]``; None for one kind.
    layout: 'scan', 'unrolled', 'loops', 'groups' or 'auto' (:mod:`remat.layout`:
      chosen here, per target and policy).

  Returns:
    ``(x, ys)``: ``ys`` stacked ``[N, ...]``, or a mapping kind -> ``[n_kind, ...]``.
  """
  lean = True
  layout = resolve_layout(layout, policy, num_units(pattern, num_layers),
                          pattern=pattern is not None,
                          inner_loop=lambda: _inner_loop(steps, x, xs, pattern),
                          stored=lambda: stored_scan.applies(x, xs))
  reference = active_reference()
  if reference is not None:   # a yardstick: the user's loop, per-layer checkpoints of its rule
    policy, layout, lean = reference, 'unrolled', False
  if pattern is None:
    if layout != 'scan':
      return unrolled_blocks.run_plain(layer_unit(steps), x, xs, num_layers, policy, layout, lean)
    return run_units(layer_unit(steps), x, xs, num_layers, policy)
  # Kinds become their numbers inside: the mappings below are pytrees, whose keys JAX sorts, and
  # an enum member (a kind) need not be orderable.
  kinds = list(dict.fromkeys(pattern))
  number = {k: i for i, k in enumerate(kinds)}
  steps = {number[k]: s for k, s in steps.items()}
  xs = {number[k]: v for k, v in xs.items()}
  pattern = tuple(number[k] for k in pattern)
  if layout != 'scan':
    x, ys = _run_pattern_blocks(steps, x, xs, num_layers, policy, pattern, layout, lean)
  else:
    x, ys = _run_pattern(steps, x, xs, num_layers, policy, pattern)
  return x, {kinds[i]: v for i, v in ys.items()}


def _inner_loop(steps, x, xs, pattern) -> bool:
  """Whether a layer of the stack runs a loop of its own (traced on its first slice)."""
  first = lambda t: jax.tree_util.tree_map(lambda a: a[0], t)
  if pattern is None:
    return has_loop(steps, x, first(xs))
  return any(has_loop(steps[k], x, first(xs[k])) for k in dict.fromkeys(pattern))


def _run_pattern_blocks(steps, x, xs, num_layers: int, policy: Policy, pattern: tuple,
                        layout: str, lean: bool):
  """:func:`run_stack` with a pattern under a layout other than the scan."""
  if not policy.mixed and not policy.segmented:
    if layout == 'groups':
      return pattern_layers.run_runs(steps, x, xs, num_layers, policy, pattern)
    return pattern_layers.run_layers(steps, x, xs, num_layers, policy, pattern, layout, lean)
  period = collections.Counter(pattern)
  reps, rem = divmod(num_layers, len(pattern))
  head = collections.Counter(pattern[:rem])
  units = reps + (1 if rem else 0)
  counts = {k: [c] * reps + ([head[k]] if rem else []) for k, c in period.items()}
  return unrolled_blocks.run(repeat_unit(steps, pattern), x, xs, counts, units, policy, layout,
                             lean, tail_unit=repeat_unit(steps, pattern[:rem]) if rem else None)


def _run_pattern(steps, x, xs, num_layers: int, policy: Policy, pattern: tuple):
  """:func:`run_stack` with a pattern, its kinds numbered 0..K-1."""
  period = collections.Counter(pattern)
  reps, rem = divmod(num_layers, len(pattern))
  head = pattern[:rem]
  in_head = collections.Counter(head)
  main = {k: jax.tree_util.tree_map(lambda a, c=c: _group(a[:reps * c], reps, c), xs[k])
          for k, c in period.items()}
  tail = {k: jax.tree_util.tree_map(
      lambda a, s=reps * period[k], c=c: _group(a[s:s + c], 1, c)[0], xs[k])
      for k, c in in_head.items()}
  units = reps + (1 if rem else 0)
  parts = policy.layer_split(units) if policy.mixed else [(units, policy)]
  start, main_ys, tail_ys = 0, [], None
  for count, part in parts:
    part = _fixed_segments(part, count)
    n_main = max(0, min(count, reps - start))
    if n_main:
      part_xs = jax.tree_util.tree_map(lambda a, s=start, c=n_main: a[s:s + c], main)
      x, ys = run_units(repeat_unit(steps, pattern), x, part_xs, n_main, part)
      main_ys.append(ys)
    if count > n_main:  # this part ends with the remainder, run as one more unit
      one = jax.tree_util.tree_map(lambda a: a[None], tail)
      x, ys = run_units(repeat_unit(steps, head), x, one, 1, part)
      tail_ys = ys
    start += count
  ys = {}
  for k, c in period.items():
    pieces = [jax.tree_util.tree_map(lambda a, c=c: _ungroup(a, c), ys_[k]) for ys_ in main_ys]
    if tail_ys is not None and k in tail_ys:
      pieces.append(jax.tree_util.tree_map(lambda a, c=in_head[k]: _ungroup(a, c), tail_ys[k]))
    ys[k] = pieces[0] if len(pieces) == 1 else jax.tree_util.tree_map(
        lambda *a: jnp.concatenate(a), *pieces)
  return x, ys


def _group(a, reps: int, count: int):
  """A kind's ``[reps * count, ...]`` inputs as ``[reps, count, ...]``, or ``[reps, ...]`` for one.

  No axis of size 1 for a kind that occurs once per repeat: XLA's CPU layouts
  made ``[reps, 1, ...]`` a copy of the stack's parameters (a 12-layer
  two-kind stack under ``full``: 368 KiB temp against 176 KiB).
  """
  return a if count == 1 else a.reshape((reps, count) + a.shape[1:])


def _ungroup(a, count: int):
  """Inverse of :func:`_group` for a per-unit output stacked ``[U, ...]``."""
  return a if count == 1 else a.reshape((-1,) + a.shape[2:])


def _fixed_segments(part: Policy, units: int) -> Policy:
  """``part`` with ``sqrt`` resolved over all of its units, the remainder repeat included.

  The full repeats and a remainder run as two calls, and ``sqrt`` of the
  first alone could pick another size than ``sqrt`` of the whole part.
  """
  if part.segment != 'sqrt':
    return part
  return dataclasses.replace(part, segment=sqrt_segment_size(units))


def repeat_unit(steps: Mapping[Hashable, Callable], kinds: tuple) -> Unit:
  """One repeat of the pattern (``kinds``, in order) as one unit of :func:`run_units`.

  The unit's step takes the repeat's inputs as a mapping kind -> ``[c_kind, ...]``
  (a kind that occurs once: its one layer's inputs, no such axis) and runs each
  layer under the per-layer rule it is given, so ``full`` in a repeat saves only
  each layer's input, as in a plain stack. A run of consecutive layers that
  holds all of its kind's layers in the repeat (Gemma 3's five local layers) is
  an inner ``lax.scan`` under a rule that recomputes matmuls (``full``,
  ``names:``, ``dots_no_batch``): inside a loop each layer's checkpoint holds on
  XLA's CPU backend, and the repeat's backward pass works on one of those
  layers at a time rather than holding all of their temporaries at once (the
  Gemma 3-style decoder of tests/public_models/gemma3.py under ``full``: 0.57x
  -> 0.18x its untouched model on CPU, 0.37x -> 0.24x on the H200 plan). (A loop of one
  iteration around each other layer was measured to cost more than it saves:
  264 -> 329 KiB on the two-kind toy of tests/test_patterns.py.)
  """
  per_repeat = collections.Counter(kinds)
  runs = []   # (kind, first index within the kind, length)
  for kind in kinds:
    if runs and runs[-1][0] == kind:
      runs[-1][2] += 1
    else:
      runs.append([kind, sum(r[2] for r in runs if r[0] == kind), 1])

  def unit(rule, prevent_cse: bool, flat: bool = False) -> Callable:
    order = []
    inner = not flat and rule not in _KEEP_MATMULS
    for kind, first, length in runs:
      if inner and length > 1 and length == per_repeat[kind]:
        order.append((kind, True, _scanned(steps[kind], rule)))
        continue
      for j in range(first, first + length):
        # Layer j of a kind reads its slice inside its checkpoint: a slice taken outside would be
        # a new value saved for the backward pass, a copy of the stack's parameters, where the
        # kind's inputs are the loop's own inputs and cost nothing to keep.
        step = steps[kind] if per_repeat[kind] == 1 else _sliced(steps[kind], j)
        order.append((kind, False, checkpointed(step, rule, prevent_cse)))

    def step(x, unit_xs: dict[Hashable, Any]):
      outs = {k: [] for k in per_repeat}
      for kind, whole, layer in order:
        x, y = layer(x, unit_xs[kind])
        outs[kind].append(y)
      return x, {k: _join(v, per_repeat[k], whole) for (k, v), whole in
                 zip(outs.items(), [_is_whole(order, k) for k in outs])}
    return step
  return unit


# Rules that keep every matmul output: their saved values are large, and an inner loop stacks
# them per repeat, which the H200 plan copies into each repeat's backward pass (a Gemma 3-style
# decoder, tests/public_models/gemma3.py: none 1.07x -> 1.19x its untouched model); with little
# to recompute, the loop's one-layer-at-a-time backward saves less than that.
_KEEP_MATMULS = (lean_saveable, jax.checkpoint_policies.dots_saveable)


def _is_whole(order, kind) -> bool:
  return any(k == kind and whole for k, whole, _ in order)


def _join(ys: list, count: int, whole: bool):
  """A kind's per-layer outputs in one repeat: ``[count, ...]``, or the one layer's for count 1."""
  if whole:
    return ys[0]
  if count == 1:
    return ys[0]
  return jax.tree_util.tree_map(lambda *a: jnp.stack(a), *ys)


def _scanned(step: Callable, rule) -> Callable:
  """A kind's layers of one repeat as an inner loop over their ``[c_kind, ...]`` inputs."""
  layer = checkpointed(step, rule, False)
  return lambda x, kind_xs: jax.lax.scan(layer, x, kind_xs)


def _sliced(step: Callable, j: int) -> Callable:
  return lambda x, kind_xs: step(x, jax.tree_util.tree_map(lambda a: a[j], kind_xs))
