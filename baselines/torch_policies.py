"""Policy families for the PyTorch baselines, applied by name to a model of :mod:`torch_models`.

========== ===================================================================
family     what the train step keeps for backward / recomputes
========== ===================================================================
none       every activation; nothing recomputed (the baseline)
hf         Hugging Face's own checkpointing (``gradient_checkpointing_enable``
           with ``use_reentrant=False``; transformers 5 names it
           ``activation_checkpointing_enable`` and keeps the old name as a
           deprecated alias): each block's input; the block's forward is
           recomputed. GPT-2 and ViT only (ResNet has no HF flag)
block      ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` around
           every block: the same as ``hf``, by wrapping the blocks' forward,
           so it works for ResNet too
sqrt       ``torch.utils.checkpoint.checkpoint_sequential`` over the N blocks in
           ``round(sqrt(N))`` segments of ``N // segments`` blocks: each
           segment's input; a segment is recomputed whole. torch's rule: the
           *last* segment (with the remainder blocks) is not checkpointed, so
           it keeps all its activations (JAX ``sqrt`` checkpoints every segment)
selective  selective activation checkpointing (``create_selective_checkpoint_contexts``)
           per block: the outputs of :data:`SAVE_OPS` (matmuls, convolutions,
           fused attention) are saved, everything else (LayerNorm/BatchNorm,
           GELU/ReLU, softmax, dropout, adds) is recomputed: JAX's ``dots_saveable``
========== ===================================================================

Blocks are those of :func:`baselines.torch_models.blocks`: GPT-2
``transformer.h[i]``, ViT's encoder layers, and for ResNet every layer of every
stage. For ``sqrt`` the ResNet blocks are one flattened list across stages (16
for ResNet-50: 4 segments of 4), the same rule as for the Transformers and as
the JAX stack's ``sqrt`` over N layers; per stage, depths such as 3 would give
segments of one block.

Every family gives the loss and gradients of ``none``: checkpointing restores
the RNG state, so dropout masks are the same when recomputed. One side effect
is not undone: a recomputed BatchNorm updates its running statistics a second
time (ResNet ``block``, ``sqrt``, ``selective``), as in any torch checkpointing
of BatchNorm.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint, checkpoint_sequential,
                                    create_selective_checkpoint_contexts)

from baselines.torch_models import MODEL_CLASSES, blocks, check_model

FAMILIES = {
    'none': 'no checkpointing: every activation kept for backward (the baseline)',
    'hf': "Hugging Face's gradient_checkpointing_enable(use_reentrant=False): each block's "
          'input kept, its forward recomputed (GPT-2, ViT)',
    'block': 'torch.utils.checkpoint.checkpoint(use_reentrant=False) around every block',
    'sqrt': 'checkpoint_sequential over the N blocks in round(sqrt(N)) segments '
            '(the last segment not checkpointed)',
    'selective': 'selective activation checkpointing per block: matmul, convolution and '
                 'attention outputs saved, the rest recomputed (JAX dots_saveable)',
}

# Ops whose outputs ``selective`` saves (by overload packet: every overload of each).
# The analogue of JAX's dots_saveable (dot_general and conv_general_dilated): nn.Linear and
# GPT-2's Conv1D reach torch as mm/addmm, the attention scores and probabilities times values
# of the math path as bmm/baddbmm, nn.Conv2d as convolution, and fused attention (CPU flash,
# CUDA flash / memory-efficient / cuDNN) as one op each whose outputs (context, logsumexp)
# are kept. Ops this torch lacks are left out.
_SAVE_OP_NAMES = (
    'mm', 'addmm', 'bmm', 'baddbmm', 'convolution',
    '_scaled_dot_product_flash_attention_for_cpu',
    '_scaled_dot_product_flash_attention',
    '_scaled_dot_product_efficient_attention',
    '_scaled_dot_product_cudnn_attention',
    '_scaled_dot_product_fused_attention_overrideable',
)
SAVE_OPS = frozenset(getattr(torch.ops.aten, n) for n in _SAVE_OP_NAMES
                     if hasattr(torch.ops.aten, n))


def check_family(family: str) -> str:
  """Returns ``family`` if it is a known family name.

  Raises:
    ValueError: one line listing the valid names.
  """
  if family not in FAMILIES:
    raise ValueError(f"unknown policy family '{family}'; valid families: {', '.join(FAMILIES)}")
  return family


def supported_families(model: str) -> tuple[str, ...]:
  """The families that apply to ``model``: all but ``hf`` where HF has no checkpointing."""
  check_model(model)
  hf = getattr(MODEL_CLASSES[model], 'supports_gradient_checkpointing', False)
  return tuple(f for f in FAMILIES if f != 'hf' or hf)


def check_supported(model: str, family: str) -> None:
  """Checks that ``family`` is a family name that applies to ``model``.

  Raises:
    ValueError: one line: an unknown model or family, or ``hf`` for a model
      that HF gives no checkpointing, naming the families that work for it.
  """
  check_model(model)
  check_family(family)
  if family not in supported_families(model):
    name = MODEL_CLASSES[model].__name__
    raise ValueError(f"policy family '{family}' needs Hugging Face gradient checkpointing, which "
                     f'{name} does not support; families for {model}: '
                     f"{', '.join(supported_families(model))}")


def sqrt_segments(n: int) -> int:
  """``round(sqrt(n))``, at least 1: the number of segments ``sqrt`` cuts N blocks into."""
  return max(1, round(n ** 0.5))


def save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
  """The ``selective`` policy: save the outputs of :data:`SAVE_OPS`, recompute the rest."""
  del ctx, args, kwargs
  if getattr(op, 'overloadpacket', None) in SAVE_OPS:
    return CheckpointPolicy.MUST_SAVE
  return CheckpointPolicy.PREFER_RECOMPUTE


def apply_policy(model: str, net: torch.nn.Module, family: str) -> torch.nn.Module:
  """Applies policy ``family`` to ``net``, built by :func:`baselines.torch_models.build_model`.

  ``block``, ``sqrt`` and ``selective`` replace the blocks' ``forward`` on the
  instances (parameter names are unchanged); ``hf`` sets HF's flag.

  Args:
    model: 'gpt2' | 'llama' | 'vit' | 'resnet', the kind of ``net``.
    net: the model, changed in place.
    family: one of :data:`FAMILIES`.

  Returns:
    ``net``.

  Raises:
    ValueError: unknown model or family, ``hf`` for a model without HF
      checkpointing (naming the families that work), or a policy already applied.
  """
  check_supported(model, family)
  if getattr(net, '_baseline_family', None) is not None:
    raise ValueError(f"policy family '{net._baseline_family}' is already applied to this model; "
                     'build a fresh one')
  if family == 'hf':
    _enable_hf(net)
  elif family == 'block':
    for b in blocks(model, net):
      _wrap(b, _checkpointed)
  elif family == 'selective':
    for b in blocks(model, net):
      _wrap(b, functools.partial(_checkpointed, context_fn=_sac_contexts))
  elif family == 'sqrt':
    _segment(blocks(model, net))
  net._baseline_family = family
  return net


def _enable_hf(net: torch.nn.Module) -> None:
  kwargs = {'use_reentrant': False}
  if hasattr(net, 'activation_checkpointing_enable'):
    # transformers >= 5.x: the new name; gradient_checkpointing_enable is its deprecated alias.
    net.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
  else:
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _sac_contexts():
  return create_selective_checkpoint_contexts(save_matmuls)


def _wrap(module: torch.nn.Module, make_forward) -> None:
  """Replaces ``module.forward`` by ``make_forward(original bound forward)`` on this instance."""
  module.forward = functools.partial(make_forward, module.forward)


def _checkpointed(inner, *args, context_fn=None, **kwargs):
  """``inner(*args, **kwargs)`` under non-reentrant checkpoint (and SAC when ``context_fn``)."""
  extra = {} if context_fn is None else {'context_fn': context_fn}
  return checkpoint(functools.partial(inner, **kwargs), *args, use_reentrant=False, **extra)


def _segment(bl: list[torch.nn.Module]) -> None:
  """``sqrt`` over blocks called one after another by the model's own loop.

  The first block runs all N (their original forwards, with the arguments it
  was called with) through ``checkpoint_sequential``; the other blocks, when
  the model's loop reaches them, return their input unchanged. Every block of
  these models takes the hidden state first and returns it as one tensor, and
  is called with the same other arguments.
  """
  inners = [b.forward for b in bl]
  segments = sqrt_segments(len(bl))

  def run_all(hidden, *args, **kwargs):
    fns = [functools.partial(_one_block, inner, args, kwargs) for inner in inners]
    return checkpoint_sequential(fns, segments, hidden, use_reentrant=False)

  bl[0].forward = run_all
  for b in bl[1:]:
    b.forward = _passthrough


def _one_block(inner, args, kwargs, hidden):
  out = inner(hidden, *args, **kwargs)
  if not isinstance(out, torch.Tensor):
    raise TypeError(f'sqrt expects blocks that return one tensor, got {type(out).__name__}')
  return out


def _passthrough(hidden, *args, **kwargs):
  del args, kwargs
  return hidden
