"""Where one train step's time goes, JAX against PyTorch, by kind of operation (CPU).

``python -m baselines.profile --model gpt2|vit|resnet [--config NAME] --batch-size B
[--seq-len L | --image-size S] [--families none,...] [--steps N]``

For each family, after warm-up steps, ``--steps`` train steps of each side are
profiled in this one process and the time of every operation is put in one
category (seconds per step):

    matmul & conv   weight matmuls and convolutions. JAX: a thunk whose HLO holds
                    a ``dot`` without batch dimensions or a ``convolution``.
                    PyTorch: ``mm``, ``addmm``, ``linear``, convolution kernels.
    attention       batched matmuls and what XLA fused with them. JAX: a thunk
                    whose HLO holds a ``dot`` with batch dimensions. PyTorch:
                    scaled-dot-product-attention kernels, ``bmm``, ``baddbmm``.
    copies          data movement only. JAX: a thunk whose HLO is nothing but
                    copy, transpose, (dynamic-)slice, dynamic-update-slice,
                    broadcast, concatenate, reshape or bitcast. PyTorch: ``copy_``,
                    ``clone``, ``cat``, ``stack``, ``_to_copy``.
    other           the rest: elementwise ops, reductions, the optimizer.

JAX times are the thunks XLA's CPU runtime records under ``jax.profiler`` (loop
thunks, whose bodies are recorded thunk by thunk, are left out). XLA runs
independent thunks concurrently and may return from a matmul before it has
finished, so its time can land on the thunks beside it: the JAX split between
categories is approximate; its total is the time of the ops. PyTorch times are
``torch.profiler``'s self CPU times of one eager step, which run one at a time.

Errors print one line, ``baselines.profile: error: ...``, and exit with code 2.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import re
import sys
import tempfile

from baselines.compare import (FAMILY_POLICY, CompareError, add_model_arguments, host_malloc,
                               load_torch, resolve, torch_fields, torch_shape)
from training.arguments import OneLineParser

PROG = 'baselines.profile'
CATEGORIES = ('matmul & conv', 'attention', 'copies', 'other')
WARMUP_STEPS = 2
_MOVES = {'copy', 'transpose', 'slice', 'dynamic-slice', 'dynamic-update-slice', 'broadcast',
          'concatenate', 'reshape', 'bitcast', 'parameter', 'constant', 'tuple',
          'get-tuple-element'}
_LOOPS = {'while', 'conditional', 'call'}
# name = shape opcode(...); a tuple shape holds spaces.
_INSTRUCTION = re.compile(r'\s*(?:ROOT )?%?([\w.\-]+) = (?:\([^=]*?\)|\S+) ([\w\-]+)\(')
_TORCH = {'matmul & conv': ('aten::mm', 'aten::addmm', 'aten::linear', 'aten::mkldnn_convolution',
                            'aten::convolution_backward', 'aten::_convolution'),
          'attention': ('aten::bmm', 'aten::baddbmm'),
          'copies': ('aten::copy_', 'aten::clone', 'aten::cat', 'aten::stack', 'aten::_to_copy')}


def hlo_categories(hlo_text: str) -> dict[str, str | None]:
  """Category of every instruction of an optimized HLO module (None: a loop, not counted)."""
  computations: dict[str, list[str]] = {}
  current = None
  for line in hlo_text.splitlines():
    header = re.match(r'^(?:ENTRY )?%?([\w.\-]+) \(', line)
    if header:
      current = computations.setdefault(header.group(1), [])
    elif current is not None and line.strip() and line.strip() != '}':
      current.append(line)
  out = {}
  for lines in computations.values():
    for line in lines:
      m = _INSTRUCTION.match(line)
      if not m:
        continue
      name, opcode = m.groups()
      called = re.search(r'calls=%?([\w.\-]+)', line)
      body = [line] + (computations.get(called.group(1), []) if called and opcode == 'fusion'
                       else [])
      out[name] = None if opcode in _LOOPS else _hlo_category(body)
  return out


def _hlo_category(lines: list[str]) -> str:
  opcodes = [m.group(2) for m in map(_INSTRUCTION.match, lines) if m]
  dots = [l for l, op in zip(lines, opcodes) if op == 'dot']
  if any('lhs_batch_dims' in l for l in dots):
    return 'attention'
  if dots or 'convolution' in opcodes:
    return 'matmul & conv'
  if set(opcodes[1:] if opcodes[0] == 'fusion' else opcodes) <= _MOVES:
    return 'copies'
  return 'other'


def torch_category(op: str) -> str:
  """Category of a torch profiler key (an aten op or a wrapper)."""
  for category, ops in _TORCH.items():
    if op in ops:
      return category
  return 'attention' if 'scaled_dot_product' in op else 'other'


def profile_jax(setup, spec: str, steps: int) -> dict[str, float]:
  """Seconds per step by category of our train step under ``spec`` (local CPU backend)."""
  import jax
  from bench.zoo import local_step
  compiled, state, batch = local_step(setup.named.model, spec, setup.batch_size, setup.size)
  categories = hlo_categories(compiled.as_text())
  for _ in range(WARMUP_STEPS):
    state, loss = compiled(state, batch)
    jax.block_until_ready(loss)
  with tempfile.TemporaryDirectory() as logdir:
    with jax.profiler.trace(logdir, create_perfetto_trace=True):
      for _ in range(steps):
        state, loss = compiled(state, batch)
        jax.block_until_ready(loss)
    with gzip.open(glob.glob(f'{logdir}/**/perfetto_trace.json.gz', recursive=True)[0]) as f:
      trace = json.load(f)
  events = trace['traceEvents'] if isinstance(trace, dict) else trace
  seconds = collections.Counter({c: 0.0 for c in CATEGORIES})
  for e in events:
    op = (e.get('args') or {}).get('hlo_op')
    if e.get('ph') == 'X' and op is not None and categories.get(op, 'other') is not None:
      seconds[categories.get(op, 'other')] += e['dur'] * 1e-6 / steps
  return dict(seconds)


def profile_torch(setup, family: str, steps: int, torch_modules) -> dict[str, float]:
  """Seconds per step by category of the Hugging Face model's eager train step under ``family``."""
  from torch.profiler import ProfilerActivity, profile
  torch_measure, torch_models, torch_policies = torch_modules
  fields, shape = torch_fields(setup), torch_shape(setup)
  net = torch_policies.apply_policy(
      setup.model, torch_models.build_model(setup.model, fields, image_size=shape['image_size']),
      family)
  batch = torch_models.make_batch(setup.model, fields, setup.batch_size, **shape)
  opt = torch_measure.make_optimizer(net)
  for i in range(WARMUP_STEPS):
    torch_measure.train_step(net, batch, opt, i)
  with profile(activities=[ProfilerActivity.CPU]) as prof:
    for i in range(steps):
      torch_measure.train_step(net, batch, opt, WARMUP_STEPS + i)
  seconds = collections.Counter({c: 0.0 for c in CATEGORIES})
  for e in prof.key_averages():
    seconds[torch_category(e.key)] += e.self_cpu_time_total * 1e-6 / steps
  return dict(seconds)


def format_rows(rows: list[dict]) -> list[str]:
  """The table: one JAX and one PyTorch line per family, seconds per step."""
  lines = [f"{'family':<11}{'side':<9}{'policy':<10}"
           + ''.join(f'{c:>15}' for c in CATEGORIES) + f"{'ops total':>12}"]
  for r in rows:
    for side, name, policy in (('jax', 'JAX', r['jax_policy']), ('torch', 'PyTorch', r['family'])):
      s = r[side]
      lines.append(f"{r['family'] if side == 'jax' else '':<11}{name:<9}{policy:<10}"
                   + ''.join(f'{s[c]:>13.2f} s' for c in CATEGORIES)
                   + f'{sum(s.values()):>10.2f} s')
  return lines


def build_parser():
  p = OneLineParser(prog=f'python -m {PROG}', description=__doc__.splitlines()[0])
  add_model_arguments(p)
  p.add_argument('--steps', type=int, default=1, help='profiled steps per side (averaged)')
  return p


def main(argv=None) -> int:
  from remat.targets import prefer_cpu_without_gpu
  prefer_cpu_without_gpu()
  try:
    setup = resolve(build_parser().parse_args(argv))
    torch_modules = load_torch()
    supported = torch_modules[2].supported_families(setup.model)
    rows = [{'family': f, 'jax_policy': FAMILY_POLICY[f],
             'jax': profile_jax(setup, FAMILY_POLICY[f], setup.steps),
             'torch': profile_torch(setup, f, setup.steps, torch_modules)}
            for f in setup.families if f in supported]
  except (CompareError, ValueError, RuntimeError) as e:
    print(f'{PROG}: error: {e}', file=sys.stderr)
    return 2
  dims = (f'image {setup.size}x{setup.size}' if setup.vision else f'seq {setup.size}')
  print(f'# seconds per train step by category, {setup.model} {setup.named.name}, batch '
        f'{setup.batch_size} x {dims}, float32, CPU, one process; host malloc {host_malloc()}; '
        f'{setup.steps} profiled step(s) per side after {WARMUP_STEPS} warm-up')
  for line in format_rows(rows):
    print(line)
  print('# JAX: XLA CPU thunks under jax.profiler (concurrent thunks blur the split; loops left '
        'out). PyTorch: torch.profiler self CPU time. Categories: see baselines/profile.py.')
  for f in setup.families:
    if f not in supported:
      print(f'# skipped {f}: not supported by the {setup.model} torch model')
  return 0


if __name__ == '__main__':
  sys.exit(main())
