"""``--remat=auto``: the policy of least recompute whose compiled plan fits a memory budget.

``choose(build, *example_args, budget='auto:40GiB', target='h200', num_layers=12)``
searches per-layer rules (none, full, dots, dots_no_batch, presets, ``names:``
subsets of the tags the program really emits; ``offload:`` ones on GPU
targets), segmentings (``RULE@seg:K`` for K dividing N, ``sqrt``, ``stage``)
and two-part mixes across the stack (``jxA+B``). ``build`` and the example
arguments are those of :func:`remat.measure`; segmentings and mixes need a
stack helper in ``build`` and ``num_layers``.

How (docs/auto.md):

1. ``none`` is compiled; if its plan fits, it is the answer.
2. ``full`` is compiled, and a few traces fit the cheap model
   (:mod:`remat.auto_model`): residual bytes per tag, recompute FLOPs.
3. Candidates are taken in order of recompute FLOPs (counted exactly before any
   compile); one whose estimated peak is over the budget (after the model's
   observed error for its kind) is skipped, the others are compiled for the
   target until one fits. Its plan, from the compiler, is the answer.

An impossible budget is a one-line :class:`AutoError` naming the least peak
any compiled candidate reached. Answers are cached on disk
(:mod:`remat.auto_cache`).
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from typing import Any, Callable

import jax

from remat import auto_cache
from remat.auto_budget import Budget, BudgetError, parse_budget
from remat.auto_model import Calibration, Candidate, layer_candidates, stack_candidates
from remat.measuring import _abstract, _parts, step_flops, step_residuals
from remat.memory import MemoryStats, compiled_memory, format_bytes
from remat.policies import PolicyError, get_policy, sqrt_segment_size
from remat.residuals import by_tag
from remat.tags import iter_eqns
from remat.targets import Target, get_target

# LLVM's optimisation of CPU code is most of a compile and changes neither buffer assignment
# nor the plan (tests/test_auto.py checks the plans agree); the GPU pipeline is left as it is.
CPU_PLAN_OPTIONS = {'xla_backend_optimization_level': 0,
                    'xla_llvm_disable_expensive_passes': True}
MAX_COMPILES = 8      # compiles after none and full before settling for the least estimate
MAX_TRACES = 16       # per-layer rules' FLOPs counted before trusting the model's


class AutoError(PolicyError):
  """A budget no policy meets, or a search that cannot run; the message is one line."""


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


def plan(program, example_args, target: Target) -> MemoryStats:
  """The compiled memory plan of ``program`` for ``target`` (compile only)."""
  fn, donate, _ = _parts(program, example_args)
  options = dict(target.compiler_options)
  if target.sharding is None and jax.default_backend() == 'cpu':
    options.update(CPU_PLAN_OPTIONS)
  args = target.place(_abstract(example_args))
  compiled = jax.jit(fn, donate_argnums=donate).lower(*args).compile(
      compiler_options=options or None)
  return compiled_memory(compiled, target.name)


class _Search:
  """One search: memoised plans, FLOP counts and residual traces of specs."""

  def __init__(self, build, args, target: Target, num_layers: int | None, log: Callable):
    self.build, self.args, self.target, self.n, self.log = build, args, target, num_layers, log
    self.plans: dict[str, MemoryStats] = {}
    self.flop_counts: dict[str, int] = {}
    self.order: list[str] = []
    self.traces = 0

  def program(self, spec: str):
    return self.build(get_policy(spec, num_layers=self.n))

  def plan(self, spec: str) -> MemoryStats:
    if spec not in self.plans:
      self.plans[spec] = plan(self.program(spec), self.args, self.target)
      self.order.append(spec)
    return self.plans[spec]

  def flops(self, spec: str) -> int:
    if spec not in self.flop_counts:
      self.flop_counts[spec] = step_flops(self.program(spec), *self.args).flops
      self.traces += 1
    return self.flop_counts[spec]

  def residuals(self, spec: str):
    return step_residuals(self.program(spec), *self.args)

  def record(self, budget_bytes: int) -> tuple[dict, ...]:
    return tuple({'spec': s, 'peak': self.plans[s].peak, 'temp': self.plans[s].temp,
                  'flops': self.flops(s), 'fits': self.plans[s].peak <= budget_bytes}
                 for s in self.order)

  def calibrate(self) -> tuple[Calibration, set[str]]:
    """The model's calibration, and the tags the program emits (one trace of none's program)."""
    res = lambda spec: sum(r.nbytes for r in self.residuals(spec))
    fn, _, _ = _parts(self.program('none'), self.args)
    jaxpr = jax.make_jaxpr(fn)(*_abstract(self.args)).jaxpr
    tags = {e.params['name'] for e in iter_eqns(jaxpr) if e.primitive.name == 'name'}
    tag_flops = {t: max(0, self.flops('full') - self.flops(f'names:{t}')) for t in sorted(tags)}
    tag_bytes = {}
    if tags:
      tag_bytes = by_tag(list(self.residuals('names:' + ','.join(sorted(tags)))))
      tag_bytes.pop('(untagged)', None)
    cal = Calibration(self.plan('none').peak, self.plan('full').peak, self.flops('none'),
                      self.flops('full'), res('none'), res('full'), tag_bytes, tag_flops,
                      {r: res(r) for r in ('dots', 'dots_no_batch')}, self.n)
    if self.n and self.n >= 2:
      k = sqrt_segment_size(self.n)
      segments = -(-self.n // k)
      if segments < self.n:
        cal.layer_input = max(0, (cal.res_full - res('sqrt')) // (self.n - segments))
      cal.segment_flops = self.flops('sqrt') - cal.flops_none
    return cal, tags

  def least(self, cands: list[Candidate]) -> tuple[str, int]:
    """(spec, peak) of the least plan: the compiled ones and the least-estimated candidate."""
    rest = [c for c in cands if c.spec not in self.plans]
    if rest:
      self.plan(min(rest, key=lambda c: c.est_peak).spec)
    spec = min(self.plans, key=lambda s: self.plans[s].peak)
    return spec, self.plans[spec].peak

  def run(self, budget: Budget, max_compiles: int) -> tuple[str, int, bool]:
    """Returns (chosen spec, budget bytes, exhausted); raises AutoError if nothing fits."""
    none = self.plan('none')
    self.flops('none')
    nbytes = budget.resolve(none.peak, self.target.device_memory, self.target.name)
    say = lambda s: self.log(f'auto: {s}')
    say(f'budget {budget.describe(nbytes)}; none plans {format_bytes(none.peak)}')
    if none.peak <= nbytes:
      return 'none', nbytes, False
    full = self.plan('full')
    self.flops('full')
    say(f'full plans {format_bytes(full.peak)}')
    cal, tags = self.calibrate()
    self.traces = 0   # the cap counts the search's own FLOP counts, not the calibration's
    cands = layer_candidates(cal, tags, offload=self.target.sharding is not None)
    cands += stack_candidates(cal, cands)
    if full.peak > nbytes and not (self.n and self.n >= 2):
      spec, peak = self.least(cands)
      raise AutoError(self._impossible(budget, nbytes, spec, peak, 'without a stack'))
    # Estimates within 2% of the none-full range of the budget are compiled rather than trusted.
    tol = 0.02 * max(0, none.peak - full.peak)
    # full is verified already: a candidate must recompute strictly less to be worth a compile.
    best = ('full', cal.flops_full) if full.peak <= nbytes else None
    offset: dict[str, float] = {}
    heap = [(c.flops, c.est_peak, not c.stock, c.spec, c) for c in cands
            if c.spec not in ('none', 'full')]
    heapq.heapify(heap)
    compiles, skipped = 0, 0
    say(f'{len(heap)} candidates; compiling those the model says fit, least recompute first')
    while heap:
      *_, c = heapq.heappop(heap)
      if c.spec in self.plans:
        continue
      if c.est_peak + offset.get(c.kind, 0.0) > nbytes + tol:
        skipped += 1
        continue
      if not c.exact and self.traces < MAX_TRACES:
        c.flops = cal.flops_none + c.extra + sum(
            w * (self.flops(dep) - cal.flops_none) for w, dep in c.deps)
        c.exact = True
        heapq.heappush(heap, (c.flops, c.est_peak, not c.stock, c.spec, c))
        continue
      if best is not None and c.flops >= best[1]:
        return best[0], nbytes, False
      if compiles >= max_compiles:
        if best is not None:   # full fits: nothing cheaper was found within the cap
          say(f'compile cap ({max_compiles}) reached; full fits')
          return best[0], nbytes, True
        say(f'compile cap ({max_compiles}) reached; taking the least estimate')
        spec, peak = self.least(cands)
        if peak > nbytes:
          raise AutoError(self._impossible(budget, nbytes, spec, peak, 'after the compile cap'))
        return spec, nbytes, True
      got = self.plan(c.spec)
      compiles += 1
      err = got.peak - c.est_peak
      offset[c.kind] = min(offset.get(c.kind, err), err)
      fits = got.peak <= nbytes
      say(f'{c.spec}: plans {format_bytes(got.peak)} (estimated {format_bytes(c.est_peak)}), '
          f'recompute {c.flops / cal.flops_none:.3f}x: {"fits" if fits else "over"}')
      if fits:
        return c.spec, nbytes, False
    if best is not None:
      return best[0], nbytes, False
    spec, peak = self.least(cands)
    if peak <= nbytes:   # the model pruned it, the compiler did not: take it
      return spec, nbytes, False
    raise AutoError(self._impossible(budget, nbytes, spec, peak, f'{len(cands)} candidates'))

  def _impossible(self, budget, nbytes, spec, peak, what) -> str:
    return (f"{budget.text}: no policy's plan fits {budget.describe(nbytes)} on "
            f'{self.target.name}; the least memory any reaches is {format_bytes(peak)} peak '
            f'({spec}; {what}, {len(self.plans)} plans compiled)')


def choose(build: Callable, *example_args: Any, budget: str | Budget,
           target: Target | str = 'cpu', num_layers: int | None = None,
           cache: bool = True, cache_key: dict | None = None,
           max_compiles: int = MAX_COMPILES, log: Callable[[str], None] | None = None) -> Choice:
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
  k = None
  if cache:
    k = auto_cache.key(_key_parts(build, example_args, budget, target, num_layers, cache_key,
                                  max_compiles))
    rec = auto_cache.load(k)
    if rec is not None:
      return Choice.from_json(rec['choice'], time.perf_counter() - start)
  search = _Search(build, example_args, target, num_layers, log)
  spec, nbytes, exhausted = search.run(budget, max_compiles)
  choice = Choice(spec, budget.text, nbytes, target.name, search.plan(spec), search.flops(spec),
                  search.plan('none').peak, search.flops('none'), search.record(nbytes),
                  time.perf_counter() - start, False, exhausted)
  if k is not None:
    auto_cache.store(k, {'choice': choice.to_json()})
  return choice


def _key_parts(build, args, budget: Budget, target: Target, num_layers, cache_key,
               max_compiles) -> dict:
  from remat.auto_budget import mem_fraction
  program = cache_key
  if program is None:
    fn, _, _ = _parts(build(get_policy('none')), args)
    program = auto_cache.jaxpr_fingerprint(jax.make_jaxpr(fn)(*_abstract(args)))
  shapes = [str(a) for a in jax.tree_util.tree_leaves(_abstract(args))]
  return {'program': program, 'args': shapes, 'env': auto_cache.environment(target),
          'budget': budget.text, 'mem_fraction': mem_fraction() if budget.device else None,
          'num_layers': num_layers, 'max_compiles': max_compiles}


__all__ = ['AutoError', 'BudgetError', 'Choice', 'choose', 'plan', 'parse_budget']
