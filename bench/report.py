"""Memory, residuals, recompute FLOPs and time of a zoo model's train step per policy: ``python -m bench.report``.

Compile only by default: inputs are abstract, nothing is allocated, so shapes far
larger than the machine can be planned, for the local CPU backend or for an
H100/H200 target (``--target``). The figures and the table are remat's
(:mod:`remat.measuring`, :mod:`remat.table`; defined in docs/measuring.md); the
backend or target that produced them is printed and written to the JSON. For
your own function use ``python -m remat.report --fn``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys

import jax

from bench import zoo
from bench.device_peak import measured_device_peak
from bench.sweep import depth_sweep, resolution_sweep
from remat import PolicyError, get_policy, measuring, table
from remat.memory import format_bytes
from remat.policies import registered_specs
from remat.sweep import SWEEP_POLICIES, format_sweep, plot_sweep
from remat.layout import LAYOUTS, check_layout, per_block_reference, unrolled_reference
from remat.table import PER_BLOCK
from remat.targets import TARGETS, Target, TargetError, get_target, prefer_cpu_without_gpu
from training.arguments import OneLineParser, add_lora_flags

PROG = 'bench.report'
MODELS = tuple(zoo.FAMILIES)


def parse_specs(text: str | None, default: tuple[str, ...], tags: list[str]) -> list[str]:
  """--policies: None (the default set), 'all', or specs split on ',' (on ';' when one holds ',')."""
  if text is None:
    specs = list(default)
  elif text == 'all':
    specs = registered_specs(tags[:3], model_tags=tags) + ['sqrt', 'full@sqrt', 'stage']
  else:
    specs = [s.strip() for s in (text.split(';') if ';' in text else text.split(',')) if s.strip()]
  return ['none'] + [s for s in specs if s != 'none']


def build_parser() -> argparse.ArgumentParser:
  p = OneLineParser(prog=f'python -m {PROG}', description=__doc__.splitlines()[0])
  p.add_argument('--model', default=None,
                 help=f"model family: {', '.join(MODELS)} (default: the config's, else gpt)")
  p.add_argument('--config', default=None,
                 help='named config (configs/*.json; default: tiny, vit-tiny or resnet-tiny)')
  p.add_argument('--batch-size', type=int, default=8)
  p.add_argument('--grad-accum', type=int, default=1, metavar='K',
                 help='the train step accumulates the batch\'s gradient over K microbatches of '
                      'batch-size / K (train.py --grad-accum; policy table, --mesh and --explain)')
  p.add_argument('--seq-len', type=int, default=128, help='gpt: tokens per sequence')
  p.add_argument('--image-size', type=int, default=None,
                 help="vit/resnet: image side in pixels (default: the config's)")
  p.add_argument('--dtype', default=None,
                 help="compute dtype: float32 or bfloat16 (parameters and optimizer state stay "
                      "float32; docs/precision.md) (default: the config's)")
  p.add_argument('--policies', default=None,
                 help="'all', or specs separated by ',' (by ';' when a spec holds ','); "
                      'default: a set chosen per model family')
  p.add_argument('--target', default='cpu', help=f"compile for: {', '.join(TARGETS)}")
  p.add_argument('--layout', default='auto',
                 help=f"how the layer stack becomes a program: {', '.join(LAYOUTS)} (auto: per "
                      'target and policy; the parameters are the same under every layout)')
  p.add_argument('--reference', default=None, choices=('unrolled',),
                 help="with the policy table: a first row, the model with its layers in a "
                      'Python loop and no checkpoint (remat.layout.unrolled_reference); every '
                      'ratio is to it')
  p.add_argument('--per-block', default='', metavar='RULE,...',
                 help='with the policy table: a row per rule (full,dots), the model with each '
                      'layer in jax.checkpoint(policy=RULE) in a Python loop, the one-line '
                      'nn.remat habit (remat.layout.per_block_reference)')
  p.add_argument('--time', action='store_true',
                 help='also run each step (median of 5 after 2 warm-up; local backend only)')
  p.add_argument('--device-peak', action='store_true',
                 help="also run each step in a fresh process on the attached GPU and read the "
                      "allocator's peak_bytes_in_use (needs a GPU)")
  p.add_argument('--json', metavar='FILE', help='write every figure and the environment as JSON')
  p.add_argument('--plot', metavar='FILE', help='write a PNG of memory against recompute')
  p.add_argument('--mesh', metavar='AXIS=N,...', default=None,
                 help='per-device plan of the train step on a device mesh (axes data, fsdp; '
                      'docs/sharding.md; with --explain, each device\'s explanation); on CPU '
                      'simulate the devices with XLA_FLAGS=--xla_force_host_platform_device_count=N')
  p.add_argument('--fit', nargs='?', const='batch', choices=('batch', 'size', 'levers'),
                 default=None,
                 help='instead of the table at one shape: per policy, the largest batch (or, with '
                      "'--fit size', sequence length / image side) whose compiled plan fits "
                      "--budget; '--fit levers': the fastest policy, microbatches and (GPU "
                      'targets) optimizer placement for --batch-size within --budget, by the '
                      'cost model of docs/making-a-run-fit.md')
  p.add_argument('--budget', default='auto', metavar='auto[:SIZE]',
                 help="for --fit: auto:SIZE (e.g. auto:40GiB), or auto: the target's memory times "
                      "the preallocated fraction (GPU targets); --fit levers also takes auto:Fx "
                      "(none's plan of the whole batch times F)")
  p.add_argument('--fused-update', action='store_true',
                 help='measure the train step with AdamW applied layer by layer in the backward '
                      'pass (remat.fused_update; a per-layer clip) instead of the ordinary one; '
                      'models without dropout, policy table only')
  p.add_argument('--offload-optimizer', action='store_true',
                 help='plan the step with the optimizer state in pinned host memory between steps, '
                      'streamed to the device a layer at a time (train.py --offload-optimizer; '
                      'GPU targets: device and host bytes apart; a no-op on the CPU backend)')
  p.add_argument('--explain', metavar='FILE|DIR',
                 help="instead of the table: what is live when in XLA's plan of the train step "
                      'under each policy (one policy: FILE.json/.png/.svg; several: DIR with one '
                      'set per policy and overlay.png); per device with --mesh; docs/measuring.md')
  add_lora_flags(p)
  p.add_argument('--sweep', metavar='depth=N,N,...|resolution=S,S,...',
                 help=f"depth (or, for vit/resnet, image-side) sweep of {', '.join(SWEEP_POLICIES)} "
                      'instead of the policy table')
  return p


def _check(args):
  """Resolves (named config, family, size) from --model/--config, --dtype and the shape flags."""
  from configs import load_config, with_dtype
  from training.run.settings import lora_spec, with_lora
  if args.model is not None and args.model not in MODELS:
    raise ValueError(f"unknown model '{args.model}'; valid: {', '.join(MODELS)}")
  named = with_dtype(load_config(args.config or zoo.FAMILIES[args.model or 'gpt'].default_config),
                     args.dtype)
  if args.lora is not None and args.lora < 1:
    raise ValueError(f'--lora must be >= 1 (the rank of the adapters), got {args.lora}')
  named = with_lora(named, lora_spec(args, named.arch))   # one-line errors, as train.py's
  if args.model is not None and named.arch != args.model:
    raise ValueError(f'--model {args.model} does not match config {named.name} (a {named.arch} model)')
  fam = zoo.FAMILIES[named.arch]
  if fam.vision:
    size = args.image_size or named.model.image_size
  else:
    if args.image_size is not None:
      raise ValueError(f'--image-size applies to vit and resnet; {named.name} is a gpt config')
    size = args.seq_len
  for name, value in (('batch-size', args.batch_size),
                      ('image-size' if fam.vision else 'seq-len', size)):
    if value < 1:
      raise ValueError(f'--{name} must be >= 1, got {value}')
  check_layout(args.layout)
  # One-line errors: the size does not fit, K does not divide the batch.
  zoo.case(named.model, args.batch_size, size, args.layout, microbatches=args.grad_accum)
  if args.grad_accum > 1 and (args.sweep or args.fit in ('batch', 'size') or args.fused_update
                             or args.device_peak):
    raise ValueError('--grad-accum plans the policy table, --mesh and --explain: drop --sweep, '
                     '--fit, --fused-update and --device-peak')
  return named, fam, size


def _parse_sweep(text: str, fam: zoo.Family) -> tuple[str, list[int]]:
  kind, _, values = text.partition('=')
  try:
    values = sorted({int(v) for v in values.split(',') if v.strip()})
  except ValueError:
    values = []
  if kind not in fam.sweeps or len(values) < 2 or min(values) < 1:
    forms = ' or '.join(f'{k}={"S" if k == "resolution" else "N"},...' for k in fam.sweeps)
    raise ValueError(f"--sweep '{text}': expected {forms} with at least two values >= 1")
  if kind == 'depth' and fam.depths is not None:
    if any(v not in fam.depths for v in values):
      raise ValueError(f"--sweep '{text}': ResNet depths must be standard ones: "
                       f"{', '.join(map(str, fam.depths))}")
  return kind, values


def _sweep_report(args, named, fam, size, target, header) -> dict:
  kind, values = _parse_sweep(args.sweep, fam)
  if kind == 'depth':
    sweep = depth_sweep(named.model, values, args.batch_size, size, target)
  else:
    sweep = resolution_sweep(named.model, values, args.batch_size, target)
  print(format_sweep(sweep, header))
  if args.plot:
    plot_sweep(sweep, args.plot, header.lstrip('# '))
  return {'sweep': sweep}


def _policy_report(args, named, fam, size, target, header) -> dict:
  if args.device_peak and jax.default_backend() != 'gpu':
    raise ValueError(f'--device-peak needs an attached GPU; the {jax.default_backend()} '
                     'backend keeps no peak memory statistics')
  case = zoo.case(named.model, args.batch_size, size, args.layout, microbatches=args.grad_accum)
  tags = sorted(case.tags())
  policies = measuring.resolve_policies(parse_specs(args.policies, fam.policies, tags), set(tags),
                                        case.num_layers)  # one-line errors before any compile
  blocks = [get_policy(r, tags=tags) for r in args.per_block.split(',') if r.strip()]
  if any(p.segmented or p.mixed or not p.remat_layers for p in blocks):
    raise PolicyError(f"--per-block takes per-layer rules that checkpoint (full,dots), got "
                      f"'{args.per_block}'")
  fused = args.fused_update
  if fused and (blocks or args.reference):
    raise ValueError('--fused-update measures the policy table of its own step: drop --reference '
                     'and --per-block')
  example_args = case.fused_step_args() if fused else case.step_args()
  results, peaks = {}, {}
  from tqdm import tqdm
  yardsticks = ([('reference', unrolled_reference())] if args.reference else []) + [
      (PER_BLOCK + p.spec, per_block_reference(p)) for p in blocks]
  for label, context in tqdm(yardsticks, desc='yardsticks', unit='program', file=sys.stderr):
    with context:   # traced, compiled and its residuals read inside the yardstick
      results[label] = measuring.measure_policy(case.train_step(get_policy('none')),
                                                *example_args, spec=label, target=target)
  for policy in tqdm(policies, desc='compiling', unit='policy', file=sys.stderr):
    step = case.fused_train_step(policy) if fused else case.train_step(policy)
    real = (case.real_fused_step_args() if fused else case.real_step_args()) if args.time else None
    results[policy.spec] = measuring.measure_policy(
        step, *example_args, spec=policy.spec, target=target, time=args.time, time_args=real)
    if args.device_peak:
      peaks[policy.spec] = measured_device_peak(named.name, policy.spec, args.batch_size,
                                                size, dtype=named.model.dtype)['peak_bytes']
  rows = measuring.Report(results, target, 'reference' if args.reference else 'none').rows()
  for r in rows:
    r['measured_device_peak'] = peaks.get(r['policy'])
  print(table.format_table(rows, header, args.time))
  if peaks:
    print('# measured device peak (allocator peak_bytes_in_use, fresh process each): ' + ', '.join(
        f"{r['policy']} {format_bytes(r['measured_device_peak'] or 0)}" for r in rows))
  print('\n'.join(table.footer(rows, target.name)))
  if args.plot:
    table.plot_front(rows, args.plot, header.lstrip('# '))
  return {'policies': rows}


def _mesh_report(args, named, fam, size, target, header) -> dict:
  """Per-device plan of each policy's train step on ``--mesh`` (:mod:`training.step.mesh_plan`)."""
  from training.step.mesh_plan import format_plan, plan_row
  if args.sweep or args.fit or args.time or args.device_peak or args.plot:
    raise ValueError('--mesh plans the policy table only: drop --sweep, --fit, --time, '
                     '--device-peak and --plot')
  place = _placement(args, target)
  from training.step.accumulate import check
  check(args.grad_accum, args.batch_size, place.batch_shards)
  case = zoo.case(named.model, args.batch_size, size, args.layout, microbatches=args.grad_accum)
  tags = sorted(case.tags())
  policies = measuring.resolve_policies(parse_specs(args.policies, fam.policies, tags), set(tags),
                                        case.num_layers)
  state, batch = case.step_args()
  from tqdm import tqdm
  rows = [plan_row(place, case.train_step(p).step, state, batch, p.spec)
          for p in tqdm(policies, desc='compiling', unit='policy', file=sys.stderr)]
  print(format_plan(rows, header.replace(', compile only', f', {_on_mesh(place, target)}, '
                                         'compile only')))
  return {'mesh': _mesh_text(place), 'mesh_plan': rows}


def _placement(args, target):
  """``--mesh``'s :class:`training.step.mesh.Placement`: local devices, or abstract GPUs of a GPU target."""
  from training.step.mesh import Placement, parse_mesh
  devices = None
  if target.sharding is not None:   # a GPU target: a host of abstract GPUs, one per mesh slot
    from training.step.mesh_plan import gpu_devices
    devices = gpu_devices(target.name, math.prod(parse_mesh(args.mesh).values()))
  return Placement.from_spec(args.mesh, args.batch_size, devices)


def _mesh_text(place) -> str:
  from training.step.mesh import format_mesh
  return format_mesh(dict(place.mesh.shape))


def _on_mesh(place, target) -> str:
  """'mesh data=1,fsdp=2 over 2 x cpu device, per device': the headers' words for a mesh."""
  where = target.name if target.sharding is not None else f'{jax.default_backend()} device'
  return f'mesh {_mesh_text(place)} over {place.mesh.size} x {where}, per device'


def _explain_report(args, named, fam, size, target, header) -> dict:
  """``--explain``: XLA's live memory over the train step's schedule, per policy (remat.explain)."""
  from remat.explaining import run_cli
  if args.sweep or args.fit or args.time or args.device_peak or args.plot:
    raise ValueError('--explain explains the train step at one shape: drop --sweep, --fit, '
                     '--time, --device-peak and --plot')
  case = zoo.case(named.model, args.batch_size, size, args.layout, microbatches=args.grad_accum)
  tags = sorted(case.tags())
  specs = parse_specs(args.policies, fam.policies, tags)
  text = args.policies or ''
  if text and text != 'all' and 'none' not in [
      s.strip() for s in (text.split(';') if ';' in text else text.split(','))]:
    specs = specs[1:]   # explain what was asked: no baseline is needed here
  env = {'jax': jax.__version__, 'target': target.name, 'config': named.name,
         'batch_size': args.batch_size, 'size': size, 'dtype': named.model.dtype}
  title = header.lstrip('# ').replace(', compile only', '')
  example = case.step_args()
  shardings = outs = None
  if args.mesh:   # the shardings the mesh table compiles (training.step.mesh_plan.plan_row)
    place = _placement(args, target)
    state, batch = example
    state_sh = place.state_shardings(state)
    shardings = (state_sh, place.batch_shardings(batch))
    outs = (state_sh, place.replicated())   # Placement.jit_train_step's: new state, stats
    env.update(mesh=_mesh_text(place), devices=place.mesh.size, per_device=True)
    title = title.replace(f' target {target.name} ({target.description})',
                          f' target {target.name}, {_on_mesh(place, target)}')
  run_cli(case.train_step, example, specs, target, args.explain, env, title, case.num_layers,
          shardings=shardings, out_shardings=outs)
  return {'explain': args.explain, **({'mesh': env['mesh']} if args.mesh else {})}


def _offload_report(args, named, fam, size, target, header) -> dict:
  """``--offload-optimizer`` on a GPU target (:mod:`bench.offload`)."""
  from bench.offload import offload_report
  case = zoo.case(named.model, args.batch_size, size, args.layout)
  tags = sorted(case.tags())
  specs = [p.spec for p in measuring.resolve_policies(
      parse_specs(args.policies, fam.policies, tags), set(tags), case.num_layers)]
  return offload_report(args, named, fam, size, target, header, specs)


def _fit_report(args, named, fam, size, target, header) -> dict:
  from remat.auto_budget import parse_budget
  from remat.fit import fit_table, format_fits, plot_fits
  budget = parse_budget(args.budget)
  if budget.fraction is not None:
    raise ValueError(f"--budget '{args.budget}': a fraction of none's plan depends on the batch; "
                     'give auto:SIZE or auto')
  nbytes = budget.resolve(0, target.device_memory, target.name)
  base = zoo.case(named.model, args.batch_size, size, args.layout)
  tags = sorted(base.tags())
  specs = [p.spec for p in measuring.resolve_policies(
      parse_specs(args.policies, fam.policies, tags), set(tags), base.num_layers)]
  axis = 'batch' if args.fit == 'batch' else ('image side' if fam.vision else 'seq len')
  high = 1 << 20
  if args.fit == 'size' and not fam.vision:
    high = named.model.max_len

  offload = args.offload_optimizer and target.sharding is not None   # a no-op on the CPU

  def case(v: int):
    c = zoo.case(named.model, v, size, args.layout, offload=offload) if args.fit == 'batch' \
        else zoo.case(named.model, args.batch_size, v, args.layout, offload=offload)
    return c.train_step, c.step_args()
  fits = fit_table(case, specs, nbytes, target, base.num_layers, high=high)
  head = header.replace(f'batch {args.batch_size} x ', 'batch B x ' if args.fit == 'batch' else
                        f'batch {args.batch_size} x ')
  head += f'; largest {axis} within {budget.describe(nbytes)}'
  if offload:
    head += '; optimizer state in host memory (peak: device bytes)'
  print(format_fits(fits, head, axis))
  if args.plot:
    plot_fits(fits, args.plot, head.lstrip('# '), axis)
  return {'budget_bytes': nbytes, 'fit_axis': axis,
          'fits': [dataclasses.asdict(f) for f in fits]}


def main(argv=None) -> int:
  prefer_cpu_without_gpu()
  args = build_parser().parse_args(argv)
  try:
    named, fam, size = _check(args)
    target: Target = get_target(args.target)
    shape = {'image_size': size} if fam.vision else {'seq_len': size}
    env = {'jax': jax.__version__, 'backend': jax.default_backend(), 'target': target.name,
           'device': target.description, 'model': fam.arch, 'config': named.name,
           'batch_size': args.batch_size, **shape, 'dtype': named.model.dtype,
           'layout': args.layout}
    what = 'loss gradient (no optimizer)' if args.sweep else 'train step'
    if args.fused_update:
      if args.sweep or args.fit or args.mesh or args.explain or args.device_peak:
        raise ValueError('--fused-update measures the policy table only: drop --sweep, --fit, '
                         '--mesh, --explain and --device-peak')
      what = 'fused train step (AdamW per layer in the backward pass)'
    if args.offload_optimizer and target.sharding is None:
      print('# --offload-optimizer: a no-op on the CPU backend (host and device memory are the '
            "same RAM); the ordinary step's plan follows")
    dims = f'image {size}x{size}' if fam.vision else f'seq {size}'
    if args.sweep and args.sweep.startswith('resolution'):
      dims = 'image SxS'
    if args.grad_accum > 1:
      env['grad_accum'] = args.grad_accum
      what += (f' accumulated over {args.grad_accum} microbatches of '
               f'{args.batch_size // args.grad_accum}')
    lora = getattr(named.model, 'lora', None)
    if lora is not None:
      env['lora'] = dataclasses.asdict(lora)
      if args.device_peak:
        raise ValueError('--device-peak runs the full fine-tune of --config in a fresh process; '
                         'with --lora plan the table instead (drop --device-peak)')
      if args.fused_update:
        raise ValueError('--fused-update applies the optimizer to every parameter in the backward '
                         'pass; a --lora run trains only its adapters: drop one of them')
    header = (f'# {what}, {fam.arch} {named.name}{f" + {lora.describe()}" if lora else ""}, '
              f'batch {args.batch_size} x {dims}, '
              f'{named.model.dtype}, target {target.name} ({target.description}), '
              f'layout {args.layout}, compile only'
              f'{" + timed on the local backend" if args.time else ""} (jax {jax.__version__})')
    if args.fit == 'levers':
      from bench.levers import levers_report
      body = levers_report(args, named, fam, size, target, header)
    elif args.offload_optimizer and target.sharding is not None and not args.fit:
      body = _offload_report(args, named, fam, size, target, header)
    elif args.explain:
      body = _explain_report(args, named, fam, size, target, header)
    elif args.mesh:
      body = _mesh_report(args, named, fam, size, target, header)
    else:
      report = _sweep_report if args.sweep else (_fit_report if args.fit else _policy_report)
      body = report(args, named, fam, size, target, header)
  except (PolicyError, TargetError, ValueError, RuntimeError) as e:
    print(f'{PROG}: error: {e}', file=sys.stderr)
    return 2
  if args.json:
    table.write_json(args.json, env, body)
  return 0


if __name__ == '__main__':
  sys.exit(main())
