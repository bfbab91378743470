"""What differs between model families: how a model is built, fed and scored.

A :class:`Task` pairs a model config with its batch format and loss:

* ``gpt`` / ``llama``: batches of token windows ``int32 [B, T + 1]``; next-token
  cross-entropy. Windows packed from several documents (:mod:`training.data.packed_text`)
  are a dict of four ``[B, T + 1]`` arrays, :data:`PACKED_KEYS`: ``tokens``,
  ``segment_ids`` (the document of each token: attention stays within it),
  ``positions`` (restarting at 0 per document) and ``loss_mask`` (1 where the
  token is a target: 0 on a prompt's tokens); a label counts when it is in the
  loss mask and in the same document as its input.
* ``vit`` / ``resnet``: batches ``{'images': float32 [B, S, S, C], 'labels': int32 [B]}``;
  classification cross-entropy, with accuracy as a metric. A held-out batch may add
  ``weights`` (float32 [B]): loss and accuracy are then means over the rows weighted by it,
  so the rows that fill up a set's last batch (weight 0) count for nothing.

``size`` is the sequence length T for the language models and the image side S for vision.
Models whose layers keep state (ResNet's BatchNorm ``batch_stats``) return the
updated state from the loss; the train step carries it in ``TrainState``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from models.chunked_loss import chunked_cross_entropy, loss_chunk_tokens
from models.gpt import GPT, GPTConfig
from models.llama import Llama, LlamaConfig, output_embedding
from models.resnet import ResNet, ResNetConfig
from models.vit import ViT, ViTConfig

# The language models: token windows in, next-token cross-entropy out.
LANGUAGE_ARCHS = ('gpt', 'llama')
ARCH_OF = {GPTConfig: 'gpt', LlamaConfig: 'llama', ViTConfig: 'vit', ResNetConfig: 'resnet'}
_MODELS = {'gpt': GPT, 'llama': Llama, 'vit': ViT, 'resnet': ResNet}
PACKED_KEYS = ('tokens', 'segment_ids', 'positions', 'loss_mask')


@dataclasses.dataclass(frozen=True)
class Task:
  """A model family with one config.

  Attributes:
    config: a GPTConfig, LlamaConfig, ViTConfig or ResNetConfig.
    layout: how the model's layer stacks become a program (:data:`remat.layout.LAYOUTS`);
      the parameters are the same under every layout.
  """
  config: Any
  layout: str = 'auto'

  @property
  def arch(self) -> str:
    return ARCH_OF[type(self.config)]

  @property
  def is_vision(self) -> bool:
    return self.arch not in LANGUAGE_ARCHS

  @property
  def num_layers(self) -> int:
    """Depth of the deepest layer stack (what ``seg:K`` is checked against)."""
    return self.config.num_layers

  @property
  def default_size(self) -> int:
    return self.config.image_size if self.is_vision else self.config.max_len

  def model(self, policy) -> nn.Module:
    return _MODELS[self.arch](self.config, policy, self.layout)

  def at_size(self, size: int) -> 'Task':
    """This task for sequence length / image side ``size``.

    A ViT learns positions for one image side, so a ViT at another side is a
    model with more (or fewer) positions; GPT and ResNet configs are unchanged.

    Raises:
      ValueError: one line, when the size does not fit the model.
    """
    cfg = self.config
    if not self.is_vision:
      if size > cfg.max_len:
        raise ValueError(f'sequence length {size} exceeds the model max_len {cfg.max_len}')
      return self
    if self.arch == 'vit':
      if size % cfg.patch_size:
        raise ValueError(f'image size {size} is not a multiple of the patch size {cfg.patch_size}')
      return Task(dataclasses.replace(cfg, image_size=size), self.layout)
    if size < 32:
      raise ValueError(f'image size {size} is too small for a ResNet; it needs >= 32')
    return self

  def batch_shape(self, batch_size: int, size: int):
    """Abstract batch (ShapeDtypeStructs) of ``batch_size`` examples at ``size``."""
    if not self.is_vision:
      return jax.ShapeDtypeStruct((batch_size, size + 1), jnp.int32)
    return {'images': jax.ShapeDtypeStruct((batch_size, size, size, self.config.channels),
                                           jnp.float32),
            'labels': jax.ShapeDtypeStruct((batch_size,), jnp.int32)}

  def zeros_batch(self, batch_size: int, size: int):
    """A concrete all-zero batch (for timing and device peaks)."""
    return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype),
                                  self.batch_shape(batch_size, size))

  def init_input(self, size: int):
    """The model input used for ``init``: one example at ``size``."""
    if not self.is_vision:
      return jnp.zeros((1, size), jnp.int32)
    return jnp.zeros((1, size, size, self.config.channels), jnp.float32)

  def init_variables(self, model: nn.Module, seed: int, size: int):
    """(params, model_state) from ``model.init``; model_state is ``{}`` without BatchNorm."""
    variables = dict(model.init(jax.random.PRNGKey(seed), self.init_input(size)))
    params = variables.pop('params')
    return params, variables

  def emitted_tags(self, size: int) -> set[str]:
    """The checkpoint names this model emits at ``size`` (traced abstractly; nothing allocated)."""
    from remat.tags import emitted_tags
    model = self.model('none')
    example = self.init_input(size)
    variables = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), example))
    return emitted_tags(lambda v, x: model.apply(v, x), variables,
                        jax.ShapeDtypeStruct(example.shape, example.dtype))

  def loss(self, model: nn.Module, params, model_state, batch, dropout_rng=None):
    """Mean cross-entropy of ``batch``, in training mode when ``dropout_rng`` is given.

    Returns:
      ``(loss, (model_state, metrics))``: the updated model state (BatchNorm
      running averages in training mode, else unchanged) and a dict of metrics.
    """
    train = dropout_rng is not None
    rngs = {'dropout': dropout_rng} if train else None
    variables = {'params': params, **model_state}
    if not self.is_vision:
      return self._lm_loss(model, variables, batch, train, rngs), (dict(model_state), {})
    mutable = list(model_state) if train and model_state else False
    inputs = batch['images']
    out = model.apply(variables, inputs, deterministic=not train, rngs=rngs, mutable=mutable)
    logits, new_state = out if mutable else (out, model_state)
    labels = batch['labels']
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    hit = jnp.argmax(logits, -1) == labels
    if 'weights' in batch:   # an --eval-data folder's batch: every image counted exactly once
      w = batch['weights'].astype(jnp.float32)
      total = jnp.maximum(w.sum(), 1.0)
      return (ce * w).sum() / total, (dict(new_state), {'accuracy': (hit * w).sum() / total})
    return ce.mean(), (dict(new_state), {'accuracy': jnp.mean(hit)})

  def _lm_loss(self, model: nn.Module, variables, windows, train: bool, rngs):
    """Mean next-token cross-entropy of a GPT or Llama over ``windows`` [B, T + 1].

    ``windows`` may be a packed batch (a dict, module docstring): the mean is
    then over the labels that count, and the model gets segment ids and positions.

    The output layer (GPT's tied ``wte``; Llama's tied embedding or untied
    ``lm_head``, in float32) is computed here from the final hidden states: in
    chunks of ``config.loss_chunk`` tokens (:func:`models.chunked_loss.chunked_cross_entropy`:
    the [B*T, V] logits and their gradient never exist), or plainly when the
    vocabulary is small enough that one chunk covers the batch. Same value and
    gradients either way, within float32 rounding.
    """
    extra, weights = {}, None
    if isinstance(windows, dict):
      segs = windows['segment_ids']
      extra = {'segment_ids': segs[:, :-1], 'positions': windows['positions'][:, :-1]}
      weights = ((windows['loss_mask'][:, 1:] > 0) & (segs[:, 1:] == segs[:, :-1])).astype(
          jnp.float32)
      windows = windows['tokens']
    inputs, labels = windows[:, :-1], windows[:, 1:]
    params = variables['params']
    emb = (output_embedding(params, self.config) if self.arch == 'llama'
           else params['wte']['embedding'])
    chunk = loss_chunk_tokens(emb.shape[0], labels.size, self.config.loss_chunk)
    if not chunk:
      logits = model.apply(variables, inputs, deterministic=not train, rngs=rngs, **extra)
      ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
      if weights is None:
        return ce.mean()
      return jnp.sum(ce * weights) / jnp.maximum(jnp.sum(weights), 1.0)
    h = model.apply(variables, inputs, deterministic=not train, rngs=rngs, return_hidden=True,
                    **extra)
    # The float32 embedding cast to the hidden states' dtype at use (a no-op in float32); the
    # loss computes the logits in float32 from those operands.
    return chunked_cross_entropy(h.reshape(-1, h.shape[-1]), emb.astype(h.dtype),
                                 labels.reshape(-1), chunk,
                                 None if weights is None else weights.reshape(-1),
                                 emb_grad=self.config.lora is None)   # a LoRA base is frozen
