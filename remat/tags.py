"""Find the ``checkpoint_name`` tags a function really emits, by walking its jaxpr."""

from __future__ import annotations

from typing import Any, Callable, Iterator

import jax
from jax.extend import core as jcore


def sub_jaxprs(value: Any) -> Iterator[Any]:
  """Yields the jaxprs held in an equation parameter (scan, remat, pjit, cond, ...)."""
  if isinstance(value, jcore.ClosedJaxpr):
    yield value.jaxpr
  elif isinstance(value, jcore.Jaxpr):
    yield value
  elif isinstance(value, (tuple, list)):
    for v in value:
      yield from sub_jaxprs(v)


def iter_eqns(jaxpr) -> Iterator[Any]:
  """Every equation of ``jaxpr`` and of all its nested sub-jaxprs, depth first."""
  for eqn in jaxpr.eqns:
    yield eqn
    for param in eqn.params.values():
      for sub in sub_jaxprs(param):
        yield from iter_eqns(sub)


def emitted_tags(fn: Callable, *args, **kwargs) -> set[str]:
  """Names passed to ``jax.ad_checkpoint.checkpoint_name`` when tracing ``fn``.

  Args:
    fn: any JAX-traceable function (e.g. a model's apply).
    *args: arguments or ``jax.ShapeDtypeStruct`` placeholders; nothing is run.
    **kwargs: passed through to ``fn``.

  Returns:
    The set of tag names.
  """
  closed = jax.make_jaxpr(lambda *a: fn(*a, **kwargs))(*args)
  return {eqn.params['name'] for eqn in iter_eqns(closed.jaxpr) if eqn.primitive.name == 'name'}
