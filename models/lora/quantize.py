"""The frozen base of a QLoRA run, stored as int8 or 4-bit NormalFloat codes with block scales.

A kernel ``[..., in, out]`` is cut into blocks of :func:`block_size` weights
(64, as bitsandbytes' QLoRA) along its input axis; each block keeps one scale,
its largest magnitude (absmax), stored bfloat16, and one code per weight:

* ``int8``: ``round(127 w / absmax)``, one byte a weight (1.03 bytes with scales);
* ``nf4``: the nearest of the 16 NormalFloat levels of ``w / absmax`` (Dettmers
  et al., 2023, Appendix E: the same table as bitsandbytes and qwix), two
  codes a byte (0.53 bytes a weight with scales): the first half of the input
  rows in the low nibbles, the second half in the high ones.

:func:`dequantize` rebuilds the kernel with elementwise operations and layout
changes only (bit masks, shifts, a 16-way select, a multiply): the operations
:func:`remat.layout.lean_saveable` rebuilds rather than keeps. So under every
policy, ``none`` included, a layer's dequantized weights are made again where
the backward pass needs them, never kept for all layers at once. (A table
lookup would be a gather, which ``none`` keeps: the base at full size.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 64
# The 16 NormalFloat-4 levels (QLoRA, Appendix E), ascending.
NF4 = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
                0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                0.7229568362236023, 1.0], np.float32)
_NF4_MIDPOINTS = (NF4[1:] + NF4[:-1]) / 2
SCALE_DTYPE = jnp.bfloat16


class QuantizeError(ValueError):
  """A kernel that cannot be stored quantized; the message is one line."""


def block_size(in_features: int, kind: str) -> int:
  """Weights per scale along the input axis: 64, or the largest power of two below it dividing
  ``in_features`` (a small test model); nf4 also needs an even count of rows to pack."""
  size = BLOCK
  while size > 1 and in_features % size:
    size //= 2
  if size < 2 or (kind == 'nf4' and in_features % 2):
    raise QuantizeError(f'--quantize {kind}: a projection with {in_features} inputs cannot be cut '
                        'into blocks of 2 to 64 weights; use a model whose widths are even')
  return size


def stored_shapes(shape, kind: str) -> dict[str, tuple[tuple[int, ...], jnp.dtype]]:
  """The shapes and dtypes :func:`quantize` stores for a kernel of ``shape`` ``[..., in, out]``."""
  *lead, n_in, n_out = shape
  blocks = n_in // block_size(n_in, kind)
  codes = (*lead, n_in // 2 if kind == 'nf4' else n_in, n_out)
  return {'codes': (codes, jnp.uint8 if kind == 'nf4' else jnp.int8),
          'scale': ((*lead, blocks, n_out), SCALE_DTYPE)}


def _blocks(w, size: int):
  *lead, n_in, n_out = w.shape
  return w.reshape(*lead, n_in // size, size, n_out)


def quantize(w, kind: str) -> dict[str, jax.Array]:
  """``{'codes', 'scale'}`` of a float kernel ``[..., in, out]`` (module docstring)."""
  w = jnp.asarray(w, jnp.float32)
  size = block_size(w.shape[-2], kind)
  blocks = _blocks(w, size)
  absmax = jnp.max(jnp.abs(blocks), axis=-2)
  # The codes are computed against the stored (rounded) scale, so dequantizing is exact to it.
  scale = (absmax / 127.0 if kind == 'int8' else absmax).astype(SCALE_DTYPE)
  safe = jnp.where(scale == 0, 1.0, scale.astype(jnp.float32))[..., None, :]
  x = blocks / safe
  if kind == 'int8':
    codes = jnp.clip(jnp.round(x), -127, 127).astype(jnp.int8).reshape(w.shape)
    return {'codes': codes, 'scale': scale}
  # Nearest level: how many midpoints between neighbouring levels lie below x.
  level = sum((x > m).astype(jnp.uint8) for m in _NF4_MIDPOINTS).reshape(w.shape)
  half = w.shape[-2] // 2
  packed = level[..., :half, :] | (level[..., half:, :] << 4)
  return {'codes': packed.astype(jnp.uint8), 'scale': scale}


def dequantize(q: dict, kind: str, dtype) -> jax.Array:
  """The kernel ``[..., in, out]`` in ``dtype`` from :func:`quantize`'s codes and scales."""
  codes, scale = q['codes'], q['scale']
  if kind == 'int8':
    values = codes.astype(jnp.float32)
  else:
    level = jnp.concatenate([codes & 15, codes >> 4], axis=-2).astype(jnp.int32)
    # A 16-way select of constants: elementwise, so rebuilt (not kept) by the lean rule.
    values = jax.lax.select_n(level, *(jnp.full(level.shape, v, jnp.float32) for v in NF4))
  n_in = values.shape[-2]
  blocks = _blocks(values, n_in // scale.shape[-2])
  return (blocks * scale.astype(jnp.float32)[..., None, :]).reshape(values.shape).astype(dtype)


def quantized_init(init, kind: str):
  """A parameter initialiser returning ``init``'s kernel quantized (a random base under QLoRA)."""
  def make(rng, shape, dtype=jnp.float32):
    return quantize(init(rng, shape, dtype), kind)
  return make


def stored_bytes(q: dict) -> int:
  """Bytes the quantized kernel occupies (codes and scales)."""
  return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in q.values())
