"""The Flax lm1b example's decoder-only Transformer LM, in Flax linen.

Follows google/flax ``examples/lm1b/models.py`` (Copyright The Flax Authors,
Apache License 2.0): ``MlpBlock``, ``EncoderDecoder1DBlock`` (pre-LayerNorm
self-attention with ``nn.SelfAttention`` and a ReLU MLP), ``Decoder`` (shared
embedding, ``shift_right``, learned position embeddings, the blocks in a Python
loop named ``encoderdecoderblock_{i}``, a final LayerNorm, logits from the
embedding) and ``TransformerLM``'s padding-and-causal mask. Left out: the
decoding cache and packed-sequence segmentation. Dropout is off (the test
compares gradients).
"""

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

import remat


@dataclasses.dataclass(frozen=True)
class Config:
  vocab_size: int = 64
  emb_dim: int = 64
  num_heads: int = 4
  num_layers: int = 6
  qkv_dim: int = 64
  mlp_dim: int = 256
  max_len: int = 64


def shift_right(x):
  return jnp.pad(x, ((0, 0), (1, 0)))[:, :-1]


class MlpBlock(nn.Module):
  config: Config

  @nn.compact
  def __call__(self, inputs):
    x = nn.Dense(self.config.mlp_dim)(inputs)
    x = nn.relu(x)
    return nn.Dense(inputs.shape[-1])(x)


class EncoderDecoder1DBlock(nn.Module):
  config: Config

  @nn.compact
  def __call__(self, inputs, decoder_mask):
    cfg = self.config
    x = nn.LayerNorm()(inputs)
    x = nn.SelfAttention(num_heads=cfg.num_heads, qkv_features=cfg.qkv_dim,
                         broadcast_dropout=False, deterministic=True)(x, mask=decoder_mask)
    x = x + inputs
    z = nn.LayerNorm()(x)
    z = MlpBlock(cfg)(z)
    return x + z


class TransformerLM(nn.Module):
  """``policy`` None: the untouched model; else its blocks on :class:`remat.LayerStack`."""
  config: Config
  policy: str | None = None
  remat_policy: Any = None   # per-block nn.remat of the untouched blocks (a jax.checkpoint policy)

  @nn.compact
  def __call__(self, inputs):
    cfg = self.config
    decoder_mask = nn.combine_masks(nn.make_attention_mask(inputs > 0, inputs > 0),
                                    nn.make_causal_mask(inputs))
    embed = nn.Embed(cfg.vocab_size, cfg.emb_dim,
                     embedding_init=nn.initializers.normal(stddev=1.0), name='embed')
    y = embed(shift_right(inputs).astype('int32'))
    pos = self.param('pos_embedding', nn.initializers.normal(stddev=0.02),
                     (1, cfg.max_len, cfg.emb_dim))
    y = y + pos[:, :inputs.shape[1]]
    if self.policy is None:
      block = (EncoderDecoder1DBlock if self.remat_policy is None else
               nn.remat(EncoderDecoder1DBlock, policy=self.remat_policy))
      for lyr in range(cfg.num_layers):
        y = block(cfg, name=f'encoderdecoderblock_{lyr}')(y, decoder_mask)
    else:
      y = remat.LayerStack(EncoderDecoder1DBlock, cfg.num_layers, self.policy,
                           block_kwargs={'config': cfg}, name='blocks')(y, decoder_mask)
    y = nn.LayerNorm(name='encoderdecoder_norm')(y)
    return embed.attend(y.astype(jnp.float32)) / jnp.sqrt(y.shape[-1])


def loss(model, params, tokens):
  logits = model.apply({'params': params}, tokens)
  logp = jax.nn.log_softmax(logits)
  return -jnp.mean(jnp.take_along_axis(logp, tokens[..., None], -1))


def stack(params, num_layers: int):
  """The untouched model's parameters in the stacked model's tree."""
  params = dict(params)
  layers = [params.pop(f'encoderdecoderblock_{i}') for i in range(num_layers)]
  params['blocks'] = {'block': jax.tree_util.tree_map(lambda *a: jnp.stack(a), *layers)}
  return params


def case(config: Config = Config(), batch: int = 8, seed: int = 0):
  from tests.public_models import Case, block_policy
  tokens = jax.random.randint(jax.random.PRNGKey(seed + 1), (batch, config.max_len), 1,
                              config.vocab_size)
  params = TransformerLM(config).init(jax.random.PRNGKey(seed), tokens)['params']
  return Case('lm1b', lambda p, t: loss(TransformerLM(config), p, t),
              lambda spec: lambda p, t: loss(TransformerLM(config, spec), p, t),
              params, tokens, lambda p: stack(p, config.num_layers), config.num_layers,
              lambda rule: lambda p, t: loss(TransformerLM(config, remat_policy=block_policy(rule)),
                                             p, t))
