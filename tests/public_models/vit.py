"""A ViT in the big_vision style, in Flax linen.

Follows google-research/big_vision ``big_vision/models/vit.py`` (Copyright Big
Vision Authors, Apache License 2.0): ``MlpBlock`` (xavier-uniform Dense, GELU,
Dense), ``Encoder1DBlock`` (pre-LayerNorm ``nn.MultiHeadDotProductAttention``
with xavier-uniform kernels, then the MLP, both residual), ``Encoder`` (the
blocks in a Python loop named ``encoderblock_{i}``, ``encoder_norm``) and the
model (a patch ``Conv`` named ``embedding``, 2-D sin-cos position embeddings,
global average pooling, a zero-initialised ``head``). Left out: the blocks'
dict of intermediate outputs (only the loss is used here), dropout, the
``nn.scan`` option (the library replaces it) and other pooling types.
"""

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import remat


@dataclasses.dataclass(frozen=True)
class Config:
  width: int = 64
  depth: int = 6
  mlp_dim: int = 256
  num_heads: int = 4
  patch_size: int = 4
  image_size: int = 32
  num_classes: int = 10


def posemb_sincos_2d(h, w, width, temperature=10_000.):
  y, x = np.mgrid[:h, :w]
  omega = np.arange(width // 4) / (width // 4 - 1)
  omega = 1. / (temperature ** omega)
  y = np.einsum('m,d->md', y.flatten(), omega)
  x = np.einsum('m,d->md', x.flatten(), omega)
  pe = np.concatenate([np.sin(x), np.cos(x), np.sin(y), np.cos(y)], axis=1)
  return jnp.asarray(pe, jnp.float32)[None, :, :]


class MlpBlock(nn.Module):
  mlp_dim: int

  @nn.compact
  def __call__(self, x):
    inits = dict(kernel_init=nn.initializers.xavier_uniform(),
                 bias_init=nn.initializers.normal(stddev=1e-6))
    d = x.shape[-1]
    x = nn.Dense(self.mlp_dim, **inits)(x)
    x = nn.gelu(x)
    return nn.Dense(d, **inits)(x)


class Encoder1DBlock(nn.Module):
  mlp_dim: int
  num_heads: int

  @nn.compact
  def __call__(self, x):
    y = nn.LayerNorm()(x)
    y = nn.MultiHeadDotProductAttention(num_heads=self.num_heads,
                                        kernel_init=nn.initializers.xavier_uniform(),
                                        deterministic=True)(y, y)
    x = x + y
    y = nn.LayerNorm()(x)
    y = MlpBlock(mlp_dim=self.mlp_dim)(y)
    return x + y


class Encoder(nn.Module):
  cfg: Config
  policy: str | None = None
  remat_policy: Any = None   # per-block nn.remat of the untouched blocks (a jax.checkpoint policy)

  @nn.compact
  def __call__(self, x):
    cfg = self.cfg
    if self.policy is None:
      block = (Encoder1DBlock if self.remat_policy is None else
               nn.remat(Encoder1DBlock, policy=self.remat_policy))
      for lyr in range(cfg.depth):
        x = block(name=f'encoderblock_{lyr}', mlp_dim=cfg.mlp_dim, num_heads=cfg.num_heads)(x)
    else:
      x = remat.LayerStack(Encoder1DBlock, cfg.depth, self.policy, name='encoderblocks',
                           block_kwargs={'mlp_dim': cfg.mlp_dim, 'num_heads': cfg.num_heads})(x)
    return nn.LayerNorm(name='encoder_norm')(x)


class ViT(nn.Module):
  """``policy`` None: the untouched model; else its encoder on :class:`remat.LayerStack`."""
  cfg: Config
  policy: str | None = None
  remat_policy: Any = None

  @nn.compact
  def __call__(self, image):
    cfg = self.cfg
    x = nn.Conv(cfg.width, (cfg.patch_size,) * 2, strides=(cfg.patch_size,) * 2,
                padding='VALID', name='embedding')(image)
    n, h, w, c = x.shape
    x = jnp.reshape(x, [n, h * w, c]) + posemb_sincos_2d(h, w, c)
    x = Encoder(cfg, self.policy, self.remat_policy, name='Transformer')(x)
    x = jnp.mean(x, axis=1)
    return nn.Dense(cfg.num_classes, kernel_init=nn.initializers.zeros, name='head')(x)


def _loss(model, params, batch):
  images, labels = batch
  logp = jax.nn.log_softmax(model.apply({'params': params}, images))
  return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], -1))


def case(cfg: Config = Config(), batch: int = 8, seed: int = 0):
  from tests.public_models import Case, block_policy
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed + 1))
  images = jax.random.normal(k1, (batch, cfg.image_size, cfg.image_size, 3))
  labels = jax.random.randint(k2, (batch,), 0, cfg.num_classes)
  params = ViT(cfg).init(jax.random.PRNGKey(seed), images)['params']
  # The zero-initialised head would give every earlier layer a zero gradient.
  params = jax.tree_util.tree_map(lambda a: a, params)
  params['head']['kernel'] = 0.1 * jax.random.normal(jax.random.PRNGKey(seed + 2),
                                                     params['head']['kernel'].shape)

  def stack(p):
    p = jax.tree_util.tree_map(lambda a: a, p)
    enc = p['Transformer']
    layers = [enc.pop(f'encoderblock_{i}') for i in range(cfg.depth)]
    enc['encoderblocks'] = {'block': jax.tree_util.tree_map(lambda *a: jnp.stack(a), *layers)}
    return p

  return Case('vit', lambda p, b: _loss(ViT(cfg), p, b),
              lambda spec: lambda p, b: _loss(ViT(cfg, spec), p, b),
              params, (images, labels), stack, cfg.depth,
              lambda rule: lambda p, b: _loss(ViT(cfg, remat_policy=block_policy(rule)), p, b))
