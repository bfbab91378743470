"""FLOPs of a whole function, recompute included, by walking its jaxpr.

XLA's compiled ``cost_analysis()`` counts a scan body once, so it cannot
price remat inside ``nn.scan``. This walker counts every ``dot_general`` and
``conv_general_dilated`` (2 FLOPs per multiply-add), multiplies scan bodies by
their length, and recurses into remat (``checkpoint``), pjit, custom_jvp/vjp
and the other sub-jaxprs. A ``cond`` counts its most expensive branch; a
``while`` loop's trip count is unknown, so its body counts once (the result
is then marked inexact). Elementwise ops are not counted: on the models here
they are a few percent of the matmul FLOPs.

The count is of the program JAX hands to XLA, before XLA's own dead-code
elimination and CSE, so it is what the policy asks for; XLA may run fewer.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax

from remat.tags import sub_jaxprs


@dataclasses.dataclass(frozen=True)
class FlopCount:
  """Matmul/conv FLOPs; ``exact`` is False when a while loop was counted once."""
  flops: int
  exact: bool = True


def _dot_flops(eqn) -> int:
  lhs, rhs = (v.aval.shape for v in eqn.invars)
  (lc, rc), (lb, rb) = eqn.params['dimension_numbers']
  rhs_free = [d for i, d in enumerate(rhs) if i not in rc and i not in rb]
  return 2 * math.prod(lhs) * math.prod(rhs_free)


def _conv_flops(eqn) -> int:
  out = eqn.outvars[0].aval.shape
  rhs = eqn.invars[1].aval.shape
  out_feature_dim = eqn.params['dimension_numbers'].rhs_spec[0]
  # Each output element costs (kernel elements / output features) multiply-adds.
  return 2 * math.prod(out) * math.prod(rhs) // rhs[out_feature_dim]


def _walk(jaxpr) -> tuple[int, bool]:
  total, exact = 0, True
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == 'dot_general':
      total += _dot_flops(eqn)
    elif name == 'conv_general_dilated':
      total += _conv_flops(eqn)
    elif name == 'scan':
      body, ok = _walk(eqn.params['jaxpr'].jaxpr)
      total, exact = total + eqn.params['length'] * body, exact and ok
    elif name == 'cond':
      counts = [_walk(b.jaxpr) for b in eqn.params['branches']]
      total += max(c for c, _ in counts)
      exact = exact and all(ok for _, ok in counts)
    else:
      if name == 'while':
        exact = False
      for param in eqn.params.values():
        for sub in sub_jaxprs(param):
          count, ok = _walk(sub)
          total, exact = total + count, exact and ok
  return total, exact


def count_flops(fn: Callable, *args, **kwargs) -> FlopCount:
  """FLOPs of ``fn(*args)``; args may be ``jax.ShapeDtypeStruct`` (nothing runs)."""
  closed = jax.make_jaxpr(lambda *a: fn(*a, **kwargs))(*args)
  return FlopCount(*_walk(closed.jaxpr))
