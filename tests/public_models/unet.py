"""A diffusion U-Net in Flax linen, as diffusers' Flax UNet2D, trained on the DDPM loss.

Follows huggingface/diffusers ``src/diffusers/models/resnet_flax.py``,
``embeddings_flax.py``, ``unets/unet_2d_blocks_flax.py`` and
``unets/unet_2d_condition_flax.py`` (Copyright The HuggingFace Team, Apache License
2.0): ``get_sinusoidal_embeddings`` (``flip_sin_to_cos=True``, ``freq_shift=0``),
``FlaxTimestepEmbedding`` (``linear_1``, SiLU, ``linear_2``), ``FlaxResnetBlock2D``
(GroupNorm(32), swish, 3x3 conv, the projected timestep embedding added, GroupNorm,
swish, 3x3 conv, a 1x1 ``conv_shortcut`` when the channels change),
``FlaxDownsample2D`` (stride-2 conv) and ``FlaxUpsample2D`` (nearest x2, conv),
``FlaxDownBlock2D`` (``resnets_{i}`` in a Python loop, each output a skip, then
``downsamplers_0`` whose output is a skip too) and ``FlaxUpBlock2D``
(``layers_per_block + 1`` resnets, each popping the last skip and concatenating it
on channels), ``conv_in``, ``conv_norm_out``, ``conv_out``, the NCHW interface. The
configuration is two ``DownBlock2D``/``UpBlock2D`` levels with equal channels and
``mid_block_type=None`` (the Flax UNet's options); left out: cross-attention
blocks and ``encoder_hidden_states``, dropout (0 here), additional residuals.

The stacked model puts each down block's ``layers_per_block`` resnets on a
:class:`remat.LayerStack` that returns every output as a per-layer output (the
skips), and each up block's first ``layers_per_block`` resnets on one that takes
those skips, reversed, as ``xs=``; the downsampler, upsampler and the up block's
last resnet (it takes the skip from ``conv_in`` or the downsampler) stay outside.
"""

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

import remat


@dataclasses.dataclass(frozen=True)
class Config:
  sample_size: int = 32
  in_channels: int = 3
  out_channels: int = 3
  block_out_channels: tuple = (32, 32)  # equal, so a level's resnets have one shape
  layers_per_block: int = 6


def get_sinusoidal_embeddings(timesteps, embedding_dim, freq_shift=1, min_timescale=1,
                              max_timescale=1.0e4, flip_sin_to_cos=False, scale=1.0):
  num_timescales = float(embedding_dim // 2)
  log_timescale_increment = math.log(max_timescale / min_timescale) / (num_timescales - freq_shift)
  inv_timescales = min_timescale * jnp.exp(jnp.arange(num_timescales, dtype=jnp.float32)
                                           * -log_timescale_increment)
  scaled_time = scale * jnp.expand_dims(timesteps, 1) * jnp.expand_dims(inv_timescales, 0)
  if flip_sin_to_cos:
    signal = jnp.concatenate([jnp.cos(scaled_time), jnp.sin(scaled_time)], axis=1)
  else:
    signal = jnp.concatenate([jnp.sin(scaled_time), jnp.cos(scaled_time)], axis=1)
  return jnp.reshape(signal, [jnp.shape(timesteps)[0], embedding_dim])


class FlaxTimestepEmbedding(nn.Module):
  time_embed_dim: int = 32

  @nn.compact
  def __call__(self, temb):
    temb = nn.Dense(self.time_embed_dim, name='linear_1')(temb)
    return nn.Dense(self.time_embed_dim, name='linear_2')(nn.silu(temb))


def _conv(features, kernel=3, stride=1, **kw):
  pad = ((1, 1), (1, 1)) if kernel == 3 else 'VALID'
  return nn.Conv(features, kernel_size=(kernel, kernel), strides=(stride, stride), padding=pad,
                 **kw)


class FlaxUpsample2D(nn.Module):
  out_channels: int

  @nn.compact
  def __call__(self, hidden_states):
    batch, height, width, channels = hidden_states.shape
    hidden_states = jax.image.resize(hidden_states, shape=(batch, height * 2, width * 2, channels),
                                     method='nearest')
    return _conv(self.out_channels, name='conv')(hidden_states)


class FlaxDownsample2D(nn.Module):
  out_channels: int

  @nn.compact
  def __call__(self, hidden_states):
    return _conv(self.out_channels, stride=2, name='conv')(hidden_states)


class FlaxResnetBlock2D(nn.Module):
  in_channels: int
  out_channels: int

  def setup(self):
    self.norm1 = nn.GroupNorm(num_groups=32, epsilon=1e-5)
    self.conv1 = _conv(self.out_channels)
    self.time_emb_proj = nn.Dense(self.out_channels)
    self.norm2 = nn.GroupNorm(num_groups=32, epsilon=1e-5)
    self.conv2 = _conv(self.out_channels)
    self.conv_shortcut = (_conv(self.out_channels, kernel=1)
                          if self.in_channels != self.out_channels else None)

  def __call__(self, hidden_states, temb):
    residual = hidden_states
    hidden_states = self.conv1(nn.swish(self.norm1(hidden_states)))
    temb = self.time_emb_proj(nn.swish(temb))
    hidden_states = hidden_states + jnp.expand_dims(jnp.expand_dims(temb, 1), 1)
    hidden_states = self.conv2(nn.swish(self.norm2(hidden_states)))
    if self.conv_shortcut is not None:
      residual = self.conv_shortcut(residual)
    return hidden_states + residual


def _maybe_remat(policy):
  """The untouched resnet class, or it in ``nn.remat`` under ``policy`` (the per-block habit)."""
  return FlaxResnetBlock2D if policy is None else nn.remat(FlaxResnetBlock2D, policy=policy)


class SkipResnet(FlaxResnetBlock2D):
  """A down resnet on the stack: its output is carried on and returned as this layer's skip."""

  def __call__(self, hidden_states, temb):
    y = super().__call__(hidden_states, temb)
    return y, y


class ConcatResnet(FlaxResnetBlock2D):
  """An up resnet on the stack: takes its skip as the per-layer input (``xs``)."""

  def __call__(self, hidden_states, res_hidden_states, temb):
    return super().__call__(jnp.concatenate((hidden_states, res_hidden_states), axis=-1), temb)


class FlaxDownBlock2D(nn.Module):
  in_channels: int
  out_channels: int
  num_layers: int
  add_downsample: bool
  policy: str | None = None
  remat_policy: Any = None   # per-block nn.remat of the untouched resnets (a jax.checkpoint policy)

  def setup(self):
    if self.policy is None:
      resnet = _maybe_remat(self.remat_policy)
      self.resnets = [resnet(self.in_channels if i == 0 else self.out_channels,
                             self.out_channels) for i in range(self.num_layers)]
    else:  # in == out channels, so every layer has one shape
      self.resnets = remat.LayerStack(SkipResnet, self.num_layers, self.policy, block_kwargs={
          'in_channels': self.in_channels, 'out_channels': self.out_channels})
    if self.add_downsample:
      self.downsamplers_0 = FlaxDownsample2D(self.out_channels)

  def __call__(self, hidden_states, temb):
    """Returns the output and the skips: a tuple, or (stacked ``[N, ...]``, tuple) when stacked."""
    if self.policy is None:
      output_states = ()
      for resnet in self.resnets:
        hidden_states = resnet(hidden_states, temb)
        output_states += (hidden_states,)
    else:
      hidden_states, stacked = self.resnets(hidden_states, temb)
    extra = ()
    if self.add_downsample:
      hidden_states = self.downsamplers_0(hidden_states)
      extra = (hidden_states,)
    return hidden_states, (output_states + extra if self.policy is None else (stacked, extra))


class FlaxUpBlock2D(nn.Module):
  in_channels: int
  out_channels: int
  prev_output_channel: int
  num_layers: int
  add_upsample: bool
  policy: str | None = None
  remat_policy: Any = None

  def _in_channels(self, i):
    skip = self.in_channels if i == self.num_layers - 1 else self.out_channels
    return (self.prev_output_channel if i == 0 else self.out_channels) + skip

  def setup(self):
    n = self.num_layers
    if self.policy is None:
      resnet = _maybe_remat(self.remat_policy)
      self.resnets = [resnet(self._in_channels(i), self.out_channels) for i in range(n)]
    else:  # the first n - 1 take this level's stacked skips; the last (conv_in's or the
      # downsampler's skip) stays outside, under its untouched name
      self.resnets = remat.LayerStack(ConcatResnet, n - 1, self.policy, block_kwargs={
          'in_channels': self._in_channels(0), 'out_channels': self.out_channels})
      self.last = FlaxResnetBlock2D(self._in_channels(n - 1), self.out_channels,
                                    name=f'resnets_{n - 1}')
    if self.add_upsample:
      self.upsamplers_0 = FlaxUpsample2D(self.out_channels)

  def __call__(self, hidden_states, res_hidden_states_tuple, temb):
    if self.policy is None:
      for resnet in self.resnets:
        res_hidden_states = res_hidden_states_tuple[-1]
        res_hidden_states_tuple = res_hidden_states_tuple[:-1]
        hidden_states = jnp.concatenate((hidden_states, res_hidden_states), axis=-1)
        hidden_states = resnet(hidden_states, temb)
    else:  # (stacked skips of the matching down block, the skip before them)
      stacked, before = res_hidden_states_tuple
      hidden_states = self.resnets(hidden_states, temb, xs=stacked[::-1])
      hidden_states = self.last(jnp.concatenate((hidden_states, before), axis=-1), temb)
    if self.add_upsample:
      hidden_states = self.upsamplers_0(hidden_states)
    return hidden_states


class FlaxUNet2D(nn.Module):
  """``policy`` None: the untouched model; else each level's resnets on `remat.LayerStack`s."""
  cfg: Config
  policy: str | None = None
  remat_policy: Any = None

  def setup(self):
    cfg, ch = self.cfg, self.cfg.block_out_channels
    self.conv_in = _conv(ch[0])
    self.time_embedding = FlaxTimestepEmbedding(ch[0] * 4)
    self.down_blocks = [FlaxDownBlock2D(ch[max(i - 1, 0)], ch[i], cfg.layers_per_block,
                                        add_downsample=i < len(ch) - 1, policy=self.policy,
                                        remat_policy=self.remat_policy)
                        for i in range(len(ch))]
    rev = list(reversed(ch))
    self.up_blocks = [FlaxUpBlock2D(rev[min(i + 1, len(ch) - 1)], rev[i], rev[max(i - 1, 0)],
                                    cfg.layers_per_block + 1, add_upsample=i < len(ch) - 1,
                                    policy=self.policy, remat_policy=self.remat_policy)
                      for i in range(len(ch))]
    self.conv_norm_out = nn.GroupNorm(num_groups=32, epsilon=1e-5)
    self.conv_out = _conv(cfg.out_channels)

  def __call__(self, sample, timesteps):
    t_emb = get_sinusoidal_embeddings(timesteps, self.cfg.block_out_channels[0],
                                      flip_sin_to_cos=True, freq_shift=0)
    t_emb = self.time_embedding(t_emb)
    sample = self.conv_in(jnp.transpose(sample, (0, 2, 3, 1)))
    if self.policy is None:
      down_block_res_samples = (sample,)
      for down_block in self.down_blocks:
        sample, res_samples = down_block(sample, t_emb)
        down_block_res_samples += res_samples
      for up_block in self.up_blocks:
        res_samples = down_block_res_samples[-(self.cfg.layers_per_block + 1):]
        down_block_res_samples = down_block_res_samples[:-(self.cfg.layers_per_block + 1)]
        sample = up_block(sample, res_samples, t_emb)
    else:  # the same skips, grouped per level: its stacked resnet outputs, and the one before
      befores, levels = [sample], []
      for down_block in self.down_blocks:
        sample, (stacked, extra) = down_block(sample, t_emb)
        levels.append(stacked)
        befores += extra
      for up_block, stacked, before in zip(self.up_blocks, levels[::-1], befores[::-1]):
        sample = up_block(sample, (stacked, before), t_emb)
    sample = self.conv_out(nn.silu(self.conv_norm_out(sample)))
    return jnp.transpose(sample, (0, 3, 1, 2))


def ddpm_loss(model, params, batch):
  """The DDPM objective: predict the noise added at a random timestep (linear betas)."""
  images, noise, timesteps = batch
  alphas_cumprod = jnp.cumprod(1.0 - jnp.linspace(1e-4, 0.02, 1000))
  abar = alphas_cumprod[timesteps][:, None, None, None]
  noisy = jnp.sqrt(abar) * images + jnp.sqrt(1 - abar) * noise
  return jnp.mean((model.apply({'params': params}, noisy, timesteps) - noise) ** 2)


def stack(params, layers_per_block: int):
  """The untouched ``resnets_{i}`` stacked: every down resnet, the first N of each up block."""
  params = jax.tree_util.tree_map(lambda a: a, params)  # a copy to pop from
  for key in [k for k in params if k.startswith(('down_blocks_', 'up_blocks_'))]:
    layers = [params[key].pop(f'resnets_{i}') for i in range(layers_per_block)]
    params[key]['resnets'] = {'block': remat.stack_layers(layers)}
  return params


def case(cfg: Config = Config(), batch: int = 8, seed: int = 0):
  from tests.public_models import Case, block_policy
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed + 1), 3)
  images = jax.random.normal(k1, (batch, cfg.in_channels, cfg.sample_size, cfg.sample_size))
  noise = jax.random.normal(k2, images.shape)
  timesteps = jax.random.randint(k3, (batch,), 0, 1000)
  params = FlaxUNet2D(cfg).init(jax.random.PRNGKey(seed), images, timesteps)['params']
  return Case('unet', lambda p, b: ddpm_loss(FlaxUNet2D(cfg), p, b),
              lambda spec: lambda p, b: ddpm_loss(FlaxUNet2D(cfg, spec), p, b),
              params, (images, noise, timesteps), lambda p: stack(p, cfg.layers_per_block),
              cfg.layers_per_block,
              lambda rule: lambda p, b: ddpm_loss(FlaxUNet2D(cfg, remat_policy=block_policy(rule)),
                                                  p, b))
