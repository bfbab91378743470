"""Dropout with ``flax.linen.Dropout``'s masks, drawn as one elementwise computation.

:func:`dropout` and its random bits (:func:`bernoulli`, and :func:`bernoulli_block`
for one block of a mask, which blockwise attention draws), and the per-block
keys (:func:`dropout_keys`). Used by GPT-2 and ViT and by :mod:`models.attention`'s
probability dropout; it imports no other model module, so both sides can import it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def dropout_keys(rng, n: int):
  """``n`` independent keys folded from a block's key, or ``n`` Nones when deterministic."""
  return (None,) * n if rng is None else tuple(jax.random.fold_in(rng, i) for i in range(n))


def _threefry2x32(k1, k2, x1, x2):
  """The Threefry-2x32 hash (20 rounds) as JAX computes it, written out unrolled."""
  def rotl(v, r):
    return (v << np.uint32(r)) | (v >> np.uint32(32 - r))
  rotations = ((13, 15, 26, 6), (17, 29, 16, 24))
  ks = (k1, k2, k1 ^ k2 ^ np.uint32(0x1BD11BDA))
  x1, x2 = x1 + ks[0], x2 + ks[1]
  for i in range(5):
    for r in rotations[i % 2]:
      x1 = x1 + x2
      x2 = x1 ^ rotl(x2, r)
    x1, x2 = x1 + ks[(i + 1) % 3], x2 + ks[(i + 2) % 3] + np.uint32(i + 1)
  return x1, x2


def _tied_zero(x) -> jax.Array:
  """A uint32 zero computed from one element of ``x`` (``min(bits, 0)``), whatever its value.

  Index arrays and fill values that depend on no input are kept by JAX as
  loop-invariant residuals of a layer scan (computed once, outside the loop, at
  full size) and hoisted by XLA out of loops; adding this zero ties them to an
  input, so they stay inside the fusion that consumes them. XLA does not fold it.
  """
  x = x.reshape(-1)[0]
  if not jnp.issubdtype(x.dtype, jnp.unsignedinteger):
    x = jax.lax.bitcast_convert_type(x, jnp.dtype(f'uint{8 * x.dtype.itemsize}'))
  return jnp.minimum(x, jnp.zeros((), x.dtype)).astype(jnp.uint32)


def _fused_bits_ok(rng, shape) -> bool:
  return (bool(jax.config.jax_threefry_partitionable) and not jax.dtypes.issubdtype(
      rng.dtype, jax.dtypes.prng_key) and rng.shape == (2,) and rng.dtype == jnp.uint32
      and math.prod(shape) < 2**32)


def bernoulli(rng, p: float, shape) -> jax.Array:
  """``jax.random.bernoulli(rng, p, shape)``, bit for bit, as one elementwise computation.

  On the CPU backend JAX hashes random bits in a rolled loop over materialised
  counters, about 24 bytes of temporaries per element (300 MB for one GPT-2
  attention mask at batch 4 x 512) in every layer's forward pass and again in
  each recompute. Written out, XLA fuses counters, hash and comparison into the
  bool mask itself. Falls back to ``jax.random.bernoulli`` where the bits could
  differ (typed or non-threefry keys, ``jax_threefry_partitionable`` off).
  """
  shape = tuple(shape)
  if not fused_bits_ok(rng, shape):
    return jax.random.bernoulli(rng, p, shape)
  return bernoulli_block(rng, p, shape, shape, (0,) * len(shape))


def fused_bits_ok(rng, shape) -> bool:
  """Whether :func:`bernoulli_block` gives ``jax.random.bernoulli``'s bits for an array of ``shape``."""
  return _fused_bits_ok(rng, tuple(shape))


def bernoulli_block(rng, p: float, shape, full_shape, starts) -> jax.Array:
  """The block ``[starts, starts + shape)`` of ``jax.random.bernoulli(rng, p, full_shape)``.

  Bit for bit the elements of the whole mask at those positions (the counter
  of an element is its flat index in ``full_shape``), without the rest of it:
  blockwise attention draws each block of the dense path's [B, H, T, T]
  dropout mask this way. Positions past ``full_shape`` (padding) get bits
  too, which are meaningless. Only valid where :func:`fused_bits_ok` holds
  for ``full_shape``.

  Args:
    rng: a raw uint32 key.
    p: the probability of True.
    shape: the block's shape.
    full_shape: the whole mask's shape (same rank).
    starts: the block's first index along each axis (ints or traced integer scalars).
  """
  # Counters: the flat element index (< 2**32, so the high word is 0), built in Horner form
  # from per-axis iotas of one axis each, each with a zero tied to the key (_tied_zero), so
  # that nothing of the mask's full shape is free of inputs (or a [B, H, T, T] uint32
  # array would be materialised outside the layer loop). As written, counters, hash and
  # comparison fuse into the bool mask.
  zero = _tied_zero(rng)
  index = zero
  for dim, (size, full, start) in enumerate(zip(shape, full_shape, starts)):
    axis = [1] * len(shape)
    axis[dim] = size
    pos = jax.lax.broadcasted_iota(jnp.uint32, axis, dim) + zero
    if not (isinstance(start, int) and start == 0):
      pos = pos + jnp.asarray(start).astype(jnp.uint32)
    index = index * np.uint32(full) + pos
  b1, b2 = _threefry2x32(rng[0], rng[1], zero, index)   # high words: 0, broadcast
  # jax.random.uniform's float32 from 32 random bits, then bernoulli's comparison.
  bits = jax.lax.shift_right_logical(b1 ^ b2, np.uint32(32 - 23)) | np.array(1.0, np.float32).view(
      np.uint32)
  u = jax.lax.bitcast_convert_type(bits, jnp.float32) - jnp.float32(1.0)
  u = jax.lax.max(jnp.float32(0.0), u * jnp.float32(1.0) + jnp.float32(0.0))
  return u < jnp.asarray(p, jnp.float32)


def dropout(x, rate: float, *, deterministic: bool, rng):
  """``flax.linen.Dropout(rate)(x, deterministic, rng=rng)``: the same masks and values.

  The mask comes from :func:`bernoulli`, which has none of the CPU backend's
  random-bit temporaries.
  """
  if rate == 0.0 or deterministic:
    return x
  if rng is None:
    raise ValueError('dropout in training mode needs a key (rng)')
  if rate == 1.0:
    return jnp.zeros_like(x)
  keep_prob = 1.0 - rate
  mask = bernoulli(rng, keep_prob, x.shape)
  return jax.lax.select(mask, x / keep_prob, jnp.zeros_like(x))
