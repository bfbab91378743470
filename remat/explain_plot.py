"""The picture of :func:`remat.explain`: live bytes over XLA's schedule, and what is live at the peak.

One figure for one policy or several overlaid: on the left the live-bytes
curve of each policy (its peak marked; for one policy the forward, backward and
update phases shaded and each marked loop bracketed), on the right one stacked
bar per policy of the peak's categories, topped by the packing loss so that the
bar's height is the plan's bytes. Written as PNG and SVG (matplotlib, Agg).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from remat.explain_analysis import CATEGORIES, Explanation

# One colour per category (the bar) and per phase (the shading), the same in every picture.
CATEGORY_COLORS = dict(zip(CATEGORIES, ('#4c72b0', '#8172b2', '#937860', '#55a868', '#c44e52',
                                        '#dd8452', '#a0a0a0')))
PHASE_COLORS = {'forward': '#c6dbef', 'backward': '#fcbba1', 'update': '#c7e9c0'}


def _unit(peak: float) -> tuple[float, str]:
  return (2**30, 'GiB') if peak >= 2**30 else (2**20, 'MiB')


def plot(explanations: Sequence[Explanation], path: str | Path, title: str = '') -> list[Path]:
  """Writes ``path`` as PNG and SVG (the suffix of ``path`` is replaced); returns both paths."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  from matplotlib.patches import Patch

  exps = list(explanations)
  if not exps:
    raise ValueError('nothing to plot: no explanation given')
  scale, unit = _unit(max(e.plan.peak for e in exps))
  several = len(exps) > 1
  fig, (ax, bar) = plt.subplots(1, 2, figsize=(13, 5.2), width_ratios=(3, 1 + 0.4 * len(exps)),
                                layout='constrained')
  for i, e in enumerate(exps):
    n = len(e.timeline) - 1
    x = [t / max(n, 1) for t in range(n + 1)] if several else list(range(n + 1))
    color = f'C{i}'
    ax.step(x, [b / scale for b in e.timeline], where='post', color=color, lw=1.2,
            label=f'{e.spec}: live peak {e.peak_bytes / scale:.2f} {unit}')
    if any(e.host_timeline):
      ax.step(x, [b / scale for b in e.host_timeline], where='post', color=color, lw=1, ls='--',
              label=f'{e.spec}: host (offloaded)')
    ax.plot(x[e.peak_time], e.peak_bytes / scale, 'o', color=color, ms=6, zorder=4)
    ax.annotate(f'peak ({e.phase_at(e.peak_time)})', (x[e.peak_time], e.peak_bytes / scale),
                xytext=(5, 5), textcoords='offset points', fontsize=8, color=color)
    ax.axhline(e.plan.peak / scale, color=color, lw=0.8, ls=':')
    pos = (lambda t, n=n: t / max(n, 1)) if several else (lambda t: t)
    if several:
      for s in e.phases[1:]:
        ax.axvline(pos(s.start), color=color, lw=0.6, ls='--', alpha=0.6)
    else:
      for s in e.phases:
        ax.axvspan(pos(s.start), pos(s.end), color=PHASE_COLORS.get(s.label, '#eeeeee'),
                   alpha=0.5, lw=0, label=s.label)
      top = max(e.plan.peak, 1) / scale
      for j, s in enumerate(e.loops):
        y = top * (1.03 + 0.035 * (j % 2))
        ax.plot([pos(s.start), pos(s.end)], [y, y], color='k', lw=1.5)
        ax.annotate(s.label, ((pos(s.start) + pos(s.end)) / 2, y), ha='center', va='bottom',
                    fontsize=7)
  ax.set_xlabel('position in XLA\'s schedule' + (' (fraction of each program)' if several else
                                                 ' (a loop body once, for every iteration)'))
  ax.set_ylabel(f'live bytes ({unit})')
  ax.plot([], [], color='k', lw=0.8, ls=':', label='plan: argument + output - alias + temp')
  if several:
    ax.plot([], [], color='k', lw=0.6, ls='--', label='start of the backward pass and update')
  ax.set_ylim(bottom=0)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7, loc='lower left')
  ax.set_title(title or 'live memory of the compiled step', fontsize=9)

  for i, e in enumerate(exps):
    bottom = 0.0
    for c in CATEGORIES:
      b = e.categories.get(c, 0) / scale
      if b:
        bar.bar(i, b, bottom=bottom, color=CATEGORY_COLORS[c], width=0.6)
        bottom += b
    bar.bar(i, max(e.packing_loss, 0) / scale, bottom=bottom, color='white', edgecolor='k',
            hatch='//', width=0.6, lw=0.5)
    if e.host_at_peak:   # offloaded bytes live in host memory: apart from the device's bar
      bar.annotate(f'+ host {e.host_at_peak / scale:.2f} {unit}', (i, e.plan.peak / scale),
                   xytext=(0, 4), textcoords='offset points', ha='center', fontsize=7)
  bar.set_xticks(range(len(exps)), [e.spec for e in exps], fontsize=8, rotation=20)
  bar.set_ylabel(f'at the peak ({unit})')
  bar.set_title('what is live at the peak', fontsize=9)
  used = [c for c in CATEGORIES if any(e.categories.get(c) for e in exps)]
  bar.legend([Patch(color=CATEGORY_COLORS[c]) for c in used] +
             [Patch(facecolor='white', edgecolor='k', hatch='//')], used + ['packing loss'],
             fontsize=7, loc='upper left', bbox_to_anchor=(1.0, 1.0))
  stem = Path(path).with_suffix('')
  out = [stem.with_suffix('.png'), stem.with_suffix('.svg')]
  fig.savefig(out[0], dpi=110)
  fig.savefig(out[1])
  plt.close(fig)
  return out
