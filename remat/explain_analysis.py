"""The analysis behind :func:`remat.explain`: a parsed XLA plan -> an :class:`Explanation`.

Phases and loops of the schedule, the live-bytes curve, the peak's categories
and buffers; definitions in :mod:`remat.explaining` and docs/measuring.md.
Pure Python over :class:`remat.buffers.Plan`: nothing here compiles.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Any

import numpy as np

from remat.buffers import Plan, Value
from remat.memory import MemoryStats, format_bytes

PARAMS, OPT, INPUTS = 'parameters', 'optimizer state', 'inputs'
GRADS, SAVED, BACKWARD, OTHER = ('gradients', 'saved for backward',
                                 'recompute + backward working set', 'other temporaries')
CATEGORIES = (PARAMS, OPT, INPUTS, GRADS, SAVED, BACKWARD, OTHER)
# A loop is marked on the timeline when its body spans at least this share of the schedule.
_LOOP_MIN_SHARE = 0.05
# ... and, inside another marked loop, at least this share of that loop's body.
_LOOP_MIN_NESTED = 0.25


@dataclasses.dataclass(frozen=True)
class Buffer:
  """One buffer live at the peak."""
  name: str          # the HLO instruction that defines it
  shape: str         # e.g. 'f32[6,8,128,128]'
  size: int
  category: str
  tag: str | None    # checkpoint_name tag (saved values), or the parameter's path
  phase: str         # forward, backward, update
  source: str | None
  op: str            # JAX name stack (op_name) without the jit(...) prefix
  loop: str | None   # 'body of LOOP' or 'carried by LOOP'


@dataclasses.dataclass(frozen=True)
class Span:
  """A marked stretch of the schedule: a phase or a loop body (``trips`` iterations)."""
  label: str
  start: int
  end: int
  trips: int | None = None


@dataclasses.dataclass(frozen=True)
class Explanation:
  """What is live when in one policy's compiled program (module docstring)."""
  spec: str
  target: str
  plan: MemoryStats
  timeline: tuple[int, ...]
  host_timeline: tuple[int, ...]
  phases: tuple[Span, ...]
  loops: tuple[Span, ...]
  peak_time: int
  categories: dict[str, int]
  saved_by_tag: dict[str, int]
  buffers: tuple[Buffer, ...]
  xla_listed_peak: tuple[int, int]
  jaxpr_residual_bytes: int
  saved_at_backward_start: int
  xla: Plan = dataclasses.field(repr=False, compare=False, default=None)
  mesh: dict[str, int] | None = None   # axis sizes when one device's program of a mesh

  @property
  def devices(self) -> int:
    return math.prod(self.mesh.values()) if self.mesh else 1

  @property
  def peak_bytes(self) -> int:
    return self.timeline[self.peak_time]

  @property
  def host_at_peak(self) -> int:
    return self.host_timeline[self.peak_time]

  @property
  def packing_loss(self) -> int:
    """Plan bytes (argument + output - alias + temp) not live at the peak: XLA's heap fragmentation."""
    return self.plan.peak - self.peak_bytes

  def phase_at(self, t: int) -> str:
    return next((s.label for s in self.phases if s.start <= t <= s.end), 'other')

  def summary(self, top: int = 10) -> str:
    """The text summary: peak, packing, categories, saved values by tag, the largest buffers."""
    f = format_bytes
    loop = next((s for s in reversed(self.loops) if s.start <= self.peak_time <= s.end), None)
    where = self.phase_at(self.peak_time) + (f', in {loop.label}' if loop else '')
    on = self.target + (f', per device of mesh {_mesh_text(self.mesh)} ({self.devices} devices)'
                        if self.mesh else '')
    lines = [f'# {self.spec} on {on}: live peak {f(self.peak_bytes)} at schedule position '
             f'{self.peak_time} of {len(self.timeline) - 1} ({where}); plan {f(self.plan.peak)} '
             f'(argument + output - alias + temp), packing loss {f(self.packing_loss)}'
             + (f'; host {f(self.host_at_peak)} at the peak' if any(self.host_timeline) else '')]
    for name in CATEGORIES:
      if self.categories.get(name):
        lines.append(f'  {name:<34}{f(self.categories[name]):>12}'
                     f'{100 * self.categories[name] / max(self.peak_bytes, 1):>6.1f}%')
        if name == SAVED:
          lines += [f'    {tag:<32}{f(b):>12}' for tag, b in self.saved_by_tag.items()]
    lines.append(f'  top {min(top, len(self.buffers))} buffers at the peak:')
    for b in self.buffers[:top]:
      label = f' [{b.tag}]' if b.tag else ''
      lines.append(f'  {f(b.size):>11}  {b.shape:<24} {b.category}{label}; {_brief(b.op) or b.name}'
                   + (f'; {b.source}' if b.source else '') + (f'; {b.loop}' if b.loop else ''))
    return '\n'.join(lines)

  def to_json(self, top: int = 50) -> dict:
    """Every figure, JSON-ready (the timeline in full, the ``top`` largest buffers)."""
    return {
        'policy': self.spec, 'target': self.target, 'per_device': self.mesh is not None,
        'mesh': self.mesh, 'devices': self.devices, 'peak_bytes': self.peak_bytes,
        'peak_time': self.peak_time, 'schedule_length': len(self.timeline) - 1,
        'peak_phase': self.phase_at(self.peak_time),
        'plan': {**dataclasses.asdict(self.plan), 'peak': self.plan.peak},
        'packing_loss': self.packing_loss, 'host_bytes_at_peak': self.host_at_peak,
        'host_peak_bytes': max(self.host_timeline),
        'xla_listed_peak': {'time': self.xla_listed_peak[0], 'bytes': self.xla_listed_peak[1]},
        'jaxpr_residual_bytes': self.jaxpr_residual_bytes,
        'saved_at_backward_start': self.saved_at_backward_start,
        'categories': self.categories, 'saved_by_tag': self.saved_by_tag,
        'phases': [dataclasses.asdict(s) for s in self.phases],
        'loops': [dataclasses.asdict(s) for s in self.loops],
        'buffers': [dataclasses.asdict(b) for b in self.buffers[:top]],
        'timeline': list(self.timeline), 'host_timeline': list(self.host_timeline)}


def _mesh_text(mesh: dict[str, int]) -> str:
  return ','.join(f'{a}={n}' for a, n in mesh.items())


def _hlo_dtype(dtype) -> str:
  d = np.dtype(dtype)
  if d.name == 'bfloat16':
    return 'bf16'
  if d.kind == 'b':
    return 'pred'
  return {'f': 'f', 'i': 's', 'u': 'u', 'c': 'c'}.get(d.kind, d.kind) + str(8 * d.itemsize)


def _shape_key(shape: str) -> tuple[str, tuple[int, ...]] | None:
  """('f32', (6, 128)) of an HLO array shape like 'f32[6,128]{1,0}'; None for tuples."""
  m = re.match(r'(\w+)\[([\d,]*)\]', shape)
  if not m or shape.startswith('('):
    return None
  return m.group(1), tuple(int(x) for x in m.group(2).split(',') if x)


def _phase_of(op_name: str) -> str | None:
  if 'transpose(' in op_name:
    return 'backward'
  if 'jvp(' in op_name:
    return 'forward'
  return None


def _short_op(op_name: str) -> str:
  return re.sub(r'^jit\([^)]*\)/', '', op_name)


def _brief(op: str) -> str:
  """An op_name for the summary: JAX's scaffolding (while/body, checkpoint) left out.

  'transpose(jvp(GPT))/h/while/body/closed_call/checkpoint/rematted_computation/Block/mlp/mul'
  -> 'transpose(jvp(GPT))/h/recompute/Block/mlp/mul'.
  """
  parts = [{'rematted_computation': 'recompute'}.get(p, p) for p in op.split('/')
           if p not in ('while', 'body', 'closed_call', 'checkpoint')]
  changed = True
  while changed:   # a module path repeated by a nested remat (Block/mlp/Block/mlp): keep it once
    changed = False
    for k in range(len(parts) // 2, 0, -1):
      for i in range(len(parts) - 2 * k + 1):
        if parts[i:i + k] == parts[i + k:i + 2 * k]:
          del parts[i + k:i + 2 * k]
          changed = True
          break
      if changed:
        break
  return '/'.join(parts)


def _loop_label(inst) -> str:
  """'GPT/h' for 'jit(step)/transpose(jvp(GPT))/h/while': the module path the loop ran in.

  A bare ``lax.scan`` outside any module is named by its source line instead.
  """
  path = re.sub(r'(transpose|jvp|jit)\(|\)', '', _short_op(inst.op_name))
  parts = [p for p in path.split('/') if p and p not in ('while', 'body', 'closed_call')]
  where = inst.source.split(' (')[0].rsplit('/', 1)[-1] if inst.source else inst.name
  return '/'.join(parts[-3:]) or where


def _boundary(kinds: list[str | None], first: str, second: str, lo: int = 0) -> int:
  """The position b >= lo that best splits ``first`` ops before it from ``second`` ops after it.

  XLA schedules independent ops where it likes (a gradient of the loss head can
  run early), so a phase is where most of its ops are: b minimises the ops of
  ``second`` before b plus the ops of ``first`` from b on.
  """
  wrong = sum(k == first for k in kinds[lo:])
  best, best_at = wrong, lo
  for t in range(lo, len(kinds)):
    wrong += (kinds[t] == second) - (kinds[t] == first)
    if wrong < best:
      best, best_at = wrong, t + 1
  return best_at


def _spans(plan: Plan) -> tuple[tuple[Span, ...], tuple[Span, ...], dict[str, Any]]:
  """Phase spans, marked loop spans, and body computation -> its while instruction."""
  kinds = []
  for name in plan.sequence:
    inst = plan.instructions.get(name)
    op = inst.op_name if inst else ''
    # An op outside jvp/transpose after the backward pass is the optimizer update.
    kinds.append(_phase_of(op) or ('update' if op and inst.opcode != 'parameter' else None))
  end = len(plan.sequence)
  phases = []
  if 'backward' in kinds:
    b = _boundary(kinds, 'forward', 'backward')
    u = _boundary(kinds, 'backward', 'update', b)
    if b > 0:
      phases.append(Span('forward', 0, b - 1))
    phases.append(Span('backward', b, max(u - 1, b)))
    if 'update' in kinds[u:]:
      phases.append(Span('update', u, end))
    else:
      phases[-1] = Span('backward', b, end)
  elif 'forward' in kinds:
    phases.append(Span('forward', 0, end))
  comp_spans = plan.computation_spans()
  body_of, found = {}, []
  for inst in plan.instructions.values():
    if inst.opcode != 'while' or len(inst.called) < 2:
      continue
    body_of[inst.called[1]] = inst
    span = comp_spans.get(inst.called[1])
    if span and span[1] - span[0] >= _LOOP_MIN_SHARE * end and inst.trip_count != 1:
      found.append((inst, span))
  loops = []
  for inst, (s, e) in found:
    # A short loop inside a marked one (a random-number loop in a layer) is left unmarked.
    if any(s2 <= s and e <= e2 and (e - s) < _LOOP_MIN_NESTED * (e2 - s2)
           for i2, (s2, e2) in found if i2 is not inst):
      continue
    label = f'{_phase_of(inst.op_name) or "loop"} {_loop_label(inst)}'
    loops.append(Span(label + (f' x{inst.trip_count}' if inst.trip_count else ''), s, e,
                      inst.trip_count))
  return tuple(phases), tuple(sorted(loops, key=lambda s: s.start)), body_of


def _curve(values: list[Value], length: int) -> tuple[np.ndarray, list[tuple[int, int, int, Value]]]:
  """Live bytes per position (values sharing bytes counted once) and the merged intervals."""
  chunks = collections.defaultdict(list)
  for v in values:
    chunks[(v.allocation, v.offset)].append(v)
  merged = []   # (start, end, bytes, values) of each stretch of one chunk's occupancy
  for vs in chunks.values():
    vs.sort(key=lambda v: (v.start, v.end))
    cur = None
    for v in vs:
      if cur and v.start <= cur[1]:
        cur[1], cur[2] = max(cur[1], v.end), max(cur[2], v.size)
        cur[3].append(v)
      else:
        cur = [v.start, v.end, v.size, [v]]
        merged.append(cur)
  delta = np.zeros(length + 2, np.int64)
  for s, e, b, _ in merged:
    delta[s] += b
    delta[e + 1] -= b
  return np.cumsum(delta)[:length + 1], merged


def analyse(plan: Plan, memory: MemoryStats, spec: str, target: str,
            roles: list[tuple[str, str]], residuals=()) -> Explanation:
  """The :class:`Explanation` of a parsed plan (``roles``: category and path per entry parameter)."""
  length = len(plan.sequence)
  kinds = {i: a for i, a in plan.allocations.items() if a.kind in ('parameter', 'output', 'temp')}
  live = [v for v in plan.values if v.allocation in kinds and v.start is not None]
  device, merged = _curve([v for v in live if not v.on_host], length)
  host, _ = _curve([v for v in live if v.on_host], length)
  peak = int(np.argmax(device))
  phases, loops, body_of = _spans(plan)
  bwd = next((s for s in phases if s.label == 'backward'), None)
  param_dims = set()
  by_tag = collections.defaultdict(set)
  for r in residuals:
    by_tag[(_hlo_dtype(r.dtype), tuple(r.shape))].add(r.tag or '(untagged)')

  def phase(v: Value) -> str:
    inst = plan.instructions.get(v.instruction)
    p = _phase_of(inst.op_name) if inst else None
    if p:
      return p
    return next((s.label for s in phases if s.start <= v.start <= s.end), 'forward')

  first_value = {}
  for v in plan.values:
    first_value.setdefault(v.allocation, v)
  for i, a in kinds.items():
    if a.parameter is not None and a.parameter < len(roles) and roles[a.parameter][0] == PARAMS:
      key = _shape_key(first_value[i].shape) if i in first_value else None
      if key is not None:
        param_dims.add(key[1])

  def classify(v: Value, held_until: int = -1) -> tuple[str, str | None, str]:
    """``held_until``: the end of the stretch of ``v``'s bytes it belongs to (a value written in a
    loop's body is carried on in the same bytes, as the stacked residual, into the backward)."""
    alloc = kinds[v.allocation]
    ph = phase(v)
    if alloc.kind == 'parameter':
      if alloc.parameter is not None and alloc.parameter < len(roles):
        return roles[alloc.parameter][0], roles[alloc.parameter][1], ph
      return INPUTS, None, ph
    key = _shape_key(v.shape)
    like_param = key is not None and _param_like(key[1], param_dims)
    if ph == 'forward' and bwd is not None and max(v.end, held_until) >= bwd.start:
      tags = _tags_of(key, by_tag)
      if tags == {'(not in the jaxpr)'} and like_param:   # e.g. a flipped conv kernel
        return SAVED, '(a copy of a parameter)', ph
      return SAVED, '/'.join(sorted(tags)), ph
    if ph == 'backward' and like_param:
      return GRADS, None, ph
    if ph == 'backward':
      return BACKWARD, None, ph
    return OTHER, None, ph

  categories = {c: 0 for c in CATEGORIES}
  saved = collections.Counter()
  buffers = []
  for s, e, b, vs in merged:
    if not s <= peak <= e:
      continue
    at = [v for v in vs if v.start <= peak <= v.end and not v.on_host]
    if not at:
      continue
    v = max(at, key=lambda v: (v.size, v.start))
    cat, tag, ph = classify(v, e)
    categories[cat] += b
    if cat == SAVED:
      saved[tag] += b
    inst = plan.instructions.get(v.instruction)
    op = _short_op(inst.op_name) if inst else ''
    if cat in (PARAMS, OPT, INPUTS):   # an argument: its path in the arguments, not a tag
      op, tag = tag or op, None
    shape = 'tuple' if v.shape.startswith('(') else v.shape.split('{')[0]
    buffers.append(Buffer(v.instruction, shape, b, cat, tag, ph, inst.source if inst else None,
                          op, _loop_of(inst, body_of)))
  buffers.sort(key=lambda x: (-x.size, x.name))
  # XLA's counterpart of the jaxpr residuals: forward values still live when the backward starts.
  saved_at_start = 0
  if bwd is not None:
    for s, e, b, vs in merged:
      at = [v for v in vs if v.start <= bwd.start <= v.end]
      if at and classify(max(at, key=lambda v: (v.size, v.start)), e)[0] == SAVED:
        saved_at_start += b
  return Explanation(spec, target, memory, tuple(int(x) for x in device),
                     tuple(int(x) for x in host), phases, loops, peak,
                     {c: b for c, b in categories.items() if b}, dict(saved.most_common()),
                     tuple(buffers), (plan.xla_peak_time, plan.xla_peak_bytes),
                     sum(r.nbytes for r in residuals), saved_at_start, plan)


def _param_like(dims: tuple[int, ...], param_dims: set) -> bool:
  """A parameter's dims in any dtype (bf16 compute accumulates bf16 gradients), or its elements
  with its last two dims (a segmented stack's [S, K, ...] gradient of an [N, ...] parameter), or
  a stacked parameter's gradient rows: ``[N, elements per layer]`` (the stored scan's, which hold
  saved values until the backward loop writes them) or flat (:mod:`remat.kept_in_gradients`)."""
  if dims in param_dims:
    return True
  n = int(np.prod(dims)) if dims else 1
  for p in param_dims:
    if int(np.prod(p)) != n:
      continue
    if len(dims) >= 2 and len(p) >= 2 and p[-2:] == dims[-2:]:   # segmented
      return True
    if len(p) >= 3 and dims in ((p[0], n // p[0]), (n,)):       # rows, or flat
      return True
  return False


def _tags_of(key, by_tag: dict) -> set[str]:
  """The jaxpr residual tags a saved buffer of (dtype, dims) can be.

  First the same dtype and dims; else the same dims in another dtype (XLA may keep a
  mixed-precision value in float32); else, on a mesh, a per-device shard of a residual (each
  dim dividing the global one).
  """
  if key is None:
    return {'(not in the jaxpr)'}
  dtype, dims = key
  for match in (lambda d, g: (d, g) == key, lambda d, g: g == dims,
                lambda d, g: d == dtype and len(g) == len(dims)
                and all(x and y % x == 0 for x, y in zip(dims, g))):
    found = set().union(*(tags for (d, g), tags in by_tag.items() if match(d, g)))
    if found:
      return found
  return {'(not in the jaxpr)'}


def _loop_of(inst, body_of) -> str | None:
  if inst is None:
    return None
  if inst.opcode == 'while':
    return f'carried by loop {_loop_label(inst)}' + (
        f' x{inst.trip_count}' if inst.trip_count else '')
  loop = body_of.get(inst.computation)
  if loop is not None:
    return f'body of loop {_loop_label(loop)} (one iteration)'
  return None
