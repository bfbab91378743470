"""Helpers of :mod:`remat.unrolled`'s loop: hoisting a block's closure, its residuals, cotangents.

Kept apart so that :mod:`remat.shared_outputs` and :mod:`remat.layout` can use
them without the loop itself.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np


def residual_origins(leaves, known):
  """Where each residual leaf of a VJP comes from, and the residuals of its own.

  ``known`` is ``[(origin, array), ...]`` of arrays the caller holds anyway (a
  layer's inputs, its parameters). A leaf that *is* one of them is recorded by
  its origin and not kept again; any other is kept, recorded as ``('r', i)``.

  Returns:
    (origins, one per leaf; the leaves to keep, in ``('r', i)`` order).
  """
  where, mine = [], []
  for leaf in leaves:
    origin = next((o for o, a in known if a is leaf), None)
    if origin is None:
      origin = ('r', len(mine))
      mine.append(leaf)
    where.append(origin)
  return where, mine


def hoist(fn: Callable, *example):
  """``fn`` with every traced value it closes over made an input: ``(fn(*args, *consts), consts)``.

  As ``jax.closure_convert``, which hoists only values that may carry a
  tangent: an integer or boolean value (an attention mask made from the batch)
  would stay closed over, which ``jax.custom_batching.custom_vmap`` refuses when
  it is batched.
  """
  closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*example)
  in_tree = jax.tree_util.tree_structure(example)
  out_tree = jax.tree_util.tree_structure(out_shape)
  traced = [isinstance(c, jax.core.Tracer) for c in closed.consts]

  def converted(*args_and_consts):
    args, hoisted = args_and_consts[:len(example)], iter(args_and_consts[len(example):])
    flat, tree = jax.tree_util.tree_flatten(args)
    assert tree == in_tree, f'{tree} != {in_tree}'
    consts = [next(hoisted) if t else c for c, t in zip(closed.consts, traced)]
    run_jaxpr = jax.extend.core.jaxpr_as_fun(jax.extend.core.ClosedJaxpr(closed.jaxpr, consts))
    return jax.tree_util.tree_unflatten(out_tree, run_jaxpr(*flat))
  return converted, [c for c, t in zip(closed.consts, traced) if t]


def inexact(a) -> bool:
  """Whether ``a`` is a float or complex value (one that has a cotangent)."""
  return jnp.issubdtype(jnp.result_type(a), jnp.inexact)


def zero_cotangent(a):
  """The cotangent nobody wrote: zeros, or float0 for integer and key leaves."""
  if inexact(a):
    return jnp.zeros(jnp.shape(a), jnp.result_type(a))
  return np.zeros(jnp.shape(a), jax.dtypes.float0)


def barrier(tree):
  """``optimization_barrier`` over the float leaves of ``tree`` (None and float0 pass through)."""
  leaves, tdef = jax.tree_util.tree_flatten(tree, is_leaf=lambda v: v is None)
  pick = [i for i, a in enumerate(leaves) if a is not None and inexact(a)
          and not isinstance(a, np.ndarray)]
  held = jax.lax.optimization_barrier([leaves[i] for i in pick])
  for i, a in zip(pick, held):
    leaves[i] = a
  return jax.tree_util.tree_unflatten(tdef, leaves)


def batched(tree) -> bool:
  """True when a leaf of ``tree`` is being batched by ``jax.vmap`` (the stack is traced inside one).

  JAX does not export its batching tracer's type, so it is recognised by name. A stack in a
  ``jax.jit`` that is itself inside ``jax.vmap`` is traced unbatched and cannot tell.
  """
  return any(isinstance(a, jax.core.Tracer) and type(a).__name__ == 'BatchTracer'
             for a in jax.tree_util.tree_leaves(tree))
