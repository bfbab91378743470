"""Our ViT and ResNet variables -> a Hugging Face ``save_pretrained`` folder.

The inverses of :func:`models.hf.layout.vit_variables` and
:func:`models.hf.layout.resnet_variables`: a writer takes our variables and
config and returns the ``transformers`` state dict (numpy, HF names and torch
layouts: Dense kernels ``[in, out]`` -> Linear weights ``[out, in]``, conv
kernels HWIO -> OIHW, stacked layers unstacked) and the ``config.json``
fields of ``ViTForImageClassification`` / ``ResNetForImageClassification``.
:func:`image_processor_files` writes the ``preprocessor_config.json`` that
resizes, rescales and normalises as the run did; :func:`write_folder` writes a
whole folder (used by ``python -m training.export`` through its writer
registry, and by the tests).

A config that ``transformers`` cannot express (a ResNet BatchNorm epsilon other
than torch's 1e-5) is an :class:`ExportError` with one line, not a folder that
loads and computes something else.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Sequence

import numpy as np

from models.resnet import ResNetConfig
from models.vit import ViTConfig


class ExportError(ValueError):
  """A model or folder that cannot be exported; the message is one line."""


def _np(a) -> np.ndarray:
  return np.ascontiguousarray(np.asarray(a, np.float32))


def _linear(kernel) -> np.ndarray:  # Dense kernel [in, out] -> torch Linear weight [out, in]
  return _np(np.swapaxes(np.asarray(kernel), -1, -2))


def _oihw(kernel) -> np.ndarray:    # Flax conv HWIO -> torch Conv2d OIHW
  return _np(np.transpose(np.asarray(kernel), (3, 2, 0, 1)))


def _labels(num_classes: int, classes: Sequence[str] | None) -> dict:
  """id2label / label2id: the data's class names, else transformers' LABEL_i."""
  names = list(classes) if classes is not None else [f'LABEL_{i}' for i in range(num_classes)]
  if len(names) != num_classes:
    raise ExportError(f'{len(names)} class names for a classifier of {num_classes} outputs')
  if len(set(names)) != len(names):
    raise ExportError(f'class names are not unique: {names[:8]}')
  return {'id2label': {str(i): n for i, n in enumerate(names)},
          'label2id': {n: i for i, n in enumerate(names)}}


def vit_writer(variables, config: ViTConfig,
               classes: Sequence[str] | None = None) -> tuple[dict[str, np.ndarray], dict]:
  """Our ViT variables -> (ViTForImageClassification state dict, config.json fields).

  Args:
    variables: ``{'params': ...}`` of :class:`models.vit.ViT` for ``config``.
    config: its config; ``image_size`` is the size the positions are for.
    classes: class names, label ``i`` first-to-last (default LABEL_i).
  """
  p = variables['params']
  emb, blk = p['embeddings'], p['encoder']['block']
  sd = {'vit.embeddings.cls_token': _np(emb['cls_token']),
        'vit.embeddings.position_embeddings': _np(emb['position_embeddings']),
        'vit.embeddings.patch_embeddings.projection.weight': _oihw(emb['patch']['kernel']),
        'vit.embeddings.patch_embeddings.projection.bias': _np(emb['patch']['bias'])}
  dense = {'attention/query': 'attention.attention.query',
           'attention/key': 'attention.attention.key',
           'attention/value': 'attention.attention.value',
           'attention/output': 'attention.output.dense',
           'intermediate': 'intermediate.dense', 'output': 'output.dense'}
  for i in range(config.num_layers):
    layer = f'vit.encoder.layer.{i}.'
    for ours, hf in dense.items():
      node = blk
      for key in ours.split('/'):
        node = node[key]
      sd[f'{layer}{hf}.weight'] = _linear(node['kernel'][i])
      sd[f'{layer}{hf}.bias'] = _np(node['bias'][i])
    for ln in ('layernorm_before', 'layernorm_after'):
      sd[f'{layer}{ln}.weight'] = _np(blk[ln]['scale'][i])
      sd[f'{layer}{ln}.bias'] = _np(blk[ln]['bias'][i])
  sd['vit.layernorm.weight'] = _np(p['layernorm']['scale'])
  sd['vit.layernorm.bias'] = _np(p['layernorm']['bias'])
  sd['classifier.weight'] = _linear(p['classifier']['kernel'])
  sd['classifier.bias'] = _np(p['classifier']['bias'])
  hf = {'architectures': ['ViTForImageClassification'], 'model_type': 'vit',
        'hidden_size': config.d_model, 'num_hidden_layers': config.num_layers,
        'num_attention_heads': config.num_heads, 'intermediate_size': config.mlp_dim,
        'hidden_act': 'gelu', 'hidden_dropout_prob': config.dropout,
        'attention_probs_dropout_prob': config.attention_dropout, 'initializer_range': 0.02,
        'layer_norm_eps': config.layer_norm_eps, 'image_size': config.image_size,
        'patch_size': config.patch_size, 'num_channels': config.channels, 'qkv_bias': True,
        'encoder_stride': config.patch_size, **_labels(config.num_classes, classes)}
  return sd, hf


def _conv_layer(sd: dict, hf: str, params, stats, i: int | None):
  """A ConvLayer (conv + BatchNorm), layer ``i`` of a stack (None: not stacked)."""
  pick = (lambda a: a) if i is None else (lambda a: np.asarray(a)[i])
  sd[f'{hf}.convolution.weight'] = _oihw(pick(params['convolution']['kernel']))
  norm, run = params['normalization'], stats['normalization']
  sd[f'{hf}.normalization.weight'] = _np(pick(norm['scale']))
  sd[f'{hf}.normalization.bias'] = _np(pick(norm['bias']))
  sd[f'{hf}.normalization.running_mean'] = _np(pick(run['mean']))
  sd[f'{hf}.normalization.running_var'] = _np(pick(run['var']))
  sd[f'{hf}.normalization.num_batches_tracked'] = np.zeros((), np.int64)


def resnet_writer(variables, config: ResNetConfig,
                  classes: Sequence[str] | None = None) -> tuple[dict[str, np.ndarray], dict]:
  """Our ResNet variables (params and batch_stats) -> (ResNetForImageClassification state dict,
  config.json fields). See :func:`vit_writer`.

  Raises:
    ExportError: a BatchNorm epsilon transformers' ResNet cannot take (it is fixed at 1e-5).
  """
  if config.bn_eps != 1e-5:
    raise ExportError(f"a ResNet with bn_eps {config.bn_eps} cannot be exported: transformers' "
                      'ResNet uses BatchNorm epsilon 1e-5')
  p, s = variables['params'], variables['batch_stats']
  sd: dict[str, np.ndarray] = {}
  _conv_layer(sd, 'resnet.embedder.embedder', p['embedder'], s['embedder'], None)
  convs = 3 if config.layer_type == 'bottleneck' else 2
  for st, depth in enumerate(config.depths):
    stage = f'resnet.encoder.stages.{st}.layers.'
    first, first_s = p[f'stages_{st}_first']['block'], s[f'stages_{st}_first']['block']
    if 'shortcut' in first:
      _conv_layer(sd, f'{stage}0.shortcut', first['shortcut'], first_s['shortcut'], 0)
    for k in range(convs):
      _conv_layer(sd, f'{stage}0.layer.{k}', first[f'layer_{k}'], first_s[f'layer_{k}'], 0)
    if depth > 1:
      rest, rest_s = p[f'stages_{st}_layers']['block'], s[f'stages_{st}_layers']['block']
      for j in range(depth - 1):
        for k in range(convs):
          _conv_layer(sd, f'{stage}{j + 1}.layer.{k}', rest[f'layer_{k}'], rest_s[f'layer_{k}'], j)
  sd['classifier.1.weight'] = _linear(p['classifier']['kernel'])
  sd['classifier.1.bias'] = _np(p['classifier']['bias'])
  hf = {'architectures': ['ResNetForImageClassification'], 'model_type': 'resnet',
        'embedding_size': config.embedding_size, 'hidden_sizes': list(config.hidden_sizes),
        'depths': list(config.depths), 'layer_type': config.layer_type, 'hidden_act': 'relu',
        'downsample_in_first_stage': False, 'downsample_in_bottleneck': False,
        'num_channels': config.channels, **_labels(config.num_classes, classes)}
  return sd, hf


WRITERS = {'vit': vit_writer, 'resnet': resnet_writer}


def image_processor_config(image_size: int, mean: Sequence[float],
                           std: Sequence[float]) -> dict:
  """``preprocessor_config.json`` for ``ViTImageProcessor``: resize to the side (bilinear),
  rescale by 1/255, normalise by ``mean``/``std``: the run's validation transform for a
  square image (a non-square one is squashed by the processor, centre-cropped by the run)."""
  return {'image_processor_type': 'ViTImageProcessor', 'do_resize': True,
          'size': {'height': image_size, 'width': image_size}, 'resample': 2,
          'do_rescale': True, 'rescale_factor': 1 / 255, 'do_normalize': True,
          'image_mean': [float(v) for v in mean], 'image_std': [float(v) for v in std]}


def image_processor_files(out_dir, image_size: int, mean: Sequence[float],
                          std: Sequence[float]) -> list[Path]:
  """Writes ``preprocessor_config.json`` into ``out_dir``; returns the files written."""
  file = Path(out_dir) / 'preprocessor_config.json'
  file.write_text(json.dumps(image_processor_config(image_size, mean, std), indent=2) + '\n')
  return [file]


def write_folder(out_dir, arch: str, variables, config, data: dict) -> Path:
  """Writes a whole ``save_pretrained`` folder: model.safetensors, config.json and the
  image-processor config, into a temporary folder renamed into place at the end (a failure
  leaves nothing at ``out_dir``).

  Args:
    out_dir: the folder to create; it must not exist, or be empty.
    arch: 'vit' or 'resnet'.
    variables, config: the model's variables and our config.
    data: what the run recorded about its data: ``classes``, ``image_size``,
      ``image_mean``, ``image_std``.

  Raises:
    ExportError: one line, for an unknown arch, a non-empty ``out_dir`` or a
      model that cannot be expressed (see the writers).
  """
  from safetensors.numpy import save_file
  if arch not in WRITERS:
    raise ExportError(f"no vision writer for '{arch}'; valid: {', '.join(WRITERS)}")
  out = Path(out_dir)
  if out.exists() and (not out.is_dir() or any(out.iterdir())):
    raise ExportError(f'{out} exists and is not an empty folder; pass a new OUT_DIR')
  state_dict, hf = WRITERS[arch](variables, config, data.get('classes'))
  out.parent.mkdir(parents=True, exist_ok=True)
  tmp = Path(tempfile.mkdtemp(prefix=f'.{out.name}.', dir=out.parent))
  try:
    save_file(state_dict, str(tmp / 'model.safetensors'), metadata={'format': 'pt'})
    (tmp / 'config.json').write_text(json.dumps({**hf, 'dtype': 'float32'}, indent=2) + '\n')
    image_processor_files(tmp, data['image_size'], data['image_mean'], data['image_std'])
    if out.exists():
      out.rmdir()
    os.replace(tmp, out)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return out
