"""Our own zoo models (GPT, ViT, Llama) at the shapes they are measured against their unrolled form.

tests/test_public_models.py checks them on the CPU and H200 plans and
``python -m tests.public_models.table --ours`` prints docs/own-model.md's rows.
The reference is the same model traced inside
:func:`remat.layout.unrolled_reference` (every stack a Python loop, no checkpoint).
"""

import dataclasses

from configs import load_config

# config -> (batch, sequence length or image size): the default configs' own sequence/image sizes
# at a batch of 8 sequences or 32 images, small enough for three compiles per plan on 2 cores.
ZOO = {'tiny': (8, 128), 'vit-tiny': (32, 32), 'llama-tiny': (8, 128)}
# Issue 23's bounds are stated for stacks of N >= 6 layers: with fewer, the loop's fixed costs (its
# carry, one layer's working set) are a larger share and the ratio says little about depth.
# vit-tiny's default has 4 layers, so it is measured with 6 (the same width and shapes).
MIN_LAYERS = 6


# Issue 34's bounds against the per-block habit are stated for stacks of >= 8 layers.
DEEP = 8


def model_config(config: str, min_layers: int = MIN_LAYERS):
  """The model config of ``configs/<config>.json`` with at least ``min_layers`` layers."""
  cfg = load_config(config).model
  return dataclasses.replace(cfg, num_layers=max(cfg.num_layers, min_layers))
