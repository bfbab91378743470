"""Bytes saved for the backward pass, by ``checkpoint_name`` tag and by where they were created.

The residuals of ``fn`` are the arrays ``jax.vjp`` keeps between the forward and
the backward pass: the leaves of the vjp closure, found by tracing
``jax.vjp(fn, *args)[1]`` (nothing runs). Parameters and inputs, and values
computed from parameters alone (reshaped or transposed weights), do not count;
everything else does (dropout masks included), with its full shape, so a value
saved in every iteration of a scan counts as the stacked ``[N, ...]`` array.
Each residual is traced back through pjit, scan, remat and custom_jvp/vjp
bodies to the equation that produced it: a ``checkpoint_name`` gives its tag
(also when the saved value is the operand of the ``checkpoint_name``, as under
``dots``), otherwise the primitive and source line are reported.

What this cannot see: values the backward pass materialises while it
recomputes (e.g. the activations a segment keeps during its own recompute
under ``sqrt``), and XLA's later buffer reuse. Those are in the compiled
``temp`` figure (:mod:`remat.memory`), not here.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable

import jax
import numpy as np
from jax.extend import core as jcore

from remat import kept_in_gradients
from remat.layout import CHEAP_PRIMITIVES

# Primitives whose sub-jaxpr outputs line up one-to-one with the equation's outputs.
_BODY_PARAM = {'pjit': 'jaxpr', 'jit': 'jaxpr', 'closed_call': 'call_jaxpr',
               'core_call': 'call_jaxpr', 'checkpoint': 'jaxpr', 'remat2': 'jaxpr',
               'custom_jvp_call': 'call_jaxpr', 'custom_vjp_call': 'call_jaxpr',
               'custom_vjp_call_jaxpr': 'fun_jaxpr', 'scan': 'jaxpr'}


# Remat wraps a saved value in these; the value's origin is their operand.
_PASS_THROUGH = ('reduce_precision', 'optimization_barrier')


@dataclasses.dataclass(frozen=True)
class Residual:
  """One saved array: its bytes and shape, and its tag or creating primitive and source."""
  nbytes: int
  shape: tuple[int, ...]
  dtype: str
  tag: str | None
  where: str


def _summarize(eqn) -> str:
  try:
    from jax._src import source_info_util
    return f'{eqn.primitive.name} at {source_info_util.summarize(eqn.source_info)}'
  except Exception:  # source info is best effort; the primitive name always exists
    return eqn.primitive.name


def _body(eqn):
  param = _BODY_PARAM.get(eqn.primitive.name)
  sub = eqn.params.get(param) if param else None
  if isinstance(sub, jcore.ClosedJaxpr):
    return sub.jaxpr
  return sub if isinstance(sub, jcore.Jaxpr) else None


def _producers(jaxpr):
  return {v: (eqn, i) for eqn in jaxpr.eqns for i, v in enumerate(eqn.outvars)}


def _tag_after(var, jaxpr, depth: int = 6):
  """The ``checkpoint_name`` eqn of the value rebuilt from ``var`` by cheap ops, if any.

  A policy that saves what an expensive op produced (``dots``, the stack's lean
  rule) keeps the matmul's output, and the model's ``checkpoint_name`` sits on a
  value computed from it elementwise (a bias added, a reshape): a consumer, not
  its producer. Consumers are followed through :data:`remat.layout.CHEAP_PRIMITIVES`
  (what the lean rule rebuilds) for at most ``depth`` steps, nearest first.
  """
  frontier, seen = [var], {var}
  for _ in range(depth):
    nxt = []
    for eqn in jaxpr.eqns:
      if not any(v in frontier for v in eqn.invars if not isinstance(v, jcore.Literal)):
        continue
      if eqn.primitive.name == 'name':
        return eqn
      if eqn.primitive.name in CHEAP_PRIMITIVES:
        nxt += [v for v in eqn.outvars if v not in seen]
        seen.update(eqn.outvars)
    if not nxt:
      return None
    frontier = nxt
  return None


def _origin(var, jaxpr, outer):
  """(tag, where) of ``var`` in ``jaxpr``; ``outer`` maps body invars to the enclosing context."""
  producers = _producers(jaxpr)
  while True:
    if var in producers:
      eqn, i = producers[var]
      if eqn.primitive.name == 'name':
        return eqn.params['name'], _summarize(eqn)
      named = _tag_after(var, jaxpr)
      if named is not None:
        return named.params['name'], _summarize(named)
      if eqn.primitive.name in _PASS_THROUGH:
        var = eqn.invars[0]
        continue
      body = _body(eqn)
      if body is not None and len(body.outvars) == len(eqn.outvars):
        inner = body.outvars[i]
        if isinstance(inner, jcore.Literal):
          return None, 'literal'
        if eqn.primitive.name == 'scan' and inner in body.invars:
          return None, f'scan carry at {_summarize(eqn).split(" at ", 1)[-1]}'  # per-iteration value
        for j, o in enumerate(body.outvars):   # the same value also returned as another output
          named = _tag_after(eqn.outvars[j], jaxpr) if o is inner and j != i else None
          if named is not None:
            return named.params['name'], _summarize(named)
        # pjit/remat body invars are their operands; follow them out.
        link = dict(zip(body.invars, eqn.invars)) if len(body.invars) == len(eqn.invars) else {}
        return _origin(inner, body, (link, jaxpr, outer))
      return None, _summarize(eqn)
    if outer is not None and var in outer[0]:
      link, parent, grand = outer
      var, jaxpr, outer = link[var], parent, grand
      producers = _producers(jaxpr)
      continue
    return None, 'input'


def _param_only(jaxpr, num_params: int) -> set:
  """Top-level vars computed from parameters alone (no batch input), e.g. reshaped weights."""
  flags = {v: {'param'} for v in jaxpr.invars[:num_params]}
  flags.update({v: {'batch'} for v in jaxpr.invars[num_params:]})
  for eqn in jaxpr.eqns:
    f = set().union(*(flags.get(v, set()) for v in eqn.invars if not isinstance(v, jcore.Literal)))
    for v in eqn.outvars:
      flags[v] = f
  return {v for v, f in flags.items() if f == {'param'}}


def saved_residuals(fn: Callable, params, *args) -> list[Residual]:
  """The arrays kept for the backward pass of ``fn`` with respect to its first argument.

  Args:
    fn: ``fn(params, *args)``, e.g. a loss.
    params: the differentiated argument (a pytree; may be abstract).
    *args: further inputs such as the batch (may be abstract); not differentiated.
  """
  # The values as saved, not where they wait: in gradient rows they would be one untagged buffer.
  with kept_in_gradients.suspended():
    closed = jax.make_jaxpr(lambda p, *a: jax.vjp(lambda q: fn(q, *a), p)[1])(params, *args)
  jaxpr = closed.jaxpr
  inputs = set(jaxpr.invars)
  num_params = len(jax.tree_util.tree_leaves(params))
  param_only = _param_only(jaxpr, num_params)
  out = []
  for var in jaxpr.outvars:
    if isinstance(var, jcore.Literal) or var in inputs or var in param_only:
      continue  # parameters, inputs, and views of parameters (reshapes, transposes)
    tag, where = _origin(var, jaxpr, None)
    if where == 'input':
      continue
    aval = var.aval
    out.append(Residual(int(np.prod(aval.shape)) * aval.dtype.itemsize, tuple(aval.shape),
                        str(aval.dtype), tag, where))
  return out


def by_tag(residuals: list[Residual]) -> dict[str, int]:
  """Bytes per tag; untagged residuals are grouped under '(untagged)'."""
  totals = collections.Counter()
  for r in residuals:
    totals[r.tag or '(untagged)'] += r.nbytes
  return dict(totals.most_common())


def by_source(residuals: list[Residual], top: int | None = None) -> dict[str, int]:
  """Bytes per creating primitive and source line (tagged ones under their tag)."""
  totals = collections.Counter()
  for r in residuals:
    totals[f'tag {r.tag}' if r.tag else r.where] += r.nbytes
  return dict(totals.most_common(top))
