"""ResNet (He et al., 2016; v1.5 strides) in Flax linen, each stage stacked by :class:`remat.LayerStack`.

A stage is one downsampling *first* block followed by ``depth - 1`` identical
blocks. Both parts go through the layer stack (the first block as a stack of
one), so a remat policy applies per block, ``sqrt``/``seg:K`` segment the
identical blocks of each stage, and ``stage`` checkpoints each part whole so
that a stage keeps only its input and its first block's output.

BatchNorm runs on batch statistics in training (``deterministic=False``,
``batch_stats`` mutable) and on running averages otherwise.

Parameter names follow Hugging Face's ``ResNetForImageClassification``
(index ``j`` of the stacked leaves under ``stages_{s}_layers/block`` is HF's
layer ``j + 1``; ``stages_{s}_first/block`` holds layer 0 with a leading axis
of 1)::

    embedder/{convolution,normalization}     resnet.embedder.embedder.{convolution,normalization}
    stages_{s}_first/block/shortcut/...      resnet.encoder.stages.{s}.layers.0.shortcut
    stages_{s}_first/block/layer_{k}/...     resnet.encoder.stages.{s}.layers.0.layer.{k}
    stages_{s}_layers/block/layer_{k}/...    resnet.encoder.stages.{s}.layers.{j + 1}.layer.{k}
    classifier                               classifier.1

Convolution outputs are tagged where they are created (:data:`TAGS`).

``ResNetConfig.dtype`` is the compute dtype (docs/precision.md): parameters and
BatchNorm's running statistics are float32 under either dtype; convolutions run
in ``dtype`` on parameters cast at use, so activations and the saved residuals
are in ``dtype``; BatchNorm's batch statistics are float32 (and the loss, in
``models.tasks``).
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from models.layers import check_dtype
from remat.policies import Policy, get_policy
from remat.stack import LayerStack

TAGS = {
    'conv1': 'first conv of a block, before BatchNorm (bottleneck: 1x1 reduce, [B, H, W, C/4])',
    'conv2': 'second conv of a block (bottleneck: the 3x3 at reduced width, [B, H, W, C/4])',
    'conv3': 'third conv of a bottleneck block (1x1 expand, [B, H, W, C]); basic blocks have none',
    'shortcut': 'projection-shortcut conv of a stage\'s first block, [B, H, W, C]',
}

# ResNet-N: (layer_type, blocks per stage), as in HF's microsoft/resnet-N configs.
DEPTHS = {
    18: ('basic', (2, 2, 2, 2)),
    34: ('basic', (3, 4, 6, 3)),
    50: ('bottleneck', (3, 4, 6, 3)),
    101: ('bottleneck', (3, 4, 23, 3)),
    152: ('bottleneck', (3, 8, 36, 3)),
}


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
  """Shape of a ResNet classifier; field names follow HF ``ResNetConfig``.

  Attributes:
    embedding_size: stem width (the 7x7 stride-2 conv).
    hidden_sizes: output width of each stage (bottleneck blocks work at a quarter of it).
    depths: blocks per stage.
    layer_type: 'bottleneck' (ResNet-50/101/152) or 'basic' (ResNet-18/34).
    num_classes: classifier outputs (HF ``num_labels``).
    channels: input channels (HF ``num_channels``).
    image_size: default training side; the network takes any side >= 32.
    bn_momentum: running-average decay of BatchNorm (torch's momentum 0.1 is 0.9 here).
    bn_eps: BatchNorm epsilon.
    dtype: compute dtype, 'float32' or 'bfloat16' (parameters and running
      statistics stay float32; docs/precision.md).
  """
  embedding_size: int = 64
  hidden_sizes: tuple[int, ...] = (256, 512, 1024, 2048)
  depths: tuple[int, ...] = (3, 4, 6, 3)
  layer_type: str = 'bottleneck'
  num_classes: int = 10
  channels: int = 3
  image_size: int = 224
  bn_momentum: float = 0.9
  bn_eps: float = 1e-5
  dtype: str = 'float32'

  def __post_init__(self):
    # JSON gives lists; the config must stay hashable.
    object.__setattr__(self, 'hidden_sizes', tuple(self.hidden_sizes))
    object.__setattr__(self, 'depths', tuple(self.depths))
    if self.layer_type not in ('basic', 'bottleneck'):
      raise ValueError(f"ResNetConfig.layer_type must be 'basic' or 'bottleneck', got "
                       f"'{self.layer_type}'")
    if not self.depths or len(self.depths) != len(self.hidden_sizes):
      raise ValueError(f'ResNetConfig.depths {self.depths} and hidden_sizes {self.hidden_sizes} '
                       'must be non-empty and of equal length')
    if min(self.depths) < 1 or min(self.hidden_sizes) < 1:
      raise ValueError('ResNetConfig.depths and hidden_sizes must be >= 1')
    if self.layer_type == 'bottleneck' and any(h % 4 for h in self.hidden_sizes):
      raise ValueError(f'ResNetConfig.hidden_sizes {self.hidden_sizes} must be multiples of 4 '
                       'for bottleneck blocks')
    for f in ('embedding_size', 'num_classes', 'channels'):
      if getattr(self, f) < 1:
        raise ValueError(f'ResNetConfig.{f} must be >= 1, got {getattr(self, f)}')
    if self.image_size < 32:
      raise ValueError(f'ResNetConfig.image_size must be >= 32, got {self.image_size}')
    check_dtype('ResNetConfig', self.dtype)

  @classmethod
  def from_depth(cls, depth: int, **kwargs) -> 'ResNetConfig':
    """The standard ResNet-``depth`` (18, 34, 50, 101 or 152)."""
    if depth not in DEPTHS:
      raise ValueError(f'no standard ResNet-{depth}; valid depths: {", ".join(map(str, DEPTHS))}')
    layer_type, depths = DEPTHS[depth]
    sizes = (64, 128, 256, 512) if layer_type == 'basic' else (256, 512, 1024, 2048)
    return cls(hidden_sizes=sizes, depths=depths, layer_type=layer_type, **kwargs)

  @property
  def num_layers(self) -> int:
    """Blocks in the deepest stack of identical blocks (what ``seg:K`` is checked against)."""
    return max(1, max(self.depths) - 1)


@jax.custom_vjp
def max_pool_3x3_s2(x):
  """The stem's 3x3 stride-2 max pool with padding 1 (torch's), NHWC.

  Its gradient is written out because JAX's (``select_and_scatter``) expands on
  the XLA CPU backend into index tensors of the input's size: 3.6 GiB of
  temporaries for ResNet-50's stem at 1024 px, batch 8, against 0.6 GiB here.
  The gradient is the same: each output's cotangent goes to the first maximum
  of its window in row-major order, as in torch.
  """
  return nn.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))


def _max_pool_fwd(x):
  y = max_pool_3x3_s2(x)
  return y, (x, y)


def _max_pool_bwd(res, g):
  x, y = res
  h, w = x.shape[1:3]
  ho, wo = y.shape[1:3]
  xp = jnp.pad(x, ((0, 0), (1, 2), (1, 2), (0, 0)), constant_values=-jnp.inf)
  hp, wp = xp.shape[1:3]
  zero = jnp.zeros((), g.dtype)
  taken = jnp.zeros(y.shape, bool)
  dxp = 0
  for i in range(3):
    for j in range(3):
      hit = (xp[:, i:i + 2 * ho:2, j:j + 2 * wo:2, :] == y) & ~taken
      taken = taken | hit
      # Stride-2 scatter as interior padding: XLA fuses the nine pads into one sum.
      cfg = ((0, 0, 0), (i, hp - i - 2 * ho + 1, 1), (j, wp - j - 2 * wo + 1, 1), (0, 0, 0))
      dxp = dxp + jax.lax.pad(jnp.where(hit, g, zero), zero, cfg)
  return (dxp[:, 1:h + 1, 1:w + 1, :],)


max_pool_3x3_s2.defvjp(_max_pool_fwd, _max_pool_bwd)


class ConvLayer(nn.Module):
  """Conv (no bias) -> BatchNorm -> optional ReLU; the conv output is tagged ``tag``."""
  features: int
  kernel: int
  stride: int
  tag: str | None
  config: ResNetConfig
  train: bool
  relu: bool = True

  @nn.compact
  def __call__(self, x):
    k, cfg = self.kernel, self.config
    # Symmetric k//2 padding as in torch; 'SAME' would pad stride-2 convs asymmetrically.
    x = nn.Conv(self.features, (k, k), (self.stride, self.stride), padding=[(k // 2, k // 2)] * 2,
                use_bias=False, name='convolution', dtype=cfg.dtype,
                kernel_init=nn.initializers.variance_scaling(2.0, 'fan_out', 'normal'))(x)
    if self.tag:
      x = checkpoint_name(x, self.tag)
    # Flax reduces the batch statistics in float32 (force_float32_reductions) and keeps
    # the running ones float32 (param_dtype); dtype is the output's.
    x = nn.BatchNorm(use_running_average=not self.train, momentum=self.config.bn_momentum,
                     epsilon=cfg.bn_eps, dtype=cfg.dtype, name='normalization')(x)
    return nn.relu(x) if self.relu else x


class Block(nn.Module):
  """A basic or bottleneck residual block, in the layer-stack convention (x, rng) -> (x, None).

  Attributes:
    config: the model config (block type).
    features: output width.
    stride: spatial stride (on the 3x3 conv, v1.5).
    shortcut: True for a projection shortcut (width or stride changes).
    train: BatchNorm on batch statistics, updating its running averages.
  """
  config: ResNetConfig
  features: int
  stride: int = 1
  shortcut: bool = False
  train: bool = False

  @nn.compact
  def __call__(self, x, rng):
    del rng  # no dropout in a ResNet
    conv = functools.partial(ConvLayer, config=self.config, train=self.train)
    residual = x
    if self.shortcut:
      residual = conv(self.features, 1, self.stride, 'shortcut', relu=False, name='shortcut')(x)
    if self.config.layer_type == 'bottleneck':
      narrow = self.features // 4
      h = conv(narrow, 1, 1, 'conv1', name='layer_0')(x)
      h = conv(narrow, 3, self.stride, 'conv2', name='layer_1')(h)
      h = conv(self.features, 1, 1, 'conv3', relu=False, name='layer_2')(h)
    else:
      h = conv(self.features, 3, self.stride, 'conv1', name='layer_0')(x)
      h = conv(self.features, 3, 1, 'conv2', relu=False, name='layer_1')(h)
    return nn.relu(h + residual), None


class ResNet(nn.Module):
  """ResNet classifier returning logits [B, num_classes] for images [B, H, W, C].

  Attributes:
    config: model shape.
    policy: remat policy (a :class:`~remat.policies.Policy` or a spec string).

  Call with ``deterministic=False`` to train: BatchNorm then uses batch
  statistics, and ``batch_stats`` must be mutable.
  """
  config: ResNetConfig
  policy: Policy | str = 'none'
  layout: str = 'auto'   # how the stacks become a program (remat.layout.LAYOUTS)

  @nn.compact
  def __call__(self, images, *, deterministic: bool = True):
    cfg = self.config
    train = not deterministic
    policy = get_policy(self.policy, num_layers=cfg.num_layers)
    if images.ndim != 4 or images.shape[-1] != cfg.channels or min(images.shape[1:3]) < 32:
      raise ValueError(f'images of shape {tuple(images.shape)} do not fit this ResNet; it takes '
                       f'[B, H, W, {cfg.channels}] with H, W >= 32')
    x = ConvLayer(cfg.embedding_size, 7, 2, None, cfg, train, name='embedder')(images)
    x = max_pool_3x3_s2(x)
    width = cfg.embedding_size
    for s, (features, depth) in enumerate(zip(cfg.hidden_sizes, cfg.depths)):
      stride = 1 if s == 0 else 2
      first = dict(config=cfg, features=features, stride=stride, train=train,
                   shortcut=width != features or stride != 1)
      # Stacks differ in depth and tags ('shortcut'): the policy is checked model-wide
      # (above for depth, by Task.emitted_tags for tags).
      x = LayerStack(Block, 1, policy, block_kwargs=first, strict=False,
                     name=f'stages_{s}_first', layout=self.layout)(x)
      if depth > 1:
        rest = dict(config=cfg, features=features, train=train)
        x = LayerStack(Block, depth - 1, policy, block_kwargs=rest, strict=False,
                       name=f'stages_{s}_layers', layout=self.layout)(x)
      width = features
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(cfg.num_classes, dtype=cfg.dtype, name='classifier')(x)
