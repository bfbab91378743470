"""A Hugging Face checkpoint fitted to a fine-tuning run's model: another image size, another head.

Fine-tuning a vision checkpoint usually changes two things the checkpoint was
trained for: the image side (a ViT's position table is resampled to the new
patch grid, :mod:`models.vit_positions`) and the classes (the classifier is
replaced by a zero-initialised one of the run's class count, as big_vision's
fine-tuning configs do with ``head_zeroinit``: the first steps train the head
from an unbiased start). Every other parameter must fit the run's config
exactly, as in :func:`models.hf.load.load_hf`; the variable tree is the model's own,
so nothing downstream knows the checkpoint had another shape.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from models.hf.load import load_hf, load_hf_config
from models.vit_positions import resize_positions


def load_pretrained(path, arch: str, config, convert=None) -> tuple[dict, list[str]]:
  """The variables of the checkpoint at ``path`` for a model of ``config``.

  Args:
    path: a ``save_pretrained`` folder.
    arch: the run's architecture; the checkpoint must be of it.
    config: the run's model config (image side and class count may differ
      from the checkpoint's; nothing else may).
    convert: how leaves are stored as they are read (:func:`models.hf.load.from_state_dict`).

  Returns:
    ``(variables, notes)``: float32 numpy variables with the tree and shapes of
    ``config``'s model, and one line per change made (resampled positions, a
    new head).

  Raises:
    HFImportError: one line (:func:`models.hf.load.load_hf`).
  """
  their_arch, theirs = load_hf_config(path)
  if arch not in ('vit', 'resnet') or their_arch != arch:  # load_hf checks and says what is wrong
    return load_hf(path, expect_arch=arch, config=config, convert=convert)[2], []
  fit, notes = config, []
  if arch == 'vit' and theirs.image_size != config.image_size:
    fit = dataclasses.replace(fit, image_size=theirs.image_size)
  if theirs.num_classes != config.num_classes:
    fit = dataclasses.replace(fit, num_classes=theirs.num_classes)
  _, _, variables = load_hf(path, expect_arch=arch, config=fit, convert=convert)
  params = variables['params']
  if fit.image_size != config.image_size and arch == 'vit':
    old, new = fit.image_size // fit.patch_size, config.image_size // config.patch_size
    emb = params['embeddings']
    emb['position_embeddings'] = resize_positions(emb['position_embeddings'], new)
    notes.append(f'position embeddings resampled (bicubic) from the checkpoint\'s {old}x{old} '
                 f'patch grid ({fit.image_size} px) to {new}x{new} ({config.image_size} px)')
  if fit.num_classes != config.num_classes:
    head = params['classifier']
    width = head['kernel'].shape[0]
    head['kernel'] = np.zeros((width, config.num_classes), np.float32)
    head['bias'] = np.zeros((config.num_classes,), np.float32)
    notes.append(f"classifier replaced: the checkpoint's {fit.num_classes} classes -> "
                 f'{config.num_classes}, zero-initialised')
  return variables, notes
