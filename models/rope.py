"""Rotary position embeddings as Hugging Face's Llama computes them, with Llama 3's frequency scaling."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama 3's rotary frequency scaling (HF ``rope_scaling`` with ``rope_type: 'llama3'``).

  Wavelengths longer than ``original_max_position_embeddings / low_freq_factor``
  are stretched by ``factor``, those shorter than ``... / high_freq_factor`` kept,
  and those between interpolated smoothly (:func:`rope_frequencies`).
  """
  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192

  def __post_init__(self):
    if not self.factor > 0:
      raise ValueError(f'RopeScaling.factor must be > 0, got {self.factor}')
    if not 0 < self.low_freq_factor < self.high_freq_factor:
      raise ValueError(f'RopeScaling needs 0 < low_freq_factor < high_freq_factor, got '
                       f'{self.low_freq_factor} and {self.high_freq_factor}')
    if self.original_max_position_embeddings < 1:
      raise ValueError('RopeScaling.original_max_position_embeddings must be >= 1, got '
                       f'{self.original_max_position_embeddings}')


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
  """Rotary inverse frequencies ``[head_dim / 2]`` (float32), Llama 3-scaled if ``scaling`` is set.

  Computed in float64 and rounded once: HF rounds each step in float32, which
  differs by an ulp or so (far inside the test tolerances).
  """
  inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  if scaling is not None:
    old = scaling.original_max_position_embeddings
    low_wavelen = old / scaling.low_freq_factor    # longer: stretched by factor
    high_wavelen = old / scaling.high_freq_factor  # shorter: kept
    wavelen = 2 * math.pi / inv_freq
    smooth = (old / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    between = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    inv_freq = np.where(wavelen > low_wavelen, inv_freq / scaling.factor,
                        np.where(wavelen < high_wavelen, inv_freq, between))
  return inv_freq.astype(np.float32)


def rotary_tables(cfg, length: int, positions=None):
  """``(cos, sin)`` ``[T, Dh]``, float32, for positions ``0..T-1`` (halves repeated, as HF).

  With ``positions`` (int ``[B, T]``, e.g. restarting at 0 for each document of a
  packed window) the tables are ``[B, T, Dh]`` at those positions.
  """
  inv_freq = jnp.asarray(rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
  pos = jnp.arange(length) if positions is None else positions
  angles = pos.astype(jnp.float32)[..., None] * inv_freq
  angles = jnp.concatenate([angles, angles], axis=-1)
  return jnp.cos(angles), jnp.sin(angles)


def apply_rotary(x, cos, sin):
  """Rotates ``[B, T, heads, Dh]`` by position (HF's ``rotate_half`` layout), in ``x``'s dtype."""
  # [T, Dh] or [B, T, Dh] tables, broadcast over the heads axis.
  cos, sin = cos[..., None, :].astype(x.dtype), sin[..., None, :].astype(x.dtype)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return x * cos + rotated * sin
