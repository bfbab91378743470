"""A ViT's learned positions, carried to another image size (the high-resolution fine-tuning case).

A ViT trained at side S with patch P learns one position per cell of an
(S/P) x (S/P) grid, plus one for the class token. At side S' the grid has
(S'/P) cells per side; the patch positions are resampled on the grid by bicubic
interpolation and the class token's position is kept, as ``transformers``'
``ViTEmbeddings.interpolate_pos_encoding`` does (``torch.nn.functional.interpolate``,
``mode='bicubic'``, ``align_corners=False``: Keys' cubic kernel with a = -0.75,
edge pixels repeated) and big_vision's ``resample_posemb``. Written in numpy as
two small interpolation matrices, one per axis, so it runs at import time
without torch and matches torch to float32 rounding.
"""

from __future__ import annotations

import math

import numpy as np

_A = -0.75  # torch's bicubic kernel parameter (PyTorch's upsample_bicubic2d)


def _cubic(t: np.ndarray) -> np.ndarray:
  t = np.abs(t)
  near = ((_A + 2) * t - (_A + 3)) * t * t + 1                 # |t| <= 1
  far = ((_A * t - 5 * _A) * t + 8 * _A) * t - 4 * _A          # 1 < |t| < 2
  return np.where(t <= 1, near, np.where(t < 2, far, 0.0))


def bicubic_matrix(n_in: int, n_out: int) -> np.ndarray:
  """The [n_out, n_in] matrix of 1-D bicubic resampling (align_corners=False, edges clamped)."""
  scale = n_in / n_out
  src = (np.arange(n_out) + 0.5) * scale - 0.5      # each output centre, in input coordinates
  base = np.floor(src).astype(int)
  frac = src - base
  m = np.zeros((n_out, n_in), np.float64)
  for k in range(-1, 3):  # the four taps around each output
    w = _cubic(frac - k)
    np.add.at(m, (np.arange(n_out), np.clip(base + k, 0, n_in - 1)), w)
  return m


def grid_side(num_positions: int) -> int:
  """The patch-grid side of a position table with ``num_positions`` rows (class token included).

  Raises:
    ValueError: one line, when the patch positions do not form a square grid.
  """
  side = math.isqrt(num_positions - 1)
  if side * side != num_positions - 1:
    raise ValueError(f'a position table of {num_positions} rows is not a class token plus a '
                     'square grid of patches')
  return side


def resize_positions(pos: np.ndarray, new_side: int) -> np.ndarray:
  """``pos`` [1, 1 + g*g, D] resampled to [1, 1 + new_side**2, D]; row 0 (class token) kept.

  An unchanged side returns the table unchanged (not resampled).
  """
  pos = np.asarray(pos)
  g = grid_side(pos.shape[1])
  if g == new_side:
    return pos
  d = pos.shape[-1]
  grid = pos[0, 1:].astype(np.float64).reshape(g, g, d)
  m = bicubic_matrix(g, new_side)
  out = np.einsum('ij,jkd,lk->ild', m, grid, m)   # rows, then columns
  out = out.reshape(1, new_side * new_side, d).astype(pos.dtype)
  return np.concatenate([pos[:, :1], out], axis=1)
