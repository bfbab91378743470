"""Vision Transformer (Dosovitskiy et al., 2021) in Flax linen, layers stacked by :class:`remat.LayerStack`.

Patch embedding (a strided convolution), a class token, learned positions,
pre-LayerNorm encoder blocks with exact-GELU MLPs, a final LayerNorm and a
linear head on the class token, as in Hugging Face's
``ViTForImageClassification``. The blocks emit the same checkpoint names as
GPT-2 (:data:`TAGS`), so every Transformer policy and preset applies.

Parameter names are ready for a mechanical import (index ``i`` of the stacked
leaves under ``encoder/block`` is HF's ``vit.encoder.layer.{i}``)::

    embeddings/cls_token                        vit.embeddings.cls_token
    embeddings/position_embeddings              vit.embeddings.position_embeddings
    embeddings/patch/{kernel,bias}              vit.embeddings.patch_embeddings.projection
    encoder/block/layernorm_before              .layernorm_before
    encoder/block/attention/{query,key,value}   .attention.attention.{query,key,value}
    encoder/block/attention/output              .attention.output.dense
    encoder/block/layernorm_after               .layernorm_after
    encoder/block/intermediate                  .intermediate.dense
    encoder/block/output                        .output.dense
    layernorm                                   vit.layernorm
    classifier                                  classifier

``ViTConfig.dtype`` is the compute dtype (docs/precision.md): parameters are
float32 under either dtype, cast to ``dtype`` where they are used; activations,
and so the saved residuals, are in ``dtype``; LayerNorm statistics and the
softmax are float32 (and the loss, in ``models.tasks``).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from models.attention import IMPLEMENTATIONS as ATTENTION_IMPLEMENTATIONS
from models.attention import attention
from models.dropout import dropout_keys
from models.layers import TRANSFORMER_TAGS, LayerNorm, Normalized, check_dtype, projection
from models.lora.spec import LoraSpec, as_spec
from remat.policies import Policy, get_policy
from remat.stack import LayerStack

TAGS = TRANSFORMER_TAGS


@dataclasses.dataclass(frozen=True)
class ViTConfig:
  """Shape and regularisation of a ViT classifier (HF ``ViTConfig`` names in brackets).

  Attributes:
    image_size: input side in pixels; positions are learned for this size.
    patch_size: patch side (``patch_size``); must divide ``image_size``.
    channels: input channels (``num_channels``).
    num_classes: classifier outputs (``num_labels``).
    num_layers: encoder blocks (``num_hidden_layers``).
    num_heads: attention heads (``num_attention_heads``).
    d_model: width (``hidden_size``).
    mlp_dim: MLP width (``intermediate_size``).
    dropout: embedding, residual and MLP dropout (``hidden_dropout_prob``).
    attention_dropout: attention-probability dropout (``attention_probs_dropout_prob``).
    layer_norm_eps: LayerNorm epsilon (HF's default is 1e-12).
    attention: attention implementation, ``'auto'``, ``'dense'``, ``'blockwise'``
      or ``'cudnn'`` (:func:`models.attention.attention`). Changes memory and
      time, not values (up to rounding).
    dtype: compute dtype, 'float32' or 'bfloat16' (parameters stay float32;
      docs/precision.md).
    lora: None (every parameter trained), or the LoRA adapters of a run whose
      base is frozen and whose classifier is trained whole (:mod:`models.lora`).
  """
  image_size: int = 32
  patch_size: int = 4
  channels: int = 3
  num_classes: int = 10
  num_layers: int = 6
  num_heads: int = 4
  d_model: int = 128
  mlp_dim: int = 512
  dropout: float = 0.0
  attention_dropout: float = 0.0
  layer_norm_eps: float = 1e-12
  attention: str = 'auto'
  dtype: str = 'float32'
  lora: LoraSpec | None = None

  def __post_init__(self):
    object.__setattr__(self, 'lora', as_spec(self.lora))
    for f in ('image_size', 'patch_size', 'channels', 'num_classes', 'num_layers', 'num_heads',
              'd_model', 'mlp_dim'):
      if getattr(self, f) < 1:
        raise ValueError(f'ViTConfig.{f} must be >= 1, got {getattr(self, f)}')
    if self.image_size % self.patch_size:
      raise ValueError(f'ViTConfig.image_size ({self.image_size}) must be a multiple of '
                       f'patch_size ({self.patch_size})')
    if self.d_model % self.num_heads:
      raise ValueError(f'ViTConfig.d_model ({self.d_model}) must be divisible by '
                       f'num_heads ({self.num_heads})')
    for f in ('dropout', 'attention_dropout'):
      if not 0.0 <= getattr(self, f) < 1.0:
        raise ValueError(f'ViTConfig.{f} must be in [0, 1), got {getattr(self, f)}')
    if self.attention not in ATTENTION_IMPLEMENTATIONS:
      raise ValueError(f"ViTConfig.attention must be one of {', '.join(ATTENTION_IMPLEMENTATIONS)}, "
                       f"got '{self.attention}'")
    check_dtype('ViTConfig', self.dtype)

  @property
  def num_patches(self) -> int:
    return (self.image_size // self.patch_size) ** 2

  @property
  def seq_len(self) -> int:
    """Tokens per image: the patches plus the class token."""
    return self.num_patches + 1


_INIT = nn.initializers.truncated_normal(0.02)


def _dense(features: int, name: str, dtype: str) -> nn.Dense:
  return nn.Dense(features, kernel_init=_INIT, dtype=dtype, name=name)


class Attention(nn.Module):
  """Bidirectional multi-head self-attention with HF ViT's parameter names.

  Reads the block's first LayerNorm in parts (:class:`~models.layers.Normalized`).
  """
  config: ViTConfig
  deterministic: bool

  @nn.compact
  def __call__(self, x: Normalized, rng):
    cfg = self.config
    b, t, _ = x.x_hat.shape
    heads = lambda y: y.reshape(b, t, cfg.num_heads, cfg.d_model // cfg.num_heads)
    proj = lambda name: heads(projection(self, cfg, 'vit', f'attention/{name}', cfg.d_model, x,
                                         kernel_init=_INIT, rng=rng))
    q = checkpoint_name(proj('query'), 'query_proj')
    k = checkpoint_name(proj('key'), 'key_proj')
    v = checkpoint_name(proj('value'), 'value_proj')
    attn_key, out_key = dropout_keys(rng, 2)
    ctx = attention(q, k, v, causal=False, dropout_rate=cfg.attention_dropout,
                    deterministic=self.deterministic, rng=attn_key, implementation=cfg.attention)
    out = projection(self, cfg, 'vit', 'attention/output', cfg.d_model,
                     ctx.reshape(b, t, cfg.d_model), kernel_init=_INIT, rng=rng)
    out = checkpoint_name(out, 'out_proj')
    return nn.Dropout(cfg.dropout)(out, self.deterministic, rng=out_key)


class Block(nn.Module):
  """Pre-LN encoder block, in the layer-stack convention (x, rng) -> (x, None)."""
  config: ViTConfig
  deterministic: bool = True

  @nn.compact
  def __call__(self, x, rng):
    cfg = self.config
    attn_key, mlp_key = dropout_keys(rng, 2)
    h = LayerNorm(cfg.layer_norm_eps, parts=True, name='layernorm_before')(x)
    x = x + Attention(cfg, self.deterministic, name='attention')(h, attn_key)
    h = LayerNorm(cfg.layer_norm_eps, parts=True, name='layernorm_after')(x)
    h = checkpoint_name(projection(self, cfg, 'vit', 'intermediate', cfg.mlp_dim, h,
                                   kernel_init=_INIT, rng=mlp_key), 'mlpwi')
    h = checkpoint_name(projection(self, cfg, 'vit', 'output', cfg.d_model, h, gelu=False,
                                   kernel_init=_INIT, rng=mlp_key), 'mlpwo')
    return x + nn.Dropout(cfg.dropout)(h, self.deterministic, rng=mlp_key), None


class Embeddings(nn.Module):
  """Patches -> tokens, with the class token prepended and positions added."""
  config: ViTConfig

  @nn.compact
  def __call__(self, images, deterministic: bool):
    cfg = self.config
    p = cfg.patch_size
    x = nn.Conv(cfg.d_model, (p, p), strides=(p, p), padding='VALID',
                kernel_init=_INIT, dtype=cfg.dtype, name='patch')(images)
    b = x.shape[0]
    x = x.reshape(b, -1, cfg.d_model)
    cls = self.param('cls_token', _INIT, (1, 1, cfg.d_model))
    pos = self.param('position_embeddings', _INIT, (1, cfg.seq_len, cfg.d_model))
    cls, pos = cls.astype(x.dtype), pos.astype(x.dtype)   # float32 parameters, cast at use
    x = jnp.concatenate([jnp.broadcast_to(cls, (b, 1, cfg.d_model)), x], axis=1) + pos
    return nn.Dropout(cfg.dropout)(x, deterministic)


class ViT(nn.Module):
  """ViT classifier returning logits [B, num_classes] for images [B, S, S, C].

  Attributes:
    config: model shape.
    policy: remat policy (a :class:`~remat.policies.Policy` or a spec string).
  """
  config: ViTConfig
  policy: Policy | str = 'none'
  layout: str = 'auto'   # how the stack becomes a program (remat.layout.LAYOUTS)

  @nn.compact
  def __call__(self, images, *, deterministic: bool = True):
    cfg = self.config
    policy = get_policy(self.policy, num_layers=cfg.num_layers)
    if images.shape[1:] != (cfg.image_size, cfg.image_size, cfg.channels):
      raise ValueError(f'images of shape {tuple(images.shape[1:])} do not fit this ViT; it takes '
                       f'[B, {cfg.image_size}, {cfg.image_size}, {cfg.channels}]')
    x = Embeddings(cfg, name='embeddings')(images, deterministic)
    x = LayerStack(Block, cfg.num_layers, policy,
                   block_kwargs={'config': cfg, 'deterministic': deterministic},
                   name='encoder', layout=self.layout)(x, deterministic=deterministic)
    x = LayerNorm(cfg.layer_norm_eps, name='layernorm')(x)
    return _dense(cfg.num_classes, 'classifier', cfg.dtype)(x[:, 0])
