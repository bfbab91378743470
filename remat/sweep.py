"""Activation memory against a size (layers N, image side S, ...), per policy, with log-log slopes.

A train step's compiled ``temp`` also holds parameter gradients and optimizer
temporaries, which grow as O(N) under every policy. A sweep therefore compiles
the loss gradient alone, with parameters as arguments and their gradients as
outputs: **activation bytes = compiled temp of value_and_grad(loss)**, i.e.
saved residuals, recompute working sets and transient buffers. (temp(batch B)
minus temp(batch 1) of the train step was tried first and rejected: XLA reuses
parameter-sized buffers differently at different batch sizes, so the difference
even shrank with depth under ``full``.) The slope of log(activation bytes)
against log(N) is ~1 for ``none`` and ~0.5 for ``sqrt``; ``full`` grows by one
saved layer input per layer on top of a constant (logits, one layer's working set).

Against an image side S, a convnet's activations grow as S**2 (slope ~2 under
every policy: remat changes the constant, not the exponent); a ViT's token
count grows as S**2 and its attention scores as S**4, so without remat its
slope lies between 2 and 4. The model-zoo sweeps are in ``bench/sweep.py``.
"""

from __future__ import annotations

import sys
from typing import Callable, Sequence

import numpy as np

from remat.measuring import step_memory
from remat.memory import format_bytes
from remat.policies import get_policy
from remat.targets import Target

SWEEP_POLICIES = ('none', 'full', 'sqrt', 'full@sqrt')
_LABELS = {'depth': 'N', 'image_size': 'S'}
_AXIS_TITLES = {'depth': 'layers N', 'image_size': 'image side S (pixels)'}


def loglog_slope(depths, values) -> float:
  """Least-squares slope of log(values) against log(depths)."""
  return float(np.polyfit(np.log(depths), np.log(values), 1)[0])


def sweep(axis: str, values: Sequence[int], case: Callable[[int], tuple], target: Target,
          policies: Sequence[str] = SWEEP_POLICIES, progress: bool = True) -> dict:
  """Activation bytes per policy and value (compile only), and each policy's log-log slope.

  Args:
    axis: the name of what varies, e.g. 'depth' or 'image_size' (a JSON key).
    values: at least two sizes.
    case: ``case(value) -> (build, example_args)`` as for :func:`remat.measure`,
      where ``build(policy)`` returns a loss (a TrainStep would add optimizer
      buffers to the figure).
    target: where to compile for.
    policies: specs to sweep.
    progress: a tqdm bar on stderr.

  Returns:
    ``{'axis', 'values', 'points': {spec: [{axis: v, 'activation_bytes', 'host_temp'}]},
    'slopes': {spec: slope}}``.
  """
  jobs = [(p, v) for p in policies for v in values]
  if progress:
    from tqdm import tqdm
    jobs = tqdm(jobs, desc=f'{axis} sweep', unit='compile', file=sys.stderr)
  points = {p: [] for p in policies}
  for spec, v in jobs:
    build, args = case(v)
    mem = step_memory(build(get_policy(spec)), *args, target=target)
    points[spec].append({axis: v, 'activation_bytes': mem.temp, 'host_temp': mem.host_temp})
  slopes = {p: loglog_slope(values, [max(1, q['activation_bytes']) for q in pts])
            for p, pts in points.items()}
  return {'axis': axis, 'values': list(values), 'points': points, 'slopes': slopes}


def format_sweep(sweep: dict, header: str) -> str:
  """The sweep as a text table: one line per policy, one column per value, and the slope."""
  axis, values = sweep['axis'], sweep['values']
  label = _LABELS.get(axis, axis)
  lines = [header, '# activation bytes = compiled temp of jax.grad(loss) (no optimizer); '
           f'slope = log-log fit against {label}',
           f"{'policy':<12}" + ''.join(f'{label + "=" + str(v):>12}' for v in values)
           + f"{'slope':>8}"]
  for p, pts in sweep['points'].items():
    lines.append(f'{p:<12}' + ''.join(f"{format_bytes(q['activation_bytes']):>12}" for q in pts)
                 + f"{sweep['slopes'][p]:>8.2f}")
  return '\n'.join(lines)


def plot_sweep(sweep: dict, path: str, title: str):
  """PNG: activation bytes against the swept size on log-log axes, slope in the legend."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 5))
  axis = sweep['axis']
  for p, pts in sweep['points'].items():
    ax.plot([q[axis] for q in pts], [q['activation_bytes'] / 2**20 for q in pts], 'o-',
            label=f"{p} (slope {sweep['slopes'][p]:.2f})")
  ax.set_xscale('log')
  ax.set_yscale('log')
  ax.set_xlabel(_AXIS_TITLES.get(axis, axis))
  ax.set_ylabel('activation bytes: compiled temp of grad(loss) (MiB)')
  ax.set_title(title, fontsize=8)
  ax.grid(alpha=0.3, which='both')
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
