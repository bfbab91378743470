"""The policy table both reports print, its Pareto front, JSON rows and plot.

Shared by ``python -m remat.report --fn`` (any function) and the model-zoo
report (``python -m bench.report``), so both print and write the same figures.
A row holds the compiled memory (:mod:`remat.memory`), residuals
(:mod:`remat.residuals`), FLOPs (:mod:`remat.flops`) and optional step time
of one policy, with ratios to the baseline row: ``none``, or the user's own
untouched function when one is measured as ``reference`` (then the first row).
"""

from __future__ import annotations

import json
from typing import Any

from remat.memory import format_bytes
from remat.residuals import by_source, by_tag

# The label of a per-block yardstick row (remat.measure(per_block=...)): 'per-block:full'.
PER_BLOCK = 'per-block:'
LEGEND = ('# temp/peak/host: XLA memory plan; residual: bytes saved for backward (jaxpr); '
          'recompute: matmul+conv FLOPs / none; * = Pareto front (temp vs recompute)')
OFFLOAD_NOTE = ('# offload policies: host offload is a no-op on the CPU backend, so they show no '
                'host bytes here; use --target h100|h200 for a GPU plan')


def pareto_front(points: dict[str, tuple[float, float]]) -> set[str]:
  """Names not dominated in (memory, cost): no other point is <= in both and < in one."""
  front = set()
  for name, (m, c) in points.items():
    if not any((m2 <= m and c2 <= c) and (m2 < m or c2 < c) for m2, c2 in points.values()):
      front.add(name)
  return front


def rows(results: dict[str, Any], baseline: str = 'none') -> list[dict]:
  """One JSON-ready row per policy, with ratios to ``baseline`` and the Pareto flag.

  Args:
    results: spec (or the reference's label) -> :class:`remat.measuring.Measurement`;
      must hold ``baseline``.
    baseline: the row every ratio is to: 'none', or the label of the user's
      untouched function.
  """
  base = results[baseline]
  ratio = lambda a, b: (a / b) if a is not None and b else None
  front = pareto_front({s: (m.memory.temp, m.flops.flops) for s, m in results.items()})
  # A stack row beside the per-block yardstick of its rule: 'full' beside 'per-block:full'.
  per_block = {s[len(PER_BLOCK):]: m for s, m in results.items() if s.startswith(PER_BLOCK)}
  out = []
  for spec, m in results.items():
    out.append({
        'policy': spec, **{k: getattr(m.memory, k) for k in
                           ('argument', 'output', 'alias', 'temp', 'host_temp')},
        'peak': m.memory.peak, 'residual_bytes': m.residual_bytes,
        'residual_by_tag': by_tag(list(m.residuals)),
        'residual_top_sources': by_source(list(m.residuals), top=8),
        'flops': m.flops.flops, 'flops_exact': m.flops.exact,
        'memory_ratio': ratio(m.memory.temp, base.memory.temp),
        'peak_ratio': ratio(m.memory.peak, base.memory.peak), 'baseline': baseline,
        'recompute_ratio': ratio(m.flops.flops, base.flops.flops),
        'step_seconds': m.step_seconds, 'time_ratio': ratio(m.step_seconds, base.step_seconds),
        'per_block_ratio': ratio(m.memory.temp, per_block[spec].memory.temp)
        if spec in per_block else None,
        'pareto': spec in front})
  return out


def format_table(table: list[dict], header: str, timed: bool) -> str:
  """The text table: one line per row of :func:`rows` under ``header``.

  Against a reference (the user's untouched function) the ratio columns are
  ``temp/ref``, ``peak/ref`` and ``flops/ref``; against ``none`` they are
  ``mem/none`` and ``recompute``, as they always were.
  """
  ref = bool(table) and table[0].get('baseline', 'none') != 'none'
  pb = any(r.get('per_block_ratio') is not None for r in table)
  cols = f"{'policy':<26}{'temp':>11}{'peak':>11}{'residual':>11}{'host':>12}"
  cols += f"{'temp/ref':>9}{'peak/ref':>9}{'flops/ref':>10}" if ref else \
      f"{'mem/none':>9}{'recompute':>10}"
  cols += f"{'time':>8}" if timed else ''
  cols += f"{'temp/pb':>9}" if pb else ''
  lines = [header, cols + '  pareto']
  for r in table:
    line = (f"{r['policy']:<26}{format_bytes(r['temp']):>11}{format_bytes(r['peak']):>11}"
            f"{format_bytes(r['residual_bytes']):>11}{format_bytes(r['host_temp']):>12}"
            f"{r['memory_ratio']:>8.1%}" + (f"{r['peak_ratio']:>8.1%} " if ref else '')
            + f"{r['recompute_ratio']:>9.3f}x")
    if timed:
      line += f"{r['time_ratio']:>7.2f}x"
    if pb:
      line += (f"{r['per_block_ratio']:>8.1%}" if r.get('per_block_ratio') is not None
               else ' ' * 9)
    lines.append(line + ('  *' if r['pareto'] else ''))
  return '\n'.join(lines)


def footer(table: list[dict], target_name: str) -> list[str]:
  """Lines printed under the table: the legend, and the CPU offload caveat when it applies."""
  from remat.policies import get_policy
  lines = [LEGEND]
  if table and table[0].get('baseline', 'none') != 'none':
    lines.append(f"# temp/ref, peak/ref, flops/ref and time: ratios to '{table[0]['baseline']}', "
                 'your untouched function (the first row), not to the stack under none')
  if any(r['policy'].startswith(PER_BLOCK) for r in table):
    lines.append('# per-block:RULE: the same model, each layer in jax.checkpoint(policy=RULE) in a '
                 'Python loop (the one-line nn.remat habit); temp/pb: a row against the '
                 'per-block row of its rule')
  specs = [r['policy'] for r in table if r['policy'] != r.get('baseline', 'none')
           and not r['policy'].startswith(PER_BLOCK)] + ['none']
  if target_name == 'cpu' and any(get_policy(s).offloads for s in specs):
    lines.append(OFFLOAD_NOTE)
  return lines


def plot_front(table: list[dict], path: str, title: str):
  """PNG: temp memory against recompute ratio, Pareto front joined, points labelled."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(8, 5.5))
  labels = {}  # policies that land on the same point share one label
  for r in table:
    xy = (round(r['recompute_ratio'], 4), r['temp'] / 2**30)
    labels.setdefault(xy, []).append(r['policy'])
    ax.scatter(*xy, color='C3' if r['pareto'] else 'C0', zorder=3)
  for xy, names in labels.items():
    ax.annotate(' / '.join(names), xy, fontsize=7, xytext=(4, 3), textcoords='offset points')
  front = sorted((r['recompute_ratio'], r['temp'] / 2**30) for r in table if r['pareto'])
  ax.plot(*zip(*front), color='C3', lw=1, label='Pareto front')
  ax.set_xlabel('recompute ratio (matmul FLOPs / none)')
  ax.set_ylabel('compiled temp memory (GiB)')
  ax.set_title(title, fontsize=9)
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def write_json(path: str, environment: dict, body: dict) -> None:
  """Writes ``{'environment': ..., **body}`` (body: ``{'policies': rows}`` or ``{'sweep': ...}``)."""
  with open(path, 'w') as f:
    json.dump({'environment': environment, **body}, f, indent=1)
