"""GPT-2 architecture in Flax linen, with its layers stacked by :class:`remat.LayerStack`.

Pre-LayerNorm blocks, learned positions, tanh-GELU MLP, tied input/output
embeddings, causal self-attention and dropout, as in Radford et al. (2019).

Parameter names follow Hugging Face's ``GPT2LMHeadModel`` so an import is a
mechanical mapping (``h.{i}`` is index ``i`` of the stacked leaves under
``h/block``; HF's fused ``c_attn`` is split into ``query``/``key``/``value``)::

    wte/embedding                      transformer.wte.weight
    wpe/embedding                      transformer.wpe.weight
    h/block/ln_1/{scale,bias}[i]       transformer.h.{i}.ln_1.{weight,bias}
    h/block/attn/{query,key,value}/... transformer.h.{i}.attn.c_attn (split in 3 on the out axis)
    h/block/attn/c_proj/{kernel,bias}  transformer.h.{i}.attn.c_proj
    h/block/ln_2/{scale,bias}          transformer.h.{i}.ln_2
    h/block/mlp/c_fc/{kernel,bias}     transformer.h.{i}.mlp.c_fc
    h/block/mlp/c_proj/{kernel,bias}   transformer.h.{i}.mlp.c_proj
    ln_f/{scale,bias}                  transformer.ln_f

Activations are tagged with ``checkpoint_name`` where they are created (see
:data:`TAGS`); policies such as ``names:...`` and the MaxText presets select
by these names.

``GPTConfig.dtype`` is the compute dtype (docs/precision.md): parameters are
float32 under either dtype, cast to ``dtype`` where they are used; activations,
and so the saved residuals, are in ``dtype``; LayerNorm statistics, the softmax,
the logits and the loss are float32.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from models.attention import IMPLEMENTATIONS as ATTENTION_IMPLEMENTATIONS
from models.attention import attention
from models.dropout import dropout, dropout_keys
from models.layers import TRANSFORMER_TAGS, LayerNorm, Normalized, check_dtype, projection
from models.lora.spec import LoraSpec, as_spec
from remat.policies import Policy, get_policy
from remat.stack import LayerStack

# Every checkpoint name the GPT block emits (tests check the traced model agrees).
TAGS = TRANSFORMER_TAGS


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  """Shape and regularisation of a GPT-2 model.

  Attributes:
    vocab_size: tokens (256 for byte-level text, 50257 for GPT-2's BPE).
    max_len: learned positions (HF ``n_positions``).
    num_layers: transformer blocks (HF ``n_layer``).
    num_heads: attention heads (HF ``n_head``).
    d_model: width (HF ``n_embd``).
    dropout: embedding, attention and residual dropout rate (HF uses 0.1 for all).
    layer_norm_eps: LayerNorm epsilon.
    loss_chunk: tokens per chunk of the training loss's tied output layer
      (:func:`models.chunked_loss.chunked_cross_entropy`): ``None`` (the default) picks
      chunks of <= 64 MiB of logits (256 tokens at 50257 words) and the plain
      loss when one chunk covers the batch (always for the byte-level V = 256);
      ``0`` always takes the plain loss. Changes memory and time, not values.
    attention: attention implementation, ``'auto'``, ``'dense'``, ``'blockwise'``
      or ``'cudnn'`` (:func:`models.attention.attention`). Changes memory and
      time, not values (up to rounding).
    dtype: compute dtype, 'float32' or 'bfloat16' (parameters stay float32;
      docs/precision.md).
    lora: None (every parameter trained), or the LoRA adapters of a run whose
      base is frozen (:mod:`models.lora`; a dict of its fields in JSON).
  """
  vocab_size: int = 256
  max_len: int = 256
  num_layers: int = 6
  num_heads: int = 4
  d_model: int = 128
  dropout: float = 0.1
  layer_norm_eps: float = 1e-5
  loss_chunk: int | None = None
  attention: str = 'auto'
  dtype: str = 'float32'
  lora: LoraSpec | None = None

  def __post_init__(self):
    object.__setattr__(self, 'lora', as_spec(self.lora))
    for f in ('vocab_size', 'max_len', 'num_layers', 'num_heads', 'd_model'):
      if getattr(self, f) < 1:
        raise ValueError(f'GPTConfig.{f} must be >= 1, got {getattr(self, f)}')
    if self.d_model % self.num_heads:
      raise ValueError(f'GPTConfig.d_model ({self.d_model}) must be divisible by '
                       f'num_heads ({self.num_heads})')
    if self.loss_chunk is not None and self.loss_chunk < 0:
      raise ValueError(f'GPTConfig.loss_chunk must be >= 0 or None, got {self.loss_chunk}')
    if not 0.0 <= self.dropout < 1.0:
      raise ValueError(f'GPTConfig.dropout must be in [0, 1), got {self.dropout}')
    if self.attention not in ATTENTION_IMPLEMENTATIONS:
      raise ValueError(f"GPTConfig.attention must be one of {', '.join(ATTENTION_IMPLEMENTATIONS)}, "
                       f"got '{self.attention}'")
    check_dtype('GPTConfig', self.dtype)

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads


class Attention(nn.Module):
  """Causal multi-head self-attention; reads ``ln_1`` in parts (:class:`~models.layers.Normalized`)."""
  config: GPTConfig
  deterministic: bool

  @nn.compact
  def __call__(self, x: Normalized, rng, segment_ids=None):
    cfg = self.config
    b, t, _ = x.x_hat.shape
    split = lambda y: y.reshape(b, t, cfg.num_heads, cfg.head_dim)
    proj = lambda name: split(projection(self, cfg, 'gpt', f'attn/{name}', cfg.d_model, x,
                                         kernel_init=nn.initializers.normal(0.02), rng=rng))
    q = checkpoint_name(proj('query'), 'query_proj')
    k = checkpoint_name(proj('key'), 'key_proj')
    v = checkpoint_name(proj('value'), 'value_proj')
    attn_key, resid_key = dropout_keys(rng, 2)
    ctx = attention(q, k, v, causal=True, dropout_rate=cfg.dropout,
                    deterministic=self.deterministic, rng=attn_key, implementation=cfg.attention,
                    segment_ids=segment_ids)
    out = projection(self, cfg, 'gpt', 'attn/c_proj', cfg.d_model, ctx.reshape(b, t, cfg.d_model),
                     kernel_init=nn.initializers.normal(0.02 / math.sqrt(2 * cfg.num_layers)),
                     rng=rng)
    out = checkpoint_name(out, 'out_proj')
    return dropout(out, cfg.dropout, deterministic=self.deterministic, rng=resid_key)


class MLP(nn.Module):
  """Two-layer tanh-GELU MLP of width 4 * d_model; reads ``ln_2`` in parts."""
  config: GPTConfig
  deterministic: bool

  @nn.compact
  def __call__(self, x: Normalized, rng):
    cfg = self.config
    h = projection(self, cfg, 'gpt', 'mlp/c_fc', 4 * cfg.d_model, x,
                   kernel_init=nn.initializers.normal(0.02), rng=rng)
    h = checkpoint_name(h, 'mlpwi')
    out = projection(self, cfg, 'gpt', 'mlp/c_proj', cfg.d_model, h, gelu=True,
                     kernel_init=nn.initializers.normal(0.02 / math.sqrt(2 * cfg.num_layers)),
                     rng=rng)
    out = checkpoint_name(out, 'mlpwo')
    return dropout(out, cfg.dropout, deterministic=self.deterministic, rng=rng)


class Block(nn.Module):
  """Pre-LN transformer block, in the layer-stack convention (x[, segment_ids], rng) -> (x, None)."""
  config: GPTConfig
  deterministic: bool = True

  @nn.compact
  def __call__(self, x, segment_ids=None, *, rng):
    cfg = self.config
    attn_key, mlp_key = dropout_keys(rng, 2)
    h = LayerNorm(cfg.layer_norm_eps, parts=True, name='ln_1')(x)
    x = x + Attention(cfg, self.deterministic, name='attn')(h, attn_key, segment_ids)
    h = LayerNorm(cfg.layer_norm_eps, parts=True, name='ln_2')(x)
    x = x + MLP(cfg, self.deterministic, name='mlp')(h, mlp_key)
    return x, None


class GPT(nn.Module):
  """GPT-2 language model returning next-token logits [B, T, vocab].

  ``return_hidden=True`` (or :meth:`hidden`) returns the final hidden states
  [B, T, d_model] instead, the input of the tied output layer ``logits = x @
  wte.T``: the training loss computes that layer itself, in chunks, so the full
  logits never exist (:func:`models.chunked_loss.chunked_cross_entropy`).

  The logits are float32 under either dtype: the output matmul takes ``dtype``
  operands and accumulates into float32, as the chunked loss does. The hidden
  states are in ``config.dtype``.

  A window packed from several documents passes ``segment_ids`` (int [B, T]:
  attention stays within a document) and ``positions`` (int [B, T]: the learned
  positions looked up, restarting at 0 in each document).

  Attributes:
    config: model shape.
    policy: remat policy (a :class:`~remat.policies.Policy` or a spec string).
  """
  config: GPTConfig
  policy: Policy | str = 'none'
  layout: str = 'auto'   # how the stack becomes a program (remat.layout.LAYOUTS)

  @nn.compact
  def __call__(self, tokens, *, deterministic: bool = True, return_hidden: bool = False,
               segment_ids=None, positions=None):
    cfg = self.config
    policy = get_policy(self.policy, num_layers=cfg.num_layers)
    t = tokens.shape[1]
    if t > cfg.max_len:
      raise ValueError(f'sequence length {t} exceeds the model max_len {cfg.max_len}')
    init = nn.initializers.normal(0.02)
    wte = nn.Embed(cfg.vocab_size, cfg.d_model, embedding_init=init, dtype=cfg.dtype, name='wte')
    wpe = nn.Embed(cfg.max_len, cfg.d_model, embedding_init=nn.initializers.normal(0.01),
                   dtype=cfg.dtype, name='wpe')
    x = wte(tokens) + (wpe(jnp.arange(t))[None] if positions is None else wpe(positions))
    x = nn.Dropout(cfg.dropout)(x, deterministic)
    segs = () if segment_ids is None else (segment_ids,)
    x = LayerStack(Block, cfg.num_layers, policy,
                   block_kwargs={'config': cfg, 'deterministic': deterministic},
                   name='h', layout=self.layout)(x, *segs, deterministic=deterministic)
    x = LayerNorm(cfg.layer_norm_eps, name='ln_f')(x)
    if return_hidden:
      return x
    if cfg.dtype == 'float32':
      return wte.attend(x)
    # bfloat16 operands, float32 accumulation and logits: a vocabulary-wide softmax of
    # bfloat16 logits (8 significant bits) would round a logit of 10 by up to 0.03.
    return jnp.dot(x, wte.embedding.astype(x.dtype).T, preferred_element_type=jnp.float32)

  def hidden(self, tokens, *, deterministic: bool = True):
    """Final hidden states [B, T, d_model] (after ``ln_f``); ``wte.attend`` of them are the logits."""
    return self(tokens, deterministic=deterministic, return_hidden=True)
