"""The language models' training loss over the output layer, in chunks of tokens.

:func:`chunked_cross_entropy` never holds the ``[B*T, V]`` logits or their
gradient; :func:`loss_chunk_tokens` picks its chunk (or the plain loss). Used
by :mod:`models.tasks`' loss.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


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
  """What the loss sum is divided by: N tokens, or the weights' sum (at least 1).

  N as a float: a Python int above 2**31 - 1 does not convert to JAX's default int32.
  """
  return float(n) if weights is None else jnp.maximum(jnp.sum(weights.astype(jnp.float32)), 1.0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 5))
def chunked_cross_entropy(h, emb, labels, chunk: int, weights=None, emb_grad: bool = True):
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
    emb_grad: False for a frozen output layer (a LoRA run): its ``[V, D]``
      gradient is neither computed nor held (it would cost a third of the
      loss's matmuls and a float32 copy of the embedding), and its cotangent is zero.
  """
  hs, ys, ws = _chunked(h, labels, chunk, weights)

  def body(total, xs):
    hc, yc, wc = xs
    _, lse, label_logit = _chunk_logits(hc, emb, yc)
    return total + jnp.sum((lse - label_logit) * wc), None
  total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), (hs, ys, ws))
  return total / _divisor(h.shape[0], weights)


def _cross_entropy_fwd(h, emb, labels, chunk, weights=None, emb_grad=True):
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
            jnp.dot(d_logits.T, hc.astype(jnp.float32)) if emb_grad else None)

  def body(carry, xs):
    total, d_emb = carry
    loss_c, d_hc, d_emb_c = grads(*xs)
    return (total + loss_c, None if d_emb is None else d_emb + d_emb_c), d_hc
  # The first chunk starts the [V, D] accumulator: a zero-filled one would be allocated
  # early (XLA schedules the fill during the layers' forward pass) and add to its peak.
  total, d_h0, d_emb = grads(hs[0], ys[0], ws[0])
  (total, d_emb), d_h = jax.lax.scan(body, (total, d_emb), (hs[1:], ys[1:], ws[1:]))
  d_h = jnp.concatenate([d_h0[None], d_h]).reshape(-1, h.shape[-1])[:h.shape[0]]
  d_emb = None if d_emb is None else d_emb.astype(emb.dtype)
  return total / n, (d_h.astype(h.dtype), d_emb, weights)


def _cross_entropy_bwd(chunk, emb_grad, res, g):
  del chunk, emb_grad
  d_h, d_emb, weights = res
  # The float32 cotangent would promote a bfloat16 residual: the cotangents must keep their
  # primals' dtypes, else the transpose of the first bfloat16 op above (Llama's final RMSNorm
  # scaling) fails on mixed operands. A frozen embedding's cotangent is None: zero.
  return ((g * d_h).astype(d_h.dtype), None if d_emb is None else (g * d_emb).astype(d_emb.dtype),
          None, None if weights is None else jnp.zeros_like(weights))


chunked_cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)
