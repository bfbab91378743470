"""Pieces shared by the Transformer models (GPT-2, ViT)."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
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


def dropout_keys(rng, n: int):
  """``n`` independent keys folded from a block's key, or ``n`` Nones when deterministic."""
  return (None,) * n if rng is None else tuple(jax.random.fold_in(rng, i) for i in range(n))


def attention(q, k, v, *, causal: bool, dropout_rate: float, deterministic: bool, rng):
  """Softmax attention of [B, T, H, Dh] heads; returns the context tagged ``context``.

  The [B, H, T, T] scores and probabilities are created here untagged: the
  per-layer rules decide whether they are kept (``dots``) or recomputed.
  """
  scores = jnp.einsum('bqhd,bkhd->bhqk', q, k) / math.sqrt(q.shape[-1])
  if causal:
    t = q.shape[1]
    scores = jnp.where(jnp.tril(jnp.ones((t, t), dtype=bool)), scores,
                       jnp.finfo(scores.dtype).min)
  probs = jax.nn.softmax(scores, axis=-1)
  probs = nn.Dropout(dropout_rate)(probs, deterministic, rng=rng)
  return checkpoint_name(jnp.einsum('bhqk,bkhd->bqhd', probs, v), 'context')
