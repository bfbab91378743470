"""Windows packed from several documents: attention stays in a document, positions restart, the loss is masked.

The reference for every packed computation is each document computed alone:
segment ids and restarting positions must make the packed window give those
values exactly (up to float32 rounding of a different summation order).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.attention import attention, blockwise_attention
from models.chunked_loss import chunked_cross_entropy
from models.gpt import GPTConfig
from models.llama import LlamaConfig
from models.tasks import Task
from numerics import assert_trees_close

SEGS = np.array([[0, 0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2],
                 [0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2]], np.int32)


def _normal(*shape, seed=0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _positions(segs):
  pos = np.zeros_like(segs)
  for b in range(segs.shape[0]):
    for t in range(1, segs.shape[1]):
      pos[b, t] = pos[b, t - 1] + 1 if segs[b, t] == segs[b, t - 1] else 0
  return pos


def _alone(f, segs, *xs):
  """f over each document alone, pasted back into a [B, T, ...] result.

  One batched call: each document starts its own row, right-padded (f is causal,
  so the padding after a document changes none of its values).
  """
  docs = [(b, np.nonzero(segs[b] == s)[0]) for b in range(segs.shape[0]) for s in np.unique(segs[b])]
  rows = [np.zeros((len(docs),) + x.shape[1:], x.dtype) for x in map(np.asarray, xs)]
  for r, (b, idx) in enumerate(docs):
    for row, x in zip(rows, xs):
      row[r, :len(idx)] = np.asarray(x)[b, idx]
  ref = np.asarray(jax.jit(f)(*rows))
  out = np.zeros(segs.shape + ref.shape[2:], ref.dtype)
  for r, (b, idx) in enumerate(docs):
    out[b, idx] = ref[r, :len(idx)]
  return out


@pytest.mark.parametrize('impl', ['dense', 'blockwise'])
def test_attention_does_not_cross_documents(impl):
  q, k, v = _normal(2, 12, 4, 8, seed=1), _normal(2, 12, 2, 8, seed=2), _normal(2, 12, 2, 8, seed=3)
  kw = dict(causal=True, dropout_rate=0.0, deterministic=True, rng=None)
  if impl == 'dense':
    packed = jax.jit(lambda q, k, v: attention(q, k, v, implementation='dense',
                                               segment_ids=jnp.asarray(SEGS), **kw))(q, k, v)
  else:   # blocks of 4 rows: segments start inside blocks and span block boundaries
    packed = jax.jit(lambda q, k, v: blockwise_attention(
        q, k, v, jnp.zeros((2,), jnp.uint32), causal=True, block_q=4, block_k=4,
        segment_ids=jnp.asarray(SEGS)))(q, k, v)
  alone = _alone(lambda q, k, v: attention(q, k, v, implementation='dense', **kw), SEGS, q, k, v)
  assert_trees_close(np.asarray(packed), alone)


def test_blockwise_segment_gradients_match_dense():
  q, k, v = _normal(2, 12, 4, 8, seed=1), _normal(2, 12, 2, 8, seed=2), _normal(2, 12, 2, 8, seed=3)
  w = _normal(2, 12, 4, 8, seed=4)
  segs = jnp.asarray(SEGS)
  dense = lambda q, k, v: attention(q, k, v, causal=True, dropout_rate=0.0, deterministic=True,
                                    rng=None, implementation='dense', segment_ids=segs)
  block = lambda q, k, v: blockwise_attention(q, k, v, jnp.zeros((2,), jnp.uint32), causal=True,
                                              block_q=4, block_k=4, segment_ids=segs)
  grads = lambda f: jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * w), argnums=(0, 1, 2)))(q, k, v)
  assert_trees_close(grads(block), grads(dense))


@pytest.mark.parametrize('arch', ['gpt', 'llama'])
def test_packed_window_equals_documents_alone(arch):
  """Segment ids and restarting positions: each document's logits as if it were alone."""
  if arch == 'gpt':
    cfg = GPTConfig(vocab_size=64, max_len=16, num_layers=2, num_heads=2, d_model=16, dropout=0.0)
  else:
    cfg = LlamaConfig(vocab_size=64, d_model=16, num_layers=2, num_heads=4, num_kv_heads=2,
                      mlp_dim=32, max_len=16)
  task = Task(cfg)
  model = task.model('none')
  params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 12), jnp.int32))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, SEGS.shape), jnp.int32)
  apply = jax.jit(lambda t, s, p: model.apply(params, t, segment_ids=s, positions=p))
  packed = apply(tokens, jnp.asarray(SEGS), jnp.asarray(_positions(SEGS)))
  alone = _alone(lambda t: model.apply(params, t), SEGS, tokens)
  assert_trees_close(np.asarray(packed), alone)
  # One segment with positions 0..T-1 (an unpacked window): the later documents see the
  # earlier ones, a real difference.
  plain = apply(tokens, jnp.zeros_like(SEGS), jnp.broadcast_to(jnp.arange(12), SEGS.shape))
  assert not np.allclose(np.asarray(plain), alone, atol=1e-3)


def _packed_batch(vocab=64):
  rng = np.random.default_rng(1)
  segs = np.repeat(SEGS[:, :1], 13, axis=1)
  segs[:, 1:] = SEGS
  mask = (rng.random(segs.shape) > 0.4).astype(np.int32)
  return {'tokens': rng.integers(0, vocab, segs.shape).astype(np.int32), 'segment_ids': segs,
          'positions': _positions(segs), 'loss_mask': mask}


def test_masked_loss_counts_only_target_tokens_of_the_same_document():
  cfg = LlamaConfig(vocab_size=64, d_model=16, num_layers=1, num_heads=2, num_kv_heads=2,
                    mlp_dim=32, max_len=16, loss_chunk=0)
  task = Task(cfg)
  model = task.model('none')
  batch = _packed_batch()
  variables = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 12), jnp.int32))
  vg = lambda t: jax.jit(jax.value_and_grad(lambda p: t.loss(model, p, {}, batch)[0]))(
      variables['params'])
  (loss, grads) = vg(task)
  logits = np.asarray(jax.jit(lambda b: model.apply(
      variables, b['tokens'][:, :-1], segment_ids=b['segment_ids'][:, :-1],
      positions=b['positions'][:, :-1]))(batch), np.float64)
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  labels = batch['tokens'][:, 1:]
  ce = -np.take_along_axis(logp, labels[..., None], -1)[..., 0]
  keep = (batch['loss_mask'][:, 1:] > 0) & (batch['segment_ids'][:, 1:] == batch['segment_ids'][:, :-1])
  assert 0 < keep.sum() < keep.size
  np.testing.assert_allclose(float(loss), (ce * keep).sum() / keep.sum(), rtol=1e-5)
  # The chunked output layer (3 chunks of 8 tokens) gives the same loss and gradients.
  chunked = Task(dataclasses.replace(cfg, loss_chunk=8))
  assert_trees_close(vg(chunked), (loss, grads))


def test_chunked_cross_entropy_weights():
  rng = np.random.default_rng(2)
  h, emb = jnp.asarray(rng.standard_normal((10, 8)), jnp.float32), jnp.asarray(
      rng.standard_normal((20, 8)), jnp.float32)
  labels = jnp.asarray(rng.integers(0, 20, 10), jnp.int32)
  w = jnp.asarray([1, 0, 1, 1, 0, 0, 1, 1, 1, 0], jnp.float32)

  def plain(h, emb):
    ce = -jax.nn.log_softmax(h @ emb.T)[jnp.arange(10), labels]
    return jnp.sum(ce * w) / jnp.sum(w)
  got = jax.jit(jax.value_and_grad(lambda h, e: chunked_cross_entropy(h, e, labels, 4, w),
                                   (0, 1)))(h, emb)
  assert_trees_close(got, jax.jit(jax.value_and_grad(plain, (0, 1)))(h, emb))
