"""Softmax attention for the Transformer models: dense, blockwise (flash-style) or cuDNN.

:func:`attention` is the one entry point; ``implementation`` picks how:

``'dense'``
  The whole [B, H, T, T] score matrix in one piece, as written in the
  papers. Fastest on CPU at short sequences. The backward pass keeps only
  ``q, k, v`` and recomputes the probabilities, :data:`BACKWARD_ROWS` query
  rows at a time, but the forward pass materialises [B, H, T, T] arrays:
  memory grows as T**2.
``'blockwise'``
  Online softmax over blocks of queries and keys in plain XLA (Milakov &
  Gimelshein 2018; Dao et al.'s FlashAttention-2 schedule), one
  ``lax.scan`` over the (query block, key block) pairs that are needed
  (causal attention skips the blocks above the diagonal). The gradient is
  blockwise too (a ``custom_vjp``): the backward pass keeps ``q, k, v``, the
  output and the per-row logsumexp of the scores, and recomputes each block's
  probabilities. Neither pass holds more than a few [B, H, block, block]
  arrays: memory grows as T. Runs on every backend.
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
block's dropout mask as that block of the dense path's [B, H, T, T] mask (the
same counter-based bits, :func:`models.dropout.bernoulli_block`), so with
the same key both paths drop the same entries and give the same values up to
float32 rounding, with dropout or without (beyond 2**32 mask elements, where
the dense path's bits use 64-bit counters, each block draws from its own
folded key instead: a different but equally valid mask, the same in the
forward and backward pass).

Remat: every implementation tags its output ``context``. Blockwise attention
also tags its per-row logsumexp ``context``: the backward pass needs both,
so every policy that saves the context (``names:context``, MaxText's
``*_with_context`` presets) saves what spares recomputing the attention
forward, and no tag-based policy can keep one without the other (saving the
output alone would be memory spent for nothing). The blockwise forward is one
opaque call to policies (like the dense path's scores): ``dots`` does not save
its block matmuls, which would stack into [T, T] residuals. Its output is not
a matmul, so ``dots`` recomputes the blockwise forward in the backward pass
where dense attention under ``dots`` keeps its context (a batched matmul).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

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


def _check_shapes(q, k, v):
  if q.ndim != 4 or k.shape != v.shape or k.ndim != 4:
    raise ValueError(f'attention wants q [B, T, H, Dh] and k, v [B, T, Hkv, Dh], got '
                     f'{q.shape}, {k.shape}, {v.shape}')
  (b, t, h, d), (bk, tk, hkv, dk) = q.shape, k.shape
  if (b, t, d) != (bk, tk, dk) or h % hkv:
    raise ValueError(f'attention: q {q.shape} and k/v {k.shape} must agree on B, T and Dh, '
                     f'and the query heads must be a multiple of the key/value heads')


def _groups(q, hkv: int):
  """[B, T, H, Dh] -> [B, Hkv, G, T, Dh]: heads first, query head h = n * G + g."""
  b, t, h, d = q.shape
  return q.reshape(b, t, hkv, h // hkv, d).transpose(0, 2, 3, 1, 4)


def _ungroup(x):
  """[B, Hkv, G, T, Dh] -> [B, T, H, Dh]."""
  b, n, g, t, d = x.shape
  return x.transpose(0, 3, 1, 2, 4).reshape(b, t, n * g, d)


def _heads(x):
  """[B, T, Hkv, Dh] <-> [B, Hkv, T, Dh].

  The matmuls run with (B, H) leading: XLA CPU's batched matmul is several
  times slower when the batch dimensions are not the leading ones (the
  forward pass of ViT-B/16 attention at batch 8: 74 ms against 16 ms).
  """
  return x.transpose(0, 2, 1, 3)


def _einsum(expr: str, x, y, **kwargs):
  """``jnp.einsum`` over grouped heads (``g`` the group axis) that drops a group axis of size 1.

  Without groups (``Hkv == H``) the dense path then runs the very matmuls it
  ran before grouped-query attention existed, with the same bits: XLA CPU's
  summation order can change with an extra unit axis.
  """
  ins, out = expr.split('->')
  a, b = ins.split(',')
  g = 'g'
  if (g in a and x.shape[a.index(g)] == 1) or (g in b and y.shape[b.index(g)] == 1):
    squeeze = lambda z, s: jnp.squeeze(z, s.index(g)) if g in s else z
    res = jnp.einsum(f"{a.replace(g, '')},{b.replace(g, '')}->{out.replace(g, '')}",
                     squeeze(x, a), squeeze(y, b), **kwargs)
    return jnp.expand_dims(res, out.index(g)) if g in out else res
  return jnp.einsum(expr, x, y, **kwargs)


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


def _int_zeros(segs):
  """The (empty) cotangent of integer segment ids, or None without them."""
  return None if segs is None else np.zeros(segs.shape, jax.dtypes.float0)


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


# ----------------------------------------------------------------------------- blockwise


def blockwise_attention(q, k, v, key, *, causal: bool, rate: float = 0.0,
                        block_q: int = 256, block_k: int = 256, segment_ids=None):
  """Blockwise (online-softmax) attention; memory linear in T, forward and backward.

  Args:
    q: [B, T, H, Dh].
    k, v: [B, T, Hkv, Dh].
    key: raw uint32 dropout key (ignored when ``rate`` is 0).
    causal: mask out keys after the query.
    rate: attention-probability dropout (0 for none), static.
    block_q, block_k: rows per query / key block (clipped to T; T need not be a
      multiple); :func:`attention` passes :data:`BLOCK_Q` and :data:`BLOCK_K`.
    segment_ids: None or int [B, T]; keys of another segment are masked in
      every block (block pairs are not skipped for it: the masks are per row).

  Returns:
    The context [B, T, H, Dh] (not tagged; :func:`attention` tags it).
  """
  _check_shapes(q, k, v)
  t = q.shape[1]
  spec = _Blocks(t, min(block_q, t), min(block_k, t), causal, float(rate))
  return _blockwise(q, k, v, key, segment_ids, spec)


class _Blocks:
  """The static layout of one blockwise call: block sizes, padding and the block pairs visited."""

  def __init__(self, t: int, bq: int, bk: int, causal: bool, rate: float):
    self.t, self.bq, self.bk, self.causal, self.rate = t, bq, bk, causal, rate
    self.nq, self.nk = -(-t // bq), -(-t // bk)
    # Causal: key block j is needed by query block i when its first key is at or before
    # the block's last query. The others are all masked and skipped.
    pairs = [(i, j) for i in range(self.nq) for j in range(self.nk)
             if not causal or j * bk <= min((i + 1) * bq, t) - 1]
    self.pairs_by_query = np.asarray(pairs, np.int32).reshape(-1, 2)
    self.pairs_by_key = np.asarray(sorted(pairs, key=lambda p: (p[1], p[0])),
                                   np.int32).reshape(-1, 2)

  def _key(self):
    return (self.t, self.bq, self.bk, self.causal, self.rate)

  def __hash__(self):
    return hash(self._key())

  def __eq__(self, other):
    return isinstance(other, _Blocks) and self._key() == other._key()


def _pad_rows(x, axis: int, size: int):
  pad = size - x.shape[axis]
  if not pad:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths)


def _q_blocks(x, hkv, spec: _Blocks):
  """[B, T, H, Dh] -> [nq, B, Hkv, G, bq, Dh] (zero-padded rows)."""
  b, t, h, d = x.shape
  x = _pad_rows(_groups(x, hkv), 3, spec.nq * spec.bq)
  return x.reshape(b, hkv, h // hkv, spec.nq, spec.bq, d).transpose(3, 0, 1, 2, 4, 5)


def _q_unblock(x, t):
  """[nq, B, Hkv, G, bq, Dh] -> [B, T, H, Dh]."""
  nq, b, n, g, bq, d = x.shape
  return _ungroup(x.transpose(1, 2, 3, 0, 4, 5).reshape(b, n, g, nq * bq, d)[:, :, :, :t])


def _row_blocks(x, spec: _Blocks):
  """[B, Hkv, G, T] row statistics -> [nq, B, Hkv, G, bq]."""
  b, n, g, _ = x.shape
  x = _pad_rows(x, 3, spec.nq * spec.bq)
  return x.reshape(b, n, g, spec.nq, spec.bq).transpose(3, 0, 1, 2, 4)


def _row_unblock(x, t):
  nq, b, n, g, bq = x.shape
  return x.transpose(1, 2, 3, 0, 4).reshape(b, n, g, nq * bq)[..., :t]


def _k_blocks(x, spec: _Blocks):
  """[B, T, Hkv, Dh] -> [nk, B, Hkv, bk, Dh] (zero-padded rows)."""
  b, t, n, d = x.shape
  x = _pad_rows(_heads(x), 2, spec.nk * spec.bk)
  return x.reshape(b, n, spec.nk, spec.bk, d).transpose(2, 0, 1, 3, 4)


def _k_unblock(x, t):
  nk, b, n, bk, d = x.shape
  return _heads(x.transpose(1, 2, 0, 3, 4).reshape(b, n, nk * bk, d)[:, :, :t])


def _take(x, i):
  return jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False)


def _put(x, i, value):
  return jax.lax.dynamic_update_index_in_dim(x, value.astype(x.dtype), i, 0)


def _pairs(pairs: np.ndarray, data):
  """The block pairs [P, 2] to scan over, tied to ``data`` (a traced input) by an optimization barrier.

  Everything a pair's step derives from the pair alone (the indices, the causal
  and padding mask) is constant across a model's layer scan. Without the tie,
  JAX's scan partial evaluation hoists that part out of the layer loop as a
  loop-invariant residual: a second scan that stacks every pair's mask,
  [P, B, Hkv, G, bq, bk] booleans, quadratic in T (17 GB for Llama-3.2-1B at
  T = 32768, P = 8256). Tied to the layer's data, the mask is computed in the
  step where it is used.
  """
  pairs, _ = jax.lax.optimization_barrier((jnp.asarray(pairs), data))
  return pairs


def _seg_blocks(segs, n: int, size: int):
  """[B, T] segment ids -> [n, B, size] (padding gets -1: padded keys are masked anyway)."""
  if segs is None:
    return None
  b, t = segs.shape
  segs = jnp.pad(segs, ((0, 0), (0, n * size - t)), constant_values=-1)
  return segs.reshape(b, n, size).transpose(1, 0, 2)


def _block_scores(qb, kb, i, j, spec: _Blocks, sq=None, sk=None):
  """Scaled scores [B, Hkv, G, bq, bk] (float32) of one block pair and its mask of valid keys.

  ``sq``, ``sk``: the pair's query and key segment ids [B, bq], [B, bk], or None.
  """
  s = _einsum('bngqd,bnkd->bngqk', qb, kb, preferred_element_type=jnp.float32)
  s = s / np.float32(math.sqrt(qb.shape[-1]))
  rows = i * spec.bq + jax.lax.broadcasted_iota(jnp.int32, (spec.bq, 1), 0)
  cols = j * spec.bk + jax.lax.broadcasted_iota(jnp.int32, (1, spec.bk), 1)
  valid = cols < spec.t                         # padded keys
  if spec.causal:
    valid = valid & (cols <= rows)
  if sq is not None:
    valid = valid & (sq[:, None, None, :, None] == sk[:, None, None, None, :])
  return s, valid


def _block_keep(key, i, j, shape, spec: _Blocks):
  """The dropout keep-mask [B, Hkv, G, bq, bk] of block pair (i, j): that block of the dense mask."""
  b, n, g, bq, bk = shape
  full = (b, n * g, spec.t, spec.t)
  keep = 1.0 - spec.rate
  if fused_bits_ok(key, full):
    mask = bernoulli_block(key, keep, (b, n * g, bq, bk), full, (0, 0, i * bq, j * bk))
  else:   # too many elements for 32-bit counters, or other keys: a key per block pair
    mask = jax.random.bernoulli(jax.random.fold_in(key, i * spec.nk + j), keep, (b, n * g, bq, bk))
  return mask.reshape(shape)


def _take_seg(blocks, i):
  return None if blocks is None else _take(blocks, i)


@functools.partial(jax.custom_jvp, nondiff_argnums=(5,))
def _blockwise_forward(q, k, v, key, segs, spec: _Blocks):
  """Output [B, T, H, Dh] and logsumexp [B, H, T] (float32) of blockwise attention.

  One ``lax.scan`` over the block pairs, query block major; the running row
  max, row sum and unnormalised output of every query row are carried whole
  (linear in T) and the pair's query block is read and written in place.
  A ``custom_jvp`` declaring the outputs constant, as :func:`_exp_scores`:
  never differentiated (the ``custom_vjp`` around it has its own rule), and
  one opaque call to remat policies, which would otherwise save the block
  matmuls of every iteration.
  """
  hkv = k.shape[2]
  qb, kb, vb = _q_blocks(q, hkv, spec), _k_blocks(k, spec), _k_blocks(v, spec)
  sqb, skb = _seg_blocks(segs, spec.nq, spec.bq), _seg_blocks(segs, spec.nk, spec.bk)
  row_shape = qb.shape[:-1]
  init = (jnp.full(row_shape, -jnp.inf, jnp.float32), jnp.zeros(row_shape, jnp.float32),
          jnp.zeros(qb.shape, jnp.float32))

  def step(carry, pair):
    m_all, l_all, acc_all = carry
    i, j = pair[0], pair[1]
    q_i, k_j, v_j = _take(qb, i), _take(kb, j), _take(vb, j)
    s, valid = _block_scores(q_i, k_j, i, j, spec, _take_seg(sqb, i), _take_seg(skb, j))
    m_old, l_old, acc_old = _take(m_all, i), _take(l_all, i), _take(acc_all, i)
    # Masked scores never raise the max; a row whose keys so far are all masked keeps
    # -inf, and its exp(-inf - -inf) NaN is replaced by the where below.
    m_new = jnp.maximum(m_old, jnp.max(jnp.where(valid, s, -jnp.inf), axis=-1))
    p = jnp.where(valid, jnp.exp(s - m_new[..., None]), 0.0)
    alpha = jnp.where(m_old == -jnp.inf, 0.0, jnp.exp(m_old - m_new))
    l_new = alpha * l_old + jnp.sum(p, axis=-1)
    if spec.rate > 0.0:   # the normaliser is over all keys; only the weights are dropped
      p = jnp.where(_block_keep(key, i, j, p.shape, spec), p / (1.0 - spec.rate), 0.0)
    pv = _einsum('bngqk,bnkd->bngqd', p.astype(v_j.dtype), v_j,
                    preferred_element_type=jnp.float32)
    acc_new = alpha[..., None] * acc_old + pv
    return (_put(m_all, i, m_new), _put(l_all, i, l_new), _put(acc_all, i, acc_new)), None

  (m, l, acc), _ = jax.lax.scan(step, init, _pairs(spec.pairs_by_query, qb))
  out = _q_unblock(acc / l[..., None], spec.t).astype(q.dtype)
  lse = _row_unblock(m + jnp.log(l), spec.t)
  b, n, g, t = lse.shape
  return out, lse.reshape(b, n * g, t)


@_blockwise_forward.defjvp
def _blockwise_forward_jvp(spec, primals, tangents):
  del tangents
  out = _blockwise_forward(*primals, spec)
  return out, tuple(jnp.zeros_like(o) for o in out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _blockwise(q, k, v, key, segs, spec: _Blocks):
  return _blockwise_forward(q, k, v, key, segs, spec)[0]


def _blockwise_fwd(q, k, v, key, segs, spec):
  out, lse = _blockwise_forward(q, k, v, key, segs, spec)
  # Tagged inside the rule, so that these very arrays (the residuals) are what a
  # policy saving `context` keeps; attention() tags the output again (an identity).
  out, lse = checkpoint_name(out, 'context'), checkpoint_name(lse, 'context')
  return out, (q, k, v, key, segs, out, lse)


def _blockwise_bwd(spec, res, g):
  """FlashAttention-2's backward: per block pair, recompute the probabilities from the logsumexp.

  One scan over the block pairs, key block major. ``dQ``, ``dK`` and ``dV``
  (float32) are carried whole and the pair's blocks updated in place.
  """
  q, k, v, key, segs, out, lse = res
  hkv = k.shape[2]
  qb, kb, vb = _q_blocks(q, hkv, spec), _k_blocks(k, spec), _k_blocks(v, spec)
  sqb, skb = _seg_blocks(segs, spec.nq, spec.bq), _seg_blocks(segs, spec.nk, spec.bk)
  gb = _q_blocks(g, hkv, spec)
  b, h, t = lse.shape
  lse_b = _row_blocks(lse.reshape(b, hkv, h // hkv, t), spec)
  # Softmax's derivative needs rowsum(P * dP) = rowsum(dO * O), with dropout too.
  delta = _row_blocks(jnp.sum(_groups(g, hkv).astype(jnp.float32)
                              * _groups(out, hkv).astype(jnp.float32), axis=-1), spec)
  init = (jnp.zeros(qb.shape, jnp.float32), jnp.zeros(kb.shape, jnp.float32),
          jnp.zeros(vb.shape, jnp.float32))
  scale = np.float32(1 / math.sqrt(q.shape[-1]))

  def step(carry, pair):
    dq_all, dk_all, dv_all = carry
    i, j = pair[0], pair[1]
    q_i, k_j, v_j, g_i = _take(qb, i), _take(kb, j), _take(vb, j), _take(gb, i)
    s, valid = _block_scores(q_i, k_j, i, j, spec, _take_seg(sqb, i), _take_seg(skb, j))
    p = jnp.where(valid, jnp.exp(s - _take(lse_b, i)[..., None]), 0.0)
    dp = _einsum('bngqd,bnkd->bngqk', g_i, v_j, preferred_element_type=jnp.float32)
    p_dropped = p
    if spec.rate > 0.0:
      keep = _block_keep(key, i, j, p.shape, spec)
      p_dropped = jnp.where(keep, p / (1.0 - spec.rate), 0.0)
      dp = jnp.where(keep, dp / (1.0 - spec.rate), 0.0)
    dv_j = _einsum('bngqk,bngqd->bnkd', p_dropped.astype(g_i.dtype), g_i,
                      preferred_element_type=jnp.float32)
    ds = (p * (dp - _take(delta, i)[..., None]) * scale).astype(q_i.dtype)
    dq_i = _einsum('bngqk,bnkd->bngqd', ds, k_j, preferred_element_type=jnp.float32)
    dk_j = _einsum('bngqk,bngqd->bnkd', ds, q_i, preferred_element_type=jnp.float32)
    return (_put(dq_all, i, _take(dq_all, i) + dq_i), _put(dk_all, j, _take(dk_all, j) + dk_j),
            _put(dv_all, j, _take(dv_all, j) + dv_j)), None

  (dq, dk, dv), _ = jax.lax.scan(step, init, _pairs(spec.pairs_by_key, gb))
  return (_q_unblock(dq, spec.t).astype(q.dtype), _k_unblock(dk, spec.t).astype(k.dtype),
          _k_unblock(dv, spec.t).astype(v.dtype), np.zeros(key.shape, jax.dtypes.float0),
          _int_zeros(segs))


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)
