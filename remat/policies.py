"""Named rematerialization policies and their spec grammar.

A policy has two parts:

* a **per-layer rule**: which values of one layer are kept for the backward
  pass (a ``jax.checkpoint`` policy), or no remat at all (``none``);
* a **segmenting** of a stack of N layers: per layer (the default), fixed
  segments of K layers (``seg:K``), or ``sqrt`` (K ~ sqrt(N), see
  :func:`sqrt_segment_size`). A
  segment is checkpointed as a whole and saves only its input; during the
  backward pass it is re-run once, and inside it the per-layer rule applies.

Spec grammar (what ``--remat`` and :func:`get_policy` accept)::

    SPEC      := STACKED | MIX
    STACKED   := RULE | SEGMENTS | RULE "@" SEGMENTS
    RULE      := none | full | everything | dots | dots_no_batch
               | convs | names:TAG[,TAG...] | offload:TAG[,TAG...] | PRESET
    SEGMENTS  := sqrt | seg:K | stage
    MIX       := J "x" STACKED ("+" J "x" STACKED)* "+" [J "x"] STACKED

A **mix** runs consecutive runs of layers of a stack under different specs:
``4xfull+none`` remats the first 4 layers and no others (Megatron's
``--recompute-num-layers 4`` with the block method). The last part may omit
its count: it takes the rest of the stack.

``sqrt`` alone is Chen et al.'s scheme (``none@sqrt``): segment inputs are
saved and a segment keeps all its activations while it is recomputed.
``full@sqrt`` additionally remats every layer inside the segment: less memory,
one more forward pass.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Callable, Iterable, Sequence

import jax

cp = jax.checkpoint_policies


def conv_saveable(prim, *_, **__) -> bool:
  """A ``jax.checkpoint`` policy saving every convolution output and nothing else.

  JAX has none: ``dots_saveable`` saves convolutions *and* every matmul, and
  ``dots_with_no_batch_dims_saveable`` saves no convolution at all.
  """
  return prim is jax.lax.conv_general_dilated_p


class PolicyError(ValueError):
  """A remat spec that cannot be used; the message is one line."""


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


@dataclasses.dataclass(frozen=True)
class Policy:
  """An immutable remat policy: a per-layer rule plus a segmenting.

  Attributes:
    spec: canonical spec string (parses back to an equal policy).
    rule: 'none', 'full', 'everything', 'dots', 'dots_no_batch', 'names' or
      'offload'.
    tags: checkpoint names saved ('names') or offloaded ('offload').
    segment: None (per layer), 'sqrt', 'stage' (the whole stack), or a fixed
      segment size K.
    description: one line for humans.
    parts: a mix's (layer count or None, policy) runs, else empty.
    preset: the PRESETS name the rule came from, else ''. A preset's tags may
      hold TAG_ALTERNATIVES of which the model emits one; a tag not emitted is
      simply not saved.
  """

  spec: str
  rule: str
  tags: tuple[str, ...] = ()
  segment: int | str | None = None
  description: str = ''
  parts: tuple[tuple[int | None, 'Policy'], ...] = ()
  preset: str = ''

  def __str__(self) -> str:
    """The spec, as written in ``--remat`` or passed to :func:`get_policy` (``'full@sqrt'``)."""
    return self.spec

  @property
  def remat_layers(self) -> bool:
    """True when each layer is wrapped in ``jax.checkpoint``."""
    return self.rule != 'none'

  @property
  def offloads(self) -> bool:
    """True when the policy asks XLA to move residuals to host memory."""
    return self.rule == 'offload' or any(p.offloads for _, p in self.parts)

  @property
  def segmented(self) -> bool:
    """True when the policy checkpoints segments of a stack (needs a stack helper)."""
    return self.segment is not None

  @property
  def mixed(self) -> bool:
    """True for a mix (``4xfull+none``): runs of layers under different specs."""
    return bool(self.parts)

  @property
  def uses_tags(self) -> bool:
    """True when a rule names tags (``names:``, ``offload:``, a preset), in any part of a mix."""
    return self.rule in _TAG_RULES or any(p.uses_tags for _, p in self.parts)

  def layer_split(self, num_layers: int) -> list[tuple[int, 'Policy']]:
    """A mix's parts as (layers, policy) over a stack of ``num_layers``, in stack order.

    Counts are taken in order and cut at the end of the stack; the last part
    without a count takes the rest. A stack shorter than the mix's counts (a
    ResNet stage under a non-strict stack) thus runs its layers under the
    first parts only.
    """
    out, left = [], num_layers
    for count, part in self.parts:
      take = left if count is None else min(count, left)
      if take > 0:
        out.append((take, part))
      left -= take
    if left > 0:  # every part was counted and they sum to less than the stack: the last runs on
      last = out[-1] if out else (0, self.parts[-1][1])
      out[-1:] = [(last[0] + left, last[1])]
    return out

  @property
  def jax_policy(self) -> Callable:
    """The per-layer ``jax.checkpoint`` policy, for a rule that saves something by name or kind.

    ``jax.checkpoint``, ``nn.remat`` and ``nnx.remat`` read ``policy=None`` as
    "save nothing", so no spec may hand them None: ``none`` (no remat at all)
    and segmentings (which need a stack) raise instead of silently becoming
    full remat. Prefer :meth:`checkpoint`, :meth:`remat` or the stack helpers,
    which do the right thing for every spec.

    Raises:
      PolicyError: for ``none`` and for segmented specs (one line, naming what to use).
    """
    if self.segmented or self.mixed:
      raise PolicyError(self._needs_stack('jax_policy'))
    if not self.remat_layers:
      raise PolicyError(
          f"remat policy '{self.spec}' means no remat, which no jax.checkpoint policy expresses "
          '(policy=None means save nothing); use policy.checkpoint(fn) or policy.remat(Module), '
          'which return the function or module unchanged for none')
    return self._layer_policy()

  def _layer_policy(self) -> Callable | None:
    # The per-layer rule, None for no remat. Only the stack helpers, which know
    # to skip jax.checkpoint for None, may use it.
    if self.mixed:
      raise PolicyError(self._needs_stack('a single per-layer rule'))
    if self.rule == 'names':
      return cp.save_only_these_names(*self.tags)
    if self.rule == 'offload':
      return cp.save_and_offload_only_these_names(
          names_which_can_be_saved=[], names_which_can_be_offloaded=list(self.tags),
          offload_src='device', offload_dst='pinned_host')
    factory = _RULES[self.rule][1]
    return None if factory is None else factory()

  def _needs_stack(self, what: str) -> str:
    verb = 'mixes rules across' if self.mixed else 'segments'
    return (f"remat policy '{self.spec}' {verb} a stack of layers, which {what} cannot "
            'express; use remat.LayerStack (linen), remat.NNXStack (nnx) or remat.scan_layers '
            '(plain JAX)')

  def segment_size(self, num_layers: int) -> int | None:
    """Layers per checkpointed segment for a stack of ``num_layers``, or None.

    A fixed size K larger than the stack gives one segment of the whole
    stack (:meth:`validate` rejects K larger than the model's deepest stack).
    """
    if self.segment is None:
      return None
    if self.segment == 'sqrt':
      return sqrt_segment_size(num_layers)
    if self.segment == 'stage':
      return num_layers
    return min(self.segment, num_layers)

  def validate(self, num_layers: int | None = None,
               tags: Iterable[str] | None = None) -> 'Policy':
    """Checks the policy against a model; returns self.

    Args:
      num_layers: depth of the (deepest) layer stack (checks the segment size).
      tags: the checkpoint names the model really emits (checks names:/offload:).

    Raises:
      PolicyError: with a one-line message naming what is valid.
    """
    if self.mixed:
      return self._validate_mix(num_layers, tags)
    if num_layers is not None and isinstance(self.segment, int) and not (
        1 <= self.segment <= num_layers):
      raise PolicyError(
          f"remat policy '{self.spec}': segment size {self.segment} is out of range; "
          f'valid sizes for this {num_layers}-layer stack are 1..{num_layers}')
    if tags is not None and self.rule in _TAG_RULES:
      known = set(tags)
      unknown = missing_tags(self.tags, known, alternatives=bool(self.preset))
      if unknown:
        emits = ', '.join(sorted(known)) or 'no tags (tag values with checkpoint_name)'
        raise PolicyError(
            f"remat policy '{self.spec}': unknown tag(s) {', '.join(unknown)}; "
            f'this model emits: {emits}')
    return self

  def _validate_mix(self, num_layers: int | None, tags) -> 'Policy':
    counted = sum(c for c, _ in self.parts if c is not None)
    if num_layers is not None:
      open_end = self.parts[-1][0] is None
      if (counted >= num_layers) if open_end else (counted != num_layers):
        want = f'fewer than {num_layers}' if open_end else f'exactly {num_layers}'
        raise PolicyError(
            f"remat policy '{self.spec}': the counted parts cover {counted} layers; this "
            f'{num_layers}-layer stack needs {want} (the last part may omit its count)')
    for count, part in (self.layer_split(num_layers) if num_layers else self.parts):
      try:
        part.validate(count, tags)
      except PolicyError as e:
        raise PolicyError(f"{e} (in the mix '{self.spec}')") from None
    return self

  def checkpoint(self, fn: Callable, *, prevent_cse: bool = True, **kwargs) -> Callable:
    """Applies the per-layer rule to a plain function: ``jax.checkpoint`` or, for ``none``, ``fn``.

    Args:
      fn: the function to rematerialize (one layer, say).
      prevent_cse: keep True outside a scan; False is safe only inside one.
      **kwargs: passed to ``jax.checkpoint`` (``static_argnums``, ...).

    Raises:
      PolicyError: for a segmented spec, which needs a stack helper.
    """
    return self._wrap(jax.checkpoint, fn, 'Policy.checkpoint', prevent_cse, kwargs)

  def remat(self, module_cls, *, prevent_cse: bool = True, **kwargs):
    """Wraps a Flax linen module class in ``nn.remat`` with this rule (``none``: unchanged).

    Use ``prevent_cse=False`` only when the module runs inside ``nn.scan``.

    Raises:
      PolicyError: for a segmented spec, which needs a stack helper.
    """
    import flax.linen as nn  # local: the policy module itself needs only jax
    return self._wrap(nn.remat, module_cls, 'Policy.remat', prevent_cse, kwargs)

  def nnx_remat(self, fn: Callable, *, prevent_cse: bool = True, **kwargs) -> Callable:
    """Wraps a function of NNX modules in ``nnx.remat`` with this rule (``none``: unchanged).

    Raises:
      PolicyError: for a segmented spec, which needs a stack helper.
    """
    from flax import nnx  # local: the policy module itself needs only jax
    return self._wrap(nnx.remat, fn, 'Policy.nnx_remat', prevent_cse, kwargs)

  def _wrap(self, wrapper: Callable, target, what: str, prevent_cse: bool, kwargs: dict):
    # The one place the three entry points share: segmentings need a stack, none is a no-op.
    if self.segmented or self.mixed:
      raise PolicyError(self._needs_stack(what))
    if not self.remat_layers:
      return target
    return wrapper(target, policy=self._layer_policy(), prevent_cse=prevent_cse, **kwargs)


def _parse_tags(kind: str, arg: str, spec: str) -> tuple[str, ...]:
  tags = tuple(t.strip() for t in arg.split(','))
  if not arg.strip() or any(not t for t in tags):
    raise PolicyError(
        f"remat policy '{spec}': empty tag in '{kind}:'; write {kind}:TAG[,TAG...] "
        f'with tags such as {", ".join(_QKV)}')
  return tags


def _parse_rule(text: str, spec: str) -> tuple[str, tuple[str, ...], str]:
  kind, sep, arg = text.partition(':')
  if sep and kind in _TAG_RULES:
    tags = _parse_tags(kind, arg, spec)
    verb = 'save only' if kind == 'names' else 'offload to host'
    return kind, tags, f'{verb}: {", ".join(tags)}'
  if text in _TAG_RULES:
    raise PolicyError(f"remat policy '{spec}': '{text}' needs tags, e.g. {text}:query_proj,key_proj")
  if text in _RULES:
    return text, (), _RULES[text][0]
  if text in PRESETS:
    kind, tags, desc = PRESETS[text]
    return kind, tags, desc
  raise PolicyError(f"unknown remat policy '{spec}'; valid: {', '.join(policy_names())} "
                    '(see --remat=list)')


def _parse_segment(text: str, spec: str) -> int | str:
  if text in ('sqrt', 'stage'):
    return text
  kind, sep, arg = text.partition(':')
  if kind == 'seg' and sep:
    # int() also takes ' 3', '+3', '1_0' and non-ASCII digits such as '２'; a spec is plain ASCII.
    k = int(arg) if arg.isascii() and arg.isdigit() else None
    if k is None or k < 1:
      raise PolicyError(f"remat policy '{spec}': segment size must be an integer >= 1, got '{arg}'")
    return k
  raise PolicyError(f"remat policy '{spec}': unknown segmenting '{text}'; valid: sqrt, seg:K, stage")


def get_policy(spec: str | Policy, *, num_layers: int | None = None,
               tags: Iterable[str] | None = None) -> Policy:
  """Parses a spec string into a :class:`Policy`.

  Args:
    spec: e.g. 'none', 'full', 'dots', 'names:query_proj,out_proj', 'sqrt',
      'seg:4', 'full@sqrt', 'save_qkv_proj@seg:3'. A Policy is returned as is
      (after validation).
    num_layers: if given, the segment size is checked against it.
    tags: if given, names:/offload: tags are checked against it.

  Returns:
    The policy.

  Raises:
    PolicyError: one line saying what is wrong and what is valid.
  """
  if isinstance(spec, Policy):
    return spec.validate(num_layers, tags)
  if not isinstance(spec, str):
    raise PolicyError(f'a remat policy is a spec string or a Policy, got {type(spec).__name__} '
                      f"{spec!r:.60}; e.g. get_policy('full@sqrt')")
  text = spec.strip()
  if not text:
    raise PolicyError(f"empty remat policy; valid: {', '.join(policy_names())}")
  if text == 'auto' or text.startswith('auto:'):
    raise PolicyError(f"'{text}' is a budget, not a policy: train.py --remat and "
                      'remat.auto.choose resolve it to the policy it picks')
  if _MIX_SEP.search(text):
    return _parse_mix(text).validate(num_layers, tags)
  count, x, rest = text.partition('x')
  if x and count.isascii() and count.isdigit():
    raise PolicyError(f"remat policy '{text}': a layer count starts a mix and needs a part after "
                      f"it, e.g. {text}+none")
  return _parse_stacked(text).validate(num_layers, tags)


# '+' separates a mix's parts, except right after ':' where it is a (bad) sign, as in 'seg:+2'.
_MIX_SEP = re.compile(r'(?<!:)\+')


def _parse_mix(text: str) -> Policy:
  """``J x SPEC + ... + [J x] SPEC``: runs of layers, each under its own (unmixed) spec."""
  parts = []
  pieces = [p.strip() for p in text.split('+')]
  for i, piece in enumerate(pieces):
    if not piece:
      raise PolicyError(f"remat policy '{text}': empty part; write J x SPEC + ... + SPEC, "
                        'e.g. 4xfull+none')
    count_text, x, rest = piece.partition('x')
    count_text = count_text.strip()
    counted = bool(x) and count_text.isascii() and count_text.isdigit()
    if counted and int(count_text) < 1:
      raise PolicyError(f"remat policy '{text}': a part's layer count must be >= 1, got "
                        f"'{count_text}'")
    if not counted and i < len(pieces) - 1:
      raise PolicyError(f"remat policy '{text}': part '{piece}' needs a layer count, "
                        "e.g. 4xfull+none (only the last part may omit it)")
    sub = _parse_stacked(rest.strip() if counted else piece, text)
    parts.append((int(count_text) if counted else None, sub))
  canon = '+'.join(p.spec if c is None else f'{c}x{p.spec}' for c, p in parts)
  desc = '; '.join(f"{'the rest' if c is None else f'{c} layers'}: {p.spec}" for c, p in parts)
  return Policy(canon, 'mix', (), None, f'layers in runs ({desc})', tuple(parts))


def _parse_stacked(text: str, spec: str | None = None) -> Policy:
  """RULE | SEGMENTS | RULE@SEGMENTS; ``spec`` is the whole spec, for messages."""
  whole = spec or text
  rule_text, at, seg_text = text.partition('@')
  segment = None
  if at:
    segment = _parse_segment(seg_text.strip(), whole)
  elif rule_text in ('sqrt', 'stage') or rule_text.startswith('seg:'):
    rule_text, segment = 'none', _parse_segment(rule_text, whole)
  rule, tag_tuple, desc = _parse_rule(rule_text.strip(), whole)
  canon_rule = rule_text.strip() if rule_text.strip() in PRESETS else (
      f'{rule}:{",".join(tag_tuple)}' if rule in _TAG_RULES else rule)
  preset = rule_text.strip() if rule_text.strip() in PRESETS else ''
  if segment is None:
    canon = canon_rule
  else:
    seg = segment if isinstance(segment, str) else f'seg:{segment}'
    canon = seg if canon_rule == 'none' else f'{canon_rule}@{seg}'
    where = {'sqrt': 'segments of ~sqrt(N) layers',
             'stage': 'one segment per layer stack (ResNet stage)'}.get(
                 segment, f'segments of {segment} layers')
    desc = (f'checkpointed {where} (segment inputs saved)' if rule == 'none'
            else f'{desc}; per layer, inside checkpointed {where}')
  return Policy(canon, rule, tag_tuple, segment, desc, preset=preset)


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
