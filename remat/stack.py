"""The linen front door: a stack of identical Flax linen blocks under a remat policy.

:class:`LayerStack` stores the blocks' variables stacked, ``[N, ...]`` per
leaf, under ``<stack>/block``, and runs them through
:func:`remat.scan_layers.segmented_scan`, the one implementation of the
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

A block is ``__call__(self, x, *args) -> y`` or ``-> (y, aux)``; ``args`` are
the stack's extra call arguments, the same for every layer (a mask, positions,
a flag). A block with a parameter named ``rng`` gets its dropout key there
(None when deterministic).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import flax.linen as nn
import jax

from remat.policies import Policy
from remat.scan_layers import (check_policy, check_signature, segmented_scan, split_output,
                               takes_rng, trace_layer)

_EXPECTS = ('LayerStack calls block(x, *args[, rng=key]) -> y or (y, aux), with args the '
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

  @nn.compact
  def __call__(self, carry, inputs, args):
    x, key = inputs if self.scan_x else (carry, inputs)
    block = self.block_cls(**self.block_kwargs)
    nn.share_scope(self, block)
    out = block(x, *args, **({'rng': key} if self.with_rng else {}))
    y, aux = split_output(out, x, _EXPECTS, same_shape=self.same_shape)
    return (carry, (y, aux)) if self.scan_x else (y, aux)


class LayerStack(nn.Module):
  """Applies ``num_layers`` copies of ``block_cls`` under ``policy``.

  Attributes:
    block_cls: a Flax linen module class with ``__call__(x, *args) -> y`` or
      ``-> (y, aux)``; ``y`` has the shape of ``x`` unless ``num_layers`` is 1.
    num_layers: N, any N >= 1 (``sqrt`` with prime N gives a remainder segment).
    policy: a :class:`~remat.policies.Policy` or a spec such as ``'full@sqrt'``.
    block_kwargs: constructor arguments of the block (its config, flags).
    strict: check the policy against this stack alone: a segment size within
      1..N and ``names:``/``offload:`` tags that this block emits. Set False in a
      model whose stacks differ in depth or tags (a ResNet: one-block stacks, a
      ``shortcut`` only in first blocks) and check the model once instead:
      ``get_policy(spec, num_layers=deepest, tags=remat.tags.emitted_tags(...))``;
      a segment larger than a stack is then one segment of that stack.

  The stacked variables live under ``<this module>/block``.
  """
  block_cls: Any
  num_layers: int
  policy: Policy | str
  block_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  strict: bool = True

  @nn.compact
  def __call__(self, x, *args, deterministic: bool = True):
    """Runs the stack.

    Args:
      x: the input, carried from block to block.
      *args: passed to every block after ``x`` (a mask, positions, a flag).
      deterministic: if False, draws the blocks' dropout keys from the 'dropout' RNG.

    Returns:
      ``y``, or ``(y, aux)`` with every block's ``aux`` stacked ``[N, ...]``
      when the block returns one that is not None.

    Raises:
      PolicyError: a segment size outside 1..N, or a ``names:``/``offload:``
        tag the block does not emit.
      StackSignatureError: a block that cannot be called as above.
    """
    n = self.num_layers
    policy = check_policy(self.policy, n if self.strict else None)
    if not (isinstance(self.block_cls, type) and issubclass(self.block_cls, nn.Module)):
      raise TypeError(f'LayerStack needs a linen Module class as block_cls, got '
                      f'{self.block_cls!r:.80}')
    with_rng = takes_rng(self.block_cls.__call__)
    check_signature(self.block_cls.__call__, (None, x) + args,
                    {'rng': None} if with_rng else {}, _EXPECTS)
    keys = None
    if not deterministic:
      keys = jax.random.split(self.make_rng('dropout'), n)
    if self.is_initializing():
      return self._init(x, args, keys, with_rng)

    block = self.block_cls(**self.block_kwargs, parent=None)  # unbound: applied functionally
    variables = {col: tree['block'] for col, tree in self.variables.items() if 'block' in tree}
    mutable = [c for c in variables if c != 'params' and self.is_mutable_collection(c)]

    def step(x, sliced):
      layer_vars, key = sliced
      kwargs = {'rng': key} if with_rng else {}
      rngs = None if key is None else {'dropout': key}
      out = block.apply(layer_vars, x, *args, **kwargs, rngs=rngs, mutable=mutable or False)
      out, new = out if mutable else (out, {})
      y, aux = split_output(out, x, _EXPECTS, same_shape=n > 1)
      return y, (aux, new)

    xs = (variables, keys)
    (_, (aux, _)), tags = trace_layer(step, x, jax.tree_util.tree_map(lambda a: a[0], xs))
    tag_rule = self.strict and policy.uses_tags
    if tag_rule:
      policy.validate(tags=tags)
    y, (auxs, new) = segmented_scan(step, x, xs, n, policy)
    for col in mutable:
      self.put_variable(col, 'block', new[col])
    return y if aux is None else (y, auxs)

  def _init(self, x, args, keys, with_rng: bool):
    # The plain per-layer path under every policy: the same seed gives the same weights.
    one = self.num_layers == 1
    body = nn.scan(_InitBody, variable_axes={True: 0}, split_rngs={'params': True},
                   in_axes=(0, nn.broadcast), length=self.num_layers)
    stack = body(block_cls=self.block_cls, block_kwargs=self.block_kwargs, with_rng=with_rng,
                 scan_x=one, same_shape=not one, name='block')
    if one:
      _, (y, aux) = stack(None, (x[None], keys), args)
      y = y[0]
    else:
      y, aux = stack(x, keys, args)
    return y if aux is None else (y, aux)
