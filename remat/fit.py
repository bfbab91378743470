"""The largest batch (or sequence length) whose compiled plan fits a memory budget, per policy.

``largest_fitting(case, spec, budget_bytes, target)`` compiles plans only
(nothing runs, so the sizes of an H200 can be planned on a CPU) and returns
the largest value ``v`` with ``peak(v) <= budget`` and ``peak(v + 1) > budget``,
where ``case(v) -> (build, example_args)`` gives the program at size ``v``.

Plans grow with the batch, nearly linearly, so the search guesses from the
slope between two plans, gallops from the guess to bracket the answer, and
bisects the bracket: about 5-8 compiles per policy instead of the ~2 log2(v)
of a blind doubling-and-bisection. Every compile is a real plan; the slope is
only used to choose where to look.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Callable, Sequence

from remat.auto import plan
from remat.measuring import step_flops
from remat.memory import format_bytes
from remat.policies import get_policy
from remat.targets import Target

MAX_VALUE = 1 << 20
# A first slope below this fraction of the first plan's peak is taken for a flat start, whose
# guess is capped at FLAT_GUESS times the second size planned (see largest_fitting).
FLAT_START = 0.005
FLAT_GUESS = 64


@dataclasses.dataclass(frozen=True)
class Fit:
  """One policy's answer: ``value`` fits (0 if even the smallest does not), ``value + 1`` does not.

  Attributes:
    spec: the policy.
    value: the largest fitting size, 0 if ``low`` does not fit.
    peak: the plan's peak at ``value`` (None when 0).
    next_peak: the plan's peak at ``value + 1`` (over the budget).
    flops_per_item: recompute-inclusive FLOPs at ``value`` divided by it (None when 0).
    compiles: plans compiled.
  """
  spec: str
  value: int
  peak: int | None
  next_peak: int | None
  flops_per_item: float | None
  compiles: int


def largest_fitting(case: Callable[[int], tuple], spec: str, budget_bytes: int, target: Target,
                    low: int = 1, high: int = MAX_VALUE, num_layers: int | None = None) -> Fit:
  """The largest size in ``[low, high]`` whose plan under ``spec`` fits ``budget_bytes``.

  Args:
    case: ``case(v) -> (build, example_args)`` for size ``v`` (a batch size, a
      sequence length).
    spec: the policy.
    budget_bytes: the bound on the plan's peak.
    target: where to compile for.
    low, high: the range searched.
    num_layers: checks ``seg:K`` specs.
  """
  peaks: dict[int, int] = {}

  def peak(v: int) -> int:
    if v not in peaks:
      build, args = case(v)
      peaks[v] = plan(build(get_policy(spec, num_layers=num_layers)), args, target).peak
    return peaks[v]

  fits = lambda v: peak(v) <= budget_bytes
  if not fits(low):
    return Fit(spec, 0, None, peak(low), None, len(peaks))
  second = min(high, 2 * low)
  if second == low:
    return _done(spec, low, peaks, case, num_layers, high, peak)
  slope = max(1.0, (peak(second) - peak(low)) / (second - low))
  guess = int(low + (budget_bytes - peak(low)) / slope)
  if slope < FLAT_START * peak(low):
    # A plan can stay flat over the first sizes and grow beyond them: on a GPU plan the stack's
    # saved values wait in gradient rows until those are full (Llama-3.1-8B, full fine-tune,
    # state on the host, H100 plan: the same peak at one sequence and at two). The slope says
    # nothing then, and its guess can be absurd (a batch of 655,077 sequences of 4096 tokens).
    guess = min(guess, FLAT_GUESS * second)
  ok, bad = low, None   # ok fits; bad (if known) does not
  if fits(second):
    ok = second
  else:
    bad = second
  if bad is None:
    v = min(high, max(ok + 1, guess))
    step = max(1, v // 64)
    while v <= high:   # gallop from the guess until a plan does not fit
      if fits(v):
        ok, v, step = v, min(high + 1, v + step), step * 2
      else:
        bad = v
        break
    if bad is None:
      return _done(spec, high, peaks, case, num_layers, high, peak)
  while bad - ok > 1:
    mid = (ok + bad) // 2
    ok, bad = (mid, bad) if fits(mid) else (ok, mid)
  return _done(spec, ok, peaks, case, num_layers, high, peak)


def _done(spec, value, peaks, case, num_layers, high, peak) -> Fit:
  nxt = peak(value + 1) if value < high else None
  build, args = case(value)
  flops = step_flops(build(get_policy(spec, num_layers=num_layers)), *args).flops
  return Fit(spec, value, peaks[value], nxt, flops / value, len(peaks))


def fit_table(case: Callable[[int], tuple], specs: Sequence[str], budget_bytes: int,
              target: Target, num_layers: int | None = None, low: int = 1,
              high: int = MAX_VALUE, progress: bool = True) -> list[Fit]:
  """:func:`largest_fitting` for every spec (a tqdm bar on stderr with ``progress``)."""
  todo = list(specs)
  if progress:
    from tqdm import tqdm
    todo = tqdm(todo, desc='fitting', unit='policy', file=sys.stderr)
  return [largest_fitting(case, s, budget_bytes, target, low, high, num_layers) for s in todo]


def format_fits(fits: Sequence[Fit], header: str, axis: str = 'batch') -> str:
  """The text table: per policy the largest fitting size, its peak, the next size's peak."""
  base = next((f.flops_per_item for f in fits if f.spec == 'none' and f.flops_per_item), None)
  lines = [header, f"{'policy':<28}{'max ' + axis:>10}{'peak':>12}{'peak at +1':>13}"
           f"{'recompute':>10}{'plans':>7}"]
  for f in fits:
    rec = f'{f.flops_per_item / base:.3f}x' if base and f.flops_per_item else '-'
    lines.append(f'{f.spec:<28}{f.value:>10}{format_bytes(f.peak or 0):>12}'
                 f'{format_bytes(f.next_peak or 0):>13}{rec:>10}{f.compiles:>7}')
  lines.append(f'# max {axis}: largest size whose compiled plan peak fits; peak at +1 is over it; '
               'recompute: FLOPs per item / none')
  return '\n'.join(lines)


def plot_fits(fits: Sequence[Fit], path: str, title: str, axis: str = 'batch'):
  """PNG: a horizontal bar per policy, the largest fitting size."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(8, 0.4 * len(fits) + 1.5))
  ax.barh([f.spec for f in fits], [f.value for f in fits], color='C0')
  for i, f in enumerate(fits):
    ax.annotate(str(f.value), (f.value, i), xytext=(3, -3), textcoords='offset points', fontsize=8)
  ax.invert_yaxis()
  ax.set_xlabel(f'largest {axis} whose compiled plan fits')
  ax.set_title(title, fontsize=9)
  ax.grid(alpha=0.3, axis='x')
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
