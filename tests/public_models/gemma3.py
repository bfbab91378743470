"""A Gemma 3-style decoder in Flax linen: five local (sliding-window) layers, then one global.

Follows google-deepmind/gemma ``gemma/gm/nn/_modules.py``, ``_layers.py``,
``_transformer.py``, ``_config.py`` and ``gemma/gm/math/_positional_embeddings.py``
(Copyright DeepMind Technologies Limited, Apache License 2.0): ``Einsum`` and
``RMSNorm`` (a ``1 + scale`` weight), an ``Embedder`` scaled by sqrt(D) whose table
also decodes, ``Attention`` with grouped key-values (``q_einsum``, ``kv_einsum``,
``attn_vec_einsum``), query and key RMSNorms (``use_qk_norm``), RoPE with base 10k
and scale 1 on local layers and base 1M and scale 8 on global ones, queries scaled
by ``head_dim ** -0.5``, ``create_sliding_mask`` on local layers, a gated GELU
``FeedForward`` with the transposed gating einsum ``[2, F, D]``, and ``Block`` with
pre- and post-norms returning ``(cache, outputs)``. The blocks are a list named
``layer_{i}`` applied in a Python loop; the layer types repeat
``GEMMA3_ATTENTION_PATTERN`` (5 local, 1 global). Left out: the KV cache (training
passes None), vision, bfloat16 parameters (float32 here) and ``nn.jit``.

The stacked model runs the same blocks on one :class:`remat.LayerStack` with
``pattern=GEMMA3_ATTENTION_PATTERN`` and the enum members as kinds, through
``StackedBlock``, the adapter to the stack's ``block(x, *args) -> y``.
"""

import dataclasses
import enum
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

import remat

K_MASK = -2.3819763e38


class AttentionType(enum.Enum):
  GLOBAL = 1
  LOCAL_SLIDING = 2


GEMMA3_ATTENTION_PATTERN = (AttentionType.LOCAL_SLIDING,) * 5 + (AttentionType.GLOBAL,)


@dataclasses.dataclass(frozen=True)
class Config:
  num_embed: int = 64
  embed_dim: int = 64
  hidden_dim: int = 256
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 16
  num_layers: int = 12
  seq_len: int = 64
  sliding_window_size: int = 16


def create_sliding_mask(positions, *, sliding_window_size):
  cache_positions = positions[..., None, :]
  positions = positions[..., :, None]
  sliding_mask = cache_positions > positions - sliding_window_size
  sliding_mask *= cache_positions < positions + sliding_window_size
  return sliding_mask


def apply_rope(inputs, positions, *, base_frequency, scale_factor=1.0):
  head_dim = inputs.shape[-1]
  fraction = 2 * jnp.arange(0, head_dim // 2) / head_dim
  timescale = base_frequency ** fraction
  sinusoid_inp = positions[..., None] / timescale[None, None, :]
  sinusoid_inp = sinusoid_inp[..., None, :] / scale_factor
  sin, cos = jnp.sin(sinusoid_inp), jnp.cos(sinusoid_inp)
  first_half, second_half = jnp.split(inputs, 2, axis=-1)
  first_part = first_half * cos - second_half * sin
  second_part = second_half * cos + first_half * sin
  return jnp.concatenate([first_part, second_part], axis=-1).astype(inputs.dtype)


class Einsum(nn.Module):
  shape: tuple[int, ...]
  weight_name: str = 'w'

  @nn.compact
  def __call__(self, eqn, x):
    return jnp.einsum(eqn, x, self.param(self.weight_name, nn.initializers.normal(), self.shape))


class RMSNorm(nn.Module):
  @nn.compact
  def __call__(self, x):
    scale = self.param('scale', nn.initializers.zeros_init(), (x.shape[-1]))
    var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    normed_inputs = x * jax.lax.rsqrt(var + 1e-06)
    return normed_inputs * (1 + jnp.expand_dims(scale, axis=range(len(x.shape) - 1)))


class Embedder(nn.Module):
  vocab_size: int
  embed_dim: int

  def setup(self):
    self.input_embedding_table = self.param('input_embedding', nn.initializers.normal(),
                                            (self.vocab_size, self.embed_dim))

  def encode(self, x):
    return self.input_embedding_table[(x,)] * jnp.sqrt(self.embed_dim).astype(jnp.float32)

  def decode(self, x):
    return jnp.dot(x, self.input_embedding_table.T)


class Attention(nn.Module):
  num_heads: int
  num_kv_heads: int
  features: int
  head_dim: int
  attn_type: AttentionType
  query_pre_attn_scalar: float
  rope_base_frequency: int
  rope_scale_factor: float
  sliding_window_size: int

  def setup(self):
    self.attn_vec_einsum = Einsum((self.num_heads, self.head_dim, self.features))
    self.q_einsum = Einsum((self.num_heads, self.features, self.head_dim))
    self.kv_einsum = Einsum((2, self.num_kv_heads, self.features, self.head_dim))
    self._query_norm = RMSNorm()
    self._key_norm = RMSNorm()

  def __call__(self, x, segment_pos, cache, attn_mask):
    query_proj = self._query_norm(self.q_einsum('BTD,NDH->BTNH', x))
    key_proj, value_proj = self.kv_einsum('BSD,CKDH->CBSKH', x)
    key_proj = self._key_norm(key_proj)
    rope = dict(base_frequency=self.rope_base_frequency, scale_factor=self.rope_scale_factor)
    query_scaled = apply_rope(query_proj, segment_pos, **rope) * self.query_pre_attn_scalar
    key_proj = apply_rope(key_proj, segment_pos, **rope)
    b, t, kg, h = query_scaled.shape  # grouped-query attention: einsums over groups
    query_scaled = query_scaled.reshape((b, t, self.num_kv_heads, kg // self.num_kv_heads, h))
    logits = jnp.einsum('BTKGH,BSKH->BTKGS', query_scaled, key_proj)
    logits = logits.reshape((b, t, kg, -1))
    if self.attn_type == AttentionType.LOCAL_SLIDING:
      attn_mask *= create_sliding_mask(segment_pos, sliding_window_size=self.sliding_window_size)
    padded_logits = jnp.where(jnp.expand_dims(attn_mask, -2), logits, K_MASK)
    probs = jax.nn.softmax(padded_logits, axis=-1).astype(key_proj.dtype)
    probs = probs.reshape((b, t, self.num_kv_heads, kg // self.num_kv_heads, -1))
    encoded = jnp.einsum('BTKGS,BSKH->BTKGH', probs, value_proj).reshape((b, t, kg, h))
    return None, self.attn_vec_einsum('BTNH,NHD->BTD', encoded)


class FeedForward(nn.Module):
  features: int
  hidden_dim: int

  @nn.compact
  def __call__(self, x):
    # transpose_gating_einsum=True, as in every Gemma 3 config.
    gating = Einsum((2, self.hidden_dim, self.features), weight_name='gating_einsum')
    nn.share_scope(self, gating)
    gate = gating('...F,NHF->...NH', x)
    activations = nn.gelu(gate[..., 0, :]) * gate[..., 1, :]
    linear = Einsum((self.hidden_dim, self.features), weight_name='linear')
    nn.share_scope(self, linear)
    return linear('...H,HF->...F', activations)


class Block(nn.Module):
  cfg: Config
  attn_type: AttentionType

  def setup(self):
    cfg, local = self.cfg, self.attn_type == AttentionType.LOCAL_SLIDING
    self.pre_attention_norm = RMSNorm()
    self.attn = Attention(
        num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, features=cfg.embed_dim,
        head_dim=cfg.head_dim, attn_type=self.attn_type,
        query_pre_attn_scalar=cfg.head_dim ** -0.5,  # BY_ONE_OVER_SQRT_HEAD_DIM
        rope_base_frequency=10_000 if local else 1_000_000,
        rope_scale_factor=1.0 if local else 8.0, sliding_window_size=cfg.sliding_window_size)
    self.post_attention_norm = RMSNorm()
    self.pre_ffw_norm = RMSNorm()
    self.mlp = FeedForward(features=cfg.embed_dim, hidden_dim=cfg.hidden_dim)
    self.post_ffw_norm = RMSNorm()

  def __call__(self, x, segment_pos, cache, attn_mask):
    cache, attn_output = self.attn(self.pre_attention_norm(x), segment_pos, cache, attn_mask)
    attn_output = self.post_attention_norm(attn_output)
    attn_output += x
    outputs = self.post_ffw_norm(self.mlp(self.pre_ffw_norm(attn_output)))
    outputs += attn_output
    return cache, outputs


class StackedBlock(Block):
  """The adapter a user writes for the stack: no cache in training, so ``(x, pos, mask) -> x``."""

  def __call__(self, x, segment_pos, attn_mask):
    return super().__call__(x, segment_pos, None, attn_mask)[1]


class Transformer(nn.Module):
  """``policy`` None: the untouched model; else its blocks on one patterned `remat.LayerStack`."""
  cfg: Config
  policy: str | None = None
  remat_policy: Any = None   # per-block nn.remat of the untouched blocks (a jax.checkpoint policy)

  def setup(self):
    cfg = self.cfg
    self.embedder = Embedder(vocab_size=cfg.num_embed, embed_dim=cfg.embed_dim)
    pattern = GEMMA3_ATTENTION_PATTERN
    if self.policy is None:  # make_attention_layers_types: the pattern repeated over the layers
      block = Block if self.remat_policy is None else nn.remat(Block, policy=self.remat_policy)
      self.blocks = [block(cfg, pattern[i % len(pattern)], name=f'layer_{i}')
                     for i in range(cfg.num_layers)]
    else:  # the config's own enum members are the kinds (stored as LOCAL_SLIDING, GLOBAL)
      self.blocks = remat.LayerStack(
          {t: StackedBlock for t in AttentionType}, cfg.num_layers, self.policy,
          block_kwargs={t: {'cfg': cfg, 'attn_type': t} for t in AttentionType}, pattern=pattern)
    self.final_norm = RMSNorm()

  def __call__(self, tokens):
    inputs_mask = tokens != 0
    positions = jnp.cumsum(inputs_mask, axis=-1) - 1
    causal = jnp.tril(jnp.ones((tokens.shape[1],) * 2, bool))
    attention_mask = inputs_mask[:, None, :] & causal[None]
    x = self.embedder.encode(tokens)
    if self.policy is None:
      for block in self.blocks:
        _, x = block(x, positions, None, attention_mask)
    else:
      x = self.blocks(x, positions, attention_mask)
    return self.embedder.decode(self.final_norm(x))


def loss(model, params, tokens):
  logp = jax.nn.log_softmax(model.apply({'params': params}, tokens)[:, :-1])
  return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))


def stack(params, num_layers: int):
  """The untouched ``layer_{i}`` trees stacked per kind, ``[n_kind, ...]`` in layer order."""
  params = dict(params)
  layers = [params.pop(f'layer_{i}') for i in range(num_layers)]
  by_kind = remat.stack_layers(layers, pattern=GEMMA3_ATTENTION_PATTERN)
  params['blocks'] = {remat.patterns.kind_name(k): v for k, v in by_kind.items()}
  return params


def case(cfg: Config = Config(), batch: int = 8, seed: int = 0):
  from tests.public_models import Case, block_policy
  tokens = jax.random.randint(jax.random.PRNGKey(seed + 1), (batch, cfg.seq_len), 1,
                              cfg.num_embed)
  params = Transformer(cfg).init(jax.random.PRNGKey(seed), tokens)['params']
  return Case('gemma3', lambda p, t: loss(Transformer(cfg), p, t),
              lambda spec: lambda p, t: loss(Transformer(cfg, spec), p, t),
              params, tokens, lambda p: stack(p, cfg.num_layers), cfg.num_layers,
              lambda rule: lambda p, t: loss(Transformer(cfg, remat_policy=block_policy(rule)),
                                             p, t))
