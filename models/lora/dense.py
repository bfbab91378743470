"""A frozen projection with a LoRA adapter, as one matmul that every remat policy reads like its base.

:func:`lora_matmul` computes ``x @ W + s (xd @ A) @ B`` as the single product
``[x, xd @ A] @ [W; s B]``: the adapter's rank-r columns are appended to the
base's contraction. A policy then sees what it sees in the base model, one
``dot_general`` per projection, tagged by the caller with the projection's
name (``query_proj``, ``mlpwi_0``, ...); ``dots`` and the lean ``none`` keep
that one output. (Written as two products and a sum, they would keep both
products, the sum being elementwise: an extra ``[B, T, out]`` array per
adapted projection.) The rank-r product ``xd @ A``, which the backward pass
needs for ``B``'s gradient, carries the projection's tag too, so ``names:``
specs and the presets keep or recompute it with its projection.

The derivative is written out: ``W`` is frozen, so the backward pass never
forms its ``[in, out]`` gradient (differentiating the concatenated product
would), only ``dx = g W^T``, ``dA`` and ``dB`` (float32), and the
concatenation costs a copy of ``W`` where it is used (where a QLoRA kernel is
dequantized anyway).

:class:`AdaptedDense` is the linen layer the models use in a LoRA run, for
every projection of their blocks: the kernel (and bias) under the base's
names, frozen, dequantized here when stored quantized, and ``lora_a``,
``lora_b`` beside them when the projection is a target.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from models.dropout import dropout
from models.lora import quantize as q
from models.lora.spec import LoraSpec

_ROWS = (((0,), (0,)), ((), ()))   # dot_general contracting the leading (row) axis of both


def _rows(a):
  return a.reshape(-1, a.shape[-1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def lora_matmul(x, xd, w, a, b, scale: float, tag: str | None):
  """``x @ w + scale * (xd @ a) @ b`` as one product (module docstring).

  Args:
    x: inputs ``[..., in]`` in the compute dtype.
    xd: the adapter's inputs (``x`` after dropout, or ``x`` itself).
    w: the frozen kernel ``[in, out]`` in the compute dtype; it gets no gradient.
    a, b: the adapter ``[in, r]`` and ``[r, out]``, float32 (cast to ``x``'s
      dtype for the products; their gradients come back float32).
    scale: ``alpha / rank``.
    tag: checkpoint name of ``xd @ a`` (the projection's), or None.
  """
  return _forward(x, xd, w, a, b, scale, tag)[0]


def _forward(x, xd, w, a, b, scale, tag):
  dt = x.dtype
  xa = jnp.dot(xd, a.astype(dt))
  if tag:
    xa = checkpoint_name(xa, tag)
  wide = jnp.concatenate([x, xa], axis=-1)
  kernel = jnp.concatenate([w.astype(dt), (b * scale).astype(dt)], axis=0)
  return jnp.dot(wide, kernel), (xd, xa, w, a, b)


def _lora_fwd(x, xd, w, a, b, scale, tag):
  return _forward(x, xd, w, a, b, scale, tag)


def _lora_bwd(scale, tag, res, g):
  del tag
  xd, xa, w, a, b = res
  dt = g.dtype
  g2 = _rows(g)
  d_xa = jnp.dot(g, b.astype(dt).T) * jnp.asarray(scale, dt)                  # [..., r]
  db = jax.lax.dot_general(_rows(xa), g2, _ROWS, preferred_element_type=jnp.float32) * scale
  da = jax.lax.dot_general(_rows(xd), _rows(d_xa), _ROWS, preferred_element_type=jnp.float32)
  dx = jnp.dot(g, w.astype(dt).T)
  d_xd = jnp.dot(d_xa, a.astype(dt).T)
  return dx, d_xd, jnp.zeros_like(w), da.astype(a.dtype), db.astype(b.dtype)


lora_matmul.defvjp(_lora_fwd, _lora_bwd)


def _lora_a_init(rng, shape, dtype=jnp.float32):
  """peft's ``lora_A`` initialisation (kaiming_uniform, a = sqrt 5): uniform in +-1/sqrt(in)."""
  bound = 1.0 / math.sqrt(shape[0])
  return jax.random.uniform(rng, shape, dtype, -bound, bound)


class AdaptedDense(nn.Module):
  """A frozen ``x @ kernel (+ bias)``, with a LoRA adapter when ``projection`` is a target.

  The parameters keep the base layer's names (``kernel``, ``bias``), shapes and
  initialisers, so a Hugging Face checkpoint imports onto them as onto the full
  model; ``lora_a`` ``[in, r]`` and ``lora_b`` ``[r, out]`` are created after them.

  Attributes:
    features: output width.
    lora: the run's adapters.
    projection: this layer's full name in :data:`models.lora.spec.PROJECTIONS`.
    tag: the checkpoint name of the projection's output (the adapter's product carries it).
    dtype: compute dtype.
    use_bias: a frozen bias (GPT-2 and ViT projections).
    kernel_init: the base layer's kernel initialiser.
  """
  features: int
  lora: LoraSpec
  projection: str
  tag: str | None
  dtype: str = 'float32'
  use_bias: bool = False
  kernel_init: Callable = nn.initializers.normal(0.02)

  @nn.compact
  def __call__(self, x, rng=None):
    """``x [..., in]`` -> ``[..., features]``; ``rng``: the adapter's dropout key (None: off)."""
    spec, dt = self.lora, self.dtype
    n_in = x.shape[-1]
    shape = (n_in, self.features)
    if spec.quantize:
      stored = self.param('kernel', q.quantized_init(self.kernel_init, spec.quantize), shape)
      w = q.dequantize(stored, spec.quantize, dt)
    else:
      w = self.param('kernel', self.kernel_init, shape, jnp.float32).astype(dt)
    w = jax.lax.stop_gradient(w)   # frozen: no gradient, whatever the caller differentiates
    # The bias before the adapter, in nn.Dense's order of creation.
    bias = self.param('bias', nn.initializers.zeros, (self.features,), jnp.float32) if (
        self.use_bias) else None
    x = x.astype(dt)
    if spec.adapts(self.projection):
      a = self.param('lora_a', _lora_a_init, (n_in, spec.rank), jnp.float32)
      b = self.param('lora_b', nn.initializers.zeros, (spec.rank, self.features), jnp.float32)
      xd = x if rng is None or not spec.dropout else dropout(x, spec.dropout, deterministic=False,
                                                             rng=rng)
      y = lora_matmul(x, xd, w, a, b, spec.scale, self.tag)
    else:
      y = jnp.dot(x, w)
    if bias is not None:
      y = y + jax.lax.stop_gradient(bias).astype(dt)
    return y


def adapter_key(rng, projection_index: int):
  """The dropout key of one projection's adapter, folded from its layer's key (None stays None)."""
  return None if rng is None else jax.random.fold_in(rng, 0x10AA + projection_index)
