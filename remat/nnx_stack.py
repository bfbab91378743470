"""The Flax NNX front door: a stack of identical NNX blocks under a remat policy.

:class:`NNXStack` creates its N blocks with ``nnx.vmap`` (parameters stacked
``[N, ...]``, each layer initialised from its own split of ``rngs``), and at
call time splits them into a graph definition and stacked state and runs them
through :func:`remat.segments.run_units`, the one implementation of
the policies shared with the linen and plain-JAX front doors. Variables other
than ``nnx.Param`` (BatchNorm statistics, RNG counters) come back from each
layer as scan outputs and are written back into the stack, so a block that
keeps its own ``nnx.Rngs`` (``nnx.Dropout(rate, rngs=rngs)``) draws a fresh
mask per layer and per call. An ``nnx.Rngs`` passed to the call is split per
layer instead, for blocks that take ``rngs`` at call time.

A ``pattern`` of block kinds (Gemma 3's local/global) holds each kind's
blocks in ``stack.layers[kind]``, stacked ``[n_kind, ...]``
(:mod:`remat.patterns`).
"""

from __future__ import annotations

import inspect
from typing import Callable, Hashable, Mapping, Sequence

import jax
from flax import nnx

from remat import patterns
from remat.layout import check_layout
from remat.policies import Policy
from remat.stack_checks import (StackSignatureError, check_keywords, check_policy, check_signature,
                                check_stacked, note_layer_call, per_layer_scalars, split_output,
                                takes_rng, trace_layer)

_EXPECTS = ('NNXStack calls block(x[, xs_i], *args[, rng=key][, rngs=nnx.Rngs]) -> y or (y, aux), '
            "with args the stack's extra call arguments")


def _create(make_block: Callable, count: int, rngs: nnx.Rngs) -> nnx.Module:
  @nnx.split_rngs(splits=count)
  @nnx.vmap(in_axes=(0,), out_axes=0, axis_size=count)
  def create(rngs):
    return make_block(rngs)
  return create(rngs)


def _takes(fn: Callable, name: str) -> bool:
  try:
    return name in inspect.signature(fn).parameters
  except (TypeError, ValueError):
    return False


class NNXStack(nnx.Module):
  """``num_layers`` NNX blocks made by ``make_block``, applied in order under ``policy``.

  Example::

      stack = NNXStack(lambda rngs: Block(256, rngs=rngs), 16, 'full@sqrt', rngs=nnx.Rngs(0))
      y = stack(x)

  Attributes:
    layers: the blocks as one module whose state is stacked ``[N, ...]``; with
      a pattern, an ``nnx.Dict`` kind -> such a module of that kind's blocks.
    num_layers: N.
    policy: the :class:`~remat.policies.Policy`.
    pattern: the pattern of kinds, or None.
  """

  def __init__(self, make_block: Callable[[nnx.Rngs], nnx.Module] | Mapping[str, Callable],
               num_layers: int, policy: Policy | str = 'none', *, rngs: nnx.Rngs,
               strict: bool = True, pattern: Sequence[Hashable] | None = None,
               layout: str = 'auto'):
    """Creates the stack.

    Args:
      make_block: ``make_block(rngs) -> block``; called once per layer under
        ``nnx.vmap``. The block is ``__call__(x, *args) -> y`` or ``-> (y, aux)``
        (``__call__(x, xs_i, *args)`` when the stack is called with ``xs``),
        ``y`` shaped like ``x`` unless N is 1; with a parameter named ``rng``
        it gets its layer's dropout key, with one named ``rngs`` an
        ``nnx.Rngs`` of its own split of the call's ``rngs``. With a
        ``pattern``: a mapping kind -> such a function.
      num_layers: N >= 1.
      policy: a :class:`~remat.policies.Policy` or a spec such as ``'full@sqrt'``.
      rngs: split N ways for the layers' initialisation.
      strict: check the policy against this stack alone (segment size within
        1..N, tags the block emits); False for a model whose stacks differ in
        depth or tags, see :class:`remat.LayerStack`.
      pattern: layer i is of kind ``pattern[i % len(pattern)]`` (any hashable
        kinds: strings, enum members); kind k's blocks are ``stack.layers[name]``
        with name :func:`remat.patterns.kind_name` of k (an enum member's
        ``name``), and segmentings count repeats of the pattern
        (:mod:`remat.patterns`).
      layout: how the blocks become a program (:data:`remat.layout.LAYOUTS`):
        'scan', 'unrolled', 'loops', 'groups', or 'auto' (per target and
        policy). The state is the same under every layout.

    Raises:
      PolicyError: a bad spec, layout or a segment size outside 1..N.
      StackSignatureError: a pattern whose kinds do not match ``make_block``'s.
    """
    self.num_layers = num_layers
    self.strict = strict
    self.layout = check_layout(layout)
    if pattern is not None:
      if not isinstance(make_block, Mapping):
        raise StackSignatureError('NNXStack with a pattern takes make_block as a mapping kind -> '
                                  'make_block(rngs)')
      pattern = patterns.check_pattern(pattern, list(make_block), 'NNXStack')
      names = patterns.kind_names(dict.fromkeys(pattern), 'NNXStack')
    self.pattern = pattern
    self.policy = check_policy(policy, patterns.num_units(pattern, num_layers) if strict else None)
    if pattern is None:
      self.layers = _create(make_block, num_layers, rngs)
    else:
      counts = patterns.kind_counts(pattern, num_layers)
      self.layers = nnx.Dict({names[k]: _create(make_block[k], counts[k], rngs) for k in counts})

  def __call__(self, x, *args, xs=None, rng: jax.Array | None = None,
               rngs: nnx.Rngs | None = None, xs_kwargs=None):
    """Runs the stack.

    Args:
      x: the input, carried from block to block.
      *args: passed to every block after ``x`` (a mask, positions, a flag).
      xs: per-layer inputs stacked ``[N, ...]`` (a KV cache); block i gets its
        slice after ``x``. With a pattern, a mapping kind -> ``[n_kind, ...]``.
      rng: one dropout key; layer i gets the i-th of ``jax.random.split(rng, N)``
        whatever the segmenting (None: blocks get ``rng=None``).
      rngs: an ``nnx.Rngs`` for blocks that take ``rngs`` at call time: one key
        is drawn from each of its streams and split N ways, so layer i gets
        ``nnx.Rngs`` of the i-th keys, whatever the segmenting.
      xs_kwargs: per-layer inputs passed by keyword, ``{name: stacked [N, ...]}``
        (a list of N numbers is stacked into an array); with a pattern, a
        mapping kind -> such a mapping. Each name must be a keyword parameter
        of the block.

    Returns:
      ``y``, or ``(y, aux)`` with every block's ``aux`` stacked ``[N, ...]``
      (with a pattern, a mapping kind name -> ``[n_kind, ...]``) when the block
      returns one that is not None: per-layer outputs such as an updated cache.

    Raises:
      PolicyError: a ``names:``/``offload:`` tag the block does not emit.
      StackSignatureError: a block that cannot be called as above, or state or
        ``xs`` not stacked ``[N, ...]`` (an unstacked state loaded into the stack).
    """
    n, policy, pattern = self.num_layers, self.policy, self.pattern
    xs, xs_kwargs = per_layer_scalars(xs), per_layer_scalars(xs_kwargs)
    if pattern is None:
      modules, per_layer, counts = {None: self.layers}, {None: xs}, {None: n}
      named = {None: xs_kwargs}
    else:
      modules = {k: self.layers[patterns.kind_name(k)] for k in dict.fromkeys(pattern)}
      per_layer = patterns.by_kind(xs, modules, 'xs', 'NNXStack')
      named = patterns.by_kind(xs_kwargs, modules, 'xs_kwargs', 'NNXStack')
      counts = patterns.kind_counts(pattern, n)
    keys = None if rng is None else jax.random.split(rng, n)
    streams = None
    if rngs is not None:
      streams = {name: jax.random.split(stream(), n) for name, stream in rngs.items()}
    index = None if pattern is None else patterns.kind_indices(pattern, n)
    pick = lambda tree, k: tree if tree is None or k is None else jax.tree_util.tree_map(
        lambda a: a[index[k]], tree)
    steps, stacked, aux, tags = {}, {}, None, set()
    for k, module in modules.items():
      call = type(module).__call__
      with_rng, with_rngs = takes_rng(call), _takes(call, 'rngs')
      if rngs is not None and not with_rngs:
        raise StackSignatureError(f'{_EXPECTS}; rngs= was given but {type(module).__name__}'
                                  '.__call__ has no parameter named rngs')
      kw = {**({'rng': None} if with_rng else {}), **({'rngs': None} if with_rngs else {}),
            **dict.fromkeys(named[k] or ())}
      if named[k] is not None:
        check_keywords(call, named[k], _EXPECTS)
      check_signature(call, (None, x) + ((None,) if per_layer[k] is not None else ()) + args, kw,
                      _EXPECTS)
      graphdef, params, rest = nnx.split(module, nnx.Param, ...)
      where = 'stack.layers' if k is None else f'stack.layers[{patterns.kind_name(k)!r}]'
      check_stacked(params, counts[k], f'{where} params')
      check_stacked(rest, counts[k], f'{where} state')
      if per_layer[k] is not None:
        check_stacked(per_layer[k], counts[k], 'xs' if k is None else f'xs[{k!r}]')
      if named[k] is not None:
        check_stacked(named[k], counts[k], 'xs_kwargs' if k is None else f'xs_kwargs[{k!r}]')
      steps[k] = _step(graphdef, args, with_rng, with_rngs, per_layer[k] is not None, n > 1)
      stacked[k] = (params, rest, pick(keys, k), pick(streams, k), per_layer[k], named[k])
      try:
        (_, (kind_aux, _)), kind_tags = trace_layer(
            steps[k], x, jax.tree_util.tree_map(lambda a: a[0], stacked[k]))
      except Exception as e:
        if not isinstance(e, StackSignatureError):
          note_layer_call(e, 'NNXStack', call, per_layer[k] is not None, named[k])
        raise
      aux = kind_aux if aux is None else aux
      tags |= kind_tags
    if self.strict and policy.uses_tags:
      policy.validate(tags=tags)
    layout = self.layout
    if pattern is None:
      y, (auxs, new_rest) = patterns.run_stack(steps[None], x, stacked[None], n, policy,
                                               layout=layout)
      nnx.update(self.layers, new_rest)
    else:
      y, outs = patterns.run_stack(steps, x, stacked, n, policy, pattern, layout=layout)
      # Keyed by kind name: the outputs are pytrees, and an enum kind need not be orderable.
      auxs = {patterns.kind_name(k): o[0] for k, o in outs.items()}
      for k, o in outs.items():
        nnx.update(modules[k], o[1])
    return y if aux is None else (y, auxs)


def _step(graphdef, args, with_rng: bool, with_rngs: bool, has_xs: bool, many: bool):
  """One block, merged from its slice of the stacked state, called on ``x``."""
  def step(x, sliced):
    layer_params, layer_rest, key, stream_keys, xs_i, kw_i = sliced
    block = nnx.merge(graphdef, layer_params, layer_rest)
    kwargs = {**(kw_i or {}), **({'rng': key} if with_rng else {})}
    if with_rngs:
      kwargs['rngs'] = None if stream_keys is None else nnx.Rngs(**stream_keys)
    out = block(x, *((xs_i,) if has_xs else ()), *args, **kwargs)
    y, aux = split_output(out, x, _EXPECTS, same_shape=many)
    return y, (aux, nnx.split(block, nnx.Param, ...)[2])
  return step
