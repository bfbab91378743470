"""Softmax attention for the Transformer models: dense, blockwise (flash-style) or cuDNN.

:func:`attention` is the one entry point; ``implementation`` picks how:

``'dense'``
  The whole [B, H, T, T] score matrix in one piece, as written in the
  papers. Fastest on CPU at short sequences. The backward pass keeps only
  ``q, k, v`` and recomputes the probabilities, :data:`BACKWARD_ROWS` query
  rows at a time, but the forward pass materialises [B, H, T, T] arrays:
  memory grows as T**2.
``'blockwise'``
  Online softmax over blocks of queries and keys in plain XLA, the gradient
  blockwise too (:mod:`models.blockwise_attention`): memory grows as T.
  Runs on every backend.
``'cudnn'``
  ``jax.nn.dot_product_attention(..., implementation='cudnn')``: NVIDIA's
  fused flash attention. Needs an attached GPU with cuDNN, float16 or
  bfloat16 inputs, and no dropout. It cannot be compiled for a GPU target
  on a CPU-only machine (``remat.targets``): JAX asks the cuDNN library for
  its version while tracing, and that library and a device are not there
  ("RuntimeError: cuDNN not found"). See docs/attention.md.
``'auto'`` (the default)
  ``'cudnn'`` where it applies (the traced program runs on an attached GPU:
  ``jax.default_backend() == 'gpu'``, inputs in float16/bfloat16, no
  dropout, head size a multiple of 8 up to 128); else ``'blockwise'`` from
  :data:`AUTO_BLOCKWISE_MIN_LEN` tokens on, ``'dense'`` below (the shipped
  configs' lengths, whose documented plans are dense; blockwise is already
  as fast on CPU from a few hundred tokens). A deviceless GPU plan is
  traced on the CPU backend, so ``'auto'`` never picks cuDNN there, which
  is as well, since it could not be compiled; it plans with blockwise (or
  dense) attention, whose memory XLA's GPU compiler does plan. To force an
  implementation, set the model config's ``attention`` field.

GPT-2 and ViT drop attention probabilities. Blockwise attention draws each
block's dropout mask as that block of the dense path's [B, H, T, T] mask, so
with the same key both paths drop the same entries
(:mod:`models.blockwise_attention`).

Remat: every implementation tags its output ``context``. The dense path's
scores are one opaque call to policies (:func:`_exp_scores`); under ``dots``
dense attention keeps its context (a batched matmul). What blockwise
attention tags and keeps: :mod:`models.blockwise_attention`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from models.attention_parts import _check_shapes, _einsum, _groups, _heads, _int_zeros, _ungroup
from models.blockwise_attention import blockwise_attention
from models.chunking import MAX_BACKWARD_CHUNKS
from models.dropout import bernoulli, bernoulli_block, fused_bits_ok
from remat import read_after

IMPLEMENTATIONS = ('auto', 'dense', 'blockwise', 'cudnn')

# 'auto' switches from dense to blockwise attention at this many tokens. On CPU blockwise
# attention is about as fast at 256 tokens and faster from 512 on (causal: 1.3x at 512, 2.6x at
# 1024; docs/attention.md), but every shipped config (GPT-2 max_len <= 1024, ViT-B/16 at 384 px:
# 577 tokens) stays on the dense path, whose plans and bitwise-checked values the docs and tests
# quote. Set a config's `attention` to 'blockwise' to use it at any length.
AUTO_BLOCKWISE_MIN_LEN = 2048

# Query and key rows per block. Each step of the blockwise scan holds a few
# [B, H, BLOCK, BLOCK] float32 arrays (scores, probabilities, their gradients): 256 KiB
# per (batch, head) each. On CPU 128 and 256 are equally fast, 512 is slower (docs/attention.md).
# Here rather than in models/blockwise_attention.py: attention() reads them at each call.
BLOCK_Q = 256
BLOCK_K = 256


def attention(q, k, v, *, causal: bool, dropout_rate: float, deterministic: bool, rng,
              implementation: str = 'auto', segment_ids=None):
  """Softmax attention of [B, T, H, Dh] queries over [B, T, Hkv, Dh] keys and values.

  Values are those of ``dropout(softmax(q k^T / sqrt(Dh))) v`` for every
  implementation (up to rounding; ``'dense'`` uses the same softmax formula
  and dropout masks as ``jax.nn.softmax`` and :func:`models.dropout.dropout`).
  Grouped-query attention when ``Hkv < H``: query head ``h`` reads key/value
  head ``h // (H // Hkv)``, without repeating ``k`` and ``v`` in memory.

  Args:
    q: queries [B, T, H, Dh].
    k, v: keys and values [B, T, Hkv, Dh]; ``H % Hkv == 0``.
    causal: mask out keys after the query.
    dropout_rate: attention-probability dropout.
    deterministic: no dropout.
    rng: dropout key (a raw uint32 key); unused when deterministic or the rate is 0.
    implementation: ``'auto'``, ``'dense'``, ``'blockwise'`` or ``'cudnn'`` (module docstring).
    segment_ids: None, or int ``[B, T]``: the document each position belongs to in a
      window packed from several documents. A query attends only to keys of its own
      segment (on every implementation), so no document sees another.

  Returns:
    The context [B, T, H, Dh], tagged ``context``.

  Raises:
    ValueError: bad shapes or implementation, dropout without a key, or
      ``'cudnn'`` with dropout or float32 inputs.
  """
  _check_shapes(q, k, v)
  if segment_ids is not None and segment_ids.shape != q.shape[:2]:
    raise ValueError(f'attention: segment_ids must be [B, T] = {q.shape[:2]}, got '
                     f'{segment_ids.shape}')
  rate = 0.0 if deterministic else float(dropout_rate)
  if rate > 0.0 and rng is None:
    raise ValueError('attention dropout in training mode needs a key (rng)')
  impl = resolve_implementation(implementation, q, rate)
  key = rng if rate > 0.0 else jnp.zeros((2,), jnp.uint32)
  if impl == 'dense':
    ctx = _attention(q, k, v, key, segment_ids, causal, rate)
  elif impl == 'blockwise':
    ctx = blockwise_attention(q, k, v, key, causal=causal, rate=rate, block_q=BLOCK_Q,
                              block_k=BLOCK_K, segment_ids=segment_ids)
  else:
    ctx = _cudnn_attention(q, k, v, causal, rate, segment_ids)
  return checkpoint_name(ctx, 'context')


def resolve_implementation(implementation: str, q, rate: float = 0.0,
                           platform: str | None = None) -> str:
  """The implementation ``'auto'`` stands for (others are returned as given).

  Args:
    implementation: one of :data:`IMPLEMENTATIONS`.
    q: the queries (an array, tracer or ShapeDtypeStruct: shape and dtype are read).
    rate: the dropout rate that applies (0 when deterministic).
    platform: the backend the program runs on; default ``jax.default_backend()``,
      which is ``'cpu'`` while planning for a GPU target on a CPU-only machine.
  """
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"unknown attention implementation '{implementation}'; valid: "
                     f"{', '.join(IMPLEMENTATIONS)}")
  if implementation != 'auto':
    return implementation
  platform = platform or jax.default_backend()
  dh = q.shape[-1]
  if (platform == 'gpu' and q.dtype in (jnp.bfloat16, jnp.float16) and rate == 0.0
      and dh % 8 == 0 and dh <= 128):
    return 'cudnn'
  return 'blockwise' if q.shape[1] >= AUTO_BLOCKWISE_MIN_LEN else 'dense'


# ----------------------------------------------------------------------------- dense


def _same_segment(segs):
  """[B, T] segment ids -> [B, 1, 1, T, T] booleans: key in the query's segment (None: None)."""
  if segs is None:
    return None
  return (segs[:, :, None] == segs[:, None, :])[:, None, None]


@functools.partial(jax.custom_jvp, nondiff_argnums=(3,))
def _exp_scores(q, k, segs, causal: bool):
  """``exp(scores - row max)`` [B, Hkv, G, T, T] and its row sums, for grouped heads.

  ``q`` is [B, Hkv, G, T, Dh], ``k`` [B, Hkv, T, Dh], ``segs`` None or the
  [B, T] segment ids (keys of another segment are masked). Only ever called inside
  :func:`_attention`'s rules, never differentiated: the rule below declares
  the outputs constant. It is a ``custom_jvp`` so that remat policies see one
  call instead of its ``dot_general``: ``dots`` then saves the projections
  and the context, as PyTorch's selective checkpointing of fused attention
  does, not the [B, H, T, T] scores, which ``none`` does not keep either.
  """
  scores = _einsum('bngqd,bnkd->bngqk', q, k) / math.sqrt(q.shape[-1])
  if causal:
    t = q.shape[3]
    scores = jnp.where(jnp.tril(jnp.ones((t, t), dtype=bool)), scores,
                       jnp.finfo(scores.dtype).min)
  if segs is not None:   # every row keeps its own position (its segment), so no row is empty
    scores = jnp.where(_same_segment(segs), scores, jnp.finfo(scores.dtype).min)
  # jax.nn.softmax's operations: exp(x - max) / sum(exp(x - max)).
  unnormalised = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
  return unnormalised, jnp.sum(unnormalised, axis=-1, keepdims=True)


@_exp_scores.defjvp
def _exp_scores_jvp(causal, primals, tangents):
  out = _exp_scores(*primals, causal)
  return out, tuple(jnp.zeros_like(o) for o in out)


def _probs(q, k, segs, causal):
  """Softmax probabilities [B, Hkv, G, T, T] of grouped heads."""
  unnormalised, row_sum = _exp_scores(q, k, segs, causal)
  return unnormalised / row_sum


def _dropped(probs, key, rate):
  """Dropout of the probabilities (``rate`` static) and the mask, or (probs, None).

  The mask is drawn in the [B, H, T, T] shape (``H = Hkv * G`` flattens in
  the same order), so its bits do not depend on the grouping.
  """
  if rate == 0.0:
    return probs, None
  b, n, g, t, tk = probs.shape
  mask = bernoulli(key, 1.0 - rate, (b, n * g, t, tk)).reshape(probs.shape)
  return jax.lax.select(mask, probs / (1.0 - rate), jnp.zeros_like(probs)), mask


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _attention(q, k, v, key, segs, causal: bool, rate: float):
  """Dense attention; the gradient keeps only ``q``, ``k`` and ``v`` (recomputes the probabilities)."""
  return _attention_fwd(q, k, v, key, segs, causal, rate)[0]


def _f32(*xs):
  return tuple(x.astype(jnp.float32) for x in xs)


def _attention_fwd(q, k, v, key, segs, causal, rate):
  # Mixed precision: the scores and softmax are float32 (q and k cast here, inside the
  # rule); the probabilities meet v in v's dtype, as flash attention's P @ V does, so the
  # context (which `dots` may save) is a bfloat16 matmul output. Residuals: q, k, v as given.
  hkv = k.shape[2]
  dropped, _ = _dropped(_probs(*_f32(_groups(q, hkv), _heads(k)), segs, causal), key, rate)
  ctx = _ungroup(_einsum('bngqk,bnkd->bngqd', dropped.astype(v.dtype), _heads(v)))
  return ctx, (q, k, v, key, segs)


# Query rows per step of the dense attention's backward pass (:func:`_attention_bwd`).
BACKWARD_ROWS = 64


def _attention_bwd(causal, rate, res, g):
  """The dense gradient, a loop over chunks of :data:`BACKWARD_ROWS` query rows.

  Each step recomputes its rows' probabilities ``[B, Hkv, G, rows, T]`` (the
  forward's formula, row by row the same values), gives their ``dQ`` and adds
  their share to ``dK`` and ``dV``: the same matmuls as one pass over all
  rows. In one pass, XLA's CPU plan computed the ``[B, H, T, T]``
  probabilities as soon as ``q`` and ``k`` existed and, under a policy that
  recomputes the layer, merged them with the recomputed forward's: they and a
  transposed copy (for ``P^T dO``) stayed live across the rest of the
  layer's backward pass, the MLP's included. The loop reads ``dO``, so it
  starts only once ``dO`` exists, and holds one chunk's ``[.., rows, T]``
  arrays at a time. Rows past the last whole chunk run as one shorter step.
  """
  q, k, v, key, segs = res
  dtypes = (q.dtype, k.dtype, v.dtype)
  # In remat.fused_update's backward pass, the head-major copies of q, k and v below wait for
  # dO: XLA's CPU schedule made them as soon as the layer's residuals were read and held them
  # through the MLP's backward pass (ViT-B/16 `dots`: 1686 -> 1665 MiB, docs/pytorch.md).
  q, k, v = read_after((q, k, v), g)
  hkv = k.shape[2]
  q, k, v, g = _f32(_groups(q, hkv), _heads(k), _heads(v), _groups(g, hkv))
  b, n, groups, t, d = q.shape
  full = (b, n * groups, t, t)
  whole_mask = None
  if rate > 0.0 and not fused_bits_ok(key, full):
    whole_mask = bernoulli(key, 1.0 - rate, full).reshape(b, n, groups, t, t)
  cols = jax.lax.broadcasted_iota(jnp.int32, (1, t), 1)

  def chunk(row0, rows: int):
    """dQ of rows ``row0 .. row0 + rows`` and their shares of dK and dV."""
    q_c = jax.lax.dynamic_slice_in_dim(q, row0, rows, axis=3)
    g_c = jax.lax.dynamic_slice_in_dim(g, row0, rows, axis=3)
    scores = _einsum('bngqd,bnkd->bngqk', q_c, k) / math.sqrt(d)
    if causal:
      ids = row0 + jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
      scores = jnp.where(cols <= ids, scores, jnp.finfo(scores.dtype).min)
    if segs is not None:
      seg_q = jax.lax.dynamic_slice_in_dim(segs, row0, rows, axis=1)
      same = (seg_q[:, :, None] == segs[:, None, :])[:, None, None]
      scores = jnp.where(same, scores, jnp.finfo(scores.dtype).min)
    # jax.nn.softmax's operations, as in the forward pass (_exp_scores).
    unnormalised = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
    probs = unnormalised / jnp.sum(unnormalised, axis=-1, keepdims=True)
    mask = None
    if rate > 0.0:   # these rows of the forward's mask, the same bits
      if whole_mask is None:
        mask = bernoulli_block(key, 1.0 - rate, (b, n * groups, rows, t), full,
                               (0, 0, row0, 0)).reshape(probs.shape)
      else:
        mask = jax.lax.dynamic_slice_in_dim(whole_mask, row0, rows, axis=3)
    dropped = probs if mask is None else jax.lax.select(mask, probs / (1.0 - rate),
                                                        jnp.zeros_like(probs))
    # The forward pass's P @ V read P in v's dtype: so does its derivative (no-op in float32).
    dv_c = _einsum('bngqk,bngqd->bnkd', *_f32(dropped.astype(dtypes[2]), g_c))
    d_probs = _einsum('bngqd,bnkd->bngqk', g_c, v)
    if mask is not None:
      d_probs = jax.lax.select(mask, d_probs / (1.0 - rate), jnp.zeros_like(d_probs))
    # Softmax derivative; masked (causal) entries have probs 0, so no gradient.
    d_scores = probs * (d_probs - jnp.sum(probs * d_probs, axis=-1, keepdims=True))
    d_scores = d_scores / math.sqrt(d)
    dq_c = _einsum('bngqk,bnkd->bngqd', d_scores, k)
    dk_c = _einsum('bngqk,bngqd->bnkd', d_scores, q_c)
    return dq_c, dk_c, dv_c

  # At most MAX_BACKWARD_CHUNKS steps (one launch of each matmul per step on a GPU).
  size = max(min(BACKWARD_ROWS, t), -(-t // MAX_BACKWARD_CHUNKS))
  whole, rest = divmod(t, size)

  def step(acc, row0):
    dq, dk, dv = acc
    dq_c, dk_c, dv_c = chunk(row0, size)
    first = row0 == 0
    return (jax.lax.dynamic_update_slice_in_dim(dq, dq_c, row0, axis=3),
            jnp.where(first, dk_c, dk + dk_c), jnp.where(first, dv_c, dv + dv_c)), None

  # The carry starts as copies of dO: buffers made once dO exists (constant zeros would be
  # made at once, and held across the rest of the layer's backward pass). No value of them
  # is read: each step writes its rows of dQ, and the first step sets dK and dV.
  acc = (g, g[:, :, 0], g[:, :, 0])
  (dq, dk, dv), _ = jax.lax.scan(step, acc, jnp.arange(whole, dtype=jnp.int32) * size)
  if rest:
    dq_c, dk_c, dv_c = chunk(whole * size, rest)
    dq = jax.lax.dynamic_update_slice_in_dim(dq, dq_c, whole * size, axis=3)
    dk, dv = dk + dk_c, dv + dv_c
  dq, dk, dv = (d.astype(t) for d, t in zip((_ungroup(dq), _heads(dk), _heads(dv)), dtypes))
  return dq, dk, dv, np.zeros(key.shape, jax.dtypes.float0), _int_zeros(segs)


_attention.defvjp(_attention_fwd, _attention_bwd)


# ----------------------------------------------------------------------------- cuDNN


def _cudnn_attention(q, k, v, causal, rate, segs=None):
  if rate > 0.0:
    raise ValueError("attention implementation 'cudnn' has no dropout (jax.nn.dot_product_attention "
                     "takes none); use 'blockwise' or 'dense', or a dropout rate of 0")
  if q.dtype not in (jnp.bfloat16, jnp.float16):
    raise ValueError(f"attention implementation 'cudnn' needs float16 or bfloat16 inputs, got "
                     f'{q.dtype}')
  # Packed documents: a [B, 1, T, T] mask of same-segment pairs, with the causal mask type.
  mask = None if segs is None else _same_segment(segs)[:, 0]
  return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal,
                                      implementation='cudnn')
