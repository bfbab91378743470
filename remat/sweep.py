"""Depth and resolution sweeps: activation memory against layers N or image side S, with log-log slopes.

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

The resolution sweep varies the image side S of a vision model instead. A
convnet's activations grow as S**2 (slope ~2 under every policy: remat changes
the constant, not the exponent); a ViT's token count grows as S**2 and its
attention scores as S**4, so without remat its slope lies between 2 and 4.
For a ResNet, depth sweeps take standard depths (18, 34, 50, 101, 152).
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


def _at_depth(model_cfg, n: int):
  from models.resnet import ResNetConfig
  if isinstance(model_cfg, ResNetConfig):
    keep = {f: getattr(model_cfg, f) for f in ('embedding_size', 'num_classes', 'channels',
                                                'image_size', 'bn_momentum', 'bn_eps')}
    return ResNetConfig.from_depth(n, **keep)
  return dataclasses.replace(model_cfg, num_layers=n)


def _sweep(axis: str, configs_and_sizes, values, batch_size, target, policies) -> dict:
  jobs = [(p, v) for p in policies for v in values]
  points = {p: [] for p in policies}
  for spec, v in tqdm(jobs, desc=f'{axis} sweep', unit='compile', file=sys.stderr):
    cfg, size = configs_and_sizes(v)
    mem = grad_memory(cfg, spec, batch_size, size, target)
    points[spec].append({axis: v, 'activation_bytes': mem.temp, 'host_temp': mem.host_temp})
  slopes = {p: loglog_slope(values, [max(1, q['activation_bytes']) for q in pts])
            for p, pts in points.items()}
  return {'axis': axis, 'values': list(values), 'batch_size': batch_size, 'points': points,
          'slopes': slopes}


def depth_sweep(model_cfg, depths: list[int], batch_size: int, size: int, target: Target,
                policies=SWEEP_POLICIES) -> dict:
  """Activation bytes per policy and depth (compile only), and each policy's log-log slope.

  ``size`` is the sequence length or image side; ResNet depths are standard ones.
  """
  return _sweep('depth', lambda n: (_at_depth(model_cfg, n), size), depths, batch_size, target,
                policies)


def resolution_sweep(model_cfg, sizes: list[int], batch_size: int, target: Target,
                     policies=SWEEP_POLICIES) -> dict:
  """Activation bytes per policy and image side S (compile only), and log-log slopes against S."""
  return _sweep('image_size', lambda s: (model_cfg, s), sizes, batch_size, target, policies)


def format_sweep(sweep: dict, header: str) -> str:
  axis, values = sweep['axis'], sweep['values']
  label = {'depth': 'N', 'image_size': 'S'}[axis]
  lines = [header, '# activation bytes = compiled temp of jax.grad(loss) (no optimizer); '
           f'slope = log-log fit against {label}',
           f"{'policy':<12}" + ''.join(f'{label + "=" + str(v):>12}' for v in values)
           + f"{'slope':>8}"]
  for p, pts in sweep['points'].items():
    lines.append(f'{p:<12}' + ''.join(f"{format_bytes(q['activation_bytes']):>12}" for q in pts)
                 + f"{sweep['slopes'][p]:>8.2f}")
  return '\n'.join(lines)


def plot_sweep(sweep: dict, path: str, title: str):
  """PNG: activation bytes against depth or image side on log-log axes, slope in the legend."""
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
  ax.set_xlabel({'depth': 'layers N', 'image_size': 'image side S (pixels)'}[axis])
  ax.set_ylabel('activation bytes: compiled temp of grad(loss) (MiB)')
  ax.set_title(title, fontsize=8)
  ax.grid(alpha=0.3, which='both')
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
