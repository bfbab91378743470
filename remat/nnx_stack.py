"""The Flax NNX front door: a stack of identical NNX blocks under a remat policy.

:class:`NNXStack` creates its N blocks with ``nnx.vmap`` (parameters stacked
``[N, ...]``, each layer initialised from its own split of ``rngs``), and at
call time splits them into a graph definition and stacked state and runs them
through :func:`remat.scan_layers.segmented_scan`, the one implementation of
the policies shared with the linen and plain-JAX front doors. Variables other
than ``nnx.Param`` (BatchNorm statistics, RNG counters) come back from each
layer as scan outputs and are written back into the stack.
"""

from __future__ import annotations

from typing import Callable

import jax
from flax import nnx

from remat.policies import Policy
from remat.scan_layers import (check_policy, check_signature, segmented_scan, split_output,
                               takes_rng, trace_layer)

_EXPECTS = ('NNXStack calls block(x, *args[, rng=key]) -> y or (y, aux), with args the '
            "stack's extra call arguments")


class NNXStack(nnx.Module):
  """``num_layers`` NNX blocks made by ``make_block``, applied in order under ``policy``.

  Example::

      stack = NNXStack(lambda rngs: Block(256, rngs=rngs), 16, 'full@sqrt', rngs=nnx.Rngs(0))
      y = stack(x)

  Attributes:
    layers: the blocks as one module whose state is stacked ``[N, ...]``.
    num_layers: N.
    policy: the :class:`~remat.policies.Policy`.
  """

  def __init__(self, make_block: Callable[[nnx.Rngs], nnx.Module], num_layers: int,
               policy: Policy | str = 'none', *, rngs: nnx.Rngs, strict: bool = True):
    """Creates the stack.

    Args:
      make_block: ``make_block(rngs) -> block``; called once per layer under
        ``nnx.vmap``. The block is ``__call__(x, *args) -> y`` or ``-> (y, aux)``,
        ``y`` shaped like ``x`` unless N is 1; with a parameter named ``rng``
        it gets its layer's dropout key.
      num_layers: N >= 1.
      policy: a :class:`~remat.policies.Policy` or a spec such as ``'full@sqrt'``.
      rngs: split N ways for the layers' initialisation.
      strict: check the policy against this stack alone (segment size within
        1..N, tags the block emits); False for a model whose stacks differ in
        depth or tags, see :class:`remat.LayerStack`.

    Raises:
      PolicyError: a bad spec or a segment size outside 1..N.
    """
    self.num_layers = num_layers
    self.strict = strict
    self.policy = check_policy(policy, num_layers if strict else None)

    @nnx.split_rngs(splits=num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, axis_size=num_layers)
    def create(rngs):
      return make_block(rngs)

    self.layers = create(rngs)

  def __call__(self, x, *args, rng: jax.Array | None = None):
    """Runs the stack.

    Args:
      x: the input, carried from block to block.
      *args: passed to every block after ``x`` (a mask, positions, a flag).
      rng: one dropout key; layer i gets the i-th of ``jax.random.split(rng, N)``
        whatever the segmenting (None: blocks get ``rng=None``).

    Returns:
      ``y``, or ``(y, aux)`` with every block's ``aux`` stacked ``[N, ...]``
      when the block returns one that is not None.

    Raises:
      PolicyError: a ``names:``/``offload:`` tag the block does not emit.
      StackSignatureError: a block that cannot be called as above.
    """
    n, policy = self.num_layers, self.policy
    call = type(self.layers).__call__
    with_rng = takes_rng(call)
    check_signature(call, (None, x) + args, {'rng': None} if with_rng else {}, _EXPECTS)
    graphdef, params, rest = nnx.split(self.layers, nnx.Param, ...)
    keys = None if rng is None else jax.random.split(rng, n)

    def step(x, sliced):
      layer_params, layer_rest, key = sliced
      block = nnx.merge(graphdef, layer_params, layer_rest)
      out = block(x, *args, **({'rng': key} if with_rng else {}))
      y, aux = split_output(out, x, _EXPECTS, same_shape=n > 1)
      return y, (aux, nnx.split(block, nnx.Param, ...)[2])

    xs = (params, rest, keys)
    (_, (aux, _)), tags = trace_layer(step, x, jax.tree_util.tree_map(lambda a: a[0], xs))
    tag_rule = self.strict and policy.uses_tags
    if tag_rule:
      policy.validate(tags=tags)
    y, (auxs, new_rest) = segmented_scan(step, x, xs, n, policy)
    nnx.update(self.layers, new_rest)
    return y if aux is None else (y, auxs)
