"""Memory, residuals, recompute FLOPs and time of the train step per policy: ``python -m remat.report``.

Compile only by default: inputs are abstract, nothing is allocated, so shapes far
larger than the machine can be planned, for the local CPU backend or for an
H100/H200 target (``--target``). Figures are defined in :mod:`remat.memory`,
:mod:`remat.residuals` and :mod:`remat.flops`; the backend or target that produced
them is printed and written to the JSON.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
from tqdm import tqdm

from remat.device_peak import measured_device_peak
from remat.measure import Measurement, measure
from remat.memory import format_bytes
from remat.policies import PolicyError, get_policy, registered_specs
from remat.residuals import by_source, by_tag
from remat.targets import TARGETS, Target, TargetError, get_target, prefer_cpu_without_gpu
from remat.sweep import SWEEP_POLICIES, depth_sweep, format_sweep, plot_sweep, resolution_sweep

_TRANSFORMER_POLICIES = ('none', 'full', 'dots', 'dots_no_batch', 'sqrt', 'full@sqrt', 'minimal',
                         'save_qkv_proj', 'save_dot_except_mlp', 'qkv_proj_offloaded')
DEFAULT_POLICIES = {
    'gpt': _TRANSFORMER_POLICIES,
    'vit': _TRANSFORMER_POLICIES,
    'resnet': ('none', 'full', 'dots', 'dots_no_batch', 'convs', 'save_conv_narrow', 'sqrt',
               'full@sqrt', 'stage', 'full@stage', 'offload:conv1,conv2'),
}
MODELS = tuple(DEFAULT_POLICIES)


def pareto_front(points: dict[str, tuple[float, float]]) -> set[str]:
  """Names not dominated in (memory, cost): no other point is <= in both and < in one."""
  front = set()
  for name, (m, c) in points.items():
    if not any((m2 <= m and c2 <= c) and (m2 < m or c2 < c) for m2, c2 in points.values()):
      front.add(name)
  return front


def _specs(text: str | None, arch: str, tags: list[str]) -> list[str]:
  if text is None:
    specs = list(DEFAULT_POLICIES[arch])
  elif text == 'all':
    specs = registered_specs(tags[:3], model_tags=tags) + ['sqrt', 'full@sqrt', 'stage']
  else:  # ';' separates specs when some of them hold ',' (names:a,b)
    specs = [s.strip() for s in (text.split(';') if ';' in text else text.split(',')) if s.strip()]
  return ['none'] + [s for s in specs if s != 'none']


def rows(results: dict[str, Measurement]) -> list[dict]:
  """One JSON-ready row per policy, with ratios to 'none' and the Pareto flag."""
  base = results['none']
  ratio = lambda a, b: (a / b) if a is not None and b else None
  points = {s: (m.memory.temp, m.flops.flops) for s, m in results.items()}
  front = pareto_front(points)
  out = []
  for spec, m in results.items():
    out.append({
        'policy': spec, **{k: getattr(m.memory, k) for k in
                           ('argument', 'output', 'alias', 'temp', 'host_temp')},
        'peak': m.memory.peak, 'residual_bytes': m.residual_bytes,
        'residual_by_tag': by_tag(list(m.residuals)),
        'residual_top_sources': by_source(list(m.residuals), top=8),
        'flops': m.flops.flops, 'flops_exact': m.flops.exact,
        'memory_ratio': ratio(m.memory.temp, base.memory.temp),
        'recompute_ratio': ratio(m.flops.flops, base.flops.flops),
        'step_seconds': m.step_seconds, 'time_ratio': ratio(m.step_seconds, base.step_seconds),
        'pareto': spec in front})
  return out


def format_table(table: list[dict], header: str, timed: bool) -> str:
  cols = f"{'policy':<26}{'temp':>11}{'peak':>11}{'residual':>11}{'host':>12}{'mem/none':>9}{'recompute':>10}"
  cols += f"{'time':>8}" if timed else ''
  lines = [header, cols + '  pareto']
  for r in table:
    line = (f"{r['policy']:<26}{format_bytes(r['temp']):>11}{format_bytes(r['peak']):>11}"
            f"{format_bytes(r['residual_bytes']):>11}{format_bytes(r['host_temp']):>12}"
            f"{r['memory_ratio']:>8.1%}{r['recompute_ratio']:>9.3f}x")
    if timed:
      line += f"{r['time_ratio']:>7.2f}x"
    lines.append(line + ('  *' if r['pareto'] else ''))
  return '\n'.join(lines)


def plot_front(table: list[dict], path: str, title: str):
  """PNG: temp memory against recompute ratio, Pareto front joined, points labelled."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(8, 5.5))
  labels = {}  # policies that land on the same point share one label
  for r in table:
    xy = (round(r['recompute_ratio'], 4), r['temp'] / 2**30)
    labels.setdefault(xy, []).append(r['policy'])
    ax.scatter(*xy, color='C3' if r['pareto'] else 'C0', zorder=3)
  for xy, names in labels.items():
    ax.annotate(' / '.join(names), xy, fontsize=7, xytext=(4, 3), textcoords='offset points')
  front = sorted((r['recompute_ratio'], r['temp'] / 2**30) for r in table if r['pareto'])
  ax.plot(*zip(*front), color='C3', lw=1, label='Pareto front')
  ax.set_xlabel('recompute ratio (matmul FLOPs / none)')
  ax.set_ylabel('compiled temp memory (GiB)')
  ax.set_title(title, fontsize=9)
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog='python -m remat.report', description=__doc__.splitlines()[0])
  p.add_argument('--model', default=None,
                 help=f"model family: {', '.join(MODELS)} (default: the config's, else gpt)")
  p.add_argument('--config', default=None,
                 help='named config (configs/*.json; default: tiny, vit-tiny or resnet-tiny)')
  p.add_argument('--batch-size', type=int, default=8)
  p.add_argument('--seq-len', type=int, default=128, help='gpt: tokens per sequence')
  p.add_argument('--image-size', type=int, default=None,
                 help="vit/resnet: image side in pixels (default: the config's)")
  p.add_argument('--policies', default=None,
                 help="'all', or specs separated by ',' (by ';' when a spec holds ','); "
                      'default: a set chosen per model family')
  p.add_argument('--target', default='cpu', help=f"compile for: {', '.join(TARGETS)}")
  p.add_argument('--time', action='store_true',
                 help='also run each step (median of 5 after 2 warm-up; local backend only)')
  p.add_argument('--device-peak', action='store_true',
                 help="also run each step in a fresh process on the attached GPU and read the "
                      "allocator's peak_bytes_in_use (needs a GPU)")
  p.add_argument('--json', metavar='FILE', help='write every figure and the environment as JSON')
  p.add_argument('--plot', metavar='FILE', help='write a PNG of memory against recompute')
  p.add_argument('--sweep', metavar='depth=N,N,...|resolution=S,S,...',
                 help=f"depth (or, for vit/resnet, image-side) sweep of {', '.join(SWEEP_POLICIES)} "
                      'instead of the policy table')
  return p


def _check(args):
  """Resolves (named config, arch, size) from --model/--config and the shape flags."""
  from configs import DEFAULT_CONFIG, load_config
  if args.model is not None and args.model not in MODELS:
    raise ValueError(f"unknown model '{args.model}'; valid: {', '.join(MODELS)}")
  named = load_config(args.config or DEFAULT_CONFIG[args.model or 'gpt'])
  if args.model is not None and named.arch != args.model:
    raise ValueError(f'--model {args.model} does not match config {named.name} (a {named.arch} model)')
  vision = named.arch != 'gpt'
  if vision:
    size = args.image_size or named.model.image_size
  else:
    if args.image_size is not None:
      raise ValueError(f'--image-size applies to vit and resnet; {named.name} is a gpt config')
    size = args.seq_len
  for name, value in (('batch-size', args.batch_size),
                      ('image-size' if vision else 'seq-len', size)):
    if value < 1:
      raise ValueError(f'--{name} must be >= 1, got {value}')
  from training.tasks import Task
  Task(named.model).at_size(size)  # one-line error if the size does not fit
  return named, named.arch, size


def _parse_sweep(text: str, arch: str) -> tuple[str, list[int]]:
  kind, _, values = text.partition('=')
  try:
    values = sorted({int(v) for v in values.split(',') if v.strip()})
  except ValueError:
    values = []
  kinds = ('depth', 'resolution') if arch != 'gpt' else ('depth',)
  if kind not in kinds or len(values) < 2 or min(values) < 1:
    forms = ' or '.join(f'{k}={"S" if k == "resolution" else "N"},...' for k in kinds)
    raise ValueError(f"--sweep '{text}': expected {forms} with at least two values >= 1")
  if kind == 'depth' and arch == 'resnet':
    from models.resnet import DEPTHS
    bad = [v for v in values if v not in DEPTHS]
    if bad:
      raise ValueError(f"--sweep '{text}': ResNet depths must be standard ones: "
                       f"{', '.join(map(str, DEPTHS))}")
  return kind, values


def _sweep_report(args, named, size, target, header) -> dict:
  kind, values = _parse_sweep(args.sweep, named.arch)
  if kind == 'depth':
    sweep = depth_sweep(named.model, values, args.batch_size, size, target)
  else:
    sweep = resolution_sweep(named.model, values, args.batch_size, target)
  print(format_sweep(sweep, header))
  if args.plot:
    plot_sweep(sweep, args.plot, header.lstrip('# '))
  return {'sweep': sweep}


def _model_tags(named, size) -> list[str]:
  from training.tasks import Task
  return sorted(Task(named.model).at_size(size).emitted_tags(size))


def _policy_report(args, named, size, target, header) -> dict:
  if args.device_peak and jax.default_backend() != 'gpu':
    raise ValueError(f'--device-peak needs an attached GPU; the {jax.default_backend()} '
                     'backend keeps no peak memory statistics')
  results, peaks = {}, {}
  tags = _model_tags(named, size)
  specs = _specs(args.policies, named.arch, tags)
  for spec in specs:  # one-line errors before any compile
    get_policy(spec, tags=tags)
  for spec in tqdm(specs, desc='compiling', unit='policy', file=sys.stderr):
    results[spec] = measure(named.model, spec, args.batch_size, size, target, run=args.time)
    if args.device_peak:
      peaks[spec] = measured_device_peak(named.name, spec, args.batch_size, size)['peak_bytes']
  table = rows(results)
  for r in table:
    r['measured_device_peak'] = peaks.get(r['policy'])
  print(format_table(table, header, args.time))
  if peaks:
    print('# measured device peak (allocator peak_bytes_in_use, fresh process each): ' + ', '.join(
        f"{r['policy']} {format_bytes(r['measured_device_peak'] or 0)}" for r in table))
  print('# temp/peak/host: XLA memory plan; residual: bytes saved for backward (jaxpr); '
        'recompute: matmul+conv FLOPs / none; * = Pareto front (temp vs recompute)')
  if target.name == 'cpu' and any(get_policy(r['policy']).offloads for r in table):
    print('# offload policies: host offload is a no-op on the CPU backend, so they show no '
          'host bytes here; use --target h100|h200 for a GPU plan')
  if args.plot:
    plot_front(table, args.plot, header.lstrip('# '))
  return {'policies': table}


def main(argv=None) -> int:
  prefer_cpu_without_gpu()
  args = build_parser().parse_args(argv)
  try:
    named, arch, size = _check(args)
    target: Target = get_target(args.target)
    shape = {'image_size': size} if arch != 'gpt' else {'seq_len': size}
    env = {'jax': jax.__version__, 'backend': jax.default_backend(), 'target': target.name,
           'device': target.description, 'model': arch, 'config': named.name,
           'batch_size': args.batch_size, **shape, 'dtype': 'float32'}
    what = 'loss gradient (no optimizer)' if args.sweep else 'train step'
    dims = f'image {size}x{size}' if arch != 'gpt' else f'seq {size}'
    if args.sweep and args.sweep.startswith('resolution'):
      dims = 'image SxS'
    header = (f'# {what}, {arch} {named.name}, batch {args.batch_size} x {dims}, '
              f'float32, target {target.name} ({target.description}), compile only'
              f'{" + timed on the local backend" if args.time else ""} (jax {jax.__version__})')
    body = (_sweep_report if args.sweep else _policy_report)(args, named, size, target, header)
  except (PolicyError, TargetError, ValueError, RuntimeError) as e:
    print(f'remat.report: error: {e}', file=sys.stderr)
    return 2
  if args.json:
    with open(args.json, 'w') as f:
      json.dump({'environment': env, **body}, f, indent=1)
  return 0


if __name__ == '__main__':
  sys.exit(main())
