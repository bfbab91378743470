"""BERT in Equinox, as in the Equinox BERT example.

Follows patrick-kidger/equinox ``examples/bert.ipynb`` (Copyright Patrick Kidger
and contributors, Apache License 2.0): ``EmbedderBlock`` (token, segment and
position embeddings, LayerNorm), ``AttentionBlock`` (``eqx.nn.MultiheadAttention``,
residual, post-LayerNorm), ``FeedForwardBlock`` (Linear, GELU, Linear, residual,
post-LayerNorm, vmapped over the sequence), ``TransformerLayer`` and ``Encoder``
(the layers in a list, applied in a Python loop, then the tanh pooler), with a
2-class head as in the example's classifier. Per example, vmapped over the
batch. Dropout is off (the test compares gradients).

The stacked model keeps one ``TransformerLayer`` whose arrays are stacked
``[N, ...]`` and runs it with :func:`remat.scan_layers`, the layer's static part
(``eqx.partition``) closed over.
"""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp

import remat


@dataclasses.dataclass(frozen=True)
class Config:
  vocab_size: int = 64
  max_length: int = 64
  type_vocab_size: int = 2
  hidden_size: int = 64
  intermediate_size: int = 256
  num_heads: int = 4
  num_layers: int = 6


class EmbedderBlock(eqx.Module):
  token_embedder: eqx.nn.Embedding
  segment_embedder: eqx.nn.Embedding
  position_embedder: eqx.nn.Embedding
  layernorm: eqx.nn.LayerNorm

  def __init__(self, cfg, key):
    k1, k2, k3 = jax.random.split(key, 3)
    self.token_embedder = eqx.nn.Embedding(cfg.vocab_size, cfg.hidden_size, key=k1)
    self.segment_embedder = eqx.nn.Embedding(cfg.type_vocab_size, cfg.hidden_size, key=k2)
    self.position_embedder = eqx.nn.Embedding(cfg.max_length, cfg.hidden_size, key=k3)
    self.layernorm = eqx.nn.LayerNorm(shape=cfg.hidden_size)

  def __call__(self, token_ids, position_ids, segment_ids):
    tokens = jax.vmap(self.token_embedder)(token_ids)
    segments = jax.vmap(self.segment_embedder)(segment_ids)
    positions = jax.vmap(self.position_embedder)(position_ids)
    return jax.vmap(self.layernorm)(tokens + segments + positions)


class FeedForwardBlock(eqx.Module):
  mlp: eqx.nn.Linear
  output: eqx.nn.Linear
  layernorm: eqx.nn.LayerNorm

  def __init__(self, cfg, key):
    k1, k2 = jax.random.split(key)
    self.mlp = eqx.nn.Linear(cfg.hidden_size, cfg.intermediate_size, key=k1)
    self.output = eqx.nn.Linear(cfg.intermediate_size, cfg.hidden_size, key=k2)
    self.layernorm = eqx.nn.LayerNorm(shape=cfg.hidden_size)

  def __call__(self, inputs):
    hidden = jax.nn.gelu(self.mlp(inputs))
    output = self.output(hidden)
    output += inputs
    return self.layernorm(output)


class AttentionBlock(eqx.Module):
  attention: eqx.nn.MultiheadAttention
  layernorm: eqx.nn.LayerNorm
  num_heads: int = eqx.field(static=True)

  def __init__(self, cfg, key):
    self.num_heads = cfg.num_heads
    self.attention = eqx.nn.MultiheadAttention(num_heads=cfg.num_heads,
                                               query_size=cfg.hidden_size, use_query_bias=True,
                                               use_key_bias=True, use_value_bias=True,
                                               use_output_bias=True, key=key)
    self.layernorm = eqx.nn.LayerNorm(shape=cfg.hidden_size)

  def __call__(self, inputs, mask):
    mask = self.make_self_attention_mask(mask)
    result = self.attention(query=inputs, key_=inputs, value=inputs, mask=mask)
    result = result + inputs
    return jax.vmap(self.layernorm)(result)

  def make_self_attention_mask(self, mask):
    mask = jnp.multiply(jnp.expand_dims(mask, axis=-1), jnp.expand_dims(mask, axis=-2))
    mask = jnp.expand_dims(mask, axis=-3)
    return jnp.repeat(mask, repeats=self.num_heads, axis=-3).astype(bool)


class TransformerLayer(eqx.Module):
  attention_block: AttentionBlock
  ff_block: FeedForwardBlock

  def __init__(self, cfg, key):
    k1, k2 = jax.random.split(key)
    self.attention_block = AttentionBlock(cfg, k1)
    self.ff_block = FeedForwardBlock(cfg, k2)

  def __call__(self, inputs, mask):
    attention_output = self.attention_block(inputs, mask)
    return jax.vmap(self.ff_block)(attention_output)


class Encoder(eqx.Module):
  """Layers in a list: the untouched model; one stacked layer: run by scan_layers under ``policy``."""
  embedder_block: EmbedderBlock
  layers: list | TransformerLayer
  pooler: eqx.nn.Linear
  classifier: eqx.nn.Linear

  def __call__(self, token_ids, segment_ids, policy='none', remat_policy=None):
    position_ids = jnp.arange(token_ids.shape[0])
    x = self.embedder_block(token_ids, position_ids, segment_ids)
    mask = jnp.asarray(token_ids != 0, dtype=jnp.int32)
    if isinstance(self.layers, list):
      call = lambda layer, x, mask: layer(x, mask)
      if remat_policy is not None:   # per-block checkpoint of the untouched layers
        call = eqx.filter_checkpoint(call, policy=remat_policy)
      for layer in self.layers:
        x = call(layer, x, mask)
    else:
      arrays, static = eqx.partition(self.layers, eqx.is_array)
      x = remat.scan_layers(lambda p, h, m: eqx.combine(p, static)(h, m), arrays, x, mask,
                            policy=policy)
    pooled = jnp.tanh(self.pooler(x[..., 0, :]))
    return self.classifier(pooled)


def make(cfg: Config, key) -> Encoder:
  ks = jax.random.split(key, cfg.num_layers + 3)
  return Encoder(EmbedderBlock(cfg, ks[0]), [TransformerLayer(cfg, k) for k in ks[1:-2]],
                 eqx.nn.Linear(cfg.hidden_size, cfg.hidden_size, key=ks[-2]),
                 eqx.nn.Linear(cfg.hidden_size, 2, key=ks[-1]))


def stacked(model: Encoder) -> Encoder:
  """The same model with its layers' arrays stacked ``[N, ...]`` (works on filtered trees too)."""
  layers = jax.tree_util.tree_map(lambda *a: jnp.stack(a) if eqx.is_array(a[0]) else a[0],
                                  *model.layers)
  return Encoder(model.embedder_block, layers, model.pooler, model.classifier)


def case(cfg: Config = Config(), batch: int = 8, seed: int = 0):
  from tests.public_models import Case, block_policy
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed + 1))
  tokens = jax.random.randint(k1, (batch, cfg.max_length), 1, cfg.vocab_size)
  tokens = tokens.at[:, -8:].set(0)   # padding, which the mask hides
  segments = jnp.zeros_like(tokens).at[:, cfg.max_length // 2:].set(1)
  labels = jax.random.randint(k2, (batch,), 0, 2)
  model = make(cfg, jax.random.PRNGKey(seed))
  params, static = eqx.partition(model, eqx.is_inexact_array)

  def loss_of(static, spec='none', remat_policy=None):
    def loss(p, b):
      tok, seg, lab = b
      logits = jax.vmap(lambda t, s: eqx.combine(p, static)(t, s, spec, remat_policy))(tok, seg)
      return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), lab[:, None], -1))
    return loss

  def stacked_loss(spec):
    return loss_of(eqx.partition(stacked(model), eqx.is_inexact_array)[1], spec)

  return Case('bert', loss_of(static), stacked_loss, params, (tokens, segments, labels),
              stacked, cfg.num_layers,
              lambda rule: loss_of(static, remat_policy=block_policy(rule)))
