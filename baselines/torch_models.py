"""Hugging Face PyTorch models with the shapes of our configs, their blocks, and seeded batches.

Each builder takes the ``"model"`` section of one of our JSON configs (a dict)
and maps the fields it knows onto the Hugging Face config; other fields are
ignored, and a missing field takes the default of our Flax dataclass
(``models/gpt.py``, ``models/vit.py``, ``models/resnet.py``)::

    gpt2: GPT2LMHeadModel
        vocab_size, max_len -> n_positions, num_layers -> n_layer, num_heads -> n_head,
        d_model -> n_embd, dropout -> embd_pdrop = attn_pdrop = resid_pdrop,
        layer_norm_eps -> layer_norm_epsilon
        (MLP 4 * d_model, 'gelu_new', tied embeddings: HF's defaults)
    llama: LlamaForCausalLM
        vocab_size, d_model -> hidden_size, num_layers -> num_hidden_layers,
        num_heads -> num_attention_heads, num_kv_heads -> num_key_value_heads,
        mlp_dim -> intermediate_size, max_len -> max_position_embeddings, rms_norm_eps,
        rope_theta, rope_scaling (llama3), tie_embeddings -> tie_word_embeddings
        (silu, no biases; float32 whatever our config's dtype)
    vit: ViTForImageClassification
        image_size, patch_size, channels -> num_channels, num_classes -> num_labels,
        num_layers -> num_hidden_layers, num_heads -> num_attention_heads,
        d_model -> hidden_size, mlp_dim -> intermediate_size, dropout -> hidden_dropout_prob,
        attention_dropout -> attention_probs_dropout_prob, layer_norm_eps
        (hidden_act 'gelu', qkv_bias True)
    resnet: ResNetForImageClassification
        embedding_size, hidden_sizes, depths, layer_type, num_classes -> num_labels,
        channels -> num_channels
        (downsample_in_first_stage and downsample_in_bottleneck False; image_size is only
        the default input side; bn_momentum and bn_eps are ignored: HF's BatchNorm has
        torch's defaults, momentum 0.1 and eps 1e-5, which are our defaults 0.9 and 1e-5)

Models are float32, in train mode (dropout at the config's rates), with
weights drawn after ``torch.manual_seed(seed)``. Attention is HF's ``sdpa``
by default; on CPU with attention dropout > 0 torch runs it as explicit
matmuls and softmax (the math path), so the scores are materialised.
"""

from __future__ import annotations

import torch
import transformers

MODELS = ('gpt2', 'llama', 'vit', 'resnet')
# The models fed token sequences (the others take images).
LANGUAGE_MODELS = ('gpt2', 'llama')
MODEL_CLASSES = {
    'gpt2': transformers.GPT2LMHeadModel,
    'llama': transformers.LlamaForCausalLM,
    'vit': transformers.ViTForImageClassification,
    'resnet': transformers.ResNetForImageClassification,
}

# Defaults of our Flax dataclasses, for fields a config leaves out.
GPT_DEFAULTS = {'vocab_size': 256, 'max_len': 256, 'num_layers': 6, 'num_heads': 4, 'd_model': 128,
                'dropout': 0.1, 'layer_norm_eps': 1e-5}
LLAMA_DEFAULTS = {'vocab_size': 256, 'd_model': 128, 'num_layers': 4, 'num_heads': 4,
                  'num_kv_heads': 2, 'mlp_dim': 384, 'max_len': 256, 'rms_norm_eps': 1e-5,
                  'rope_theta': 10000.0, 'rope_scaling': None, 'tie_embeddings': True}
VIT_DEFAULTS = {'image_size': 32, 'patch_size': 4, 'channels': 3, 'num_classes': 10,
                'num_layers': 6, 'num_heads': 4, 'd_model': 128, 'mlp_dim': 512, 'dropout': 0.0,
                'attention_dropout': 0.0, 'layer_norm_eps': 1e-12}
RESNET_DEFAULTS = {'embedding_size': 64, 'hidden_sizes': (256, 512, 1024, 2048),
                   'depths': (3, 4, 6, 3), 'layer_type': 'bottleneck', 'num_classes': 10,
                   'channels': 3, 'image_size': 224}


def check_model(model: str) -> str:
  """Returns ``model`` if it is a known model name.

  Raises:
    ValueError: one line listing the valid names.
  """
  if model not in MODELS:
    raise ValueError(f"unknown model '{model}'; valid models: {', '.join(MODELS)}")
  return model


def _with_defaults(fields: dict, defaults: dict) -> dict:
  return {k: fields.get(k, v) for k, v in defaults.items()}


def gpt2_config(fields: dict, attn_implementation: str = 'sdpa') -> transformers.GPT2Config:
  """HF ``GPT2Config`` for our GPT fields (unknown fields ignored)."""
  f = _with_defaults(fields, GPT_DEFAULTS)
  last = f['vocab_size'] - 1  # HF's gpt2 uses its last token (50256) as BOS/EOS
  return transformers.GPT2Config(
      vocab_size=f['vocab_size'], n_positions=f['max_len'], n_layer=f['num_layers'],
      n_head=f['num_heads'], n_embd=f['d_model'], n_inner=None, activation_function='gelu_new',
      embd_pdrop=f['dropout'], attn_pdrop=f['dropout'], resid_pdrop=f['dropout'],
      layer_norm_epsilon=f['layer_norm_eps'], tie_word_embeddings=True, use_cache=False,
      bos_token_id=last, eos_token_id=last, attn_implementation=attn_implementation)


def llama_config(fields: dict, attn_implementation: str = 'sdpa') -> transformers.LlamaConfig:
  """HF ``LlamaConfig`` for our Llama fields (unknown ones, dtype and loss_chunk ignored)."""
  f = _with_defaults(fields, LLAMA_DEFAULTS)
  scaling = f['rope_scaling']
  if scaling is not None:  # a dict (dataclasses.asdict of our RopeScaling)
    scaling = {'rope_type': 'llama3', **scaling}
  last = f['vocab_size'] - 1
  return transformers.LlamaConfig(
      vocab_size=f['vocab_size'], hidden_size=f['d_model'], intermediate_size=f['mlp_dim'],
      num_hidden_layers=f['num_layers'], num_attention_heads=f['num_heads'],
      num_key_value_heads=f['num_kv_heads'], max_position_embeddings=f['max_len'],
      rms_norm_eps=f['rms_norm_eps'], rope_theta=f['rope_theta'], rope_scaling=scaling,
      tie_word_embeddings=f['tie_embeddings'], hidden_act='silu', attention_bias=False,
      mlp_bias=False, use_cache=False, bos_token_id=last, eos_token_id=last, pad_token_id=None,
      attn_implementation=attn_implementation)


def vit_config(fields: dict, image_size: int | None = None,
               attn_implementation: str = 'sdpa') -> transformers.ViTConfig:
  """HF ``ViTConfig`` for our ViT fields; ``image_size`` (if given) replaces the config's."""
  f = _with_defaults(fields, VIT_DEFAULTS)
  return transformers.ViTConfig(
      image_size=image_size or f['image_size'], patch_size=f['patch_size'],
      num_channels=f['channels'], num_labels=f['num_classes'], num_hidden_layers=f['num_layers'],
      num_attention_heads=f['num_heads'], hidden_size=f['d_model'],
      intermediate_size=f['mlp_dim'], hidden_act='gelu', hidden_dropout_prob=f['dropout'],
      attention_probs_dropout_prob=f['attention_dropout'], layer_norm_eps=f['layer_norm_eps'],
      qkv_bias=True, problem_type='single_label_classification',
      attn_implementation=attn_implementation)


def resnet_config(fields: dict) -> transformers.ResNetConfig:
  """HF ``ResNetConfig`` for our ResNet fields (``image_size``, ``bn_*``, others ignored)."""
  f = _with_defaults(fields, RESNET_DEFAULTS)
  return transformers.ResNetConfig(
      num_channels=f['channels'], embedding_size=f['embedding_size'],
      hidden_sizes=list(f['hidden_sizes']), depths=list(f['depths']), layer_type=f['layer_type'],
      hidden_act='relu', downsample_in_first_stage=False, downsample_in_bottleneck=False,
      num_labels=f['num_classes'], problem_type='single_label_classification')


def input_shape(model: str, fields: dict, seq_len: int | None = None,
                image_size: int | None = None) -> tuple[int | None, int | None]:
  """``(seq_len, image_size)`` of the model's input, defaults filled in and checked.

  GPT-2 and Llama take ``seq_len`` (default: the config's ``max_len``) and no image
  size; ViT and ResNet take ``image_size`` (default: the config's) and no
  sequence length.

  Raises:
    ValueError: unknown model, a sequence longer than ``max_len``, or an image
      side that the model cannot take (ViT: not a multiple of ``patch_size``).
  """
  check_model(model)
  if model in LANGUAGE_MODELS:
    defaults = GPT_DEFAULTS if model == 'gpt2' else LLAMA_DEFAULTS
    max_len = fields.get('max_len', defaults['max_len'])
    seq_len = seq_len or max_len
    if not 1 <= seq_len <= max_len:
      raise ValueError(f'seq_len {seq_len} must be in 1..{max_len} (the model max_len)')
    return seq_len, None
  defaults = VIT_DEFAULTS if model == 'vit' else RESNET_DEFAULTS
  image_size = image_size or fields.get('image_size', defaults['image_size'])
  if model == 'vit':
    patch = fields.get('patch_size', VIT_DEFAULTS['patch_size'])
    if image_size % patch:
      raise ValueError(f'image_size {image_size} must be a multiple of patch_size {patch}')
  elif image_size < 32:
    raise ValueError(f'image_size {image_size} must be >= 32 for ResNet')
  return None, image_size


def build_model(model: str, fields: dict, *, image_size: int | None = None, seed: int = 0,
                device: str | torch.device = 'cpu',
                attn_implementation: str = 'sdpa') -> torch.nn.Module:
  """The HF model for ``model`` ('gpt2' | 'llama' | 'vit' | 'resnet') with our config's shape.

  Args:
    model: model name, one of :data:`MODELS`.
    fields: the ``"model"`` dict of one of our JSON configs.
    image_size: ViT only: the side its learned positions are made for
      (default: the config's ``image_size``); ignored by the others.
    seed: ``torch.manual_seed`` before the weights are drawn (sets torch's global seed).
    device: where the float32 weights live.
    attn_implementation: HF attention backend for GPT-2, Llama and ViT ('sdpa' or 'eager').

  Returns:
    The model in train mode.

  Raises:
    ValueError: unknown model name (one line listing the valid names).
  """
  check_model(model)
  if model == 'gpt2':
    config = gpt2_config(fields, attn_implementation)
  elif model == 'llama':
    config = llama_config(fields, attn_implementation)
  elif model == 'vit':
    _, image_size = input_shape('vit', fields, image_size=image_size)
    config = vit_config(fields, image_size, attn_implementation)
  else:
    config = resnet_config(fields)
  torch.manual_seed(seed)
  net = MODEL_CLASSES[model](config).to(device=device, dtype=torch.float32)
  # The loss this model computes from ``labels`` (named so HF does not guess and warn).
  net.loss_type = 'ForCausalLM' if model in LANGUAGE_MODELS else 'ForImageClassification'
  return net.train()


def blocks(model: str, net: torch.nn.Module) -> list[torch.nn.Module]:
  """The model's repeated blocks in execution order, the unit the policy families checkpoint.

  GPT-2: ``transformer.h[i]``; Llama: ``model.layers[i]``; ViT: ``vit.layers[i]``
  (``vit.encoder.layer[i]``
  in transformers 4.x); ResNet: every layer of every stage,
  ``resnet.encoder.stages[s].layers[j]``, flattened in order.
  """
  check_model(model)
  if model == 'gpt2':
    return list(net.transformer.h)
  if model == 'llama':
    return list(net.model.layers)
  if model == 'vit':
    vit = net.vit
    return list(vit.layers if hasattr(vit, 'layers') else vit.encoder.layer)
  return [layer for stage in net.resnet.encoder.stages for layer in stage.layers]


def make_batch(model: str, fields: dict, batch_size: int, seq_len: int | None = None,
               image_size: int | None = None, seed: int = 0,
               device: str | torch.device = 'cpu') -> dict[str, torch.Tensor]:
  """Seeded random inputs and labels: ``model(**batch).loss`` is the training loss.

  GPT-2 and Llama: ``input_ids`` uniform over the vocabulary, [B, L], and
  ``labels = input_ids`` (HF shifts them: next-token cross-entropy over
  B x (L - 1) positions). ViT and ResNet: ``pixel_values`` standard normal,
  [B, C, S, S] float32, and ``labels`` uniform over the classes, [B]
  (cross-entropy). The same seed gives the same batch; torch's global RNG is
  not touched.
  """
  seq_len, image_size = input_shape(model, fields, seq_len, image_size)
  gen = torch.Generator().manual_seed(seed)
  if model in LANGUAGE_MODELS:
    vocab = fields.get('vocab_size', (GPT_DEFAULTS if model == 'gpt2' else
                                      LLAMA_DEFAULTS)['vocab_size'])
    ids = torch.randint(0, vocab, (batch_size, seq_len), generator=gen)
    return {'input_ids': ids.to(device), 'labels': ids.to(device)}
  defaults = VIT_DEFAULTS if model == 'vit' else RESNET_DEFAULTS
  channels = fields.get('channels', defaults['channels'])
  classes = fields.get('num_classes', defaults['num_classes'])
  pixels = torch.randn((batch_size, channels, image_size, image_size), generator=gen)
  labels = torch.randint(0, classes, (batch_size,), generator=gen)
  return {'pixel_values': pixels.to(device), 'labels': labels.to(device)}
