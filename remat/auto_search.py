"""The search behind :func:`remat.auto.choose`: plans compiled, FLOPs counted, candidates pruned.

:class:`_Search` holds one search's memoised plans, FLOP counts and residual
traces; :func:`plan` compiles one program's plan for a target. How the search
goes is in :mod:`remat.auto`'s docstring and docs/auto.md.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import heapq
import os
import time
from typing import Any, Callable

import jax

from remat.auto_budget import Budget
from remat.auto_model import Calibration, Candidate, layer_candidates, stack_candidates
from remat.flops import _walk
from remat.layout import compiling_for
from remat.measuring import _abstract, _parts, step_flops, step_residuals
from remat.memory import MemoryStats, compiled_memory, format_bytes
from remat.policies import PolicyError, get_policy, sqrt_segment_size
from remat.residuals import by_tag
from remat.tags import iter_eqns
from remat.targets import Target, with_shardings

# LLVM's optimisation of CPU code is most of a compile and changes neither buffer assignment
# nor the plan (tests/test_auto.py checks the plans agree); the GPU pipeline is left as it is.
CPU_PLAN_OPTIONS = {'xla_backend_optimization_level': 0,
                    'xla_llvm_disable_expensive_passes': True}
MAX_COMPILES = 8      # compiles after none and full before settling for the least estimate
MAX_TRACES = 16       # per-layer rules' FLOPs counted before trusting the model's
# Plans compiled at once. XLA's compile of one plan runs on one core and releases the GIL, so on
# a machine with two cores two finalists (or the two anchors, while the calibration traces run)
# cost about one compile's wall time; the answer is the same as compiling them one by one.
PARALLEL = max(1, min(2, os.cpu_count() or 1))


class AutoError(PolicyError):
  """A budget no policy meets, or a search that cannot run; the message is one line.

  Attributes:
    least_spec, least_peak: the compiled plan of least peak, when a search ran and
      nothing fit (what :func:`remat.auto_levers.choose_levers` reports across levers).
  """

  def __init__(self, message: str, least_spec: str | None = None, least_peak: int | None = None,
               budget_bytes: int | None = None):
    super().__init__(message)
    self.least_spec, self.least_peak, self.budget_bytes = least_spec, least_peak, budget_bytes

def plan(program, example_args, target: Target, shardings: tuple | None = None) -> MemoryStats:
  """The compiled memory plan of ``program`` for ``target`` (compile only).

  ``shardings``: ``(in_shardings, out_shardings)`` of a program on a device
  mesh (local devices); the plan is then XLA's per-device plan. A
  :class:`remat.measuring.TrainStep` with its own ``compile`` is compiled by it.
  """
  if getattr(program, 'compile', None) is not None and shardings is None:
    return compiled_memory(program.compile(example_args, target), target.name)
  lowered, options = _lower(program, example_args, target, shardings)
  return compiled_memory(lowered.compile(compiler_options=options or None), target.name)


def _lower(program, example_args, target: Target, shardings: tuple | None):
  """(lowered program, compiler options): the part of a plan that needs the GIL."""
  traced, options = _trace(program, example_args, target, shardings)
  return traced.lower(), options


def _trace(program, example_args, target: Target, shardings: tuple | None):
  """(traced step, compiler options): one trace serves the FLOP count and the lowering."""
  fn, donate, _ = _parts(program, example_args)
  options = dict(target.compiler_options)
  if target.sharding is None and jax.default_backend() == 'cpu':
    options.update(CPU_PLAN_OPTIONS)
  if shardings is None:
    jitted = jax.jit(fn, donate_argnums=donate)
    args = target.place(_abstract(example_args))
  else:
    jitted = jax.jit(fn, in_shardings=shardings[0], out_shardings=shardings[1],
                     donate_argnums=donate)
    args = with_shardings(_abstract(example_args), shardings[0])
  with compiling_for(target.platform):   # stacks with layout='auto' choose for the target
    return jitted.trace(*args), options


def mesh_description(shardings: tuple | None) -> dict | None:
  """What a cache key needs of ``(in_shardings, out_shardings)``: mesh axes, devices, specs."""
  if shardings is None:
    return None
  leaves = [s for s in jax.tree_util.tree_leaves(shardings)
            if isinstance(s, jax.sharding.Sharding)]
  mesh = next((s.mesh for s in leaves if isinstance(s, jax.sharding.NamedSharding)), None)
  return {'axes': dict(mesh.shape) if mesh is not None else None,
          'devices': sorted({d.device_kind for s in leaves for d in s.device_set}),
          'device_count': len({d for s in leaves for d in s.device_set}),
          'specs': [str(getattr(s, 'spec', s)) for s in leaves]}


class _Search:
  """One search: memoised plans, FLOP counts and residual traces of specs."""

  def __init__(self, build, args, target: Target, num_layers: int | None, log: Callable,
               shardings: tuple | None = None, parallel: int = PARALLEL,
               offload_rules: bool | None = None):
    self.build, self.args, self.target, self.n, self.log = build, args, target, num_layers, log
    self.shardings = shardings
    # offload: rules are searched only where they act (GPU targets), unless told otherwise.
    self.offload_rules = (target.sharding is not None if offload_rules is None
                          else offload_rules)
    self.plans: dict[str, MemoryStats] = {}
    self.pending: dict[str, concurrent.futures.Future] = {}
    self.seconds: dict[str, tuple[float, float]] = {}   # spec -> (lowering s, compile s)
    self.flop_counts: dict[str, int] = {}
    self.order: list[str] = []
    self.traces = 0
    self.trace_seconds = 0.0
    self.residual_traces = 0
    self.pool = concurrent.futures.ThreadPoolExecutor(max(1, parallel))
    self.traced: dict[str, Any] = {}   # spec -> (traced step, options), until it is lowered
    self.cpu_start = time.process_time()

  def program(self, spec: str):
    return self.build(get_policy(spec, num_layers=self.n))

  def submit(self, spec: str) -> None:
    """Lowers ``spec``'s step here and compiles it on the pool (no-op if planned or pending)."""
    if spec in self.plans or spec in self.pending:
      return
    program = self.program(spec)
    if getattr(program, 'compile', None) is not None and self.shardings is None:
      # A step with its own compile (optimizer state in host memory): planned as it runs.
      self.traced.pop(spec, None)
      def own_compile():
        t = time.perf_counter()
        mem = compiled_memory(program.compile(self.args, self.target), self.target.name)
        return mem, time.perf_counter() - t
      self.pending[spec] = self.pool.submit(own_compile)
      self.seconds[spec] = (0.0, 0.0)
      self.order.append(spec)
      return
    t = time.perf_counter()
    traced, options = self._traced(spec)
    lowered = traced.lower()
    del self.traced[spec]
    lower_s = time.perf_counter() - t

    def compile_():
      t = time.perf_counter()
      mem = compiled_memory(lowered.compile(compiler_options=options or None), self.target.name)
      return mem, time.perf_counter() - t
    self.pending[spec] = self.pool.submit(compile_)
    self.seconds[spec] = (lower_s, 0.0)
    self.order.append(spec)

  def plan(self, spec: str) -> MemoryStats:
    if spec not in self.plans:
      self.submit(spec)
      mem, compile_s = self.pending.pop(spec).result()
      self.plans[spec] = mem
      self.seconds[spec] = (self.seconds[spec][0], compile_s)
    return self.plans[spec]

  def drain(self) -> None:
    """Waits for every pending compile (each is recorded; none is left running)."""
    for spec in list(self.pending):
      self.plan(spec)

  def _traced(self, spec: str):
    """The step of ``spec`` traced once: its jaxpr is counted, then it is lowered."""
    if spec not in self.traced:
      t = time.perf_counter()
      self.traced[spec] = _trace(self.program(spec), self.args, self.target, self.shardings)
      self.trace_seconds += time.perf_counter() - t
    return self.traced[spec]

  def flops(self, spec: str) -> int:
    if spec not in self.flop_counts:
      if spec in self.plans or spec in self.pending:   # lowered already: count it afresh
        with compiling_for(self.target.platform):   # the program that was compiled
          self.flop_counts[spec] = step_flops(self.program(spec), *self.args).flops
      else:
        self.flop_counts[spec] = _walk(self._traced(spec)[0].jaxpr.jaxpr)[0]
      self.traces += 1
    return self.flop_counts[spec]

  def profile(self) -> str:
    """Where the search's time went: compiles (lower + XLA) and traces, one line."""
    comp = [self.seconds[s][1] for s in self.order if s in self.plans]
    low = sum(self.seconds[s][0] for s in self.order)
    each = ', '.join(f'{c:.0f}' for c in comp)
    return (f'{len(comp)} plans compiled, up to {self.pool._max_workers} at once (XLA compile '
            f's each: {each}; lowering {low:.0f} s in all); traces {self.trace_seconds:.0f} s '
            f'({len(self.flop_counts)} FLOP counts, {self.residual_traces} residual traces); '
            f'{time.process_time() - self.cpu_start:.0f} CPU s in all')

  def residuals(self, spec: str):
    self.residual_traces += 1
    t = time.perf_counter()
    with compiling_for(self.target.platform):
      out = step_residuals(self.program(spec), *self.args)
    self.trace_seconds += time.perf_counter() - t
    return out

  def record(self, budget_bytes: int) -> tuple[dict, ...]:
    self.drain()
    return tuple({'spec': s, 'peak': self.plans[s].peak, 'temp': self.plans[s].temp,
                  'host_argument': self.plans[s].host_argument,
                  'host_temp': self.plans[s].host_temp,
                  'memory': dataclasses.asdict(self.plans[s]),
                  'flops': self.flops(s), 'fits': self.plans[s].peak <= budget_bytes,
                  'lower_s': round(self.seconds[s][0], 2),
                  'compile_s': round(self.seconds[s][1], 2)}
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
    say = lambda s: self.log(f'auto: {s}')
    # Both anchors compile while the calibration traces run; full is needed unless none fits.
    self.flops('none')   # one trace each: counted, then lowered
    self.flops('full')
    self.submit('none')
    self.submit('full')
    cal, tags = self.calibrate()
    none, full = self.plan('none'), self.plan('full')
    nbytes = budget.resolve(none.peak, self.target.device_memory, self.target.name)
    say(f'budget {budget.describe(nbytes)}; none plans {format_bytes(none.peak)}')
    if none.peak <= nbytes:
      return 'none', nbytes, False
    say(f'full plans {format_bytes(full.peak)}')
    self.traces = 0   # the cap counts the search's own FLOP counts, not the calibration's
    cands = layer_candidates(cal, tags, offload=self.offload_rules)
    cands += stack_candidates(cal, cands)
    if full.peak > nbytes and not (self.n and self.n >= 2):
      spec, peak = self.least(cands)
      raise AutoError(self._impossible(budget, nbytes, spec, peak, 'without a stack'),
                      spec, peak, nbytes)
    # Estimates within 2% of the none-full range of the budget are compiled rather than trusted.
    tol = 0.02 * max(0, none.peak - full.peak)
    # full is verified already: a candidate must recompute strictly less to be worth a compile.
    best = ('full', cal.flops_full) if full.peak <= nbytes else None
    offset: dict[str, float] = {}
    over: list[frozenset] = []   # tag sets of names: rules whose plans were over the budget
    # Ties in FLOPs go to per-layer rules first: the model is closest on them, and a mix or
    # segmenting pays for stack bookkeeping (a copy of the stack's gradient) that a rule does not.
    order = lambda c: (c.flops, c.kind != 'layer', c.est_peak, not c.stock, c.spec, c)
    heap = [order(c) for c in cands if c.spec not in ('none', 'full')]
    heapq.heapify(heap)

    def next_candidate() -> Candidate | None:
      """The next candidate worth a compile, least (exact) FLOPs first; None when none is left."""
      while heap:
        *_, c = heapq.heappop(heap)
        if c.spec in self.plans or c.spec in self.pending:
          continue
        if c.est_peak + offset.get(c.kind, 0.0) > nbytes + tol:
          continue
        # Saving a superset of a rule's tags keeps at least its residuals: over as well.
        if c.saves is not None and any(o <= c.saves for o in over):
          continue
        if not c.exact and self.traces < MAX_TRACES:
          c.flops = cal.flops_none + c.extra + sum(
              w * (self.flops(dep) - cal.flops_none) for w, dep in c.deps)
          c.exact = True
          heapq.heappush(heap, order(c))
          continue
        # A mix jxA+B that recomputes no less than A alone is beaten by A (it keeps less).
        if c.kind == 'mix' and c.exact and round(c.flops) >= self.flops(c.deps[0][1]):
          continue
        return c
      return None

    say(f'{len(heap)} candidates; compiling those the model says fit, least recompute first')
    queue: list[Candidate] = []   # compiling, in order of FLOPs
    compiles, stop = 0, None
    while True:
      # The next candidates in order compile together; the first that fits is the answer.
      while len(queue) < self.pool._max_workers and stop is None:
        c = next_candidate()
        if c is None:
          stop = 'empty'
        elif best is not None and c.flops >= best[1]:
          stop = 'best'
        elif compiles >= max_compiles:
          stop = 'cap'
        else:
          self.submit(c.spec)
          compiles += 1
          queue.append(c)
      if not queue:
        break
      c = queue.pop(0)
      got = self.plan(c.spec)
      err = got.peak - c.est_peak
      offset[c.kind] = min(offset.get(c.kind, err), err)
      fits = got.peak <= nbytes
      say(f'{c.spec}: plans {format_bytes(got.peak)} (estimated {format_bytes(c.est_peak)}), '
          f'recompute {c.flops / cal.flops_none:.3f}x: {"fits" if fits else "over"}')
      if fits:
        return c.spec, nbytes, False
      if c.saves is not None:
        over.append(c.saves)
    if stop == 'best':
      return best[0], nbytes, False
    if stop == 'cap':
      if best is not None:   # full fits: nothing cheaper was found within the cap
        say(f'compile cap ({max_compiles}) reached; full fits')
        return best[0], nbytes, True
      say(f'compile cap ({max_compiles}) reached; taking the least estimate')
      spec, peak = self.least(cands)
      if peak > nbytes:
        raise AutoError(self._impossible(budget, nbytes, spec, peak, 'after the compile cap'),
                        spec, peak, nbytes)
      return spec, nbytes, True
    if best is not None:
      return best[0], nbytes, False
    spec, peak = self.least(cands)
    if peak <= nbytes:   # the model pruned it, the compiler did not: take it
      return spec, nbytes, False
    raise AutoError(self._impossible(budget, nbytes, spec, peak, f'{len(cands)} candidates'),
                    spec, peak, nbytes)

  def _impossible(self, budget, nbytes, spec, peak, what) -> str:
    return (f"{budget.text}: no policy's plan fits {budget.describe(nbytes)} on "
            f'{self.target.name}; the least memory any reaches is {format_bytes(peak)} peak '
            f'({spec}; {what}, {len(self.plans)} plans compiled)')
