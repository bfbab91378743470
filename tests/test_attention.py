"""Attention implementations (models/attention.py): blockwise equals dense, in values, gradients and memory shape."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models.attention as attn
import models.blockwise_attention as blockwise
from models.attention import attention, blockwise_attention, resolve_implementation
from models.gpt import GPT, TAGS, GPTConfig
from numerics import assert_trees_close
from remat.measuring import step_memory
from remat.residuals import saved_residuals
from remat.tags import emitted_tags
from training.step import train_step as st

KEY = jax.random.PRNGKey(3)
NO_KEY = jnp.zeros((2,), jnp.uint32)


def _normal(*shape, seed=0):
  return jnp.asarray(np.random.default_rng(seed + len(shape) + sum(shape)).standard_normal(shape),
                     jnp.float32)


def _qkvw(b, t, h, hkv, d=8):
  return (_normal(b, t, h, d, seed=1), _normal(b, t, hkv, d, seed=2), _normal(b, t, hkv, d, seed=3),
          _normal(b, t, h, d, seed=4))


def _dense(causal, rate, key=KEY):
  return lambda q, k, v: attention(q, k, v, causal=causal, dropout_rate=rate, deterministic=False,
                                   rng=key, implementation='dense')


def _blockwise(causal, rate, bq, bk, key=KEY):
  return lambda q, k, v: blockwise_attention(q, k, v, key if rate else NO_KEY, causal=causal,
                                             rate=rate, block_q=bq, block_k=bk)


def _value_and_grads(f, q, k, v, w):
  """``f(q, k, v)`` and the gradient of ``sum(f * w)``, in one compiled program."""
  def both(q, k, v):
    out, pullback = jax.vjp(f, q, k, v)
    return out, pullback(w)
  return jax.jit(both)(q, k, v)


# (T, H, Hkv, block_q, block_k): T a multiple of the blocks or not, blocks unequal, grouped
# heads (2 and 4 query heads per key head), T = 1, one block covering all of T.
SHAPES = [(16, 4, 4, 4, 4), (17, 2, 2, 8, 4), (9, 4, 2, 4, 4), (16, 4, 1, 4, 8), (1, 2, 1, 4, 4),
          (12, 2, 2, 256, 256)]


@pytest.mark.parametrize('causal', [False, True], ids=['bidirectional', 'causal'])
@pytest.mark.parametrize('t,h,hkv,bq,bk', SHAPES)
def test_blockwise_matches_dense(t, h, hkv, bq, bk, causal):
  q, k, v, w = _qkvw(2, t, h, hkv)
  got = _value_and_grads(_blockwise(causal, 0.0, bq, bk), q, k, v, w)
  want = _value_and_grads(_dense(causal, 0.0), q, k, v, w)
  assert_trees_close(got[0], want[0])
  assert_trees_close(got[1], want[1])


# The default suite takes the case with GQA, causal masking and a ragged last block; the
# others run with -m slow.
@pytest.mark.parametrize('t,h,hkv,bq,bk,causal', [
    (17, 4, 2, 8, 4, True),
    *(pytest.param(*c, marks=pytest.mark.slow)
      for c in [(17, 4, 2, 8, 4, False), (16, 2, 2, 4, 4, False), (16, 2, 2, 4, 4, True)])])
def test_blockwise_dropout_matches_dense(t, h, hkv, bq, bk, causal):
  # Each block's mask is that block of the dense path's [B, H, T, T] mask: same values.
  q, k, v, w = _qkvw(2, t, h, hkv)
  got = _value_and_grads(_blockwise(causal, 0.3, bq, bk), q, k, v, w)
  want = _value_and_grads(_dense(causal, 0.3), q, k, v, w)
  assert_trees_close(got[0], want[0])
  assert_trees_close(got[1], want[1])
  # Dropout is really on, and follows the key.
  plain = _blockwise(causal, 0.0, bq, bk)(q, k, v)
  other = _blockwise(causal, 0.3, bq, bk, jax.random.PRNGKey(4))(q, k, v)
  assert float(jnp.max(jnp.abs(got[0] - plain))) > 0.1
  assert float(jnp.max(jnp.abs(got[0] - other))) > 0.1


def _reference(causal, rate, key, segs):
  """Softmax attention written out, differentiated by JAX: the dense path's values and masks."""
  from models.dropout import bernoulli

  def f(q, k, v):
    b, t, h, d = q.shape
    rep = h // k.shape[2]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    s = jnp.einsum('bqhd,bkhd->bhqk', q, k) / math.sqrt(d)
    valid = jnp.ones((t, t), bool)
    if causal:
      valid = jnp.tril(valid)
    valid = valid[None, None]
    if segs is not None:
      valid = valid & (segs[:, :, None] == segs[:, None, :])[:, None]
    p = jax.nn.softmax(jnp.where(valid, s, jnp.finfo(s.dtype).min), axis=-1)
    if rate:
      p = jnp.where(bernoulli(key, 1.0 - rate, p.shape), p / (1.0 - rate), 0.0)
    return jnp.einsum('bhqk,bkhd->bqhd', p, v)
  return f


# T = 150: two whole chunks of BACKWARD_ROWS (64) query rows and a remainder of 22.
@pytest.mark.parametrize('causal,rate,packed', [
    (True, 0.0, False), (False, 0.3, False), (True, 0.3, True),
    pytest.param(False, 0.0, True, marks=pytest.mark.slow)])
def test_dense_backward_over_row_chunks_matches_autodiff(causal, rate, packed):
  assert attn.BACKWARD_ROWS == 64
  t = 150
  q, k, v, w = _qkvw(2, t, 4, 2)
  segs = jnp.asarray(np.repeat([[0] * 70 + [1] * 50 + [2] * 30], 2, axis=0)) if packed else None
  dense = lambda q, k, v: attention(q, k, v, causal=causal, dropout_rate=rate, deterministic=False,
                                    rng=KEY, implementation='dense', segment_ids=segs)
  got = _value_and_grads(dense, q, k, v, w)
  want = _value_and_grads(_reference(causal, rate, KEY, segs), q, k, v, w)
  assert_trees_close(got[0], want[0])
  assert_trees_close(got[1], want[1])


def test_blockwise_dropout_fallback_is_consistent(monkeypatch):
  # Where the dense mask's 32-bit counters do not reach (> 2**32 elements), each block pair
  # draws from its own folded key. The gradient must use the very masks of the forward pass:
  # compare with autodiff of dense softmax attention under the assembled block masks.
  # Patched where _block_keep reads it: models/blockwise_attention.py.
  monkeypatch.setattr(blockwise, 'fused_bits_ok', lambda key, shape: False)
  t, h, bq, bk, rate = 10, 2, 4, 4, 0.3
  q, k, v, w = _qkvw(1, t, h, h)
  spec = blockwise._Blocks(t, bq, bk, True, rate)
  keep = jnp.zeros((1, h, spec.nq * bq, spec.nk * bk), bool)
  for i, j in spec.pairs_by_query:
    block = blockwise._block_keep(KEY, i, j, (1, h, 1, bq, bk), spec)[:, :, 0]
    keep = keep.at[:, :, i * bq:(i + 1) * bq, j * bk:(j + 1) * bk].set(block)
  keep = keep[:, :, :t, :t]

  def reference(q, k, v):
    q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    scores = jnp.einsum('bhqd,bhkd->bhqk', q, k) / math.sqrt(q.shape[-1])
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -jnp.inf)
    probs = jnp.where(keep, jax.nn.softmax(scores, axis=-1) / (1 - rate), 0.0)
    return jnp.einsum('bhqk,bhkd->bhqd', probs, v).transpose(0, 2, 1, 3)

  got = _value_and_grads(_blockwise(True, rate, bq, bk), q, k, v, w)
  want = _value_and_grads(reference, q, k, v, w)
  assert_trees_close(got[0], want[0])
  assert_trees_close(got[1], want[1])


def test_grouped_heads_read_their_key_value_head():
  # Query head h reads key/value head h // (H / Hkv): as with k and v repeated per group.
  q, k, v, w = _qkvw(2, 9, 6, 2)
  rep = lambda x: jnp.repeat(x, 3, axis=2)
  for impl in ('dense', 'blockwise'):
    f = lambda q, k, v: attention(q, k, v, causal=True, dropout_rate=0.0, deterministic=True,
                                  rng=None, implementation=impl)
    got = _value_and_grads(f, q, k, v, w)
    want = _value_and_grads(lambda q, k, v: f(q, rep(k), rep(v)), q, k, v, w)
    assert_trees_close(got[0], want[0])
    assert_trees_close(got[1], want[1])


def test_resolve_implementation():
  s = lambda t, dtype=jnp.float32, d=64: jax.ShapeDtypeStruct((1, t, 4, d), dtype)
  assert resolve_implementation('auto', s(attn.AUTO_BLOCKWISE_MIN_LEN - 1)) == 'dense'
  assert resolve_implementation('auto', s(attn.AUTO_BLOCKWISE_MIN_LEN)) == 'blockwise'
  assert resolve_implementation('auto', s(128, jnp.bfloat16), platform='gpu') == 'cudnn'
  # cuDNN only where it applies: half precision, no dropout, a supported head size.
  assert resolve_implementation('auto', s(128), platform='gpu') == 'dense'
  assert resolve_implementation('auto', s(128, jnp.bfloat16), 0.1, platform='gpu') == 'dense'
  assert resolve_implementation('auto', s(128, jnp.bfloat16, 160), platform='gpu') == 'dense'
  # A deviceless GPU plan is traced on the CPU backend: never cuDNN there.
  assert resolve_implementation('auto', s(4096, jnp.bfloat16), platform='cpu') == 'blockwise'
  assert resolve_implementation('dense', s(4096)) == 'dense'
  with pytest.raises(ValueError, match='unknown attention implementation'):
    resolve_implementation('flash', s(8))


def test_argument_errors():
  q, k, v, _ = _qkvw(1, 4, 4, 2)
  call = lambda q, k, v, **kw: attention(q, k, v, causal=True, **{
      'dropout_rate': 0.0, 'deterministic': True, 'rng': None, **kw})
  with pytest.raises(ValueError, match='multiple of the key/value heads'):
    call(q, k[:, :, :1].repeat(3, axis=2), v[:, :, :1].repeat(3, axis=2))
  with pytest.raises(ValueError, match='needs a key'):
    call(q, k, v, dropout_rate=0.1, deterministic=False)
  with pytest.raises(ValueError, match='float16 or bfloat16'):
    call(q, k, v, implementation='cudnn')
  with pytest.raises(ValueError, match='no dropout'):
    call(q, k, v, implementation='cudnn', dropout_rate=0.1, deterministic=False, rng=KEY)
  with pytest.raises(ValueError, match='GPTConfig.attention'):
    GPTConfig(attention='flash')


def _step_temp(impl, t, target='cpu', dtype=jnp.float32, b=1, h=4, d=32):
  def loss(qkv, w):
    q, k, v = qkv
    out = attention(q, k, v, causal=True, dropout_rate=0.0, deterministic=True, rng=None,
                    implementation=impl)
    return jnp.sum(out.astype(jnp.float32) * w)
  shape = jax.ShapeDtypeStruct((b, t, h, d), dtype)
  return step_memory(loss, (shape, shape, shape), jax.ShapeDtypeStruct(shape.shape, jnp.float32),
                     target=target).temp


def test_blockwise_memory_is_linear_in_t():
  # Compiled temp of a fwd+bwd step: dense holds [B, H, T, T] arrays (x4 per doubling),
  # blockwise a few [B, H, 256, 256] blocks plus O(T) copies and accumulators.
  dense = {t: _step_temp('dense', t) for t in (1024, 2048)}
  block = {t: _step_temp('blockwise', t) for t in (1024, 2048, 4096)}
  assert dense[2048] / dense[1024] > 3.5, dense
  assert block[2048] / block[1024] <= 2.2 and block[4096] / block[2048] <= 2.2, block
  assert block[2048] < dense[2048] / 4, (block, dense)


def test_blockwise_in_a_layer_scan_stacks_nothing_per_block_pair():
  # In a layer scan, JAX hoisted what a pair's step derives from the pair alone (the causal
  # mask) out of the loop as a residual stacked over all P pairs: [P, ..., bq, bk], quadratic
  # in T (17 GB for Llama-3.2-1B at T = 32768). T = 64 in blocks of 8: P = 36 causal pairs.
  import re
  layer = lambda x: _blockwise(True, 0.0, 8, 8)(x, x[:, :, :2], x[:, :, :2])
  loss = lambda x: jnp.sum(jax.lax.scan(lambda c, _: (layer(c), None), x, None, length=2)[0])
  text = str(jax.make_jaxpr(jax.grad(loss))(_normal(1, 64, 4, 8)))
  assert blockwise._Blocks(64, 8, 8, True, 0.0).pairs_by_query.shape == (36, 2)
  per_pair = set(re.findall(r'\w+\[36,[0-9,]*\]', text)) - {'i32[36,2]'}   # the pair list itself
  assert not per_pair, per_pair


CFG = GPTConfig(vocab_size=64, max_len=24, num_layers=2, num_heads=4, d_model=32, dropout=0.1)


@pytest.fixture(scope='module')
def gpt_setup():
  params = GPT(CFG).init(jax.random.PRNGKey(0), jnp.zeros((1, 24), jnp.int32))['params']
  windows = jnp.asarray(np.random.default_rng(0).integers(0, 64, size=(2, 25)), jnp.int32)
  return params, windows


def _gpt_value_and_grad(config, spec, params, windows):
  loss = lambda p: st.lm_loss(GPT(config, spec), p, windows, jax.random.PRNGKey(42))
  return jax.jit(jax.value_and_grad(loss))(params)


@pytest.fixture
def small_blocks(monkeypatch):
  # Blocks of 8 in a 24-token GPT: 3 query blocks, causal skipping, several pairs per row.
  monkeypatch.setattr(attn, 'BLOCK_Q', 8)
  monkeypatch.setattr(attn, 'BLOCK_K', 8)


@pytest.fixture(scope='module')
def gpt_dense(gpt_setup):
  params, windows = gpt_setup
  return _gpt_value_and_grad(dataclasses.replace(CFG, attention='dense'), 'none', params, windows)


# Each compiles a GPT gradient: about 50 s of wall time on the shared 2-core machine (10 s of
# CPU), so all but `none` are slow.
@pytest.mark.parametrize('spec', ['none'] + [pytest.param(s, marks=pytest.mark.slow)
                                            for s in ('full', 'dots', 'names:context')])
def test_gpt_blockwise_gradients_match_dense(spec, gpt_setup, gpt_dense, small_blocks):
  # Dropout on: the blockwise masks are the dense ones, so the loss and gradients agree.
  params, windows = gpt_setup
  want = gpt_dense
  got = _gpt_value_and_grad(dataclasses.replace(CFG, attention='blockwise'), spec, params, windows)
  assert_trees_close(got[0], want[0])
  assert_trees_close(got[1], want[1])


def test_gpt_blockwise_tags_and_residuals(gpt_setup, small_blocks):
  params, windows = gpt_setup
  cfg = dataclasses.replace(CFG, attention='blockwise')
  tags = emitted_tags(lambda p, x: GPT(cfg).apply({'params': p}, x), params, windows[:, :-1])
  assert tags == set(TAGS)

  def residuals(spec):
    loss = lambda p, w: st.lm_loss(GPT(cfg, spec), p, w, jax.random.PRNGKey(0))
    return saved_residuals(loss, params, windows)
  # names:context keeps the output and the logsumexp [N, B, H, T] (so the backward pass
  # does not rerun the attention forward) and nothing of [T, T] under any policy.
  context = {r.shape for r in residuals('names:context') if r.tag == 'context'}
  assert context == {(2, 2, 24, 4, 8), (2, 2, 4, 24)}, context
  for spec in ('none', 'dots', 'everything', 'names:context'):
    shapes = [r.shape for r in residuals(spec)]
    assert not any(s[-2:] in ((24, 24), (8, 8)) for s in shapes), (spec, shapes)


@pytest.mark.gpu_plan
def test_blockwise_compiles_for_gpu_targets_linear_in_t():
  # bfloat16 fwd+bwd for H100 and H200 plans; on the H200, temp grows linearly in T.
  assert _step_temp('blockwise', 1024, 'h100', jnp.bfloat16) > 0
  temps = {t: _step_temp('blockwise', t, 'h200', jnp.bfloat16) for t in (2048, 4096)}
  assert temps[4096] / temps[2048] <= 2.2, temps


@pytest.mark.gpu_plan
def test_cudnn_cannot_be_planned_without_a_gpu():
  # What docs/attention.md reports: JAX asks the cuDNN library for its version while
  # tracing, and a CPU-only machine with the gpu-plan extra has none. If this ever
  # compiles (cuDNN installed), the docs' statement is out of date.
  with pytest.raises(RuntimeError, match='cuDNN'):
    _step_temp('cudnn', 512, 'h200', jnp.bfloat16)
