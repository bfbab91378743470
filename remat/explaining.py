"""Where the memory goes: ``remat.explain(build, *example_args, policy=...)``.

Compiles one policy's program as :func:`remat.measure` does and reads XLA's
own buffer assignment and schedule of it (:mod:`remat.buffers`), then gives:

* **the timeline**: live bytes at each position of XLA's schedule (the
  module-scoped, flattened sequence: a loop's body appears once and stands for
  every iteration, whose buffers it reuses), with the forward pass, the
  backward pass, the optimizer update and each scanned loop marked;
* **the peak's contents** in categories (:data:`CATEGORIES`), the values
  saved for the backward pass by ``checkpoint_name`` tag, and the largest
  buffers with shape, dtype, size, source line and loop;
* **the packing loss**: the plan's bytes (``argument + output - alias +
  temp``, :mod:`remat.memory`) minus the live peak.

Definitions (docs/measuring.md):

* *live bytes at position t*: the bytes of the plan's parameter, output and
  temp allocations that hold an ``HloValue`` live at t, by XLA's live ranges
  (``HloLiveRange``) and XLA's offsets; two values in the same bytes at once
  (an in-place update at the instant it happens, a loop's carried value and its
  body parameter) count once. Host-memory values (offload) are a separate curve.
* *live peak*: the maximum of that curve. XLA's dump also names a "peak"
  moment, chosen with a loop-carried value sized as its while loop's tuple
  (a few bytes), so its moment can miss the maximum; it is reported beside ours
  as ``xla_listed_peak``.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from remat.buffers import Plan, PlanError, Value, compile_with_plan
from remat.memory import MemoryStats, compiled_memory, format_bytes
from remat.policies import Policy, PolicyError, get_policy
from remat.targets import Target, get_target

PARAMS, OPT, INPUTS = 'parameters', 'optimizer state', 'inputs'
GRADS, SAVED, BACKWARD, OTHER = ('gradients', 'saved for backward',
                                 'recompute + backward working set', 'other temporaries')
CATEGORIES = (PARAMS, OPT, INPUTS, GRADS, SAVED, BACKWARD, OTHER)
# A loop is marked on the timeline when its body spans at least this share of the schedule.
_LOOP_MIN_SHARE = 0.05
# ... and, inside another marked loop, at least this share of that loop's body.
_LOOP_MIN_NESTED = 0.25


class ExplainError(ValueError):
  """A program that cannot be explained (does not trace or compile); the message is one line."""


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
    lines = [f'# {self.spec} on {self.target}: live peak {f(self.peak_bytes)} at schedule position '
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
      lines.append(f'  {f(b.size):>11}  {b.shape:<24} {b.category}{label}; {b.op or b.name}'
                   + (f'; {b.source}' if b.source else '') + (f'; {b.loop}' if b.loop else ''))
    return '\n'.join(lines)

  def to_json(self, top: int = 50) -> dict:
    """Every figure, JSON-ready (the timeline in full, the ``top`` largest buffers)."""
    return {
        'policy': self.spec, 'target': self.target, 'peak_bytes': self.peak_bytes,
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


def _loop_label(inst) -> str:
  """'GPT/h' for 'jit(step)/transpose(jvp(GPT))/h/while': the module path the loop ran in.

  A bare ``lax.scan`` outside any module is named by its source line instead.
  """
  path = re.sub(r'(transpose|jvp)\(|\)', '', _short_op(inst.op_name))
  parts = [p for p in path.split('/') if p and p not in ('while', 'body', 'closed_call')]
  where = inst.source.split(' (')[0].rsplit('/', 1)[-1] if inst.source else inst.name
  return '/'.join(parts[-3:]) or where


def _leaf_roles(program, args, kind: str) -> list[tuple[str, str]]:
  """(category, path) of every flattened leaf of ``args``, in jit's parameter order."""
  from remat.measuring import TrainStep
  flat, _ = jax.tree_util.tree_flatten_with_path(args)
  roles = [(INPUTS, jax.tree_util.keystr(p)) for p, _ in flat]
  n0 = len(jax.tree_util.tree_leaves(args[0])) if args else 0
  if kind == 'loss':
    roles[:n0] = [(PARAMS, p) for _, p in roles[:n0]]
  elif isinstance(program, TrainStep):
    roles[:n0] = [(OPT, p) for _, p in roles[:n0]]
    try:   # which state leaves the loss differentiates: trace loss_args on leaf numbers
      numbered = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(args[0]), range(n0))
      picked = jax.tree_util.tree_leaves(program.loss_args(numbered, *args[1:])[0])
      for i in picked:
        if isinstance(i, int) and 0 <= i < n0:
          roles[i] = (PARAMS, roles[i][1])
    except Exception:  # a loss_args that computes: the state stays 'optimizer state'
      pass
  return roles


def _compile(program, args, target: Target, shardings):
  from remat.measuring import TrainStep, _abstract, _parts
  fn, donate, _ = _parts(program, args)
  # Given shardings name the devices (a mesh of CPU or abstract GPU devices) themselves.
  placed = target.place(_abstract(args)) if shardings is None else _abstract(args)
  kw = {'in_shardings': shardings} if shardings is not None else {}
  # keep_unused: HLO parameter i is then flattened leaf i, so each buffer maps to its argument.
  lowered = jax.jit(fn, donate_argnums=donate, keep_unused=True, **kw).lower(*placed)
  options = dict(target.compiler_options)
  if target.sharding is None and jax.default_backend() == 'cpu':
    # LLVM's optimisation of the CPU code is much of a compile and changes no buffer (the
    # plan is read, never run): the tiny GPT's plan is byte for byte the same without it.
    options['xla_backend_optimization_level'] = 0
  compiled, plan = compile_with_plan(lowered, options)
  return compiled, plan, ('step' if isinstance(program, TrainStep) else 'loss')


def explain(build: Callable[[Policy], Any], *example_args, policy: str | Policy = 'none',
            target: Target | str = 'cpu', shardings=None) -> Explanation:
  """Compiles ``build(policy)`` and explains XLA's memory plan of it (module docstring).

  Args:
    build: ``build(policy) -> program``, as for :func:`remat.measure`: a loss
      (explained as its ``value_and_grad`` w.r.t. the first argument) or a
      :class:`remat.TrainStep` (first argument donated).
    *example_args: arrays or ``jax.ShapeDtypeStruct``; compiled abstractly.
    policy: a spec or :class:`remat.Policy`.
    target: 'cpu', 'h100', 'h200' or a Target.
    shardings: ``in_shardings`` for ``jax.jit`` (a pytree prefix of the
      arguments): the per-device program on a mesh is explained.

  Raises:
    PolicyError: an unknown spec, or a tag the program does not emit.
    TargetError: an unknown target, or a GPU target without the plugin.
    ExplainError: ``build`` fails to trace or compile under the policy.
  """
  return explain_all(build, *example_args, policies=[policy], target=target,
                     shardings=shardings)[0]


def explain_all(build: Callable[[Policy], Any], *example_args, policies, target='cpu',
                shardings=None, num_layers: int | None = None,
                log: Callable[[str], None] | None = None) -> list[Explanation]:
  """:func:`explain` for several policies; every spec is checked before anything compiles."""
  from remat.measuring import program_tags
  target = get_target(target) if isinstance(target, str) else target
  try:
    tags = program_tags(build, *example_args)
  except Exception as e:  # the user's function does not even trace under none
    raise ExplainError(f"build('none') does not trace: {_one_line(e)}") from None
  resolved = [get_policy(p, num_layers=num_layers, tags=tags) for p in policies]
  out = []
  for pol in resolved:
    if log:
      log(f'explaining {pol.spec} on {target.name} ...')
    out.append(_explain_policy(build, example_args, pol, target, shardings))
  return out


def _explain_policy(build, example_args, pol: Policy, target: Target, shardings) -> Explanation:
  from remat.measuring import step_residuals
  try:
    program = build(pol)
    compiled, plan, kind = _compile(program, example_args, target, shardings)
    residuals = step_residuals(program, *example_args)
  except PolicyError as e:   # e.g. a segmenting build() cannot apply
    raise PolicyError(str(e).strip().splitlines()[0]) from None
  except PlanError as e:
    raise ExplainError(str(e)) from None
  except Exception as e:  # a user function that fails to trace, lower or compile
    raise ExplainError(f"build('{pol.spec}') does not compile for {target.name}: "
                       f'{_one_line(e)}') from None
  memory = compiled_memory(compiled, target.name)
  roles = _leaf_roles(program, example_args, kind)
  return analyse(plan, memory, pol.spec, target.name, roles, residuals)


def write(explanations: list[Explanation], path: str, environment: dict,
          title: str = '') -> list[str]:
  """Writes the JSON, PNG and SVG of ``explanations``; returns the paths written.

  One explanation: ``path`` is a file (``X.json``, ``X.png``, ``X.svg`` from its
  stem) unless it is a directory or ends with '/'. Several: ``path`` is a
  directory (created) holding one ``SPEC.json/.png/.svg`` per policy and
  ``overlay.png/.svg`` with every policy on one plot.
  """
  from remat.explain_plot import plot
  from remat.table import write_json
  p = Path(path)
  as_dir = len(explanations) > 1 or p.is_dir() or str(path).endswith(('/', os.sep))
  if as_dir:
    p.mkdir(parents=True, exist_ok=True)
  elif p.parent and not p.parent.exists():
    raise ExplainError(f'--explain {path}: directory {p.parent} does not exist')
  written = []
  for e in explanations:
    stem = p / _file_name(e.spec) if as_dir else p.with_suffix('')
    write_json(str(stem.with_suffix('.json')), environment, {'explain': e.to_json()})
    written.append(str(stem.with_suffix('.json')))
    written += [str(x) for x in plot([e], stem, f'{title} {e.spec}'.strip())]
  if len(explanations) > 1:
    written += [str(x) for x in plot(explanations, p / 'overlay', title)]
  return written


def run_cli(build, example_args, specs: list[str], target: Target, path: str, environment: dict,
            title: str, num_layers: int | None = None) -> int:
  """``--explain`` of the reports: prints each policy's summary and writes the files (:func:`write`).

  Raises the one-line errors of :func:`explain_all` for the report to print.
  """
  import sys
  exps = explain_all(build, *example_args, policies=specs, target=target, num_layers=num_layers,
                     log=lambda s: print(s, file=sys.stderr, flush=True))
  for e in exps:
    print(e.summary())
  for written in write(exps, path, environment, title):
    print(f'wrote {written}')
  return 0


def _file_name(spec: str) -> str:
  return re.sub(r'[^\w.@+-]', '_', spec)


def _one_line(e: Exception) -> str:
  text = str(e).strip().splitlines()
  return f'{type(e).__name__}: {text[0] if text else ""}'.rstrip(': ')


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
  param_shapes = set()
  by_tag = collections.defaultdict(set)
  for r in residuals:
    by_tag[(_hlo_dtype(r.dtype), tuple(r.shape))].add(r.tag or '(untagged)')

  def phase(v: Value) -> str:
    inst = plan.instructions.get(v.instruction)
    p = _phase_of(inst.op_name) if inst else None
    if p:
      return p
    return next((s.label for s in phases if s.start <= v.start <= s.end), 'forward')

  for i, a in kinds.items():
    if a.parameter is not None and a.parameter < len(roles) and roles[a.parameter][0] == PARAMS:
      shp = next((_shape_key(v.shape) for v in plan.values if v.allocation == i), None)
      param_shapes.add(shp)

  def classify(v: Value) -> tuple[str, str | None, str]:
    alloc = kinds[v.allocation]
    ph = phase(v)
    if alloc.kind == 'parameter':
      if alloc.parameter is not None and alloc.parameter < len(roles):
        return roles[alloc.parameter][0], roles[alloc.parameter][1], ph
      return INPUTS, None, ph
    key = _shape_key(v.shape)
    if ph == 'forward' and bwd is not None and v.end >= bwd.start:
      return SAVED, '/'.join(sorted(_tags_of(key, by_tag))), ph
    if ph == 'backward' and key in param_shapes:
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
    cat, tag, ph = classify(v)
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
      if at and classify(max(at, key=lambda v: (v.size, v.start)))[0] == SAVED:
        saved_at_start += b
  return Explanation(spec, target, memory, tuple(int(x) for x in device),
                     tuple(int(x) for x in host), phases, loops, peak,
                     {c: b for c, b in categories.items() if b}, dict(saved.most_common()),
                     tuple(buffers), (plan.xla_peak_time, plan.xla_peak_bytes),
                     sum(r.nbytes for r in residuals), saved_at_start, plan)


def _tags_of(key, by_tag: dict) -> set[str]:
  """The jaxpr residual tags a saved buffer of (dtype, dims) can be.

  The same shape, or on a mesh a per-device shard of it (each dim dividing the global one).
  """
  if key in by_tag:
    return by_tag[key]
  if key is not None:
    dtype, dims = key
    found = set().union(*(tags for (d, g), tags in by_tag.items() if d == dtype and len(g) == len(dims)
                          and all(x and y % x == 0 for x, y in zip(dims, g))), set())
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
