"""The plain-JAX front door: :func:`scan_layers`, N layers of one function (or a pattern of kinds).

The layers' parameters are stacked ``[N, ...]``; the stack runs through
:func:`remat.patterns.run_stack` and so the one implementation of the policies
(:mod:`remat.segments`) shared with the linen, NNX and Equinox front doors.
"""

from __future__ import annotations

from typing import Callable, Hashable, Mapping, Sequence

import jax

from remat import patterns
from remat.layout import check_layout
from remat.policies import Policy
from remat.stack_checks import (StackSignatureError, check_keywords, check_policy,
                                check_signature, check_stacked, check_swapped, first_layer,
                                note_layer_call, num_stacked, per_layer_scalars, split_output,
                                takes_rng, trace_layer)

_EXPECTS = ('scan_layers calls layer_fn(params, x[, xs_i], *args[, rng=key]) -> y or (y, aux), '
            'with params one slice of stacked_params (and xs_i one of xs)')


def scan_layers(layer_fn: Callable | Mapping[Hashable, Callable], stacked_params, x, *args,
                xs=None, policy: Policy | str = 'none', rng: jax.Array | None = None,
                num_layers: int | None = None, strict: bool = True,
                pattern: Sequence[Hashable] | None = None, xs_kwargs: Mapping | None = None,
                layout: str = 'auto'):
  """Applies N layers that share one function and have stacked parameters, under ``policy``.

  Args:
    layer_fn: ``layer_fn(params, x, *args) -> y`` or ``-> (y, aux)``, where
      ``params`` is one layer's slice of ``stacked_params`` and ``y`` is shaped
      like ``x`` (any shape when N is 1). With ``xs``, ``layer_fn(params, x,
      xs_i, *args)``. If it has a parameter named ``rng``, it gets ``rng=``
      layer i's key (None without ``rng``). With a ``pattern``: a mapping
      kind -> such a function.
    stacked_params: a pytree whose leaves are stacked ``[N, ...]``; with a
      ``pattern``, a mapping kind -> a pytree stacked ``[n_kind, ...]`` (the
      layers of that kind, in order).
    x: the input (an array or a pytree), carried from layer to layer.
    *args: inputs every layer gets unchanged (a mask, positions, a flag).
    xs: per-layer inputs, a pytree stacked ``[N, ...]`` (a KV cache, per-layer
      state); layer i gets its slice after ``x``. With a ``pattern``, a mapping
      kind -> ``[n_kind, ...]``. A layer returning ``(y, ys_i)`` gives ``ys``
      stacked the same way. A list of N Python numbers (a per-layer rate) is
      stacked into an array.
    policy: a :class:`~remat.policies.Policy` or a spec such as ``'full@sqrt'``.
    rng: one key; layer i gets the i-th of ``jax.random.split(rng, N)``,
      whatever the segmenting.
    num_layers: N; checked against the stacked leaves (required only when
      ``stacked_params`` and ``xs`` are empty).
    strict: check the policy against this stack alone (segment size within
      1..N, tags the layer emits); False for a model whose stacks differ in
      depth or tags, see :class:`remat.LayerStack`.
    pattern: layer i is of kind ``pattern[i % len(pattern)]``, e.g.
      ``('local',) * 5 + ('global',)``; segmentings and mix counts then count
      repeats of the pattern (:mod:`remat.patterns`).
    xs_kwargs: per-layer inputs passed by keyword, ``{name: stacked [N, ...]}``:
      layer i is called with ``name=`` its slice (a U-Net block's ``enc=``
      skip, a per-layer drop rate). Each name must be a keyword parameter of
      the layer. With a ``pattern``, a mapping kind -> such a mapping.
    layout: how the layers become a program (:data:`remat.layout.LAYOUTS`):
      'scan', 'unrolled', 'loops', 'groups', or 'auto' (per target and policy).
      The parameters and gradients are the same under every layout.

  Returns:
    ``y``, or ``(y, aux)`` with every layer's ``aux`` stacked ``[N, ...]``
    (with a pattern: a mapping kind -> ``[n_kind, ...]``) when the layer
    returns one that is not None.

  Raises:
    PolicyError: a segment size outside 1..N, or a ``names:``/``offload:`` tag
      that the layer does not emit.
    StackSignatureError: a layer that cannot be called as above (swapped
      arguments included), or a ``num_layers``, ``xs`` or pattern that
      disagrees with the stacked leaves.
  """
  check_layout(layout)
  xs, xs_kwargs = per_layer_scalars(xs), per_layer_scalars(xs_kwargs)
  if pattern is None:
    fns, params, per_layer = {None: layer_fn}, {None: stacked_params}, {None: xs}
    named = {None: xs_kwargs}
    n = _stack_depth(stacked_params, (xs, xs_kwargs), num_layers)
  else:
    if not (isinstance(layer_fn, Mapping) and isinstance(stacked_params, Mapping)):
      raise StackSignatureError('scan_layers with a pattern takes layer_fn and stacked_params as '
                                'mappings kind -> function and kind -> stacked params')
    pattern = patterns.check_pattern(pattern, list(layer_fn), 'scan_layers')
    patterns.check_pattern(pattern, list(stacked_params), 'scan_layers stacked_params')
    if xs is not None and not (isinstance(xs, Mapping) and set(xs) <= set(layer_fn)):
      raise StackSignatureError('scan_layers with a pattern takes xs as a mapping kind -> '
                                'inputs stacked [n_kind, ...]')
    if xs_kwargs is not None and not (isinstance(xs_kwargs, Mapping) and
                                      set(xs_kwargs) <= set(layer_fn)):
      raise StackSignatureError('scan_layers with a pattern takes xs_kwargs as a mapping kind -> '
                                '{name: inputs stacked [n_kind, ...]}')
    fns, params = dict(layer_fn), dict(stacked_params)
    per_layer = {k: None if xs is None else xs.get(k) for k in fns}
    named = {k: None if xs_kwargs is None else xs_kwargs.get(k) for k in fns}
    counts = {k: num_stacked(params[k], f"stacked_params[{k!r}]") for k in fns}
    n = patterns.layers_for(counts, pattern)
    if num_layers is not None and num_layers != n:
      raise StackSignatureError(f'the stack has num_layers={num_layers} but stacked_params holds '
                                f'{n} layers of the pattern; pass num_layers={n}')
  units = patterns.num_units(pattern, n)
  policy = check_policy(policy, units if strict else None)
  counts = {None: n} if pattern is None else patterns.kind_counts(pattern, n)
  keys = None if rng is None else jax.random.split(rng, n)
  index = None if pattern is None else patterns.kind_indices(pattern, n)
  steps, stacked, aux, tags = {}, {}, None, set()
  for kind, fn in fns.items():
    what = 'stacked_params' if kind is None else f'stacked_params[{kind!r}]'
    check_stacked(params[kind], counts[kind], what)
    if per_layer[kind] is not None:
      check_stacked(per_layer[kind], counts[kind], what.replace('stacked_params', 'xs'))
    if named[kind] is not None:
      check_keywords(fn, named[kind], _EXPECTS)
      check_stacked(named[kind], counts[kind], what.replace('stacked_params', 'xs_kwargs'))
    kind_keys = None if keys is None or kind is None else keys[index[kind]]
    step, layer_xs = _plain_step(fn, x, args, per_layer[kind] is not None, n > 1,
                                 tuple(named[kind] or ()))
    stacked[kind] = (params[kind], keys if kind is None else kind_keys, per_layer[kind],
                     named[kind])
    steps[kind] = step
    try:
      (_, kind_aux), kind_tags = trace_layer(step, x, first_layer(stacked[kind]))
    except Exception as e:
      check_swapped(fn, lambda: trace_layer(layer_xs, x, first_layer(stacked[kind])), _EXPECTS)
      if isinstance(e, StackSignatureError) and num_layers is None:
        raise StackSignatureError(
            f'{e} (N={n} was read from the leading axis of {what}; is every leaf stacked '
            '[N, ...]? a per-layer tree is stacked by remat.stack_layers)') from None
      if not isinstance(e, StackSignatureError):
        note_layer_call(e, 'scan_layers', fn, per_layer[kind] is not None, named[kind])
      raise
    aux = kind_aux if aux is None else aux
    tags |= kind_tags
  if strict and policy.uses_tags:
    policy.validate(tags=tags)
  if pattern is None:
    y, auxs = patterns.run_stack(steps[None], x, stacked[None], n, policy, layout=layout)
  else:
    y, auxs = patterns.run_stack(steps, x, stacked, n, policy, pattern, layout=layout)
  return y if aux is None else (y, auxs)


def _stack_depth(stacked_params, xs, num_layers: int | None) -> int:
  """N: ``num_layers``, else the leading axis of the stacked parameters (or of ``xs``)."""
  if num_layers is not None:
    return num_layers
  if jax.tree_util.tree_leaves(stacked_params):
    return num_stacked(stacked_params, 'stacked_params')
  if jax.tree_util.tree_leaves(xs):
    return num_stacked(xs, 'xs')
  raise StackSignatureError('scan_layers needs num_layers when stacked_params and xs are empty')


def _plain_step(layer_fn: Callable, x, args: tuple, has_xs: bool, many: bool,
                names: tuple = ()):
  """(the scan step of ``layer_fn``, the same step with params and x swapped, for diagnosis)."""
  with_rng = takes_rng(layer_fn)
  rng_kw = {'rng': None} if with_rng else {}
  check_signature(layer_fn, (None, x) + ((None,) if has_xs else ()) + args,
                  {**rng_kw, **dict.fromkeys(names)}, _EXPECTS)

  def call(first, second, sliced):
    _, key, xs_i, kw_i = sliced
    more = (xs_i,) if has_xs else ()
    return layer_fn(first, second, *more, *args, **(kw_i or {}),
                    **({'rng': key} if with_rng else {}))

  def step(x, sliced):
    out = call(sliced[0], x, sliced)
    return split_output(out, x, _EXPECTS, same_shape=many)

  def swapped(x, sliced):
    return split_output(call(x, sliced[0], sliced), x, _EXPECTS, same_shape=many)
  return step, swapped
