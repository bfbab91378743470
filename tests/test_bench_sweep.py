"""bench.sweep: depth and resolution sweeps of zoo models have the expected log-log slopes."""

import dataclasses

import pytest

from bench.sweep import depth_sweep
from models.gpt import GPTConfig
from remat.targets import get_target

SMALL = GPTConfig(vocab_size=256, max_len=32, num_layers=4, num_heads=2, d_model=32, dropout=0.1)


@pytest.mark.extended
def test_depth_sweep_slopes():
  cfg = dataclasses.replace(SMALL, max_len=64)
  sweep = depth_sweep(cfg, [4, 16, 64], 4, 64, get_target('cpu'), policies=('none', 'sqrt'))
  none, sqrt = ([q['activation_bytes'] for q in sweep['points'][p]] for p in ('none', 'sqrt'))
  # Without remat the memory is affine in depth: the same bytes per layer from 4
  # to 16 as from 16 to 64; the constant (logits and their gradient) keeps the
  # log-log slope over 4..64 a little under 1.
  assert (none[2] - none[1]) / 48 == pytest.approx((none[1] - none[0]) / 12, rel=0.02)
  assert sweep['slopes']['none'] >= 0.8
  # sqrt: each layer added costs less the deeper the stack.
  assert (sqrt[2] - sqrt[1]) / 48 < 0.7 * (sqrt[1] - sqrt[0]) / 12
  assert sweep['slopes']['sqrt'] <= 0.6


@pytest.mark.slow
def test_resolution_sweep_slopes(capsys):
  # Activations of a convnet grow as the image area: slope ~2 against the side S.
  from bench.sweep import resolution_sweep
  from models.resnet import ResNetConfig
  cfg = ResNetConfig(embedding_size=4, hidden_sizes=(32, 64), depths=(3, 3), num_classes=5,
                     image_size=32)
  sweep = resolution_sweep(cfg, [64, 128, 256], 2, get_target('cpu'), policies=('none', 'full'))
  assert sweep['axis'] == 'image_size' and sweep['values'] == [64, 128, 256]
  assert 1.7 <= sweep['slopes']['none'] <= 2.1
  assert all(f < n for f, n in zip(*(
      [p['activation_bytes'] for p in sweep['points'][k]] for k in ('full', 'none'))))
