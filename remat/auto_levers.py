"""``--remat=auto`` over every lever: the fastest (policy, microbatches, optimizer offload) that fits.

:func:`remat.auto.choose` finds the policy of least recompute whose plan fits a
budget for one program. When the global batch does not fit under any policy,
or only under a heavy one, a lighter policy on smaller microbatches (gradient
accumulation), or the optimizer state in host memory, may cost less time.
:func:`choose_levers` searches those settings too, with ``build(policy,
microbatches, offload)`` giving the program of each, and ranks the plans that
fit by a stated cost model (:class:`CostModel`, docs/making-a-run-fit.md)::

    seconds = FLOPs / flops_per_s                         compute, recompute included
            + (K - 1) * microbatch_bytes / memory_bytes_per_s   each extra microbatch
            + 2 * host_bytes / host_bytes_per_s           host memory in and out

where ``microbatch_bytes`` is the weights read twice (forward and backward) and
the float32 gradient sum read and written, and ``host_bytes`` is what the
compiled plan keeps in host memory (optimizer state, offloaded activations). FLOPs are counted exactly (:mod:`remat.flops`);
peaks are the compiler's plans; only the ranking uses the model.

The search stays small:

* settings are taken in order of a lower bound of their cost (``none``'s FLOPs
  on the whole batch, their microbatch and known transfer terms), and skipped
  once the bound reaches the cost of the best plan found: none can beat it;
* a setting with less accumulation and no more offload than one where nothing
  fit is skipped (a larger microbatch keeps more, never less);
* within a setting, :func:`remat.auto.choose` finds its least-recompute plan,
  the least cost there but for transfers: on GPU targets it searches twice,
  with and without ``offload:`` rules (activations in host memory), and the
  cheaper answer stands; answers are cached on disk, and every plan compiled
  that fits is ranked with the others.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import jax

from remat import auto
from remat.auto_budget import Budget, parse_budget
from remat.measuring import _abstract, _parts, step_flops
from remat.memory import MemoryStats, format_bytes
from remat.policies import get_policy
from remat.targets import Target, get_target


@dataclasses.dataclass(frozen=True)
class CostModel:
  """The rates the estimated step time uses (see the module docstring).

  Attributes:
    flops_per_s: matmul/conv FLOP rate.
    memory_bytes_per_s: device memory bandwidth (weights and gradient sums).
    host_bytes_per_s: host <-> device link, each direction.
    source: where the figures come from.
  """
  flops_per_s: float
  memory_bytes_per_s: float
  host_bytes_per_s: float
  source: str

  def terms(self, flops: float, microbatches: int, microbatch_bytes: float,
            host_bytes: float) -> tuple[float, float, float]:
    """(compute, microbatch, host transfer) seconds of one step."""
    return (flops / self.flops_per_s,
            (microbatches - 1) * microbatch_bytes / self.memory_bytes_per_s,
            2 * host_bytes / self.host_bytes_per_s)


# Nominal rates: H100 SXM5 and H200 dense BF16 tensor-core peak 989.4 TFLOP/s (NVIDIA data
# sheets), device memory bandwidth from the target's config (remat/targets/*.txtpb), PCIe Gen5
# x16 64 GB/s per direction. Real steps reach a fraction of each; the model only ranks plans.
GPU_FLOPS = 989.4e12
PCIE5_BYTES = 64e9
# The CPU backend: host and device memory are the same RAM (offload is no lever there). The
# rates are rough figures for a few cores with AVX2 and a DDR4 channel or two; only their
# ratio matters to the ranking, which weighs extra microbatches against recompute.
CPU_MODEL = CostModel(1e11, 2e10, 2e10, 'nominal CPU: 100 GFLOP/s, 20 GB/s memory')


def cost_model(target: Target) -> CostModel:
  """The :class:`CostModel` of ``target`` (nominal rates; see the module constants)."""
  if target.sharding is None:
    return CPU_MODEL
  bw = target.memory_bandwidth or 3.35e12
  return CostModel(GPU_FLOPS, bw, PCIE5_BYTES,
                   f'nominal {target.name}: {GPU_FLOPS / 1e12:.1f} TFLOP/s BF16, '
                   f'{bw / 1e12:.2f} TB/s memory, {PCIE5_BYTES / 1e9:.0f} GB/s PCIe')


@dataclasses.dataclass(frozen=True)
class Plan:
  """One compiled plan that fits, with its estimated time by the cost model."""
  spec: str
  microbatches: int
  offload: bool
  peak: int
  temp: int
  host: int
  flops: int
  terms: tuple[float, float, float]

  @property
  def seconds(self) -> float:
    return sum(self.terms)

  def levers(self, batch_size: int) -> str:
    """e.g. 'full, 2 microbatches of 8, optimizer state on the host'."""
    mb = ('whole batch' if self.microbatches == 1 else
          f'{self.microbatches} microbatches of {batch_size // self.microbatches}')
    return f"{self.spec}, {mb}{', optimizer state on the host' if self.offload else ''}"


@dataclasses.dataclass(frozen=True)
class LeverChoice:
  """The answer: the fastest plan that fits by the cost model, and what the search did.

  Attributes:
    budget, budget_bytes, target, batch_size: what was asked.
    best: the chosen plan; ``choice`` is :func:`remat.auto.choose`'s answer for its levers.
    runners_up: the next plans by estimated time among those compiled that fit (up to two).
    settings: one dict per lever setting: microbatches, offload, outcome and its lower bound.
    model: the :class:`CostModel` used.
    none_flops: ``none``'s FLOPs on the whole batch (the recompute ratios' base).
    seconds: the search's wall time.
  """
  budget: str
  budget_bytes: int
  target: str
  batch_size: int
  best: Plan
  runners_up: tuple[Plan, ...]
  choice: auto.Choice
  settings: tuple[dict, ...]
  model: CostModel
  none_flops: int
  seconds: float

  @property
  def spec(self) -> str:
    return self.best.spec

  @property
  def microbatches(self) -> int:
    return self.best.microbatches

  @property
  def offload(self) -> bool:
    return self.best.offload

  def summary(self) -> str:
    """One line: the levers, the plan against the budget, the search's cost."""
    searched = sum(1 for s in self.settings if s['outcome'] != 'skipped')
    return (f'{self.budget} -> {self.best.levers(self.batch_size)}: peak '
            f'{format_bytes(self.best.peak)} within {format_bytes(self.budget_bytes)} on '
            f'{self.target}; est. {self.best.seconds * 1e3:.3g} ms/step by the cost model '
            f'({searched} of {len(self.settings)} lever settings searched in '
            f'{self.seconds:.0f} s)')

  def table(self) -> str:
    """The choice and its runners-up, one row each, with the model's terms."""
    w = max(len(p.spec) for p in (self.best, *self.runners_up)) + 2
    head = (f"{'':<6}{'policy':<{w}}{'microbatches':>14}{'optimizer':>11}{'peak':>12}"
            f"{'host':>11}{'recompute':>11}{'est. ms':>9}{'compute':>9}{'accum':>8}"
            f"{'host io':>9}")
    rows = [f'# {self.budget} ({format_bytes(self.budget_bytes)}) on {self.target}, batch '
            f'{self.batch_size}: the fastest plan that fits by the cost model', head]
    for label, p in zip(('pick', '2nd', '3rd'), (self.best, *self.runners_up)):
      mb = f'{p.microbatches} x {self.batch_size // p.microbatches}'
      c, a, h = (t * 1e3 for t in p.terms)
      rows.append(f"{label:<6}{p.spec:<{w}}{mb:>14}{'host' if p.offload else 'device':>11}"
                  f'{format_bytes(p.peak):>12}{format_bytes(p.host):>11}'
                  f'{p.flops / self.none_flops:>10.3f}x{p.seconds * 1e3:>9.3g}{c:>9.3g}'
                  f'{a:>8.3g}{h:>9.3g}')
    rows.append(f'# est. ms = compute (FLOPs) + accum (extra microbatches) + host io (optimizer '
                f'state and activations in host memory, in and out): {self.model.source}; peak '
                f'and host: XLA plans')
    return '\n'.join(rows)

  def to_json(self) -> dict:
    d = dataclasses.asdict(self)
    d['choice'] = self.choice.to_json()
    return d


def _weights(program, args) -> tuple[int, int]:
  """(bytes, float32 gradient bytes) of the parameters ``program`` differentiates."""
  leaves = jax.tree_util.tree_leaves(_abstract(_parts(program, args)[2][1]))
  inexact = [a for a in leaves if jax.numpy.issubdtype(a.dtype, jax.numpy.inexact)]
  return (sum(a.size * a.dtype.itemsize for a in leaves), sum(4 * a.size for a in inexact))


def choose_levers(build: Callable, *example_args: Any, budget: str | Budget, batch_size: int,
                  target: Target | str = 'cpu', num_layers: int | None = None,
                  microbatches: Sequence[int] | None = None, offload: Sequence[bool] = (False,),
                  model: CostModel | None = None, weight_bytes: int | None = None,
                  cache: bool = True, cache_key: dict | None = None,
                  max_compiles: int = auto.MAX_COMPILES,
                  log: Callable[[str], None] | None = None,
                  shardings: tuple | None = None) -> LeverChoice:
  """The fastest (policy, microbatches, offload) whose compiled plan fits ``budget``.

  Args:
    build: ``build(policy, microbatches, offload) -> program`` (a loss or a
      :class:`remat.TrainStep`; one with its own ``compile`` is planned by it).
    *example_args: the program's arguments, the same for every setting (the
      global batch; the program splits it into microbatches).
    budget: as for :func:`remat.auto.choose`; ``auto:Fx`` is relative to ``none``
      on the whole batch with the optimizer state on the device.
    batch_size: the global batch (for the table and the default ``microbatches``).
    target: 'cpu', 'h100', 'h200' or a Target.
    num_layers: the layer stack's depth (segmentings need it).
    microbatches: the K to try (default: every divisor of ``batch_size``).
    offload: the optimizer placements to try (``(False, True)`` on a GPU target).
    model: the cost model (default: :func:`cost_model` of the target).
    weight_bytes: bytes of every weight a microbatch reads (default: the
      differentiated parameters'; pass the frozen base's too for adapters).
    cache, cache_key, max_compiles, shardings: as for :func:`remat.auto.choose`,
      per setting.
    log: called with one line per step of the search.

  Raises:
    BudgetError: a budget that cannot be read.
    AutoError: nothing fits under any setting (one line: the least peak found).
  """
  start = time.perf_counter()
  log = log or (lambda s: None)
  target = get_target(target) if isinstance(target, str) else target
  budget = parse_budget(budget) if isinstance(budget, str) else budget
  model = model or cost_model(target)
  ks = sorted(set(microbatches or [k for k in range(1, batch_size + 1) if batch_size % k == 0]))
  base = build(get_policy('none'), 1, False)
  params_bytes, grad_bytes = _weights(base, example_args)
  mb_bytes = 2 * (weight_bytes if weight_bytes is not None else params_bytes) + 2 * grad_bytes
  offload = sorted(set(offload))
  gpu = target.sharding is not None
  nbytes = budget.nbytes
  if nbytes is None and budget.fraction is None:   # plain auto: the target's memory
    nbytes = budget.resolve(0, target.device_memory, target.name)
  if nbytes is None and (ks[0], offload[0]) != (1, False):
    nbytes = budget.resolve(auto.plan(base, example_args, target, shardings).peak, None, '')
  # Otherwise auto:Fx resolves in the first setting searched (K=1 on the device), whose none
  # is the whole batch's.
  # none's FLOPs bound every plan's from below. They are counted once, on the whole batch:
  # a microbatched step does the same matmuls on slices of it (per-example layers), so
  # the count does not depend on K (the settings searched report their own).
  none_flops = step_flops(base, *example_args).flops
  host_known = [0]   # the state's host bytes, once a plan with offload has shown them

  def bound(k: int, off: bool) -> float:
    return sum(model.terms(none_flops, k, mb_bytes, host_known[0] if off else 0))

  # Every plan's peak counts its arguments: without offload, none of K fits below them.
  arg_bytes = sum(a.size * a.dtype.itemsize
                  for a in jax.tree_util.tree_leaves(_abstract(example_args)))
  pending = [(k, off) for k in ks for off in offload]
  settings, plans, infeasible = [], [], []
  picks: dict[tuple[int, bool], tuple[Plan, auto.Choice]] = {}   # each setting's own answer
  answers_of: dict[tuple[int, bool], list[auto.Choice]] = {}
  least = None   # (peak, spec, k, off): the least plan of the settings where nothing fit
  while pending:
    pending.sort(key=lambda s: (bound(*s), s))
    k, off = pending.pop(0)
    lb = bound(k, off)
    row = {'microbatches': k, 'offload': off, 'bound_s': lb}
    say = lambda s, k=k, off=off: log(f'levers: K={k}{" offload" if off else ""}: {s}')
    best = min(plans, key=lambda p: p.seconds, default=None)
    why = None
    if best is not None and lb >= best.seconds:
      why = 'its least cost is no less than the best plan'
    elif not off and nbytes is not None and arg_bytes > nbytes:
      why = (f'its arguments alone (parameters, optimizer state, batch: '
             f'{format_bytes(arg_bytes)}) exceed the budget')
    elif any(k <= k2 and off <= off2 for k2, off2 in infeasible):
      why = 'fewer (so larger) microbatches than a setting where nothing fit'
    if why is not None:
      settings.append({**row, 'outcome': 'skipped', 'why': why})
      say(f'skipped: {why}')
      continue
    key = None if cache_key is None else {**cache_key, 'microbatches': k, 'offload': off}
    answers, errors = [], []
    # remat.auto takes the least recompute; an offload: rule (activations in host memory) can
    # be that and still cost more in transfers than another rule's recompute, so on a GPU the
    # rules that keep activations on the device are searched apart, and both answers ranked.
    for rules in ((False, True) if gpu else (False,)):
      try:
        fixed = budget if nbytes is None else Budget(budget.text, nbytes=nbytes)
        answers.append(auto.choose(lambda pol, k=k, off=off: build(pol, k, off), *example_args,
                                   budget=fixed, target=target, num_layers=num_layers,
                                   cache=cache, cache_key=key, max_compiles=max_compiles,
                                   log=say, shardings=shardings, offload_rules=rules))
        nbytes = answers[-1].budget_bytes
      except auto.AutoError as e:
        nbytes = nbytes if nbytes is not None else e.budget_bytes
        errors.append(e)
    if not answers:
      e = min(errors, key=lambda e: e.least_peak if e.least_peak is not None else 1 << 62)
      infeasible.append((k, off))
      settings.append({**row, 'outcome': 'nothing fits', 'least_peak': e.least_peak,
                       'least_spec': e.least_spec})
      if e.least_peak is not None and (least is None or e.least_peak < least[0]):
        least = (e.least_peak, e.least_spec, k, off)
      say(f'nothing fits (least {format_bytes(e.least_peak or 0)})')
      continue
    # Host bytes move each step: the optimizer state (offloaded) and activations an offload:
    # rule keeps in host memory (the plan's host temp), each once in and once out.
    host = lambda argument, temp, off=off: (argument if off else 0) + temp
    if off:
      host_known[0] = answers[0].memory.host_argument
    seen = {(p.spec, p.microbatches, p.offload) for p in plans}
    for choice in answers:
      for rec in choice.compiled:
        if rec['fits'] and (rec['spec'], k, off) not in seen:
          seen.add((rec['spec'], k, off))
          h = host(rec.get('host_argument', 0), rec.get('host_temp', 0))
          plans.append(Plan(rec['spec'], k, off, rec['peak'], rec['temp'], h, rec['flops'],
                            model.terms(rec['flops'], k, mb_bytes, h)))
    # The setting's answer: the cheaper of the searches' (each the least recompute that fits).
    mine, choice = min(((Plan(c.spec, k, off, c.memory.peak, c.memory.temp,
                              host(c.memory.host_argument, c.memory.host_temp), c.flops,
                              model.terms(c.flops, k, mb_bytes,
                                          host(c.memory.host_argument, c.memory.host_temp))), c)
                        for c in answers), key=lambda pc: pc[0].seconds)
    picks[(k, off)] = (mine, choice)
    answers_of[(k, off)] = answers
    settings.append({**row, 'outcome': choice.spec, 'peak': choice.memory.peak,
                     'est_s': mine.seconds, 'cached': all(c.cached for c in answers)})
    say(f'{choice.spec} plans {format_bytes(choice.memory.peak)}, est. '
        f'{mine.seconds * 1e3:.3g} ms')
  if not picks:
    spec, peak = (least[1], least[0]) if least else (None, None)
    raise auto.AutoError(_nothing_fits(budget, nbytes, target, batch_size, ks, offload, least,
                                       arg_bytes), spec, peak, nbytes)
  # Any plan compiled that fits may win, not only each setting's least recompute: an
  # offload: policy's transfers can cost more than another policy's recompute.
  best = min(plans, key=lambda p: (p.seconds, p.peak))
  choice = picks[(best.microbatches, best.offload)][1]
  if choice.spec != best.spec:   # the record describes the plan that is taken
    rec = next(r for c in answers_of[(best.microbatches, best.offload)] for r in c.compiled
               if r['spec'] == best.spec)
    choice = dataclasses.replace(choice, spec=best.spec, flops=best.flops,
                                 memory=MemoryStats(**rec['memory']))
  same = lambda p: (p.spec, p.microbatches, p.offload) == (best.spec, best.microbatches,
                                                            best.offload)
  runners = sorted((p for p in plans if not same(p)), key=lambda p: (p.seconds, p.peak))[:2]
  return LeverChoice(budget.text, nbytes, target.name, batch_size, best, tuple(runners),
                     choice, tuple(settings), model, none_flops, time.perf_counter() - start)


def _nothing_fits(budget, nbytes, target, batch_size, ks, offload, least, arg_bytes) -> str:
  where = f"microbatches {','.join(map(str, ks))}"
  if True in offload:
    where += (', optimizer state on the device or the host' if False in offload else
              ', optimizer state on the host')
  found = (f'; the arguments alone (parameters, optimizer state, batch) are '
           f'{format_bytes(arg_bytes)}')
  if least is not None:
    peak, spec, k, off = least
    found = (f'; the least peak any plan reaches is {format_bytes(peak)} ({spec}, {k} '
             f"microbatches of {batch_size // k}{', optimizer on the host' if off else ''})")
  return (f'{budget.text}: no plan fits {budget.describe(nbytes)} on {target.name} for batch '
          f'{batch_size} (every policy; {where}){found}')


__all__ = ['CostModel', 'LeverChoice', 'Plan', 'choose_levers', 'cost_model']
