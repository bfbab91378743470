"""PyTorch baselines: our model shapes in Hugging Face ``transformers``, measured per policy family.

The PyTorch side of the JAX-vs-PyTorch comparison. Torch and transformers are
an optional extra; nothing in ``remat/``, ``models/`` or ``training/`` imports
them, and importing this package does not import them either (the names below
load their module on first use).

- :mod:`baselines.torch_models`: ``GPT2LMHeadModel``, ``ViTForImageClassification``
  and ``ResNetForImageClassification`` built from the ``"model"`` section of our
  JSON configs, their checkpointable blocks and seeded input batches;
- :mod:`baselines.torch_policies`: the policy families ``none``, ``hf``, ``block``,
  ``sqrt`` and ``selective``, applied to such a model by name;
- :mod:`baselines.torch_measure`: :func:`measure_torch`, the peak memory (and its
  activation part), FLOPs and time of one steady-state train step.

Typical use::

    from baselines import measure_torch
    m = measure_torch('gpt2', load_json('configs/gpt2-small.json')['model'], 'hf',
                      batch_size=4, seq_len=512, image_size=None)
    print(m.peak_bytes, m.activation_bytes, m.step_flops, m.step_seconds)
"""

import importlib

_LAZY = {
    'MODELS': 'baselines.torch_models',
    'build_model': 'baselines.torch_models',
    'make_batch': 'baselines.torch_models',
    'FAMILIES': 'baselines.torch_policies',
    'apply_policy': 'baselines.torch_policies',
    'supported_families': 'baselines.torch_policies',
    'TorchMeasurement': 'baselines.torch_measure',
    'measure_torch': 'baselines.torch_measure',
}

__all__ = sorted(_LAZY)


def __getattr__(name):
  if name in _LAZY:
    return getattr(importlib.import_module(_LAZY[name]), name)
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
