"""Depth and resolution sweeps of the zoo's models: activation memory against N or S.

Activation bytes are the compiled temp of the loss gradient alone
(:mod:`remat.sweep` says why, and why ``temp(batch B) - temp(batch 1)`` of the
train step was rejected). A depth sweep keeps the config's width and changes its
layer count (for a ResNet: standard depths 18, 34, 50, 101, 152, with the
config's stem and classes); a resolution sweep changes a vision model's image
side (a ViT gets the positions for that side).
"""

from __future__ import annotations

from bench import zoo
from remat.sweep import SWEEP_POLICIES, sweep
from remat.targets import Target


def _loss_case(model_cfg, batch_size: int, size: int):
  c = zoo.case(model_cfg, batch_size, size)
  return c.loss, c.loss_args()


def depth_sweep(model_cfg, depths: list[int], batch_size: int, size: int, target: Target,
                policies=SWEEP_POLICIES) -> dict:
  """Activation bytes per policy and depth (compile only), and each policy's log-log slope.

  ``size`` is the sequence length or image side; ResNet depths are standard ones.
  """
  at_depth = zoo.family(model_cfg).at_depth
  out = sweep('depth', depths, lambda n: _loss_case(at_depth(model_cfg, n), batch_size, size),
              target, policies)
  return {**out, 'batch_size': batch_size}


def resolution_sweep(model_cfg, sizes: list[int], batch_size: int, target: Target,
                     policies=SWEEP_POLICIES) -> dict:
  """Activation bytes per policy and image side S (compile only), and log-log slopes against S."""
  out = sweep('image_size', sizes, lambda s: _loss_case(model_cfg, batch_size, s), target,
              policies)
  return {**out, 'batch_size': batch_size}
