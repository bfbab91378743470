"""GPT train-step memory: chunked tied-output cross-entropy, cheap derivatives, optimizer.

The chunked loss must give the plain loss's value and gradients (within float32
rounding) under every policy, with dropout on, while planning less memory.
"""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from models.chunked_loss import chunked_cross_entropy, loss_chunk_tokens
from models.gpt import GPT, GPTConfig
from models.tasks import Task
from numerics import assert_trees_close
from remat.memory import compiled_memory
from training.step import train_step as st

# A vocabulary large enough that the [B*T, V] logits dominate the activations.
WIDE_VOCAB = GPTConfig(vocab_size=4096, max_len=32, num_layers=2, num_heads=2, d_model=32,
                       dropout=0.1)


def test_chunk_size_choice():
  assert loss_chunk_tokens(50257, 4 * 512) == 256          # 256 x 50257 x 4 B = 51 MB <= 64 MiB
  assert loss_chunk_tokens(50257, 200) == 0                # one chunk would cover the batch
  assert loss_chunk_tokens(256, 16 * 128) == 0             # byte-level vocabulary: plain loss
  assert loss_chunk_tokens(50257, 4 * 512, 0) == 0
  assert loss_chunk_tokens(50257, 4 * 512, 100) == 100
  with pytest.raises(ValueError):
    GPTConfig(loss_chunk=-1)


def test_chunked_cross_entropy_traces_beyond_int32_tokens():
  # --fit can plan a batch of more than 2**31 - 1 tokens; the mean's N must not become an int32
  n, d, v = 2**31 + 64, 8, 16
  grad = jax.grad(lambda h, e, y: chunked_cross_entropy(h, e, y, 1 << 20), argnums=(0, 1))
  out = jax.eval_shape(grad, jax.ShapeDtypeStruct((n, d), jnp.bfloat16),
                       jax.ShapeDtypeStruct((v, d), jnp.float32),
                       jax.ShapeDtypeStruct((n,), jnp.int32))
  assert out[0].shape == (n, d) and out[1].shape == (v, d)


@pytest.mark.parametrize('chunk', [7, 32, 96])   # padded last chunk, exact split, one chunk
def test_chunked_cross_entropy_matches_optax(chunk):
  rng = np.random.default_rng(0)
  n, d, v = 96, 16, 300
  h = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
  emb = jnp.asarray(rng.normal(size=(v, d)) * 0.5, jnp.float32)
  labels = jnp.asarray(rng.integers(0, v, size=n), jnp.int32)
  plain = lambda h, e: optax.softmax_cross_entropy_with_integer_labels(h @ e.T, labels).mean()
  chunked = lambda h, e: chunked_cross_entropy(h, e, labels, chunk)
  assert_trees_close(chunked(h, emb), plain(h, emb))
  assert_trees_close(jax.jit(chunked)(h, emb), plain(h, emb))
  # The backward pass scales the gradient formed in the forward pass by the cotangent.
  out, vjp = jax.vjp(chunked, h, emb)
  out_ref, vjp_ref = jax.vjp(plain, h, emb)
  assert_trees_close(out, out_ref)
  for got, want in zip(vjp(jnp.float32(2.5)), vjp_ref(jnp.float32(2.5))):   # d/dh, d/demb
    assert_trees_close(got, want)


def _loss_and_grads(config, spec, windows, params, rng):
  task = Task(config)
  model = task.model(spec)
  fn = lambda p: task.loss(model, p, {}, windows, rng)[0]
  return jax.jit(jax.value_and_grad(fn))(params)


@pytest.fixture(scope='module')
def wide():
  params = GPT(WIDE_VOCAB).init(jax.random.PRNGKey(0), jnp.zeros((1, 32), jnp.int32))['params']
  windows = jnp.asarray(np.random.default_rng(1).integers(0, 4096, size=(3, 33)), jnp.int32)
  return params, windows


@pytest.mark.parametrize('spec', ['full', pytest.param('none', marks=pytest.mark.slow),
                                  pytest.param('sqrt', marks=pytest.mark.slow)])
def test_chunked_loss_and_gradients_equal_plain(wide, spec):
  params, windows = wide
  rng = jax.random.PRNGKey(5)   # dropout on: the same masks on both paths
  plain_loss, plain_grads = _loss_and_grads(dataclasses.replace(WIDE_VOCAB, loss_chunk=0), 'none',
                                            windows, params, rng)
  for chunk in (None, 13, 48):   # None: 4096 words -> chunks of 4096 tokens: the plain path
    loss, grads = _loss_and_grads(dataclasses.replace(WIDE_VOCAB, loss_chunk=chunk), spec,
                                  windows, params, rng)
    assert_trees_close(loss, plain_loss)
    assert_trees_close(grads, plain_grads)


def test_eval_loss_and_hidden(wide):
  params, windows = wide
  chunked = Task(dataclasses.replace(WIDE_VOCAB, loss_chunk=10))
  plain = Task(dataclasses.replace(WIDE_VOCAB, loss_chunk=0))
  got = chunked.loss(chunked.model('none'), params, {}, windows)[0]
  want = plain.loss(plain.model('none'), params, {}, windows)[0]
  assert_trees_close(got, want)
  model = GPT(WIDE_VOCAB)
  x = windows[:, :-1]
  h = model.apply({'params': params}, x, method=GPT.hidden)
  logits = model.apply({'params': params}, x)
  assert_trees_close(h @ params['wte']['embedding'].T, logits)


def _train_step_memory(config, spec='full', batch=8):
  model = GPT(config, spec)
  tx = st.make_optimizer(1e-3, 10, 2, 0.1, 1.0)
  state, windows = st.abstract_inputs(model, tx, batch, config.max_len)
  return compiled_memory(st.compile_train_step(model, tx, 0, state, windows))


def test_chunked_loss_plans_less_memory():
  # 8 x 32 tokens x 4096 words: plain logits and their gradient are 4 MiB each;
  # chunks of 32 tokens hold 0.5 MiB at a time.
  plain = _train_step_memory(dataclasses.replace(WIDE_VOCAB, loss_chunk=0))
  chunked = _train_step_memory(dataclasses.replace(WIDE_VOCAB, loss_chunk=32))
  assert chunked.temp < plain.temp - 4 * 2**20, (chunked.temp, plain.temp)


def test_no_remat_keeps_only_the_gelu_input():
  # Without remat the MLP keeps h alone; gelu(h) and gelu'(h) are rebuilt from it in the
  # backward pass (GeluDense), not kept with the tanh formula's intermediates.
  from remat.residuals import saved_residuals
  cfg = GPTConfig(vocab_size=256, max_len=16, num_layers=2, num_heads=2, d_model=16)
  params = GPT(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, 16), jnp.int32))['params']
  windows = jnp.zeros((2, 17), jnp.int32)
  loss = lambda p, w: st.lm_loss(GPT(cfg, 'none'), p, w, jax.random.PRNGKey(0))
  wide = [r for r in saved_residuals(loss, params, windows) if r.shape[-1] == 4 * cfg.d_model
          and len(r.shape) == 4]
  assert len(wide) == 1, wide


@pytest.mark.parametrize('scale', [1e-3, 1e3])   # below and above the clipping threshold
def test_clip_matches_optax(scale):
  grads = {'a': jnp.arange(6.0).reshape(2, 3) * scale, 'b': jnp.full((4,), -scale)}
  ours = st.clip_by_global_norm(1.0)
  theirs = optax.clip_by_global_norm(1.0)
  got = ours.update(grads, ours.init(grads))[0]
  want = theirs.update(grads, theirs.init(grads))[0]
  assert_trees_close(got, want)
  zeros = jax.tree_util.tree_map(jnp.zeros_like, grads)
  chex.assert_trees_all_equal(ours.update(zeros, ours.init(zeros))[0], zeros)


def test_dropout_masks_match_flax():
  # The fused mask generator gives flax.linen.Dropout's masks bit for bit (so every
  # checkpoint, run and policy sees the dropout it saw before).
  import flax.linen as nn
  from models.dropout import bernoulli, dropout
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 17, 19)), jnp.float32)
  for seed in range(3):
    key = jax.random.fold_in(jax.random.PRNGKey(seed), 11)
    want = nn.Dropout(0.1).apply({}, x, False, rng=key)
    np.testing.assert_array_equal(dropout(x, 0.1, deterministic=False, rng=key), want)
    np.testing.assert_array_equal(
        jax.jit(lambda k: bernoulli(k, 0.7, (5, 33)))(key), jax.random.bernoulli(key, 0.7, (5, 33)))
  np.testing.assert_array_equal(dropout(x, 0.1, deterministic=True, rng=None), x)
