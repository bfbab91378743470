"""XLA's own buffer assignment and schedule of one compiled program, read from its dump files.

XLA decides where every array of a compiled program lives and for how long, but
exposes only totals to Python (``Compiled.memory_analysis()``). Its debug dumps
hold the rest, and per-compile debug options let us get them for one program
without process-wide ``XLA_FLAGS``::

    compiled = lowered.compile(compiler_options={'xla_dump_to': DIR, 'xla_dump_hlo_as_text': True})

This module compiles that way (:func:`compile_with_plan`) and parses three of the
files into a :class:`Plan`:

* ``*after_optimizations.txt``: the scheduled HLO module: each instruction's
  computation, opcode, shape and metadata (``op_name`` with the JAX name stack,
  e.g. ``jit(step)/transpose(jvp(Model))/.../rematted_computation/...``, and a
  stack frame giving the Python source line); while loops with their body and
  known trip count.
* ``*-live-range.txt``: XLA's ``HloLiveRange`` of the module-scoped schedule:
  the flattened instruction sequence (a while loop's condition and body appear
  once, before the while instruction, and stand for every iteration), each
  ``HloValue``'s live range ``[start, end]`` in that sequence, and the peak
  moment with the values live at it (``Live ranges at T (peak)``).
* ``*-buffer-assignment.txt``: every allocation (entry parameter, output,
  preallocated temp heap, constants, thread-local scalars) and the values in
  it, with their byte offset and size.

Nothing here estimates: every byte, offset and time is XLA's.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import tempfile
from typing import Any

# HLO memory space of pinned host memory (offloaded values: `S(5)` in a layout, `@5` on a value).
HOST_MEMORY_SPACE = 5


class PlanError(RuntimeError):
  """XLA wrote no dump files we can read for the program; the message is one line."""


@dataclasses.dataclass(frozen=True)
class Instruction:
  """One instruction of the scheduled HLO module."""
  name: str
  computation: str
  opcode: str
  shape: str
  op_name: str
  source: str | None          # 'file:line (function)' of the innermost Python frame, if known
  parameter: int | None       # entry/body parameter number
  called: tuple[str, ...]     # while: (condition, body); others: ()
  trip_count: int | None      # while: XLA's known trip count


@dataclasses.dataclass(frozen=True)
class Allocation:
  """One buffer-assignment allocation: ``kind`` is parameter, output, temp, constant or thread-local."""
  index: int
  size: int
  kind: str
  parameter: int | None
  live_out: bool


@dataclasses.dataclass(frozen=True)
class Value:
  """One ``HloValue``: where it lives (allocation, offset) and when (``[start, end]`` in the schedule)."""
  key: str                    # 'instruction{shape index}', as the live-range dump names it
  instruction: str
  size: int
  offset: int
  allocation: int
  shape: str
  memory_space: int
  phi: bool
  start: int | None
  end: int | None

  @property
  def on_host(self) -> bool:
    return self.memory_space == HOST_MEMORY_SPACE


@dataclasses.dataclass(frozen=True)
class Plan:
  """XLA's buffer assignment and schedule of one compiled program (see the module docstring)."""
  sequence: tuple[str, ...]
  instructions: dict[str, Instruction]
  allocations: dict[int, Allocation]
  values: tuple[Value, ...]
  xla_peak_time: int
  xla_peak_keys: tuple[str, ...]
  xla_peak_bytes: int
  entry: str

  def live_value_bytes(self, t: int) -> int:
    """Bytes of the values live at ``t``, each counted, as XLA sums its ``Live ranges at T`` list."""
    return sum(v.size for v in self.values if v.start is not None and v.start <= t <= v.end)

  def computation_spans(self) -> dict[str, tuple[int, int]]:
    """computation -> (first, last) time of its instructions in the flattened sequence."""
    spans: dict[str, list[int]] = {}
    for t, name in enumerate(self.sequence):
      inst = self.instructions.get(name)
      if inst is not None:
        s = spans.setdefault(inst.computation, [t, t])
        s[1] = t
    return {c: (a, b) for c, (a, b) in spans.items()}



def _split_shape(text: str) -> tuple[str, str]:
  """Splits 'SHAPE rest' where SHAPE may be a parenthesised tuple with spaces inside."""
  if text.startswith('('):
    depth = 0
    for i, ch in enumerate(text):
      depth += ch == '('
      depth -= ch == ')'
      if depth == 0:
        return text[:i + 1], text[i + 1:].lstrip()
  shape, _, rest = text.partition(' ')
  return shape, rest


_COMP_RE = re.compile(r'^(ENTRY )?%?([\w.\-]+) .*\{\s*$')
_INST_RE = re.compile(r'^\s+(ROOT )?%?([\w.\-]+) = (.*)$')
_TABLE_ROW = re.compile(r'^(\d+) (.*)$')


def _fields(text: str) -> dict[str, str]:
  return dict(re.findall(r'(\w+)=("[^"]*"|[^ }]+)', text))


def parse_hlo(text: str) -> tuple[dict[str, Instruction], str]:
  """Instructions of a scheduled HLO module's text (``Compiled.as_text()`` or the dump), and its entry."""
  tables: dict[str, dict[int, str]] = {}
  table = None
  raw = []
  computation, entry = None, ''
  for line in text.splitlines():
    if line in ('FileNames', 'FunctionNames', 'FileLocations', 'StackFrames'):
      table = tables.setdefault(line, {})
      continue
    if table is not None:
      m = _TABLE_ROW.match(line)
      if m:
        table[int(m.group(1))] = m.group(2)
        continue
      table = None
    m = _INST_RE.match(line)
    if m and computation is not None:
      raw.append((computation, m.group(2), m.group(3)))
      continue
    m = _COMP_RE.match(line)
    if m and not line.startswith(' '):
      computation = m.group(2)
      if m.group(1):
        entry = computation
  files = {k: v.strip('"') for k, v in tables.get('FileNames', {}).items()}
  funcs = {k: v.strip('"') for k, v in tables.get('FunctionNames', {}).items()}
  locations = {k: _fields(v) for k, v in tables.get('FileLocations', {}).items()}
  frames = {k: _fields(v) for k, v in tables.get('StackFrames', {}).items()}

  def source(frame_id: int) -> str | None:
    loc = locations.get(int(frames.get(frame_id, {}).get('file_location_id', -1)))
    if not loc:
      return None
    path = files.get(int(loc.get('file_name_id', -1)), '?')
    func = funcs.get(int(loc.get('function_name_id', -1)))
    return f"{_short_path(path)}:{loc.get('line', '?')}" + (f' ({func})' if func else '')

  out = {}
  for comp, name, rest in raw:
    shape, rest = _split_shape(rest)
    opcode = rest.split('(', 1)[0].strip()
    op_name = re.search(r'op_name="([^"]*)"', rest)
    frame = re.search(r'stack_frame_id=(\d+)', rest)
    src = source(int(frame.group(1))) if frame else None
    if src is None:
      f, l = re.search(r'source_file="([^"]*)"', rest), re.search(r'source_line=(\d+)', rest)
      src = f'{_short_path(f.group(1))}:{l.group(1)}' if f and l else None
    param = re.match(r'parameter\((\d+)\)', rest)
    called: tuple[str, ...] = ()
    trip = None
    if opcode == 'while':
      cond, body = re.search(r'condition=%?([\w.\-]+)', rest), re.search(r'body=%?([\w.\-]+)', rest)
      called = tuple(x.group(1) for x in (cond, body) if x)
      n = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)
      trip = int(n.group(1)) if n else None
    out[name] = Instruction(name, comp, opcode, shape, op_name.group(1) if op_name else '',
                            src, int(param.group(1)) if param else None, called, trip)
  return out, entry


def _short_path(path: str) -> str:
  """A path relative to the working directory when under it, else from site-packages on."""
  cwd = os.getcwd() + os.sep
  if path.startswith(cwd):
    return path[len(cwd):]
  i = path.find('site-packages' + os.sep)
  return path[i + len('site-packages') + 1:] if i >= 0 else path


_ALLOC_RE = re.compile(r'^allocation (\d+): size (\d+)(.*):\s*$')
_VALUE_RE = re.compile(r'^ value: <\d+ ([\w.\-]+)(\{[\d,]*\})?( \(phi\))? @(\d+)> '
                       r'\(size=(\d+),offset=(\d+)\): (.*)$')


def parse_buffer_assignment(text: str) -> tuple[dict[int, Allocation], list[tuple]]:
  """Allocations and ``(key, instruction, size, offset, allocation, shape, space, phi)`` of each value."""
  allocations, values, current = {}, [], None
  for line in text.splitlines():
    m = _ALLOC_RE.match(line)
    if m:
      index, size, attrs = int(m.group(1)), int(m.group(2)), m.group(3)
      param = re.search(r'parameter (\d+)', attrs)
      if param:
        kind = 'parameter'
      elif 'preallocated-temp' in attrs:
        kind = 'temp'
      elif 'output shape' in attrs:
        kind = 'output'
      elif 'constant' in attrs:
        kind = 'constant'
      elif 'thread-local' in attrs:
        kind = 'thread-local'
      else:
        kind = 'output' if 'live-out' in attrs else 'temp'
      allocations[index] = Allocation(index, size, kind, int(param.group(1)) if param else None,
                                      'live-out' in attrs)
      current = index
      continue
    m = _VALUE_RE.match(line)
    if m and current is not None:
      name, index = m.group(1), m.group(2) or '{}'
      shape = m.group(7)
      space = int(m.group(4))
      if f':S({HOST_MEMORY_SPACE})' in shape:
        space = HOST_MEMORY_SPACE
      values.append((name + index, name, int(m.group(5)), int(m.group(6)), current, shape,
                     space, bool(m.group(3))))
  return allocations, values


_RANGE_RE = re.compile(r'^    ([\w.\-]+\{[\d,]*\}):(-?\d+)-(-?\d+)$')
_PEAK_ITEM_RE = re.compile(r'^    ([\w.\-]+\{[\d,]*\}): (\d+) bytes')


def parse_live_range(text: str) -> tuple[list[str], dict[str, tuple[int, int]], int, list[str], int]:
  """(sequence, key -> (start, end), peak time, keys live at the peak, their bytes) of the dump."""
  sequence, ranges, peak_keys = [], {}, []
  peak_time, peak_bytes, section = -1, 0, None
  for line in text.splitlines():
    s = line.strip()
    if s == 'InstructionSequence:':
      section = 'seq'
      continue
    if s == 'BufferLiveRange:':
      section = 'ranges'
      continue
    m = re.match(r'Live ranges at (\d+) \(peak\):', s)
    if m:
      section, peak_time = 'peak', int(m.group(1))
      continue
    if s.startswith('Stack trace breakdown'):
      section = None
      continue
    if section == 'seq':
      t, _, name = s.partition(':')
      if t.isdigit():
        sequence.append(name)
    elif section == 'ranges':
      m = _RANGE_RE.match(line)
      if m:
        ranges[m.group(1)] = (int(m.group(2)), int(m.group(3)))
    elif section == 'peak':
      m = _PEAK_ITEM_RE.match(line)
      if m:
        peak_keys.append(m.group(1))
        peak_bytes += int(m.group(2))
  return sequence, ranges, peak_time, peak_keys, peak_bytes


def read_plan(hlo_text: str, buffer_text: str, live_text: str) -> Plan:
  """A :class:`Plan` from the three dump files' texts."""
  instructions, entry = parse_hlo(hlo_text)
  allocations, raw = parse_buffer_assignment(buffer_text)
  sequence, ranges, peak_time, peak_keys, peak_bytes = parse_live_range(live_text)
  values = []
  for key, name, size, offset, alloc, shape, space, phi in raw:
    start, end = ranges.get(key, (None, None))
    values.append(Value(key, name, size, offset, alloc, shape, space, phi, start, end))
  return Plan(tuple(sequence), instructions, allocations, tuple(values), peak_time,
              tuple(peak_keys), peak_bytes, entry)


def _one(directory: str, suffix: str) -> str:
  found = sorted(glob.glob(os.path.join(directory, f'*{suffix}')))
  if not found:
    raise PlanError(f'XLA wrote no *{suffix} for this program (is XLA_FLAGS overriding '
                    '--xla_dump_to?)')
  # Several modules may be dumped (e.g. a separate host computation); the step is the largest.
  return max(found, key=os.path.getsize)


def compile_with_plan(lowered: Any, compiler_options: dict | None = None) -> tuple[Any, Plan]:
  """Compiles ``lowered`` (a ``jax.stages.Lowered``) and reads XLA's plan of it from its dumps.

  The dump options are per compile (``compiler_options``); the files go to a
  temporary directory that is removed afterwards.

  Returns:
    ``(compiled, plan)``.
  """
  with tempfile.TemporaryDirectory(prefix='remat-explain-') as tmp:
    opts = dict(compiler_options or {})
    opts.update({'xla_dump_to': tmp, 'xla_dump_hlo_as_text': True})
    compiled = lowered.compile(compiler_options=opts)
    live = _one(tmp, 'after_optimizations-live-range.txt')
    prefix = live[:-len('-live-range.txt')]
    texts = []
    for path in (prefix + '.txt', prefix + '-buffer-assignment.txt', live):
      if not os.path.exists(path):
        raise PlanError(f'XLA wrote {os.path.basename(live)} but not {os.path.basename(path)}')
      with open(path) as f:
        texts.append(f.read())
  return compiled, read_plan(*texts)
