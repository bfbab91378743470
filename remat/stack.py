"""The one place that applies remat to a stack of identical layers.

Models build their repeated blocks through :class:`LayerStack`. It runs the
block with Flax ``nn.scan`` over layers and ``nn.remat`` inside the scan
(``prevent_cse=False`` is safe there, and on the XLA CPU backend a remat
outside a scan is undone by the compiler).

Invariants every policy keeps:

* **One parameter tree.** Variables are stored stacked, ``[N, ...]`` per leaf,
  under ``name``. Segmented policies view them as ``[N // K, K, ...]`` plus a
  ``[1, N % K, ...]`` remainder only at call time (``nn.map_variables``), so a
  checkpoint written under one policy loads under any other. Initialisation
  always takes the plain per-layer path, so the same seed gives the same
  initial weights under every policy.
* **One dropout stream.** Layer ``i`` gets the i-th of N keys split from one
  ``make_rng('dropout')`` call of the stack, whatever the segmenting; with
  dropout on, losses and gradients are equal across policies.

A block follows the scan convention ``__call__(self, x, rng) -> (x, None)``,
where ``rng`` is its dropout key (None when deterministic).

One-iteration loops. A stack of one layer (a ResNet stage's downsampling
block), a remainder segment and a ``stage`` segment run as scans of length 1,
with ``prevent_cse=True`` (an optimisation barrier) since the loop cannot be
relied on. XLA's while-loop simplifier inlines such loops, after which the CPU
backend keeps the activations their checkpoints were to drop: compile CPU
steps with :data:`remat.targets.CPU_COMPILER_OPTIONS` (the train step, the
report and the tests do). GPU pipelines honour these checkpoints either way.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

from remat.policies import Policy


def _scan(cls, length: int):
  # All collections (params, batch_stats, ...) are stacked on axis 0; only
  # 'params' RNGs are split (dropout keys arrive as scanned inputs instead).
  return nn.scan(cls, variable_axes={True: 0}, split_rngs={'params': True},
                 in_axes=0, length=length)


def _layer_scan(block_cls, policy: Policy, length: int):
  # prevent_cse=False is safe only inside a real loop; XLA inlines length-1 scans.
  return _scan(policy.remat(block_cls, prevent_cse=length == 1), length)


class _One(nn.Module):
  """A single layer as a scan body over a length-1 axis of its input.

  Its input is a scanned slice rather than the carry, so the layer may change
  the shape (a ResNet stage's downsampling block). ``share_scope`` keeps the
  block's variables directly under this module, as in the N-layer scan.
  """
  block_cls: Any
  block_kwargs: Mapping[str, Any]

  @nn.compact
  def __call__(self, carry, inputs):
    x, key = inputs
    block = self.block_cls(**self.block_kwargs)
    nn.share_scope(self, block)
    return carry, block(x, key)[0]


class _Segment(nn.Module):
  """``size`` consecutive layers; checkpointed as a whole by the caller."""
  block_cls: Any
  block_kwargs: Mapping[str, Any]
  policy: Policy
  size: int

  @nn.compact
  def __call__(self, x, keys):
    layers = _layer_scan(self.block_cls, self.policy, self.size)
    x, _ = layers(**self.block_kwargs, name='layer')(x, keys)
    return x, None


class _Segmented(nn.Module):
  """Scan over checkpointed segments (saving only segment inputs), then the remainder."""
  block_cls: Any
  block_kwargs: Mapping[str, Any]
  policy: Policy
  num_layers: int
  size: int

  @nn.compact
  def __call__(self, x, keys):
    full, rest = divmod(self.num_layers, self.size)
    seg_cls = nn.remat(_Segment, policy=jax.checkpoint_policies.nothing_saveable,
                       prevent_cse=full == 1)
    kw = dict(block_cls=self.block_cls, block_kwargs=self.block_kwargs, policy=self.policy)
    main_keys, rest_keys = _split_stacked(keys, self.num_layers, self.size)
    x, _ = _scan(seg_cls, full)(size=self.size, **kw, name='main')(x, main_keys)
    if rest:
      # A length-1 scan keeps the remainder segment's remat inside a scan too.
      x, _ = _scan(seg_cls, 1)(size=rest, **kw, name='rest')(x, rest_keys)
    return x, None


def _split_stacked(tree, num_layers: int, size: int):
  """[N, ...] leaves -> ([N//K, K, ...], [1, N%K, ...]) leaves."""
  full, rest = divmod(num_layers, size)
  cut = full * size
  main = jax.tree_util.tree_map(lambda a: a[:cut].reshape((full, size) + a.shape[1:]), tree)
  tail = jax.tree_util.tree_map(lambda a: a[cut:].reshape((1, rest) + a.shape[1:]), tree)
  return main, tail


def _to_segments(num_layers: int, size: int):
  def fn(collections):
    out = {}
    for col, tree in collections.items():
      main, tail = _split_stacked(tree, num_layers, size)
      view = {'main': {'layer': main}}
      if num_layers % size:
        view['rest'] = {'layer': tail}
      out[col] = view
    return out
  return fn


def _from_segments(collections):
  out = {}
  for col, view in collections.items():
    if not view:
      out[col] = view
      continue
    parts = [view['main']['layer']] + ([view['rest']['layer']] if 'rest' in view else [])
    out[col] = jax.tree_util.tree_map(
        lambda *a: jnp.concatenate([x.reshape((-1,) + x.shape[2:]) for x in a]), *parts)
  return out


class LayerStack(nn.Module):
  """Applies ``num_layers`` copies of ``block_cls`` under ``policy``.

  Attributes:
    block_cls: a Flax module class with ``__call__(x, rng) -> (y, None)``;
      ``y`` has the shape of ``x`` unless ``num_layers`` is 1.
    num_layers: N, any N >= 1 (``sqrt`` with prime N gives a remainder segment).
    policy: the :class:`~remat.policies.Policy` to apply.
    block_kwargs: constructor arguments of the block (its config, flags).

  The stacked variables live under ``<this module>/block``.
  """
  block_cls: Any
  num_layers: int
  policy: Policy
  block_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  @nn.compact
  def __call__(self, x, *, deterministic: bool = True):
    """Runs the stack; draws dropout keys from the 'dropout' RNG unless deterministic."""
    if self.num_layers < 1:
      raise ValueError(f'LayerStack needs num_layers >= 1, got {self.num_layers}')
    size = self.policy.segment_size(self.num_layers)
    keys = None
    if not deterministic:
      keys = jax.random.split(self.make_rng('dropout'), self.num_layers)
    kwargs = dict(self.block_kwargs)
    if self.num_layers == 1:
      return self._single(x, keys, kwargs, segmented=size is not None)
    if size is None or self.is_initializing():
      block = _layer_scan(self.block_cls, self.policy, self.num_layers)(**kwargs, name='block')
      return block(x, keys)[0]
    segmented = nn.map_variables(
        _Segmented, True, trans_in_fn=_to_segments(self.num_layers, size),
        trans_out_fn=_from_segments, mutable=True)
    stack = segmented(block_cls=self.block_cls, block_kwargs=kwargs, policy=self.policy,
                      num_layers=self.num_layers, size=size, name='block')
    return stack(x, keys)[0]

  def _single(self, x, keys, kwargs, segmented: bool):
    # One layer, which may change the shape, so it cannot be a scan carry. A
    # segment of one layer saves only its input: an outer nothing_saveable
    # checkpoint around the per-layer rule.
    cls = self.policy.remat(_One, prevent_cse=True)
    if segmented and not self.is_initializing():
      cls = nn.remat(cls, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=True)
    layer = _scan(cls, 1)(block_cls=self.block_cls, block_kwargs=kwargs, name='block')
    return layer(None, (x[None], keys))[1][0]
