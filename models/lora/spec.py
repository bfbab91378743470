"""What a LoRA run adapts: :class:`LoraSpec` (rank, alpha, dropout, targets, base storage).

A :class:`LoraSpec` rides on a model config (``GPTConfig.lora``,
``LlamaConfig.lora``, ``ViTConfig.lora``; None: full fine-tuning). With one,
the model's projections named by ``targets`` gain a low-rank adapter
(Hu et al., 2021)::

    y = x @ W + (alpha / rank) * (dropout(x) @ A) @ B      A: [in, rank], B: [rank, out]

``W`` and every other base weight are frozen, stored in the compute dtype (or
quantized, ``quantize``), and get no gradient and no optimizer state; ``A``
(uniform in +-1/sqrt(in), as peft initialises ``lora_A``) and ``B`` (zeros) are
float32 and trained. The trained classifier head of a vision model is trained
whole beside them (peft's ``modules_to_save``): a fine-tuned head is the point
of a vision fine-tune, and a new class count has a new, zero-initialised one.

A projection is named as in the parameter tree below the layer stack
(``self_attn/q_proj``); a target matches it whole or by its last part
(``q_proj``), as peft's ``target_modules`` match. :data:`PROJECTIONS` lists
every family's; :func:`resolve_targets` turns names into them.
"""

from __future__ import annotations

import dataclasses

# Every projection of each family's block that can carry an adapter, in the block's order:
# (path below the block, the checkpoint name of its output). The adapter's rank-r product
# carries the same name, so a policy treats it with its base projection.
PROJECTIONS = {
    'llama': (('self_attn/q_proj', 'query_proj'), ('self_attn/k_proj', 'key_proj'),
              ('self_attn/v_proj', 'value_proj'), ('self_attn/o_proj', 'out_proj'),
              ('mlp/gate_proj', 'mlpwi_0'), ('mlp/up_proj', 'mlpwi_1'),
              ('mlp/down_proj', 'mlpwo')),
    'gpt': (('attn/query', 'query_proj'), ('attn/key', 'key_proj'), ('attn/value', 'value_proj'),
            ('attn/c_proj', 'out_proj'), ('mlp/c_fc', 'mlpwi'), ('mlp/c_proj', 'mlpwo')),
    'vit': (('attention/query', 'query_proj'), ('attention/key', 'key_proj'),
            ('attention/value', 'value_proj'), ('attention/output', 'out_proj'),
            ('intermediate', 'mlpwi'), ('output', 'mlpwo')),
}
# Where each family's stacked blocks are in the parameter tree.
STACKS = {'llama': ('layers', 'block'), 'gpt': ('h', 'block'), 'vit': ('encoder', 'block')}
# Names peft users give that stand for several of our projections (GPT-2's fused c_attn).
ALIASES = {'gpt': {'c_attn': ('attn/query', 'attn/key', 'attn/value')}}
# Top-level modules trained whole in a LoRA run (peft's modules_to_save).
TRAINED_WHOLE = {'vit': ('classifier',)}
QUANTIZE = ('int8', 'nf4')


@dataclasses.dataclass(frozen=True)
class LoraSpec:
  """The adapters of a LoRA (or QLoRA) run.

  Attributes:
    rank: r, the adapters' inner width (>= 1).
    alpha: the adapter output is scaled by ``alpha / rank`` (peft's ``lora_alpha``).
    dropout: dropout on the adapter's input in training (peft's ``lora_dropout``).
    targets: the adapted projections, as full names of :data:`PROJECTIONS`
      (:func:`resolve_targets` makes them); None: every projection.
    quantize: None (the base in the compute dtype), ``'int8'`` or ``'nf4'``:
      every block projection's kernel stored quantized in blocks of 64 weights
      along its input axis (:mod:`models.lora.quantize`), dequantized layer by
      layer where it is used.
  """
  rank: int
  alpha: float = 16.0
  dropout: float = 0.0
  targets: tuple[str, ...] | None = None
  quantize: str | None = None

  def __post_init__(self):
    if isinstance(self.targets, list):   # from a JSON run record
      object.__setattr__(self, 'targets', tuple(self.targets))
    if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
      raise ValueError(f'--lora: the rank must be an integer >= 1, got {self.rank!r}')
    if not self.alpha > 0:
      raise ValueError(f'--lora-alpha must be > 0, got {self.alpha}')
    if not 0.0 <= self.dropout < 1.0:
      raise ValueError(f'--lora-dropout must be in [0, 1), got {self.dropout}')
    if self.quantize not in (None,) + QUANTIZE:
      raise ValueError(f"--quantize must be one of {', '.join(QUANTIZE)}, got '{self.quantize}'")
    if self.targets is not None and not self.targets:
      raise ValueError('--lora-targets names no projection')

  @property
  def scale(self) -> float:
    """``alpha / rank``, what the adapter's output is multiplied by."""
    return self.alpha / self.rank

  def adapts(self, projection: str) -> bool:
    """Whether the projection (a full name of :data:`PROJECTIONS`) carries an adapter."""
    return self.targets is None or projection in self.targets

  def describe(self) -> str:
    """One phrase for logs and table headers: 'LoRA r=16 alpha=32 on 7 projections, nf4 base'."""
    what = 'every projection' if self.targets is None else ', '.join(self.targets)
    base = f', {self.quantize} base' if self.quantize else ''
    drop = f' dropout {self.dropout:g}' if self.dropout else ''
    return f'{"QLoRA" if self.quantize else "LoRA"} r={self.rank} alpha={self.alpha:g}{drop} on {what}{base}'


def projection_tag(arch: str, projection: str) -> str:
  """The checkpoint name of a projection's output (what its adapter's product is tagged)."""
  return dict(PROJECTIONS[arch])[projection]


def resolve_targets(arch: str, names) -> tuple[str, ...] | None:
  """``--lora-targets`` (names, or a comma-separated string) -> full projection names.

  None or 'all' keeps every projection (None). A name matches a projection
  whole (``self_attn/q_proj``) or by its last part (``q_proj``; ``c_proj`` is both
  of GPT-2's), or is a peft alias (GPT-2's ``c_attn``: query, key and value).

  Raises:
    ValueError: one line naming a target that matches no projection, and the
      projections there are; or a family without adapters.
  """
  if arch not in PROJECTIONS:
    raise ValueError(f"--lora applies to {', '.join(sorted(PROJECTIONS))} models, not {arch}")
  if names is None:
    return None
  if isinstance(names, str):
    names = [n.strip() for n in names.split(',') if n.strip()]
  if list(names) == ['all']:
    return None
  known = [p for p, _ in PROJECTIONS[arch]]
  chosen = set()
  for name in names:
    hits = ALIASES.get(arch, {}).get(name) or [p for p in known
                                              if name in (p, p.rsplit('/', 1)[-1])]
    if not hits:
      raise ValueError(f"--lora-targets: '{name}' matches no projection of a {arch} model; its "
                       f"projections: {', '.join(known)} (or their last parts, or all)")
    chosen.update(hits)
  if not chosen:
    raise ValueError('--lora-targets names no projection')
  return tuple(p for p in known if p in chosen)


def check_config(config, arch: str) -> None:
  """Raises a one-line ValueError if ``config.lora`` does not fit a model of ``arch``."""
  spec = getattr(config, 'lora', None)
  if spec is None:
    return
  if arch not in PROJECTIONS:
    raise ValueError(f"--lora applies to {', '.join(sorted(PROJECTIONS))} models, not {arch}")
  known = {p for p, _ in PROJECTIONS[arch]}
  unknown = [t for t in spec.targets or () if t not in known]
  if unknown:
    raise ValueError(f"LoRA targets {', '.join(unknown)} are not projections of a {arch} model; "
                     f"its projections: {', '.join(p for p, _ in PROJECTIONS[arch])}")


def as_spec(value) -> LoraSpec | None:
  """None, a LoraSpec, or its fields as a dict (a JSON run record) -> a LoraSpec or None."""
  if value is None or isinstance(value, LoraSpec):
    return value
  if isinstance(value, dict):
    fields = {f.name for f in dataclasses.fields(LoraSpec)}
    unknown = sorted(set(value) - fields)
    if unknown:
      raise ValueError(f"lora: unknown field(s) {', '.join(unknown)}; valid: {', '.join(sorted(fields))}")
    return LoraSpec(**value)
  raise ValueError(f'lora must be None, a LoraSpec or a dict, got {value!r:.60}')
