"""Per-layer parameter trees to the stacked tree the stacks read, and back.

A model written with N separate blocks stores N subtrees (``block_0`` ...
``block_{N-1}`` in a linen params dict, ``layers[0]`` ... in an NNX state, or a
Python list). :class:`remat.LayerStack`, :class:`remat.NNXStack` and
:func:`remat.scan_layers` read one tree whose leaves are stacked ``[N, ...]``.
:func:`stack_layers` turns the first into the second, so an existing
checkpoint loads into a stack, and :func:`unstack_layers` turns it back, so a
stacked model's weights can be written in the per-layer layout.

Partitioned leaves (``nn.Partitioned`` from ``nn.with_logical_partitioning``)
get the new leading axis in their names, as ``nn.scan`` names it, so
``nn.get_partition_spec`` still works. Leaves that are not arrays (an
Equinox module's activation function, a flag) must be equal in every layer and
are kept once.
"""

from __future__ import annotations

import re
from typing import Any, Hashable, Mapping, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from remat.patterns import kind_indices


class LayoutError(ValueError):
  """Per-layer trees that cannot be stacked (or a tree that cannot be unstacked); one line."""


def _is_box(a) -> bool:
  return isinstance(a, nn.meta.AxisMetadata)


def _is_array(a) -> bool:
  return hasattr(a, 'shape') and hasattr(a, 'dtype')


def _shape(a) -> str:
  return f'{a.dtype}[{", ".join(map(str, a.shape))}]'


def _layers_of(layers, prefix: str | None) -> list:
  """The per-layer trees in order, from a sequence or a mapping ``{prefix}{i}`` / ``{i}``."""
  if isinstance(layers, Sequence) and not isinstance(layers, (str, bytes)):
    if not layers:
      raise LayoutError('stack_layers needs at least one layer, got an empty sequence')
    return list(layers)
  if not isinstance(layers, Mapping):
    raise LayoutError(f'stack_layers takes a sequence of per-layer trees or a mapping '
                      f"{{'block_0': ..., 'block_1': ...}}, got {type(layers).__name__}")
  found = {}
  for key in layers:
    if isinstance(key, int):
      name, i = '', key
    else:
      m = re.fullmatch(r'(.*?)(\d+)', str(key))
      if m is None or (prefix is not None and m.group(1) != prefix):
        if prefix is not None:
          continue  # with a prefix, other keys (a final norm, an embedding) are not layers
        raise LayoutError(f"stack_layers: key {key!r} is not PREFIX<i> (as 'block_3'); pass "
                          "prefix='...' to take only the layer keys of a larger tree")
      name, i = m.group(1), int(m.group(2))
    found.setdefault(name, {})[i] = layers[key]
  if not found:
    raise LayoutError(f"stack_layers: no key of the form {prefix!r}<i> among "
                      f"{', '.join(map(repr, list(layers)[:8]))}")
  if len(found) > 1:
    raise LayoutError(f'stack_layers: the keys have several prefixes '
                      f'({", ".join(map(repr, found))}); pass prefix=... for the one that names '
                      'the layers')
  by_index = next(iter(found.values()))
  missing = sorted(set(range(len(by_index))) - set(by_index))
  if missing:
    raise LayoutError(f'stack_layers: layers must be numbered 0..N-1; {len(by_index)} keys found, '
                      f'missing layer(s) {", ".join(map(str, missing[:8]))}')
  return [by_index[i] for i in range(len(by_index))]


def stack_layers(layers: Sequence[Any] | Mapping[Any, Any], *, prefix: str | None = None,
                 axis_name: str | None = 'layers', pattern: Sequence[Hashable] | None = None):
  """Stacks N per-layer trees into one tree whose leaves are ``[N, ...]``.

  Args:
    layers: a sequence of N trees, or a mapping whose keys are ``PREFIX<i>``
      (``block_0`` ... ``block_{N-1}``) or the integers 0..N-1 (an NNX state of
      an ``nnx.List`` of blocks). Linen params, NNX states and plain pytrees
      all work; every tree must have the structure, shapes and dtypes of
      layer 0.
    prefix: take only the keys ``prefix<i>`` of a mapping that holds others too
      (``prefix='encoderblock_'`` on a ViT encoder's params).
    axis_name: the name of the new axis on partitioned leaves (None for
      ``nn.with_partitioning``'s mesh axis names, as ``LayerStack(partition_name=None)``).
    pattern: the layers' repeating pattern of kinds, as given to the stack
      (``('local',) * 5 + ('global',)``): the layers of each kind are stacked
      apart, in order (layer ``remat.kind_indices(pattern, N)[kind][j]`` is
      the kind's slice j).

  Returns:
    The stacked tree, with layer 0's structure; with a pattern, a dict kind ->
    the stacked tree of that kind's layers.

  Raises:
    LayoutError: one line naming the layer and leaf that do not match.
  """
  trees = _layers_of(layers, prefix)
  if pattern is not None:
    index = kind_indices(_pattern(pattern), len(trees))
    out = {}
    for kind, layer_numbers in index.items():
      try:
        out[kind] = _stack([trees[i] for i in layer_numbers], axis_name)
      except LayoutError as e:
        raise LayoutError(f'{e} (among the layers of kind {kind!r}: '
                          f'{", ".join(map(str, layer_numbers[:8]))}...)') from None
    return out
  return _stack(trees, axis_name)


def _pattern(pattern) -> tuple:
  if isinstance(pattern, (str, bytes)) or not isinstance(pattern, Sequence) or not pattern:
    raise LayoutError(f"pattern must be a non-empty sequence of kinds such as ('local',) * 5 + "
                      f"('global',), got {pattern!r:.60}")
  return tuple(pattern)


def _stack(trees: list, axis_name: str | None):
  """The trees (one per layer, alike) stacked ``[N, ...]``; the layer numbers are list positions."""
  flat0, treedef = jax.tree_util.tree_flatten(trees[0], is_leaf=_is_box)
  columns = [[leaf] for leaf in flat0]
  paths = [jax.tree_util.keystr(p) for p, _ in
           jax.tree_util.tree_flatten_with_path(trees[0], is_leaf=_is_box)[0]]
  for i, tree in enumerate(trees[1:], 1):
    flat, other = jax.tree_util.tree_flatten(tree, is_leaf=_is_box)
    if other != treedef:
      raise LayoutError(f"stack_layers: layer {i}'s tree differs from layer 0's: {other} vs "
                        f'{treedef}'[:400])
    for col, path, leaf in zip(columns, paths, flat):
      a, b = (nn.meta.unbox(x) for x in (col[0], leaf))
      same = _is_array(a) == _is_array(b) and (
          not _is_array(a) or (a.shape, a.dtype) == (b.shape, b.dtype))
      if not same:
        raise LayoutError(f"stack_layers: layer {i}'s {path or 'leaf'} is "
                          f"{_shape(b) if _is_array(b) else repr(b)[:40]}, layer 0's "
                          f"{_shape(a) if _is_array(a) else repr(a)[:40]}")
      if not _is_array(a) and a != b:
        raise LayoutError(f"stack_layers: layer {i}'s {path or 'leaf'} is {b!r:.40}, layer 0's "
                          f'{a!r:.40}; leaves that are not arrays must be equal in every layer')
      col.append(leaf)
  out = []
  for col in columns:
    first = col[0]
    value = nn.meta.unbox(first)
    if not _is_array(value):
      out.append(first)
      continue
    stacked = jnp.stack([nn.meta.unbox(x) for x in col])
    out.append(first.replace_boxed(stacked).add_axis(0, {nn.PARTITION_NAME: axis_name})
               if _is_box(first) else stacked)
  return jax.tree_util.tree_unflatten(treedef, out)


def unstack_layers(stacked, *, prefix: str | None = None,
                   pattern: Sequence[Hashable] | None = None):
  """Splits a tree stacked ``[N, ...]`` into N per-layer trees (inverse of :func:`stack_layers`).

  Args:
    stacked: a tree whose array leaves all have the same leading axis N; with
      a pattern, a mapping kind -> the stacked tree of that kind's layers.
    prefix: if given, return ``{f'{prefix}{i}': tree_i}`` instead of a list.
    pattern: the stack's repeating pattern of kinds; the layers come back in
      model order, interleaved as the pattern says.

  Returns:
    A list of N trees, or a dict keyed ``prefix<i>``. Partitioned leaves lose
    their leading axis name.

  Raises:
    LayoutError: leaves whose leading axes differ, or a tree without arrays.
  """
  if pattern is not None:
    pattern = _pattern(pattern)
    if not isinstance(stacked, Mapping) or set(stacked) != set(pattern):
      raise LayoutError(f'unstack_layers with a pattern takes a mapping kind -> stacked tree with '
                        f'the kinds {", ".join(map(repr, dict.fromkeys(pattern)))}')
    per_kind = {k: _unstack(stacked[k]) for k in stacked}
    n = sum(len(v) for v in per_kind.values())
    index = kind_indices(pattern, n)
    if any(len(index[k]) != len(per_kind[k]) for k in per_kind):
      counts = ', '.join(f'{k!r}: {len(v)}' for k, v in per_kind.items())
      raise LayoutError(f'unstack_layers: the pattern {pattern!r:.60} over {n} layers does not give '
                        f'the stacked layers of each kind ({counts})')
    trees = [None] * n
    for k, layer_numbers in index.items():
      for j, i in enumerate(layer_numbers):
        trees[i] = per_kind[k][j]
  else:
    trees = _unstack(stacked)
  return trees if prefix is None else {f'{prefix}{i}': t for i, t in enumerate(trees)}


def _unstack(stacked) -> list:
  flat, treedef = jax.tree_util.tree_flatten(stacked, is_leaf=_is_box)
  paths = [jax.tree_util.keystr(p) for p, _ in
           jax.tree_util.tree_flatten_with_path(stacked, is_leaf=_is_box)[0]]
  sizes = {}
  for path, leaf in zip(paths, flat):
    value = nn.meta.unbox(leaf)
    if _is_array(value):
      if not value.shape:
        raise LayoutError(f'unstack_layers: {path or "leaf"} is a scalar, not stacked [N, ...]')
      sizes.setdefault(value.shape[0], path)
  if len(sizes) != 1:
    detail = '; '.join(f'{p or "leaf"} has {n}' for n, p in list(sizes.items())[:4])
    raise LayoutError(f'unstack_layers: every array must be stacked [N, ...] with one N; '
                      f'{detail or "no arrays found"}')
  n = next(iter(sizes))

  def layer(i):
    out = []
    for leaf in flat:
      value = nn.meta.unbox(leaf)
      if not _is_array(value):
        out.append(leaf)
      elif isinstance(leaf, nn.Partitioned):  # drop the layer axis's name with the axis
        out.append(leaf.replace(value=value[i], names=tuple(leaf.names[1:])))
      elif _is_box(leaf):
        out.append(leaf.replace_boxed(value[i]))
      else:
        out.append(value[i])
    return jax.tree_util.tree_unflatten(treedef, out)
  return [layer(i) for i in range(n)]
