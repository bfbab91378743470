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

The rules, presets and tag groups a spec can name, ``sqrt``'s segment size and the listings
live in :mod:`remat.policy_tables` (this file's ~400-line guide); re-exported here.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Iterable

import jax

from remat.policy_tables import (PRESETS, TAG_ALTERNATIVES, _QKV, _RULES, _TAG_RULES,
                                 conv_saveable, list_policies, missing_tags, policy_names,
                                 preset_tags, registered_specs, sqrt_segment_size)

cp = jax.checkpoint_policies


class PolicyError(ValueError):
  """A remat spec that cannot be used; the message is one line."""


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


__all__ = ['Policy', 'PolicyError', 'get_policy', 'PRESETS', 'TAG_ALTERNATIVES', 'conv_saveable',
           'missing_tags', 'preset_tags', 'sqrt_segment_size', 'policy_names', 'list_policies',
           'registered_specs']
