"""``--remat=auto``: the policy of least recompute whose compiled plan fits a memory budget.

``choose(build, *example_args, budget='auto:40GiB', target='h200', num_layers=12)``
searches per-layer rules (none, full, dots, dots_no_batch, presets, ``names:``
subsets of the tags the program really emits; ``offload:`` ones on GPU
targets), segmentings (``RULE@seg:K`` for K dividing N, ``sqrt``, ``stage``)
and two-part mixes across the stack (``jxA+B``). ``build`` and the example
arguments are those of :func:`remat.measure`; segmentings and mixes need a
stack helper in ``build`` and ``num_layers``.

How (docs/auto.md):

1. ``none`` and ``full`` are compiled (together, while a few traces fit the
   cheap model, :mod:`remat.auto_model`: residual bytes per tag, recompute
   FLOPs); if ``none``'s plan fits, it is the answer.
2. Candidates are taken in order of recompute FLOPs (counted exactly before any
   compile); one whose estimated peak is over the budget (after the model's
   observed error for its kind), a ``names:`` superset of a rule that planned
   over, or a mix no cheaper than its leaner rule is skipped; the others are
   compiled for the target, two at a time, until one fits in order. Its plan,
   from the compiler, is the answer.

An impossible budget is a one-line :class:`AutoError` naming the least peak
any compiled candidate reached. Answers are cached on disk
(:mod:`remat.auto_cache`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import jax

from remat import auto_cache
from remat.auto_budget import Budget, BudgetError, parse_budget  # noqa: F401  (BudgetError: public)
from remat.auto_search import (  # noqa: F401  (public here: remat.auto.plan, AutoError, ...)
    CPU_PLAN_OPTIONS, MAX_COMPILES, MAX_TRACES, PARALLEL, AutoError, _Search, mesh_description,
    plan)
from remat.measuring import _abstract, _parts
from remat.memory import MemoryStats, format_bytes
from remat.policies import get_policy
from remat.targets import Target, get_target


@dataclasses.dataclass(frozen=True)
class Choice:
  """The answer: a spec and the compiler's plan for it.

  Attributes:
    spec: the chosen policy, a spec string that reproduces it.
    budget: the budget spec ('auto:40GiB').
    budget_bytes: the budget in bytes.
    memory: the compiled plan of the chosen policy (peak is what met the budget).
    flops: its matmul/conv FLOPs, recompute included.
    none_peak, none_flops: ``none``'s plan peak and FLOPs.
    compiled: every plan compiled, ``{'spec', 'peak', 'temp', 'flops', 'fits'}``.
    seconds: time the search took (the cache read, when cached).
    cached: True when the answer came from the cache.
    exhausted: True when the compile cap was reached and the least estimate was taken.
    profile: where the cold search's time went (compiles, their seconds, traces).
  """
  spec: str
  budget: str
  budget_bytes: int
  target: str
  memory: MemoryStats
  flops: int
  none_peak: int
  none_flops: int
  compiled: tuple[dict, ...]
  seconds: float
  cached: bool = False
  exhausted: bool = False
  profile: str = ''

  @property
  def recompute(self) -> float:
    return self.flops / self.none_flops if self.none_flops else 1.0

  def summary(self) -> str:
    """One line: the spec, its plan against the budget, its recompute, how it was found."""
    how = ('from the cache' if self.cached else
           f'{len(self.compiled)} plans compiled in {self.seconds:.0f} s')
    return (f'{self.budget} -> {self.spec}: peak {format_bytes(self.memory.peak)} (temp '
            f'{format_bytes(self.memory.temp)}) within {format_bytes(self.budget_bytes)} on '
            f'{self.target}; none {format_bytes(self.none_peak)}; recompute '
            f'{self.recompute:.3f}x none ({how})')

  def to_json(self) -> dict:
    d = dataclasses.asdict(self)
    d['compiled'] = list(self.compiled)
    return d

  @classmethod
  def from_json(cls, d: dict, seconds: float) -> 'Choice':
    fields = {f.name for f in dataclasses.fields(cls)}
    d = {k: v for k, v in d.items() if k in fields}
    return cls(**{**d, 'memory': MemoryStats(**d['memory']), 'compiled': tuple(d['compiled']),
                  'seconds': seconds, 'cached': True})

def choose(build: Callable, *example_args: Any, budget: str | Budget,
           target: Target | str = 'cpu', num_layers: int | None = None,
           cache: bool = True, cache_key: dict | None = None,
           max_compiles: int = MAX_COMPILES, log: Callable[[str], None] | None = None,
           shardings: tuple | None = None, parallel: int = PARALLEL,
           offload_rules: bool | None = None) -> Choice:
  """The policy of least recompute whose compiled plan's peak fits ``budget``.

  Args:
    build: ``build(policy) -> program``, as for :func:`remat.measure` (a loss or
      a :class:`remat.TrainStep`).
    *example_args: the program's arguments (arrays or ``jax.ShapeDtypeStruct``).
    budget: 'auto', 'auto:SIZE' or 'auto:Fx' (:mod:`remat.auto_budget`), or a Budget.
    target: 'cpu', 'h100', 'h200' or a Target.
    num_layers: N of the program's layer stack; without it only per-layer rules
      are searched (no segmentings or mixes).
    cache: read and write the on-disk cache (:mod:`remat.auto_cache`).
    cache_key: a JSON-able description of the program (model config, shapes,
      source hash) to key the cache by; without it the jaxpr of ``build(none)``
      is traced and hashed.
    max_compiles: candidate compiles (besides none and full) before settling.
    log: called with one line per step of the search.
    shardings: ``(in_shardings, out_shardings)`` for a program on a device mesh
      of local devices: every plan is XLA's per-device plan of the partitioned
      step, the budget is per device, and the mesh is part of the cache key.
    parallel: plans compiled at once (the answer does not depend on it).
    offload_rules: search ``offload:`` rules (activations in host memory); default:
      on GPU targets (a no-op on the CPU backend).

  Returns:
    A :class:`Choice`.

  Raises:
    BudgetError: a budget that cannot be read (one line).
    AutoError: no policy fits (one line, with the least memory reached).
  """
  start = time.perf_counter()
  log = log or (lambda s: None)
  target = get_target(target) if isinstance(target, str) else target
  budget = parse_budget(budget) if isinstance(budget, str) else budget
  if offload_rules is None:
    offload_rules = target.sharding is not None
  k = None
  if cache:
    k = auto_cache.key(_key_parts(build, example_args, budget, target, num_layers, cache_key,
                                  max_compiles, shardings, offload_rules))
    rec = auto_cache.load(k)
    said = rec.get('impossible') if rec is not None else None
    if isinstance(said, list) and len(said) == 4:   # the same search found nothing: say so again
      raise AutoError(*said)
    if rec is not None and 'choice' in rec:
      return Choice.from_json(rec['choice'], time.perf_counter() - start)
  search = _Search(build, example_args, target, num_layers, log, shardings, parallel,
                   offload_rules)
  try:
    spec, nbytes, exhausted = search.run(budget, max_compiles)
    record = search.record(nbytes)
  except AutoError as e:
    if k is not None and e.least_peak is not None:
      auto_cache.store(k, {'impossible': [str(e), e.least_spec, e.least_peak, e.budget_bytes]})
    raise
  finally:   # no compile is left running behind the answer (or the error)
    search.drain()
    search.pool.shutdown()
  choice = Choice(spec, budget.text, nbytes, target.name, search.plan(spec), search.flops(spec),
                  search.plan('none').peak, search.flops('none'), record,
                  time.perf_counter() - start, False, exhausted, search.profile())
  log(f'auto: {choice.profile}')
  if k is not None:
    auto_cache.store(k, {'choice': choice.to_json()})
  return choice


def _key_parts(build, args, budget: Budget, target: Target, num_layers, cache_key,
               max_compiles, shardings=None, offload_rules=None) -> dict:
  from remat.auto_budget import mem_fraction
  program = cache_key
  if program is None:
    fn, _, _ = _parts(build(get_policy('none')), args)
    program = auto_cache.jaxpr_fingerprint(jax.make_jaxpr(fn)(*_abstract(args)))
  shapes = [str(a) for a in jax.tree_util.tree_leaves(_abstract(args))]
  return {'program': program, 'args': shapes, 'env': auto_cache.environment(target),
          'budget': [budget.text, budget.nbytes], 'mem_fraction': mem_fraction() if budget.device else None,
          'num_layers': num_layers, 'max_compiles': max_compiles,
          'mesh': mesh_description(shardings), 'offload_rules': offload_rules}


__all__ = ['AutoError', 'BudgetError', 'Choice', 'choose', 'plan', 'parse_budget']
