"""The cheap model ``--remat=auto`` prunes with: candidate specs and their estimated plans and FLOPs.

Nothing here compiles. The model is calibrated by two real plans (``none``
and ``full``) and a few traces, and is used only to order and prune; the
search (:mod:`remat.auto`) compiles the finalists and reports the compiler's
figures.

**Memory.** A per-layer rule R keeps ``res(R)`` bytes for the backward pass
(:func:`remat.residuals.saved_residuals`, by tracing). Plans are taken to move
with residuals at the rate the two anchors show::

    peak(R) ~ peak(full) + alpha (res(R) - res(full)),
    alpha = (peak(none) - peak(full)) / (res(none) - res(full))

A ``names:S`` rule keeps full's residuals plus each tag's bytes, read once
from the trace of ``names:<every tag>``, so all 2^T tag subsets cost no trace.
A segmented ``R@seg:K`` keeps N/K segment inputs instead of N layer inputs
(``in`` bytes each) and, while one segment is recomputed, K layers' worth of
R's residuals: ``peak(full) + alpha ((N/K + K - N) in + K d(R))`` with
``d(R) = (res(R) - res(full)) / N``. A mix ``jxA+B`` keeps j layers of A and
N - j of B. The search corrects each kind's estimates by the smallest error
it has seen in that kind's real plans (a mix pays a gradient copy, say).

**FLOPs.** Recompute is additive over layers, so a mix is exact from its
parts: ``flops(none) + j r(A) + (N - j) r(B)``, ``r = (flops(R) - flops(none)) / N``.
A segmenting adds one forward of the stack (``flops(sqrt) - flops(none)``). A
``names:S`` rule recomputes full's matmuls less those whose outputs S saves
(each tag's producing matmul, found in the jaxpr). Before a candidate is
compiled its FLOPs are counted exactly (:func:`remat.flops.count_flops`).
"""

from __future__ import annotations

import dataclasses
import itertools

from remat.policies import PRESETS, preset_tags, sqrt_segment_size

# More tags than this: singletons and all-but-one subsets instead of all 2^T.
MAX_TAGS_ALL_SUBSETS = 8
# Per-layer rules (besides none and full) that the mixes and segmentings combine.
MAX_COMBINED_RULES = 6


@dataclasses.dataclass
class Candidate:
  """A spec with its estimated peak and FLOPs; ``exact`` once the FLOPs are counted.

  The exact FLOPs are ``flops(none) + sum(w * (flops(rule) - flops(none)) for w, rule in deps)
  + extra``: a per-layer rule depends on itself, ``R@seg:K`` on R plus one forward
  (``extra``), a mix ``jxA+B`` on A and B weighted j/N and (N-j)/N. So counting
  a few per-layer rules makes every segmenting and mix over them exact.
  """
  spec: str
  kind: str                 # 'layer', 'segmented' or 'mix'
  est_peak: float
  flops: float
  exact: bool = False
  stock: bool = False       # a named rule, preset or segmenting (not a tag subset or mix)
  deps: tuple[tuple[float, str], ...] = ()
  extra: float = 0.0
  saves: frozenset | None = None   # the tags a names: rule saves (None for other kinds)

  def __post_init__(self):
    if not self.deps and self.kind == 'layer':
      self.deps = ((1.0, self.spec),)


@dataclasses.dataclass
class Calibration:
  """What the model is fitted to: two real plans and a few traces (bytes, FLOPs)."""
  peak_none: int
  peak_full: int
  flops_none: int
  flops_full: int
  res_none: int
  res_full: int
  tag_bytes: dict[str, int]           # bytes each tag adds when saved (names:<all> trace)
  tag_flops: dict[str, int]           # recompute FLOPs saving each tag alone saves, vs full
  rule_res: dict[str, int]            # traced residuals of rules that are not tag subsets
  num_layers: int | None = None
  layer_input: int = 0                # bytes of one layer's input (a segment checkpoint)
  segment_flops: int = 0              # FLOPs one segmenting adds: flops(sqrt) - flops(none)

  @property
  def alpha(self) -> float:
    d = self.res_none - self.res_full
    return (self.peak_none - self.peak_full) / d if d > 0 else 1.0

  def layer_est(self, res: float) -> float:
    return self.peak_full + self.alpha * (res - self.res_full)


def tag_subsets(tags: list[str]) -> list[tuple[str, ...]]:
  """Non-empty tag subsets to try: all of them for a few tags, else singletons and complements."""
  tags = sorted(tags)
  if len(tags) <= MAX_TAGS_ALL_SUBSETS:
    return [c for k in range(1, len(tags) + 1) for c in itertools.combinations(tags, k)]
  return [(t,) for t in tags] + [tuple(u for u in tags if u != t) for t in tags] + [tuple(tags)]


def layer_candidates(cal: Calibration, tags: set[str], offload: bool) -> list[Candidate]:
  """Per-layer rules: none, full, dots, dots_no_batch, presets and ``names:`` tag subsets.

  ``offload``: also ``offload:`` subsets and offload presets (GPU targets; on the
  CPU backend offload is a no-op, the same plan as ``names:``).
  """
  out = [Candidate('none', 'layer', cal.peak_none, cal.flops_none, True, True),
         Candidate('full', 'layer', cal.peak_full, cal.flops_full, True, True)]
  for rule, res in cal.rule_res.items():   # dots, dots_no_batch: their matmuls are saved
    out.append(Candidate(rule, 'layer', cal.layer_est(res), cal.flops_none, False, True))
  preset_of = {}
  for name, (kind, _, _) in PRESETS.items():
    ptags = preset_tags(name, tags)   # on this model: the MLP-input alternative it emits
    if ptags is not None and (kind == 'names' or offload):
      preset_of.setdefault((kind, frozenset(ptags)), name)
  kinds = ('names', 'offload') if offload else ('names',)
  # A tag that is no residual when every tag is saved and saves no FLOPs alone (a value the
  # backward pass never reads, as the output feeding only a residual add) changes nothing:
  # subsets that differ only in such tags are one candidate, named by a preset if one is.
  live = {t for t in tags if cal.tag_bytes.get(t, 0) > 0 or cal.tag_flops.get(t, 0) > 0}
  seen: dict[tuple, int] = {}
  for subset in tag_subsets(list(tags)):
    saved = sum(cal.tag_bytes.get(t, 0) for t in subset)
    flops = max(cal.flops_none, cal.flops_full - sum(cal.tag_flops.get(t, 0) for t in subset))
    for kind in kinds:
      name = preset_of.get((kind, frozenset(subset)))
      spec = name or f'{kind}:{",".join(subset)}'
      # Offloaded residuals leave the device: its plan is about full's.
      est = cal.layer_est(cal.res_full + (saved if kind == 'names' else 0))
      cand = Candidate(spec, 'layer', est, flops, False, name is not None,
                       saves=frozenset(subset) if kind == 'names' else None)
      key = (kind, frozenset(subset) & live)
      if key not in seen:
        seen[key] = len(out)
        out.append(cand)
      elif name is not None and not out[seen[key]].stock:
        out[seen[key]] = cand
  return out


def front(cands: list[Candidate], limit: int) -> list[Candidate]:
  """The candidates not dominated in (estimated peak, FLOPs), at most ``limit``, spread evenly."""
  pts = sorted(cands, key=lambda c: (c.flops, c.est_peak))
  out, best = [], float('inf')
  for c in pts:
    if c.est_peak < best:
      out.append(c)
      best = c.est_peak
  if len(out) > limit:
    step = (len(out) - 1) / (limit - 1)
    out = [out[round(i * step)] for i in range(limit)]
  return out


def stack_candidates(cal: Calibration, layer: list[Candidate]) -> list[Candidate]:
  """Segmentings ``R@seg:K`` (K dividing N) and two-part mixes ``jxA+B`` over the layer front."""
  n = cal.num_layers
  if not n or n < 2:
    return []
  by_spec = {c.spec: c for c in layer}
  base = [by_spec['none'], by_spec['full']]
  combined = base + [c for c in front(layer, MAX_COMBINED_RULES + 2) if c.spec not in
                     ('none', 'full')][:MAX_COMBINED_RULES]
  d = lambda c: (c.est_peak - cal.peak_full) / cal.alpha / n      # residual bytes per layer
  r = lambda c: (c.flops - cal.flops_none) / n                     # recompute FLOPs per layer
  out = []
  sqrt_k = sqrt_segment_size(n)
  for k in [k for k in range(2, n + 1) if n % k == 0]:
    seg = 'sqrt' if k == sqrt_k else ('stage' if k == n else f'seg:{k}')
    for c in combined:
      est = cal.peak_full + cal.alpha * ((n // k + k - n) * cal.layer_input + k * d(c))
      spec = seg if c.spec == 'none' else f'{c.spec}@{seg}'
      stock = c.stock
      out.append(Candidate(spec, 'segmented', est, c.flops + cal.segment_flops, False, stock,
                           ((1.0, c.spec),), cal.segment_flops))
  for a, b in itertools.permutations(combined, 2):
    if not (a.flops > b.flops and a.est_peak < b.est_peak):
      continue   # the first j layers take the rule that recomputes more and keeps less
    for j in range(1, n):
      est = cal.peak_full + cal.alpha * (j * d(a) + (n - j) * d(b))
      flops = cal.flops_none + j * r(a) + (n - j) * r(b)
      out.append(Candidate(f'{j}x{a.spec}+{b.spec}', 'mix', est, flops, False, False,
                           ((j / n, a.spec), ((n - j) / n, b.spec))))
  return out
