"""Helpers of :mod:`remat.unrolled`'s loop: a block's closure, residuals, matmul operands, cotangents.

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
  """``fn`` with every traced value it closes over made an input.

  As ``jax.closure_convert``, which hoists only values that may carry a
  tangent: an integer or boolean value (an attention mask made from the batch)
  would stay closed over, which ``jax.custom_batching.custom_vmap`` refuses when
  it is batched.

  Returns:
    ``(converted, consts, jaxpr)``: ``converted(*args, *consts)`` is ``fn(*args)``;
    ``jaxpr`` is ``fn``'s, its inputs the leaves of ``example``.
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
  return converted, [c for c, t in zip(closed.consts, traced) if t], closed


def inexact(a) -> bool:
  """Whether ``a`` is a float or complex value (one that has a cotangent)."""
  return jnp.issubdtype(jnp.result_type(a), jnp.inexact)


def zero_cotangent(a):
  """The cotangent nobody wrote: zeros, or float0 for integer and key leaves."""
  if inexact(a):
    return jnp.zeros(jnp.shape(a), jnp.result_type(a))
  return np.zeros(jnp.shape(a), jax.dtypes.float0)


def is_primal(a) -> bool:
  """A ``custom_vjp`` forward's argument under ``symbolic_zeros=True`` (value and ``perturbed``)."""
  return isinstance(a, jax.custom_derivatives.CustomVJPPrimal)


def primal_values(tree):
  """``(values, perturbed flags per leaf)`` of a tree of :func:`is_primal` arguments."""
  leaves = jax.tree_util.tree_leaves(tree, is_leaf=is_primal)
  values = jax.tree_util.tree_map(lambda p: p.value, tree, is_leaf=is_primal)
  return values, [p.perturbed for p in leaves]


def materialise(tree):
  """``tree`` with each symbolic zero cotangent JAX passed (an output nobody differentiates) as zeros."""
  def leaf(ct):
    if not isinstance(ct, jax.custom_derivatives.SymbolicZero):
      return ct
    if jnp.issubdtype(ct.aval.dtype, jnp.inexact):
      return jnp.zeros(ct.aval.shape, ct.aval.dtype)
    return np.zeros(ct.aval.shape, jax.dtypes.float0)
  return jax.tree_util.tree_map(
      leaf, tree, is_leaf=lambda a: isinstance(a, jax.custom_derivatives.SymbolicZero))


def barrier(tree):
  """``optimization_barrier`` over the float leaves of ``tree`` (None and float0 pass through)."""
  leaves, tdef = jax.tree_util.tree_flatten(tree, is_leaf=lambda v: v is None)
  pick = [i for i, a in enumerate(leaves) if a is not None and inexact(a)
          and not isinstance(a, np.ndarray)]
  held = jax.lax.optimization_barrier([leaves[i] for i in pick])
  for i, a in zip(pick, held):
    leaves[i] = a
  return jax.tree_util.tree_unflatten(tdef, leaves)


def zero_after(tree) -> jax.Array:
  """An int32 zero that XLA can neither fold nor compute before ``tree``'s first leaf.

  ``clamp(0, b, 0)`` of one element ``b`` of that leaf (a float's bits): 0 for
  every value, NaN and inf included, and XLA's simplifier leaves a clamp with
  equal bounds alone. The XLA CPU backend drops ``optimization_barrier``, so an
  offset or an addend made from it is how a read there waits for the data and
  stays apart from the same read elsewhere (:func:`remat.unrolled.run`).
  """
  leaf = jnp.ravel(jax.tree_util.tree_leaves(tree)[0])[0]
  if jnp.issubdtype(leaf.dtype, jnp.complexfloating):
    leaf = jnp.real(leaf)
  bits = (jax.lax.bitcast_convert_type(leaf.astype(jnp.float32), jnp.int32)
          if jnp.issubdtype(leaf.dtype, jnp.floating) else leaf.astype(jnp.int32))
  return jax.lax.clamp(jnp.int32(0), bits, jnp.int32(0))


def plus_zero(tree, zero):
  """``tree`` with ``zero`` (:func:`zero_after`) added to each float leaf: the same values, new arrays."""
  return jax.tree_util.tree_map(
      lambda a: a + zero.astype(a.dtype) if a is not None and inexact(a) else a, tree,
      is_leaf=lambda a: a is None)


def batched(tree) -> bool:
  """True when a leaf of ``tree`` is being batched by ``jax.vmap`` (the stack is traced inside one).

  JAX does not export its batching tracer's type, so it is recognised by name. A stack in a
  ``jax.jit`` that is itself inside ``jax.vmap`` is traced unbatched and cannot tell.
  """
  return any(isinstance(a, jax.core.Tracer) and type(a).__name__ == 'BatchTracer'
             for a in jax.tree_util.tree_leaves(tree))


_MATMULS = ('dot_general', 'conv_general_dilated', 'ragged_dot_general')


def matmul_operands(closed, inputs) -> set:
  """Which of ``inputs`` (positions in ``closed``'s inputs) reach a matmul with nothing else.

  A value computed from these inputs alone (a weight, transposed, scaled,
  concatenated with another) that is an operand of a matmul or convolution
  marks the inputs it came from. Once a value has met anything else (the
  carry, an activation) it no longer marks. Inside a call whose body cannot be
  followed (a loop, a conditional), every such input it is given is marked.
  """
  marked = set()

  def walk(jaxpr, env):
    # env: var -> frozenset of the inputs the value comes from alone, or None (it met others)
    read = lambda v: frozenset() if isinstance(v, jax.extend.core.Literal) else env.get(v)
    for eqn in jaxpr.eqns:
      ins = [read(v) for v in eqn.invars]
      if eqn.primitive.name in _MATMULS:
        for s in ins[:2]:
          if s:
            marked.update(s)
      body = _body(eqn)
      if body is not None:
        outs = walk(body, dict(zip(body.invars, ins)))
      elif _bodies(eqn):
        for s in ins:
          marked.update(s or ())
        outs = [None] * len(eqn.outvars)
      elif any(s is None for s in ins):
        outs = [None] * len(eqn.outvars)
      else:
        outs = [frozenset().union(*ins)] * len(eqn.outvars)
      env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]

  env = {v: (frozenset([i]) if i in inputs else None) for i, v in enumerate(closed.jaxpr.invars)}
  env.update({v: frozenset() for v in closed.jaxpr.constvars})
  walk(closed.jaxpr, env)
  return marked


def _bodies(eqn) -> list:
  """The jaxprs an equation runs (a call's body, a loop's body and condition, a cond's branches)."""
  params = (q for p in eqn.params.values() for q in (p if isinstance(p, (tuple, list)) else (p,)))
  return [p for p in params if isinstance(p, (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr))]


def _body(eqn):
  """The one body a call-like equation runs on its inputs in order (jit, checkpoint, scan), or None."""
  bodies = _bodies(eqn)
  if len(bodies) != 1:
    return None
  body = bodies[0].jaxpr if isinstance(bodies[0], jax.extend.core.ClosedJaxpr) else bodies[0]
  return body if len(body.invars) == len(eqn.invars) else None
