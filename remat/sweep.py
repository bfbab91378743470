"""Depth sweep: activation memory against the number of layers N, with fitted log-log slopes.

The train step's compiled ``temp`` also holds parameter gradients and optimizer
temporaries, which grow as O(N) under every policy. The sweep therefore compiles
the loss gradient alone, with parameters as arguments and their gradients as
outputs: **activation bytes = compiled temp of jax.grad(loss)**, i.e. saved
residuals, recompute working sets and transient buffers. (temp(batch B) minus
temp(batch 1) of the train step was tried first and rejected: XLA reuses
parameter-sized buffers differently at different batch sizes, so the difference
even shrank with depth under ``full``.) The slope of log(activation bytes)
against log(N) is ~1 for ``none`` and ~0.5 for ``sqrt``; ``full`` grows by one
saved layer input per layer on top of a constant (logits, one layer's working set).
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
from tqdm import tqdm

from remat.measure import grad_memory
from remat.memory import format_bytes
from remat.targets import Target

SWEEP_POLICIES = ('none', 'full', 'sqrt', 'full@sqrt')


def loglog_slope(depths, values) -> float:
  """Least-squares slope of log(values) against log(depths)."""
  return float(np.polyfit(np.log(depths), np.log(values), 1)[0])


def depth_sweep(model_cfg, depths: list[int], batch_size: int, seq_len: int, target: Target,
                policies=SWEEP_POLICIES) -> dict:
  """Activation bytes per policy and depth (compile only), and each policy's log-log slope."""
  jobs = [(p, n) for p in policies for n in depths]
  points = {p: [] for p in policies}
  for spec, n in tqdm(jobs, desc='sweep', unit='compile', file=sys.stderr):
    mem = grad_memory(dataclasses.replace(model_cfg, num_layers=n), spec, batch_size, seq_len, target)
    points[spec].append({'depth': n, 'activation_bytes': mem.temp, 'host_temp': mem.host_temp})
  slopes = {p: loglog_slope(depths, [max(1, q['activation_bytes']) for q in pts])
            for p, pts in points.items()}
  return {'depths': depths, 'batch_size': batch_size, 'points': points, 'slopes': slopes}


def format_sweep(sweep: dict, header: str) -> str:
  depths = sweep['depths']
  lines = [header, '# activation bytes = compiled temp of jax.grad(loss) (no optimizer); '
           'slope = log-log fit against N',
           f"{'policy':<12}" + ''.join(f'{"N=" + str(n):>12}' for n in depths) + f"{'slope':>8}"]
  for p, pts in sweep['points'].items():
    lines.append(f'{p:<12}' + ''.join(f"{format_bytes(q['activation_bytes']):>12}" for q in pts)
                 + f"{sweep['slopes'][p]:>8.2f}")
  return '\n'.join(lines)


def plot_sweep(sweep: dict, path: str, title: str):
  """PNG: activation bytes against depth on log-log axes, slope in the legend."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 5))
  for p, pts in sweep['points'].items():
    ax.plot([q['depth'] for q in pts], [q['activation_bytes'] / 2**20 for q in pts], 'o-',
            label=f"{p} (slope {sweep['slopes'][p]:.2f})")
  ax.set_xscale('log')
  ax.set_yscale('log')
  ax.set_xlabel('layers N')
  ax.set_ylabel('activation bytes: compiled temp of grad(loss) (MiB)')
  ax.set_title(title, fontsize=8)
  ax.grid(alpha=0.3, which='both')
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
