"""The tables behind remat policies, and the helpers that read only them.

What a spec can name: the argument-free rules (``_RULES``, each with its
``jax.checkpoint`` policy, and :func:`conv_saveable`, the one JAX lacks), the
MaxText and ResNet presets (:data:`PRESETS`) and the tag groups they may save
(:data:`TAG_ALTERNATIVES`, :func:`missing_tags`, :func:`preset_tags`); how
``sqrt`` sizes its segments (:func:`sqrt_segment_size`); and the listings
(:func:`policy_names`, :func:`list_policies`, :func:`registered_specs`).

Apart from :mod:`remat.policies` (the :class:`~remat.policies.Policy` class and
the spec grammar) so that file stays within the ~400-line guide; nothing here
needs either, and every public name here is re-exported there, where callers
import it.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Sequence

import jax

cp = jax.checkpoint_policies


def conv_saveable(prim, *_, **__) -> bool:
  """A ``jax.checkpoint`` policy saving every convolution output and nothing else.

  JAX has none: ``dots_saveable`` saves convolutions *and* every matmul, and
  ``dots_with_no_batch_dims_saveable`` saves no convolution at all.
  """
  return prim is jax.lax.conv_general_dilated_p


# Rules that need no argument: name -> (description, factory of the JAX policy).
# ``None`` as factory means "do not remat".
_RULES: dict[str, tuple[str, Callable | None]] = {
    'none': ('no remat: every activation is stored (the baseline)', None),
    'full': ('save nothing inside a layer; recompute the whole layer '
             '(nothing_saveable)', lambda: cp.nothing_saveable),
    'everything': ('save everything (everything_saveable), also what the '
                   "models' own derivative rules recompute (gelu(h)); a control "
                   'for none', lambda: cp.everything_saveable),
    'dots': ('save every matmul output, incl. batched ones such as attention '
             'scores (dots_saveable)', lambda: cp.dots_saveable),
    'dots_no_batch': ('save matmuls without batch dims (weight matmuls), '
                      'recompute attention scores and elementwise ops '
                      '(dots_with_no_batch_dims_saveable)',
                      lambda: cp.dots_with_no_batch_dims_saveable),
    'convs': ('save every convolution output, recompute normalisation, activations and '
              'matmuls (for convnets: conv_saveable)', lambda: conv_saveable),
}

_QKV = ('query_proj', 'key_proj', 'value_proj')

# Tags that stand for one value in either of two model forms: a preset naming the group saves
# whichever alternative the block emits. The MLP input is GPT-2's single 'mlpwi' (no gated MLP)
# or MaxText's gated 'mlpwi_0' (gate) and 'mlpwi_1' (up), as a Llama block emits them.
TAG_ALTERNATIVES: tuple[tuple[tuple[str, ...], ...], ...] = (
    (('mlpwi',), ('mlpwi_0', 'mlpwi_1')),
)
_MLPWI = tuple(t for alt in TAG_ALTERNATIVES[0] for t in alt)
_ALTERNATIVE_TAGS = frozenset(t for group in TAG_ALTERNATIVES for alt in group for t in alt)

# MaxText presets over our tag vocabulary: name -> (kind, tags, description).
# MaxText's fused 'qkv_proj' maps to our separate query/key/value tags; the MLP input
# is the group 'mlpwi' | 'mlpwi_0' + 'mlpwi_1' (TAG_ALTERNATIVES), so the presets
# apply to GPT-2's plain MLP and to a gated (SwiGLU) one.
PRESETS: dict[str, tuple[str, tuple[str, ...], str]] = {
    'minimal': ('names', _QKV + ('out_proj',) + _MLPWI + ('mlpwo',),
                'MaxText minimal: save every weight matmul output'),
    'minimal_with_context': ('names', _QKV + ('context', 'out_proj') + _MLPWI + ('mlpwo',),
                             'MaxText minimal_with_context: minimal + attention context'),
    'save_dot_with_context_except_mlp': ('names', _QKV + ('context', 'out_proj'),
                                         'MaxText: save attention matmuls and context, recompute the MLP'),
    'save_dot_except_mlpwi': ('names', _QKV + ('out_proj', 'mlpwo'),
                              'MaxText: save all weight matmuls except the MLP input projection'),
    'save_dot_except_mlp': ('names', _QKV + ('out_proj',),
                            'MaxText: save attention weight matmuls, recompute the MLP'),
    'save_qkv_proj': ('names', _QKV, 'MaxText: save only the q/k/v projections'),
    'save_out_proj': ('names', ('out_proj',), 'MaxText: save only the attention output projection'),
    'qkv_proj_offloaded': ('offload', _QKV,
                           'MaxText: offload q/k/v projections to pinned host memory'),
    'minimal_offloaded': ('offload', _QKV + ('out_proj',) + _MLPWI + ('mlpwo',),
                          'MaxText: offload every weight matmul output to pinned host memory'),
    # Convnet presets over the ResNet tags (models/resnet.py).
    'save_conv_narrow': ('names', ('conv1', 'conv2'),
                         'ResNet: save the first two conv outputs of each block (the '
                         'reduced-width ones in a bottleneck), recompute the last conv, BN, ReLU'),
}

_TAG_RULES = ('names', 'offload')


def missing_tags(tags: Iterable[str], model_tags: Iterable[str], *,
                 alternatives: bool = False) -> list[str]:
  """The tags of a names:/offload: list that a model does not emit, in order.

  Args:
    tags: the tags a rule saves or offloads.
    model_tags: the tags the model emits.
    alternatives: True for a preset: a TAG_ALTERNATIVES group counts as present
      when one of its alternatives is emitted whole (a missing group is listed as
      'mlpwi or mlpwi_0+mlpwi_1'). False for a user's ``names:`` list, where every
      tag must be emitted, so a typo fails.
  """
  known = set(model_tags)
  if not alternatives:
    return [t for t in tags if t not in known]
  missing = [t for t in tags if t not in known and t not in _ALTERNATIVE_TAGS]
  for group in TAG_ALTERNATIVES:
    if any(t in tags for alt in group for t in alt) and not any(set(a) <= known for a in group):
      missing.append(' or '.join('+'.join(alt) for alt in group))
  return missing


def preset_tags(name: str, model_tags: Iterable[str]) -> tuple[str, ...] | None:
  """The tags preset ``name`` saves (or offloads) on a model emitting ``model_tags``.

  Returns None when the preset does not apply to the model (a tag it needs is not
  emitted); else its tags less the alternatives the model does not emit.
  """
  ptags = PRESETS[name][1]
  known = set(model_tags)
  if missing_tags(ptags, known, alternatives=True):
    return None
  return tuple(t for t in ptags if t in known)


# A divisor K of N within this factor of sqrt(N) costs at most 8% more in N/K + K (checkpoints
# plus one segment's layers) than the ideal 2 sqrt(N).
_SQRT_DIVISOR_FACTOR = 1.5


def sqrt_segment_size(num_layers: int) -> int:
  """K for ``sqrt``: a divisor of N near sqrt(N) if there is one, else round(sqrt(N)).

  The divisor nearest sqrt(N) (the smaller on a tie) is taken if it lies
  within a factor 1.5 of sqrt(N). A remainder segment is not free: its
  layers' variables are sliced off the stack, so XLA assembles the stack's
  gradient by concatenation, a copy the size of the stack's parameters (GPT-2
  medium, 24 layers, batch 2 x 512, CPU plan: temp 3349 MiB with K = 5 and a
  remainder of 4, 2234 MiB with K = 4). Only when no divisor is near (N prime,
  say) does ``sqrt`` take a remainder.
  """
  root = math.sqrt(num_layers)
  near = [k for k in range(1, num_layers + 1) if num_layers % k == 0
          and root / _SQRT_DIVISOR_FACTOR <= k <= root * _SQRT_DIVISOR_FACTOR]
  if near:
    return min(near, key=lambda k: (abs(k - root), k))
  return max(1, round(root))


def policy_names() -> list[str]:
  """Names accepted on their own (rules, presets, segmentings)."""
  return list(_RULES) + list(PRESETS) + ['sqrt', 'seg:K', 'stage', 'names:T1,..',
                                          'offload:T1,..', 'JxSPEC+SPEC']


def list_policies() -> list[tuple[str, str]]:
  """Every registered policy and form, as (spec, one-line description)."""
  rows = [(name, desc) for name, (desc, _) in _RULES.items()]
  rows += [('names:T1,T2,...', 'save only the values tagged T1, T2, ... (save_only_these_names)'),
           ('offload:T1,T2,...', 'offload the values tagged T1, T2, ... to pinned host memory, '
            'recompute the rest (save_and_offload_only_these_names)')]
  rows += [(name, desc) for name, (_, _, desc) in PRESETS.items()]
  rows += [('sqrt', 'Chen et al.: checkpointed segments of ~sqrt(N) layers (a divisor of N near '
            'sqrt(N) when there is one, else round(sqrt(N))); '
            'segment inputs saved, one extra forward'),
           ('seg:K', 'checkpointed segments of K layers (a shorter last segment if K does not '
            'divide N, which costs a copy of the stack\'s gradients)'),
           ('stage', 'one checkpointed segment per layer stack: saves only stack (ResNet stage) '
            'inputs, recomputes a whole stage at once'),
           ('RULE@sqrt, RULE@seg:K', 'per-layer RULE inside checkpointed segments, e.g. full@sqrt'),
           ('JxSPEC+SPEC', 'a mix: the first J layers of a stack under one spec, the rest under '
            "another, e.g. 4xfull+none (Megatron's --recompute-num-layers 4)"),
           ('auto, auto:SIZE, auto:Fx', 'train.py only: the policy of least recompute whose '
            'compiled plan fits a budget (docs/auto.md)')]
  return rows


def registered_specs(sample_tags: Sequence[str] = _QKV,
                     model_tags: Iterable[str] | None = None) -> list[str]:
  """Concrete specs covering every rule and preset (used by the tests and the report).

  Args:
    sample_tags: tags for the sample ``names:``/``offload:`` specs.
    model_tags: if given, only presets that apply to a model emitting them
      (:func:`preset_tags`) are included.
  """
  known = None if model_tags is None else set(model_tags)
  presets = [n for n in PRESETS if known is None or preset_tags(n, known) is not None]
  return (list(_RULES) + [f'names:{",".join(sample_tags)}', f'offload:{",".join(sample_tags)}']
          + presets)
