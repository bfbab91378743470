"""Pieces shared by the Transformer models (GPT-2, ViT).

Mixed precision (docs/precision.md): parameters are float32; a layer given a
``dtype`` casts them to it at use, and activations flow in that dtype. LayerNorm
statistics, the attention softmax and the loss are computed in float32 and cast
back. The derivative rules below keep their residuals in the activation dtype.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

# The checkpoint names a Transformer block emits; GPT-2 and ViT use the same
# vocabulary, so every tag-based policy and preset applies to both.
TRANSFORMER_TAGS = {
    'query_proj': 'query projection, [B, T, H, Dh]',
    'key_proj': 'key projection, [B, T, H, Dh]',
    'value_proj': 'value projection, [B, T, H, Dh]',
    'context': 'attention output before the output projection, [B, T, H, Dh]',
    'out_proj': 'attention output projection, [B, T, D]',
    'mlpwi': 'MLP input projection before GELU, [B, T, F]',
    'mlpwo': 'MLP output projection, [B, T, D]',
}


# The compute dtypes a model config may name; parameters are float32 under both.
DTYPES = ('float32', 'bfloat16')


def check_dtype(owner: str, dtype) -> None:
  """Raises a one-line ValueError unless ``dtype`` is one of :data:`DTYPES` (by name)."""
  if not isinstance(dtype, str) or dtype not in DTYPES:
    raise ValueError(f"{owner}.dtype must be 'float32' or 'bfloat16', got {dtype!r}")


def _low(dtype) -> bool:
  """True for a dtype narrower than float32 (bfloat16): the mixed-precision code paths."""
  return jnp.dtype(dtype) != jnp.float32


def dropout_keys(rng, n: int):
  """``n`` independent keys folded from a block's key, or ``n`` Nones when deterministic."""
  return (None,) * n if rng is None else tuple(jax.random.fold_in(rng, i) for i in range(n))


def gelu_slope(x, approximate: bool):
  """The derivative ``gelu'(x)`` as one elementwise formula (tanh or exact erf GELU).

  Differentiating ``jax.nn.gelu`` instead would keep up to four ``[.., F]``
  intermediates of its formula (``x**3``, ``tanh``, ``erfc``, ``exp``, ...).
  """
  if approximate:
    c = math.sqrt(2 / math.pi)
    t = jnp.tanh(c * (x + 0.044715 * x ** 3))
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x)
  cdf = 0.5 * jax.lax.erfc(-x * np.sqrt(0.5).astype(x.dtype))
  pdf = jnp.exp(-0.5 * x * x) * np.float32(1 / math.sqrt(2 * math.pi)).astype(x.dtype)
  return cdf + x * pdf


def _matmul(x, kernel):
  """``nn.Dense``'s contraction: the last axis of ``x`` with the first of ``kernel``."""
  return jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))


def _dense_apply(x, kernel, bias):
  """``nn.Dense``'s computation: ``x @ kernel + bias``."""
  y = _matmul(x, kernel)
  return y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))


def _dense_params(module: nn.Module, in_features: int, features: int, kernel_init):
  """``kernel`` and ``bias`` as ``nn.Dense`` creates them (same names, shapes, initialisers)."""
  kernel = module.param('kernel', kernel_init, (in_features, features), jnp.float32)
  return kernel, module.param('bias', nn.initializers.zeros_init(), (features,), jnp.float32)


# Rows (tokens) per step of the chunked backward passes (gelu_dense; models/llama.py's MLP).
BACKWARD_ROWS = 128
# ... in at most this many steps: a loop step is one launch of each matmul on a GPU, so at real
# sizes (16k tokens) the chunks grow (1024 rows) rather than the launches; the working set is
# still a sixteenth of one pass's.
MAX_BACKWARD_CHUNKS = 16


def row_chunks(rows: int, size: int = BACKWARD_ROWS) -> int:
  """How many equal chunks of about ``size`` rows (at least ``size``; 1 if fewer; at most
  :data:`MAX_BACKWARD_CHUNKS`) ``rows`` splits into."""
  n = max(1, min(rows // size, MAX_BACKWARD_CHUNKS))
  while rows % n:
    n -= 1
  return n


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def gelu_dense(h, kernel, bias, approximate: bool):
  """``nn.Dense`` applied to ``jax.nn.gelu(h)``, keeping only ``h``, with a chunked backward pass.

  Same values as the two ops. Differentiated as written, the backward pass
  would keep ``gelu(h)`` (the matmul's input, for its weight gradient) and
  the slope ``gelu'(h)``, two ``[.., F]`` arrays, while PyTorch keeps ``h``
  and ``gelu(h)``. This rule keeps ``h`` alone and runs its backward pass
  over :data:`BACKWARD_ROWS` rows at a time: each step rebuilds ``gelu(h)``
  and the slope for its rows, elementwise, writes its rows of ``dh`` and adds
  its share of the weight and bias gradients. Written as one pass, XLA's CPU
  plan held five more ``[.., F]`` buffers at once (``gelu(h)``, three of the
  rebuilt erf GELU and ``dO W^T``). No matmul is recomputed or added. The
  forward matmul is a plain ``dot_general``, so ``dots`` policies still see
  (and may save) its output.
  """
  return _dense_apply(jax.nn.gelu(h, approximate=approximate), kernel, bias)


def _gelu_dense_fwd(h, kernel, bias, approximate):
  return gelu_dense(h, kernel, bias, approximate), (h, kernel, bias)


def _gelu_dense_bwd(approximate, res, g):
  h, kernel, bias = res
  f, d = kernel.shape
  h2, g2 = h.reshape(-1, f), g.reshape(-1, d)
  rows = h2.shape[0]
  n = row_chunks(rows)
  size = rows // n
  contract_rows = (((0,), (0,)), ((), ()))

  def step(acc, row0):
    dh, dw, db = acc
    h_c = jax.lax.dynamic_slice_in_dim(h2, row0, size)
    g_c = jax.lax.dynamic_slice_in_dim(g2, row0, size)
    a = jax.nn.gelu(h_c, approximate=approximate)
    dw_c = jax.lax.dot_general(a, g_c, contract_rows, preferred_element_type=jnp.float32)
    db_c = jnp.sum(g_c.astype(jnp.float32), axis=0)
    dh_c = jnp.dot(g_c, kernel.T) * gelu_slope(h_c, approximate)
    return (jax.lax.dynamic_update_slice_in_dim(dh, dh_c.astype(dh.dtype), row0, 0),
            dw + dw_c, db + db_c), None

  acc = (jnp.zeros(h2.shape, h.dtype), jnp.zeros(kernel.shape, jnp.float32),
         jnp.zeros(bias.shape, jnp.float32))
  (dh, dw, db), _ = jax.lax.scan(step, acc, jnp.arange(n, dtype=jnp.int32) * size)
  return dh.reshape(h.shape), dw.astype(kernel.dtype), db.astype(bias.dtype)


gelu_dense.defvjp(_gelu_dense_fwd, _gelu_dense_bwd)


class GeluDense(nn.Module):
  """``nn.Dense(features)(jax.nn.gelu(x))``: the same ``kernel``/``bias`` and values, leaner derivative.

  The backward pass keeps the input ``x`` alone (:func:`gelu_dense`).

  Attributes:
    features: output width.
    approximate: tanh GELU (GPT-2's ``gelu_new``) or exact erf GELU (ViT's).
    kernel_init: as ``nn.Dense``'s.
    dtype: computation dtype, as ``nn.Dense``'s (None: promote the input and parameters).
  """
  features: int
  approximate: bool
  kernel_init: Callable = nn.linear.default_kernel_init
  dtype: Any = None

  @nn.compact
  def __call__(self, x):
    kernel, bias = _dense_params(self, x.shape[-1], self.features, self.kernel_init)
    x, kernel, bias = nn.dtypes.promote_dtype(x, kernel, bias, dtype=self.dtype)
    return gelu_dense(x, kernel, bias, self.approximate)


@functools.partial(jax.custom_jvp, nondiff_argnums=(3,))
def layer_norm(x, scale, bias, eps: float):
  """LayerNorm over the last axis, as ``flax.linen.LayerNorm`` computes it, with a lean derivative.

  The derivative rule forms the normalised input ``x_hat`` and ``1 / std`` in
  the forward pass and writes the tangent with them alone, so without remat the
  backward pass keeps those two (one ``[.., D]`` array and one per row) instead
  of the four ``[.., D]`` arrays of the differentiated formula (``x * x``,
  ``x - mean``, ...). The output, which the next matmul keeps anyway, is the
  second array, as in PyTorch's LayerNorm.
  """
  y, _, _ = _layer_norm_parts(x, scale, bias, eps)
  return y


def _layer_norm_parts(x, scale, bias, eps):
  """Output (Flax's formula: fast variance, ``(x - mean) * (rsqrt(var + eps) * scale) + bias``), x_hat, rstd.

  Computed in float32 whatever ``x``'s dtype (a bfloat16 mean and variance over
  D elements would lose most of their digits); the output has ``x``'s dtype,
  ``x_hat`` and ``rstd`` are float32.
  """
  dtype = x.dtype
  x = x.astype(jnp.float32)
  mean = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.maximum(0.0, jnp.mean(jax.lax.square(x), axis=-1, keepdims=True) - jax.lax.square(mean))
  rstd = jax.lax.rsqrt(var + eps)
  centred = x - mean
  y = centred * (rstd * scale) + bias
  return y.astype(dtype), centred * rstd, rstd


def _x_hat_tangent(x_hat, rstd, dx):
  # d x_hat = rstd * (dx - mean(dx) - x_hat * mean(dx * x_hat)): linear in dx given x_hat, rstd.
  return rstd * (dx - jnp.mean(dx, axis=-1, keepdims=True)
                 - x_hat * jnp.mean(dx * x_hat, axis=-1, keepdims=True))


@functools.partial(jax.checkpoint, prevent_cse=False)
def _x_hat_tangent_low(x_hat, rstd, dx):
  # The tangent of a bfloat16 x_hat, computed in float32. A checkpoint saves its inputs
  # alone, so the backward pass keeps the bfloat16 x_hat (and the per-row rstd) and
  # converts it again; written plainly, the float32 copy would be the residual instead.
  dx_hat = _x_hat_tangent(x_hat.astype(jnp.float32), rstd, dx.astype(jnp.float32))
  return dx_hat.astype(dx.dtype)


@functools.partial(jax.checkpoint, prevent_cse=False)
def _layer_norm_tangent_low(x_hat, rstd, scale, dx, dscale, dbias):
  # As _x_hat_tangent_low, for the whole LayerNorm: only the bfloat16 x_hat and rstd are kept.
  x_hat = x_hat.astype(jnp.float32)
  dx_hat = _x_hat_tangent(x_hat, rstd, dx.astype(jnp.float32))
  return (dx_hat * scale + x_hat * dscale + dbias).astype(dx.dtype)


@layer_norm.defjvp
def _layer_norm_jvp(eps, primals, tangents):
  (x, scale, bias), (dx, dscale, dbias) = primals, tangents
  y, x_hat, rstd = _layer_norm_parts(x, scale, bias, eps)
  if _low(x.dtype):
    return y, _layer_norm_tangent_low(x_hat.astype(x.dtype), rstd, scale, dx, dscale, dbias)
  dx_hat = _x_hat_tangent(x_hat, rstd, dx)
  return y, (dx_hat * scale + x_hat * dscale + dbias).astype(y.dtype)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def normalize(x, eps: float):
  """LayerNorm's ``x_hat = (x - mean) / sqrt(var + eps)`` over the last axis; its derivative keeps x_hat and 1/std."""
  return _layer_norm_parts(x, 1.0, 0.0, eps)[1].astype(x.dtype)


@normalize.defjvp
def _normalize_jvp(eps, primals, tangents):
  (x,), (dx,) = primals, tangents
  _, x_hat, rstd = _layer_norm_parts(x, 1.0, 0.0, eps)
  if _low(x.dtype):
    # The output and the residual are one bfloat16 array, shared with the NormDense readers.
    x_hat = x_hat.astype(x.dtype)
    return x_hat, _x_hat_tangent_low(x_hat, rstd, dx)
  return x_hat.astype(x.dtype), _x_hat_tangent(x_hat, rstd, dx).astype(x.dtype)


class Normalized(NamedTuple):
  """A LayerNorm output ``x_hat * scale + bias`` in its parts, the input of :class:`NormDense`."""
  x_hat: jax.Array
  scale: jax.Array
  bias: jax.Array


@jax.custom_jvp
def norm_dense(x_hat, scale, bias, kernel, kernel_bias):
  """``nn.Dense`` applied to a LayerNorm output ``x_hat * scale + bias``, keeping only ``x_hat``.

  Same values as the two ops (the output is ``x_hat * scale + bias`` with
  ``x_hat`` as :func:`normalize` computes it). Differentiated as written, the
  backward pass would keep the LayerNorm output (the matmul's input, for its
  weight gradient) besides ``x_hat`` (for LayerNorm's own derivative), two
  ``[.., D]`` arrays, as PyTorch keeps LayerNorm's input and the Linear's. The
  tangent here is written with ``x_hat`` alone (``(x_hat * scale + bias) dW =
  x_hat (scale dW) + bias dW``), so that is all the backward pass keeps, and
  matmuls reading one LayerNorm share it. The forward matmul stays a plain
  ``dot_general``, so ``dots`` policies still see (and may save) its output.
  """
  return _dense_apply(x_hat * scale + bias, kernel, kernel_bias)


@norm_dense.defjvp
def _norm_dense_jvp(primals, tangents):
  (x_hat, scale, bias, kernel, kernel_bias) = primals
  (dx_hat, d_scale, d_bias, d_kernel, d_kernel_bias) = tangents
  out = _dense_apply(x_hat * scale + bias, kernel, kernel_bias)
  # bias @ dW written elementwise: a [D] x [D, F] product, not a matmul worth counting.
  tangent = (_dense_apply(dx_hat * scale + x_hat * d_scale + d_bias, kernel, d_kernel_bias)
             + _matmul(x_hat, scale[:, None] * d_kernel)
             + jnp.sum(bias[:, None] * d_kernel, axis=0))
  return out, tangent


class NormDense(nn.Module):
  """``nn.Dense(features)`` of a :class:`Normalized` LayerNorm output; same parameters and values.

  The backward pass keeps ``x_hat`` alone (:func:`norm_dense`).

  Attributes:
    features: output width.
    kernel_init: as ``nn.Dense``'s.
    dtype: computation dtype, as ``nn.Dense``'s (None: promote the inputs and parameters);
      the LayerNorm's ``scale`` and ``bias`` are cast to it too.
  """
  features: int
  kernel_init: Callable = nn.linear.default_kernel_init
  dtype: Any = None

  @nn.compact
  def __call__(self, x: Normalized):
    kernel, bias = _dense_params(self, x.x_hat.shape[-1], self.features, self.kernel_init)
    return norm_dense(*nn.dtypes.promote_dtype(*x, kernel, bias, dtype=self.dtype))


class LayerNorm(nn.Module):
  """``flax.linen.LayerNorm`` over the last axis (same ``scale``/``bias`` parameters and values).

  Its derivative keeps one ``[.., D]`` array rather than four (:func:`layer_norm`).
  With ``parts=True`` it returns the output in its parts (:class:`Normalized`)
  for the :class:`NormDense` layers that read it, which then keep that one
  array alone instead of also the output itself.

  The statistics are float32 whatever the input's dtype; the output (or
  ``x_hat``) has the input's dtype, and ``scale``/``bias`` stay float32 here
  (a :class:`NormDense` casts them to its dtype).

  Attributes:
    epsilon: added to the variance.
    parts: return a :class:`Normalized` instead of the output.
  """
  epsilon: float = 1e-6
  parts: bool = False

  @nn.compact
  def __call__(self, x):
    d = x.shape[-1]
    scale = self.param('scale', nn.initializers.ones, (d,), jnp.float32)
    bias = self.param('bias', nn.initializers.zeros, (d,), jnp.float32)
    if self.parts:
      return Normalized(normalize(x, self.epsilon), scale, bias)
    return layer_norm(x, scale, bias, self.epsilon)


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


def __getattr__(name):
  # models.attention builds on this module (dropout's random bits), so it is imported
  # lazily here rather than at the top: ``from models.layers import attention`` keeps working.
  if name == 'attention':
    from models.attention import attention
    return attention
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


# Bytes of float32 logits one chunk of the chunked cross-entropy may hold when
# the chunk size is left to :func:`loss_chunk_tokens`.
LOSS_CHUNK_BYTES = 64 * 2**20


def loss_chunk_tokens(vocab_size: int, num_tokens: int, chunk: int | None = None) -> int:
  """Tokens per chunk of :func:`chunked_cross_entropy`, or 0 for the plain loss.

  Args:
    vocab_size: V, the width of the output layer.
    num_tokens: N, the tokens of the batch (B * T).
    chunk: ``None`` picks the largest power of two whose float32 logits
      ``[chunk, V]`` fit :data:`LOSS_CHUNK_BYTES` (256 tokens, 51 MB, for GPT-2's
      50257 words); ``0`` always takes the plain loss; a positive number is
      used as given.

  Returns the chunk, or 0 when the plain loss is at least as good: one chunk
  would cover the batch (the byte-level vocabulary, V = 256, always does).
  """
  if chunk is None:
    limit = max(1, LOSS_CHUNK_BYTES // (4 * vocab_size))
    chunk = 1 << (limit.bit_length() - 1)
  if chunk < 0:
    raise ValueError(f'loss chunk must be >= 0 tokens, got {chunk}')
  return 0 if chunk == 0 or chunk >= num_tokens else chunk


def _chunked(h, labels, chunk: int, weights=None):
  """[N, D], [N] -> [C, chunk, D], [C, chunk], weights [C, chunk] (0 on padding)."""
  n = h.shape[0]
  num = -(-n // chunk)
  pad = num * chunk - n
  weight = jnp.ones((n,), jnp.float32) if weights is None else weights.astype(jnp.float32)
  h, labels, weight = (jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1))
                       for a in (h, labels, weight))
  return (h.reshape(num, chunk, h.shape[-1]), labels.reshape(num, chunk),
          weight.reshape(num, chunk))


def _chunk_logits(hc, emb, yc):
  """Logits [c, V] of one chunk (float32), their logsumexp and the label logits."""
  logits = jnp.dot(hc, emb.T, preferred_element_type=jnp.float32)
  lse = jax.nn.logsumexp(logits, axis=-1)
  label_logit = jnp.take_along_axis(logits, yc[:, None], axis=-1)[:, 0]
  return logits, lse, label_logit


def _divisor(n: int, weights):
  """What the loss sum is divided by: N tokens, or the weights' sum (at least 1)."""
  return n if weights is None else jnp.maximum(jnp.sum(weights.astype(jnp.float32)), 1.0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def chunked_cross_entropy(h, emb, labels, chunk: int, weights=None):
  """Mean softmax cross-entropy of the tied output layer ``logits = h @ emb.T``, in chunks.

  Equal (within float32 rounding) to
  ``optax.softmax_cross_entropy_with_integer_labels(h @ emb.T, labels).mean()``,
  but the ``[N, V]`` logits and their gradient never exist at once: a scan over
  chunks of ``chunk`` tokens holds one chunk's ``[chunk, V]`` logits at a time.

  The gradient is computed with the loss, in the same pass over the chunks
  (the loss is a mean, so ``d loss / d logits = (softmax - onehot) / N``): the
  forward pass keeps ``dL/dh`` ``[N, D]`` and ``dL/demb`` ``[V, D]`` and the
  backward pass scales them by the incoming cotangent. So the logits matmul is
  never recomputed: three ``N x D x V`` matmuls, as without chunking. Only
  reverse-mode differentiation is defined (as for any ``custom_vjp``).

  Args:
    h: final hidden states ``[N, D]``.
    emb: the tied embedding ``[V, D]``.
    labels: int ``[N]``.
    chunk: tokens per chunk (static); N need not be a multiple (padding rows
      weigh 0).
    weights: None, or float ``[N]`` per-token weights (0 or 1: a loss mask); the
      result is then ``sum(ce * weights) / max(sum(weights), 1)``, the mean over
      the tokens that count. Not differentiated.
  """
  hs, ys, ws = _chunked(h, labels, chunk, weights)

  def body(total, xs):
    hc, yc, wc = xs
    _, lse, label_logit = _chunk_logits(hc, emb, yc)
    return total + jnp.sum((lse - label_logit) * wc), None
  total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), (hs, ys, ws))
  return total / _divisor(h.shape[0], weights)


def _cross_entropy_fwd(h, emb, labels, chunk, weights=None):
  n = _divisor(h.shape[0], weights)
  hs, ys, ws = _chunked(h, labels, chunk, weights)

  def grads(hc, yc, wc):
    """One chunk's loss sum and its contributions to dL/dh and dL/demb."""
    logits, lse, label_logit = _chunk_logits(hc, emb, yc)
    # d mean / d logits = (softmax - onehot) / N, zero on padding rows.
    probs = jnp.exp(logits - lse[:, None])
    onehot = jnp.arange(logits.shape[-1])[None, :] == yc[:, None]
    d_logits = jnp.where(onehot, probs - 1.0, probs) * (wc / n)[:, None]
    return (jnp.sum((lse - label_logit) * wc), jnp.dot(d_logits, emb.astype(jnp.float32)),
            jnp.dot(d_logits.T, hc.astype(jnp.float32)))

  def body(carry, xs):
    total, d_emb = carry
    loss_c, d_hc, d_emb_c = grads(*xs)
    return (total + loss_c, d_emb + d_emb_c), d_hc
  # The first chunk starts the [V, D] accumulator: a zero-filled one would be allocated
  # early (XLA schedules the fill during the layers' forward pass) and add to its peak.
  total, d_h0, d_emb = grads(hs[0], ys[0], ws[0])
  (total, d_emb), d_h = jax.lax.scan(body, (total, d_emb), (hs[1:], ys[1:], ws[1:]))
  d_h = jnp.concatenate([d_h0[None], d_h]).reshape(-1, h.shape[-1])[:h.shape[0]]
  return total / n, (d_h.astype(h.dtype), d_emb.astype(emb.dtype), weights)


def _cross_entropy_bwd(chunk, res, g):
  d_h, d_emb, weights = res
  # The float32 cotangent would promote a bfloat16 residual: the cotangents must keep their
  # primals' dtypes, else the transpose of the first bfloat16 op above (Llama's final RMSNorm
  # scaling) fails on mixed operands.
  return ((g * d_h).astype(d_h.dtype), (g * d_emb).astype(d_emb.dtype), None,
          None if weights is None else jnp.zeros_like(weights))


chunked_cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)
