"""Blockwise (flash-style) attention: memory linear in T, forward and backward.

:func:`models.attention.attention` runs it for ``implementation='blockwise'``
(and for ``'auto'`` from :data:`models.attention.AUTO_BLOCKWISE_MIN_LEN` tokens
on). Online softmax over blocks of queries and keys in plain XLA (Milakov &
Gimelshein 2018; Dao et al.'s FlashAttention-2 schedule), one
``lax.scan`` over the (query block, key block) pairs that are needed
(causal attention skips the blocks above the diagonal). The gradient is
blockwise too (a ``custom_vjp``): the backward pass keeps ``q, k, v``, the
output and the per-row logsumexp of the scores, and recomputes each block's
probabilities. Neither pass holds more than a few [B, H, block, block]
arrays: memory grows as T. Runs on every backend.

Dropout: each block's mask is that block of the dense path's [B, H, T, T] mask (the
same counter-based bits, :func:`models.dropout.bernoulli_block`), so with
the same key both paths drop the same entries and give the same values up to
float32 rounding, with dropout or without (beyond 2**32 mask elements, where
the dense path's bits use 64-bit counters, each block draws from its own
folded key instead: a different but equally valid mask, the same in the
forward and backward pass).

Remat: :func:`models.attention.attention` tags the output ``context``; blockwise attention
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

from models.attention_parts import _check_shapes, _einsum, _groups, _heads, _int_zeros, _ungroup
from models.chunking import zeros_after
from models.dropout import bernoulli_block, fused_bits_ok


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
      multiple); :func:`models.attention.attention` passes its
      :data:`~models.attention.BLOCK_Q` and :data:`~models.attention.BLOCK_K`.
    segment_ids: None or int [B, T]; keys of another segment are masked in
      every block (block pairs are not skipped for it: the masks are per row).

  Returns:
    The context [B, T, H, Dh] (not tagged; :func:`models.attention.attention` tags it).
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
  A ``custom_jvp`` declaring the outputs constant, as
  :func:`models.attention._exp_scores`: never differentiated (the
  ``custom_vjp`` around it has its own rule), and one opaque call to remat
  policies, which would otherwise save the block matmuls of every iteration.
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
  # The accumulators start from zeros made from delta, so they exist only once dO does
  # (models.chunking.zeros_after). Constant zeros let XLA's GPU pipeline make every unrolled
  # layer's at the start of the backward pass and hold them (llama-tiny, 8 layers, 2 x 2048
  # tokens, dots, H100 plan: 222.44 -> 193.22 MiB). Made from a bfloat16 dO itself, one
  # attention's step planned 114.5 MiB at T = 8192 on the H200 plan, not 97.1.
  init = (zeros_after(qb.shape, jnp.float32, delta), zeros_after(kb.shape, jnp.float32, delta),
          zeros_after(vb.shape, jnp.float32, delta))
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
