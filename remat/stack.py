"""The linen front door: a stack of identical Flax linen blocks under a remat policy.

:class:`LayerStack` stores the blocks' variables stacked, ``[N, ...]`` per
leaf, under ``<stack>/block``, and runs them through
:func:`remat.segments.run_units`, the one implementation of the
policies shared with the NNX and plain-JAX front doors. It applies the
block functionally (``block.apply`` on layer i's slice of the variables), so:

* **One parameter tree.** Every policy reads the same ``[N, ...]`` variables;
  a segmented policy reshapes them only inside the step, so a checkpoint
  written under one policy loads under any other. Initialisation always takes
  the plain per-layer ``nn.scan`` path, so the same seed gives the same
  initial weights under every policy.
* **One dropout stream.** Layer ``i`` gets the i-th of N keys split from one
  ``make_rng('dropout')`` call of the stack, whatever the segmenting, as its
  ``rng`` argument and as its 'dropout' RNG.
* **Mutable state** (BatchNorm's ``batch_stats``) comes back from each layer
  as a scan output and is written back stacked.

* **Partitioned parameters** (``nn.with_logical_partitioning``) keep their
  names with a new leading axis name (``partition_name``, 'layers'), as
  ``nn.scan(metadata_params={nn.PARTITION_NAME: ...})`` gives them, so
  ``nn.get_partition_spec`` and mesh sharding work on the stacked tree.
  Parameters partitioned by *mesh* axis names (``nn.with_partitioning``) need
  ``partition_name=None``: the layer axis is then unsharded, where 'layers'
  would name a mesh axis that does not exist.

A block is ``__call__(self, x, *args) -> y`` or ``-> (y, aux)``; ``args`` are
the stack's extra call arguments, the same for every layer (a mask, positions,
a flag). With per-layer inputs ``xs`` (a KV cache) the block is
``__call__(self, x, xs_i, *args)``. A block with a parameter named ``rng``
gets its dropout key there (None when deterministic). A ``pattern`` of block
kinds (Gemma 3's local/global) stores each kind under ``<stack>/<kind>``
(:mod:`remat.patterns`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Hashable, Mapping, Sequence

import flax.linen as nn
import jax

from remat import patterns
from remat.layout import check_layout
from remat.policies import Policy
from remat.stack_checks import (StackSignatureError, check_keywords, check_policy, check_signature,
                                check_stacked, note_layer_call, per_layer_scalars, split_output,
                                takes_rng, trace_layer)

_EXPECTS = ('LayerStack calls block(x[, xs_i], *args[, rng=key]) -> y or (y, aux), with args the '
            "stack's extra call arguments")


class _InitBody(nn.Module):
  """One layer as an ``nn.scan`` body, used only to create the stacked variables.

  ``share_scope`` keeps the block's variables directly under the scan, so they
  are ``<stack>/block/...``. With ``scan_x`` the input is a scanned slice
  rather than the carry, so a one-layer stack may change the shape.
  """
  block_cls: Any
  block_kwargs: Mapping[str, Any]
  with_rng: bool
  scan_x: bool
  same_shape: bool
  has_xs: bool

  @nn.compact
  def __call__(self, carry, inputs, args):
    x_in, key, xs_i, kw_i = inputs
    x = x_in if self.scan_x else carry
    # An explicit name: the automatic one (ClassName_0) would clash with a child of the same
    # class inside the shared scope (a block `Dense` holding an nn.Dense).
    block = self.block_cls(**self.block_kwargs, name='remat_stacked_block')
    nn.share_scope(self, block)
    more = (xs_i,) if self.has_xs else ()
    out = block(x, *more, *args, **(kw_i or {}), **({'rng': key} if self.with_rng else {}))
    y, aux = split_output(out, x, _EXPECTS, same_shape=self.same_shape)
    return (carry, (y, aux)) if self.scan_x else (y, aux)


def _is_box(a) -> bool:
  return isinstance(a, nn.meta.AxisMetadata)


class LayerStack(nn.Module):
  """Applies ``num_layers`` copies of ``block_cls`` under ``policy``.

  Attributes:
    block_cls: a Flax linen module class with ``__call__(x, *args) -> y`` or
      ``-> (y, aux)`` (``__call__(x, xs_i, *args)`` when called with ``xs``);
      ``y`` has the shape of ``x`` unless ``num_layers`` is 1. With a
      ``pattern``: a mapping kind -> module class.
    num_layers: N, any N >= 1 (``sqrt`` with prime N gives a remainder segment).
    policy: a :class:`~remat.policies.Policy` or a spec such as ``'full@sqrt'``.
    block_kwargs: constructor arguments of the block (its config, flags); with a
      ``pattern``, a mapping kind -> such arguments (kinds left out get none).
    strict: check the policy against this stack alone: a segment size within
      1..N and ``names:``/``offload:`` tags that this block emits. Set False in a
      model whose stacks differ in depth or tags (a ResNet: one-block stacks, a
      ``shortcut`` only in first blocks) and check the model once instead:
      ``get_policy(spec, num_layers=deepest, tags=remat.tags.emitted_tags(...))``;
      a segment larger than a stack is then one segment of that stack.
    pattern: layer i is of kind ``pattern[i % len(pattern)]``, e.g.
      ``('local',) * 5 + ('global',)``; kinds are any hashable values (strings,
      enum members), and each kind's variables are stacked ``[n_kind, ...]``
      under ``<stack>/<name>`` (:func:`remat.patterns.kind_name`: a string
      itself, an enum member its ``name``). Segmentings count repeats of the
      pattern (:mod:`remat.patterns`).
    partition_name: the axis name given to the new leading layer axis of
      partitioned variables: a logical name for ``nn.with_logical_partitioning``
      ('layers'), or None for ``nn.with_partitioning``'s mesh axis names (the
      layer axis then stays unsharded).
    layout: how the blocks become a program (:data:`remat.layout.LAYOUTS`):
      'scan', 'unrolled', 'loops', 'groups', or 'auto' (per target and
      policy). The variables are the same under every layout.

  The stacked variables live under ``<this module>/block`` (``<this module>/<kind>``
  with a pattern).
  """
  block_cls: Any
  num_layers: int
  policy: Policy | str
  block_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  strict: bool = True
  pattern: Sequence[Hashable] | None = None
  partition_name: str | None = 'layers'
  layout: str = 'auto'

  @nn.compact
  def __call__(self, x, *args, xs=None, deterministic: bool = True, xs_kwargs=None):
    """Runs the stack.

    Args:
      x: the input, carried from block to block.
      *args: passed to every block after ``x`` (a mask, positions, a flag).
      xs: per-layer inputs stacked ``[N, ...]`` (a KV cache); block i gets its
        slice after ``x``. With a pattern, a mapping kind -> ``[n_kind, ...]``.
      deterministic: if False, draws the blocks' dropout keys from the 'dropout' RNG.
      xs_kwargs: per-layer inputs passed by keyword, ``{name: stacked [N, ...]}``
        (a U-Net block's ``enc=`` skip, a per-layer drop rate: a list of N
        numbers is stacked into an array); with a pattern, a mapping kind ->
        such a mapping. Each name must be a keyword parameter of the block.

    Returns:
      ``y``, or ``(y, aux)`` with every block's ``aux`` stacked ``[N, ...]``
      (with a pattern, a mapping kind name -> ``[n_kind, ...]``) when the block
      returns one that is not None: per-layer outputs such as an updated cache.

    Raises:
      PolicyError: a segment size outside 1..N, or a ``names:``/``offload:``
        tag the block does not emit.
      StackSignatureError: a block that cannot be called as above, or variables
        or ``xs`` not stacked ``[N, ...]`` (a ``num_layers`` that disagrees with
        them, an unstacked checkpoint).
    """
    n, pattern = self.num_layers, self.pattern
    check_layout(self.layout)
    xs, xs_kwargs = per_layer_scalars(xs), per_layer_scalars(xs_kwargs)
    if pattern is None:
      classes, kwargs, per_layer = {'block': self.block_cls}, {'block': self.block_kwargs}, \
          {'block': xs}
      named = {'block': xs_kwargs}
    else:
      if not isinstance(self.block_cls, Mapping):
        raise StackSignatureError('LayerStack with a pattern takes block_cls as a mapping kind -> '
                                  'linen Module class')
      pattern = patterns.check_pattern(pattern, list(self.block_cls), 'LayerStack')
      classes = dict(self.block_cls)
      kwargs = {k: dict(self.block_kwargs.get(k, {})) for k in classes}
      per_layer = patterns.by_kind(xs, classes, 'xs', 'LayerStack')
      named = patterns.by_kind(xs_kwargs, classes, 'xs_kwargs', 'LayerStack')
    names = {'block': 'block'} if pattern is None else patterns.kind_names(classes, 'LayerStack')
    policy = check_policy(self.policy, patterns.num_units(pattern, n) if self.strict else None)
    counts = {'block': n} if pattern is None else patterns.kind_counts(pattern, n)
    for cls in classes.values():
      if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f'LayerStack needs a linen Module class as block_cls, got {cls!r:.80}')
    with_rng = {k: takes_rng(c.__call__) for k, c in classes.items()}
    for k, cls in classes.items():
      if named[k] is not None:
        check_keywords(cls.__call__, named[k], _EXPECTS)
        check_stacked(named[k], counts[k], 'xs_kwargs' if pattern is None else f'xs_kwargs[{k!r}]')
      check_signature(cls.__call__, (None, x) + ((None,) if per_layer[k] is not None else ())
                      + args, {**({'rng': None} if with_rng[k] else {}),
                               **dict.fromkeys(named[k] or ())}, _EXPECTS)
      if per_layer[k] is not None:
        check_stacked(per_layer[k], counts[k], 'xs' if pattern is None else f'xs[{k!r}]')
    keys = None
    if not deterministic:
      keys = jax.random.split(self.make_rng('dropout'), n)
    kind_keys = {'block': keys} if pattern is None or keys is None else {
        k: keys[i] for k, i in patterns.kind_indices(pattern, n).items()}
    if self.is_initializing():
      outs = {k: self._init(names[k], classes[k], kwargs[k], counts[k], x, args,
                            kind_keys.get(k), per_layer[k], named[k], with_rng[k])
              for k in classes}
      if pattern is None:
        return outs['block']
    return self._apply(classes, names, kwargs, counts, with_rng, kind_keys, per_layer, named, x,
                       args, policy, pattern)

  def _apply(self, classes, names, kwargs, counts, with_rng, kind_keys, per_layer, named, x, args,
             policy, pattern):
    n = self.num_layers
    steps, stacked, mutable, boxes, aux, tags = {}, {}, {}, {}, None, set()
    for k, cls in classes.items():
      block = cls(**kwargs[k], parent=None)  # unbound: applied functionally
      name = names[k]
      boxed = {col: tree[name] for col, tree in self.variables.items() if name in tree}
      for col, tree in boxed.items():
        check_stacked(nn.meta.unbox(tree), counts[k], "/".join((col,) + self.scope.path + (name,)))
      boxes[k] = boxed
      variables = nn.meta.unbox(boxed)
      mutable[k] = [c for c in variables if c != 'params' and self.is_mutable_collection(c)]
      steps[k] = _step(block, args, with_rng[k], per_layer[k] is not None, mutable[k], n > 1)
      stacked[k] = (variables, kind_keys.get(k), per_layer[k], named[k])
      try:
        (_, (kind_aux, _)), kind_tags = trace_layer(
            steps[k], x, jax.tree_util.tree_map(lambda a: a[0], stacked[k]))
      except Exception as e:
        if not isinstance(e, StackSignatureError):
          note_layer_call(e, f'LayerStack {self.name!r}', cls.__call__, per_layer[k] is not None,
                          named[k])
        raise
      aux = kind_aux if aux is None else aux
      tags |= kind_tags
    if self.strict and policy.uses_tags:
      policy.validate(tags=tags)
    layout = self.layout
    if pattern is None:
      y, (auxs, new) = patterns.run_stack(steps['block'], x, stacked['block'], n, policy,
                                          layout=layout)
      auxs, new = {'block': auxs}, {'block': new}
    else:
      y, outs = patterns.run_stack(steps, x, stacked, n, policy, pattern, layout=layout)
      # Keyed by kind name: the outputs are pytrees, and an enum kind need not be orderable.
      auxs = {names[k]: o[0] for k, o in outs.items()}
      new = {k: o[1] for k, o in outs.items()}
    if not self.is_initializing():  # init keeps the initial statistics, as nn.scan's init does
      for k in classes:
        for col in mutable[k]:
          old = boxes[k][col]
          self.put_variable(col, names[k], jax.tree_util.tree_map(
              lambda o, v: o.replace_boxed(v) if _is_box(o) else v, old, new[k][col],
              is_leaf=_is_box))
    if aux is None:
      return y
    return (y, auxs['block']) if pattern is None else (y, auxs)

  def _init(self, name, block_cls, block_kwargs, count, x, args, keys, xs, kw, with_rng: bool):
    # The plain per-layer path under every policy: the same seed gives the same weights.
    one = self.num_layers == 1
    body = nn.scan(_InitBody, variable_axes={True: 0}, split_rngs={'params': True},
                   in_axes=(0, nn.broadcast), length=count,
                   metadata_params={nn.PARTITION_NAME: self.partition_name})
    stack = body(block_cls=block_cls, block_kwargs=block_kwargs, with_rng=with_rng,
                 scan_x=one, same_shape=not one, has_xs=xs is not None, name=name)
    if one:
      _, (y, aux) = stack(None, (x[None], keys, xs, kw), args)
      y = y[0]
    else:
      y, aux = stack(x, (None, keys, xs, kw), args)
    return y if aux is None else (y, aux)


def _step(block, args, with_rng: bool, has_xs: bool, mutable: list, many: bool):
  """One layer of ``block`` applied functionally to its slice (variables, key, xs_i)."""
  def step(x, sliced):
    layer_vars, key, xs_i, kw_i = sliced
    kwargs = {**(kw_i or {}), **({'rng': key} if with_rng else {})}
    rngs = None if key is None else {'dropout': key}
    more = (xs_i,) if has_xs else ()
    out = block.apply(layer_vars, x, *more, *args, **kwargs, rngs=rngs, mutable=mutable or False)
    out, new = out if mutable else (out, {})
    y, aux = split_output(out, x, _EXPECTS, same_shape=many)
    return y, (aux, new)
  return step
