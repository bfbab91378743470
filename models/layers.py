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

from models.chunking import row_chunks, zeros_after
from models.lora.dense import AdaptedDense, adapter_key
from models.lora.spec import PROJECTIONS, projection_tag

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


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def gelu_dense(h, kernel, bias, approximate: bool):
  """``nn.Dense`` applied to ``jax.nn.gelu(h)``, keeping only ``h``, with a chunked backward pass.

  Same values as the two ops. Differentiated as written, the backward pass
  would keep ``gelu(h)`` (the matmul's input, for its weight gradient) and
  the slope ``gelu'(h)``, two ``[.., F]`` arrays, while PyTorch keeps ``h``
  and ``gelu(h)``. This rule keeps ``h`` alone and runs its backward pass
  over :data:`models.chunking.BACKWARD_ROWS` rows at a time: each step rebuilds ``gelu(h)``
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

  # zeros_after, not constant zeros, nor dh as a scan output (which JAX starts as constant
  # zeros): see models.chunking.zeros_after.
  acc = (zeros_after(h2.shape, h.dtype, g2), zeros_after(kernel.shape, jnp.float32, g2),
         zeros_after(bias.shape, jnp.float32, g2))
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


def projection(parent: nn.Module, config, arch: str, path: str, features: int, x, *,
               kernel_init: Callable, rng=None, gelu: bool | None = None):
  """One projection of a GPT-2 or ViT block, named by its path below the block ('attn/query').

  ``x`` is a :class:`Normalized` LayerNorm output (a :class:`NormDense`), the
  input of a GELU (``gelu``: its ``approximate`` flag; a :class:`GeluDense`), or
  an array (``nn.Dense``); every one has a bias. In a LoRA run
  (``config.lora``) the layer is a frozen :class:`~models.lora.dense.AdaptedDense`
  of the same parameters, fed the LayerNorm's or GELU's output, with an
  adapter if ``path`` is a target (``rng``: the block's key for its dropout).
  """
  name = path.rsplit('/', 1)[-1]
  dtype = config.dtype
  if config.lora is None:
    if isinstance(x, Normalized):
      return NormDense(features, kernel_init, dtype, name=name, parent=parent)(x)
    if gelu is not None:
      return GeluDense(features, gelu, kernel_init, dtype, name=name, parent=parent)(x)
    return nn.Dense(features, kernel_init=kernel_init, dtype=dtype, name=name, parent=parent)(x)
  if isinstance(x, Normalized):   # NormDense's input, as it forms it: all three in dtype
    x = x.x_hat.astype(dtype) * x.scale.astype(dtype) + x.bias.astype(dtype)
  elif gelu is not None:
    x = jax.nn.gelu(x.astype(dtype), approximate=gelu)
  index = [p for p, _ in PROJECTIONS[arch]].index(path)
  return AdaptedDense(features, config.lora, path, projection_tag(arch, path), dtype,
                      use_bias=True, kernel_init=kernel_init, name=name,
                      parent=parent)(x, adapter_key(rng, index))
