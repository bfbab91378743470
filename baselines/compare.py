"""JAX (our policies) against PyTorch (HF models + torch checkpointing) per policy family, one table.

``python -m baselines.compare --model gpt2|llama|vit|resnet [--config NAME] --batch-size B
[--seq-len L | --image-size S] [--families none,hf,block,sqrt,selective] [--steps N]
[--json FILE] [--plot FILE]``

For one model config, batch and shape, every policy family gets a JAX row (our
train step under the policy of :data:`FAMILY_POLICY`, :func:`bench.zoo.measure`)
and a PyTorch row (the Hugging Face model under the torch family,
:func:`baselines.torch_measure.measure_torch`), all measured in this one process
on the CPU: step times are only comparable within one run.

Columns (one train step: forward, loss, backward, global-norm clip 1.0, AdamW)::

    peak        bytes live at the peak of one whole train step (parameters, optimizer
                state, batch, gradients, activations, temporaries).
                JAX: the compiled plan's ``peak = argument + output - alias + temp``
                from XLA's ``memory_analysis()`` (compile only, CPU backend; the
                train state is donated, so it counts once). An upper bound under
                XLA's buffer assignment, not an allocator measurement.
                PyTorch: MemTracker's 'Total' at its peak during one steady-state
                step on CPU (parameters and AdamW moments exist, gradients do not
                at the start): a trace of live tensor storage, without the
                allocator's caching or fragmentation or oneDNN scratch.
    activation  bytes the forward keeps for backward.
                JAX: ``residual_bytes``: the arrays the loss's VJP keeps, found by
                tracing the jaxpr (parameters, inputs and parameter-only values
                excluded; before XLA's buffer reuse; blind to what a recompute
                materialises in backward).
                PyTorch: ``saved_activation_bytes``: MemTracker's 'Activation'
                category live right after forward and loss, before backward
                (tensor storage created in the forward and still alive).
                The two are measured differently (program analysis vs storage
                trace); compare them as orders of magnitude and across families.
    FLOPs       matmul/convolution FLOPs of the whole step (2 per multiply-add),
                recomputation included; elementwise ops, norms and the optimizer
                count 0.
                JAX: our jaxpr walk (``dot_general`` and ``conv_general_dilated``;
                scan bodies times their length; :mod:`remat.flops`).
                PyTorch: ``FlopCounterMode`` (mm/addmm/bmm/baddbmm, convolution,
                scaled-dot-product attention kernels).
    recompute   FLOPs / FLOPs of ``none`` on the same side (1.000x = no recompute).
    time        median seconds of ``--steps`` train steps.
                JAX: ``measure(..., run=True)``: the compiled step, after 2 warm-up
                steps. PyTorch: eager steps after its warm-up, memory and FLOP steps.
    peak J/T    JAX peak / PyTorch peak of the family (on the PyTorch row).
    time J/T    JAX time / PyTorch time of the family (on the PyTorch row).

Matching the two sides:

* Family mapping: :data:`FAMILY_POLICY`. ``hf`` and ``block`` both map to JAX
  ``full``, which is measured once and shown on both families' JAX rows.
  Families a model does not support on the torch side (ResNet has no ``hf``)
  are skipped with a note.
* Optimizer: both AdamW with b1 0.9, b2 0.95, eps 1e-8, weight decay 0.1 and
  global-norm clipping at 1.0. The learning rate differs (JAX: the warmup-cosine
  schedule of :func:`training.step.train_step.make_optimizer` with peak 1e-3 that
  :mod:`bench.zoo` uses; torch: constant 3e-4); it changes neither memory nor
  FLOPs. torch's AdamW runs its default per-parameter (for-loop) implementation
  on CPU; optax's update is fused by XLA.
* GPT tokens: JAX ``--seq-len L`` means batches of ``[B, L + 1]`` windows, a
  forward over ``L`` positions and loss over ``B * L`` predictions. The torch
  side gets ``input_ids`` of ``[B, L + 1]`` (labels = inputs, shifted by HF), so
  it also predicts ``B * L`` tokens; its forward runs over ``L + 1`` positions
  (the last position's logits are computed and ignored by the loss), a
  ``1 / L`` larger forward. If ``L + 1`` exceeds the config's ``max_len`` the
  torch model gets ``L + 1`` learned positions (one row more than JAX's).
* Vision: the same images (JAX NHWC, torch NCHW) and labels per example.
* ``sqrt``: torch's ``checkpoint_sequential`` does not checkpoint its last
  segment, JAX's ``sqrt`` checkpoints every segment; for ResNet, torch segments
  all blocks as one list, JAX segments the identical blocks of each stage.
* ``selective`` saves the outputs of torch's matmul/conv/fused-attention ops,
  JAX ``dots`` saves every ``dot_general``/conv output.

Errors print one line, ``baselines.compare: error: ...``, and exit with code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import sys

from baselines.compare_output import JAX_WARMUP_STEPS, footer, format_table, plot
from training.arguments import OneLineParser

# Our policy for each PyTorch family: the JAX row of that family measures this spec.
FAMILY_POLICY = {
    'none': 'none',        # no checkpointing: every activation kept on both sides
    'hf': 'full',          # HF gradient checkpointing: per block, block input saved, block recomputed
    'block': 'full',       # torch.utils.checkpoint around every block: as hf
    'sqrt': 'sqrt',        # checkpoint_sequential in round(sqrt(N)) segments vs JAX ~sqrt(N)-layer segments
    'selective': 'dots',   # SAC saving matmul/conv outputs vs jax dots_saveable
}
FAMILIES = tuple(FAMILY_POLICY)
# --model -> our arch.
MODEL_ARCH = {'gpt2': 'gpt', 'llama': 'llama', 'vit': 'vit', 'resnet': 'resnet'}
MODELS = tuple(MODEL_ARCH)
# Our archs whose size is a sequence length (models.tasks.LANGUAGE_ARCHS, not imported here:
# resolve() runs before anything heavy is).
LANGUAGE_ARCHS = ('gpt', 'llama')
DEFAULT_CONFIG = {'gpt2': 'gpt2-small', 'llama': 'llama-tiny', 'vit': 'vit-b16-224',
                  'resnet': 'resnet-50'}
DEFAULT_SEQ_LEN = 128  # capped at the config's max_len
# What bench.zoo gives the JAX step: training.step.train_step.make_optimizer(**bench.zoo.OPTIMIZER).
JAX_OPTIMIZER = {'name': 'optax adamw (clip_by_global_norm first)', 'b1': 0.9, 'b2': 0.95,
                 'eps': 1e-8, 'weight_decay': 0.1, 'grad_clip': 1.0,
                 'lr': 'warmup-cosine schedule, peak 1e-3 (10 warm-up steps of 1000)'}
PROG = 'baselines.compare'
TORCH_HINT = ('install them with pip install -e ".[torch]" '
              '(torch==2.13.0 gives the CPU build here)')


class CompareError(ValueError):
  """A one-line error for the command line."""


def add_model_arguments(p: argparse.ArgumentParser) -> None:
  """The flags that pick the model, shapes and families (what :func:`resolve` checks)."""
  p.add_argument('--model', required=True, help=f"model: {', '.join(MODELS)}")
  p.add_argument('--config', default=None,
                 help='named config (configs/*.json) of that model; default: '
                      + ', '.join(f'{m} -> {c}' for m, c in DEFAULT_CONFIG.items()))
  p.add_argument('--batch-size', type=int, required=True, help='examples per step')
  p.add_argument('--seq-len', type=int, default=None,
                 help=f'gpt2/llama: predicted tokens per row, L (JAX windows [B, L+1], torch '
                      f'input_ids [B, L+1]); default min({DEFAULT_SEQ_LEN}, max_len)')
  p.add_argument('--image-size', type=int, default=None,
                 help="vit/resnet: image side in pixels (default: the config's)")
  p.add_argument('--families', default=None,
                 help=f"policy families, comma-separated, from {', '.join(FAMILIES)} "
                      '(default: all the model supports)')


def build_parser() -> argparse.ArgumentParser:
  p = OneLineParser(prog=f'python -m {PROG}', description=__doc__.splitlines()[0])
  add_model_arguments(p)
  p.add_argument('--steps', type=int, default=3, help='timed steps per row (median)')
  p.add_argument('--fused-update', action='store_true',
                 help='JAX side: AdamW applied layer by layer in the backward pass '
                      '(remat.fused_update), so no whole-stack gradient exists; its global-norm '
                      'clip becomes a clip per layer. Models without dropout (vit, llama)')
  p.add_argument('--layout', default='auto', metavar='LAYOUT',
                 help='JAX side: how the layer stack becomes a program: auto, scan, unrolled, '
                      'loops, groups (auto: the scan on the CPU; the parameters are the same '
                      'under every layout; docs/own-model.md)')
  p.add_argument('--json', metavar='FILE', help='write every figure of both sides and the environment')
  p.add_argument('--plot', metavar='FILE',
                 help='write a PNG: peak memory per family, JAX vs PyTorch, time ratio annotated')
  return p


@dataclasses.dataclass(frozen=True)
class Setup:
  """What is measured, checked: model, config, shapes and families."""
  model: str                   # gpt2 | llama | vit | resnet
  arch: str                    # gpt | llama | vit | resnet
  named: object                # configs.NamedConfig
  batch_size: int
  size: int                    # JAX size: seq_len L (gpt) or image side S
  families: tuple[str, ...]    # requested, known names, in the order given
  steps: int
  fused: bool = False          # JAX side runs training.step.fused_step's step
  layout: str = 'auto'         # JAX side: remat.layout.LAYOUTS

  @property
  def vision(self) -> bool:
    return self.arch not in LANGUAGE_ARCHS


def _parse_families(text: str | None) -> tuple[str, ...]:
  if text is None:
    return FAMILIES
  names = [f.strip() for f in text.split(',') if f.strip()]
  bad = [f for f in names if f not in FAMILY_POLICY]
  if bad or not names:
    raise CompareError(f"unknown policy family '{bad[0] if bad else text}'; valid: "
                       f"{', '.join(FAMILIES)}")
  return tuple(dict.fromkeys(names))


def resolve(args) -> Setup:
  """Checks the flags (nothing heavy is imported or measured); one-line CompareError otherwise."""
  if args.model not in MODEL_ARCH:
    raise CompareError(f"unknown model '{args.model}'; valid: {', '.join(MODELS)}")
  arch = MODEL_ARCH[args.model]
  from configs import load_config
  try:
    named = load_config(args.config or DEFAULT_CONFIG[args.model])
  except ValueError as e:
    raise CompareError(str(e)) from None
  if named.arch != arch:
    raise CompareError(f"--model {args.model} (our '{arch}') does not match config {named.name}, "
                       f"a '{named.arch}' model")
  families = _parse_families(args.families)
  vision = arch not in LANGUAGE_ARCHS
  if vision:
    if args.seq_len is not None:
      raise CompareError(f'--seq-len applies to gpt2 and llama; {named.name} is a {arch} config '
                         '(use --image-size)')
    size = args.image_size if args.image_size is not None else named.model.image_size
  else:
    if args.image_size is not None:
      raise CompareError(f'--image-size applies to vit and resnet; {named.name} is a {arch} config '
                         '(use --seq-len)')
    size = (args.seq_len if args.seq_len is not None
            else min(DEFAULT_SEQ_LEN, named.model.max_len))
  for flag, value in (('batch-size', args.batch_size),
                      ('image-size' if vision else 'seq-len', size), ('steps', args.steps)):
    if value < 1:
      raise CompareError(f'--{flag} must be >= 1, got {value}')
  from models.tasks import Task
  try:
    Task(named.model).at_size(size)
  except ValueError as e:
    raise CompareError(str(e)) from None
  fused = bool(getattr(args, 'fused_update', False))
  if fused:
    if arch == 'resnet':
      raise CompareError('--fused-update cuts a model at its one layer stack; a ResNet has one '
                         'per stage')
    from training.step.fused_step import dropout_of
    drop = dropout_of(named.model)
    if drop:
      raise CompareError(f'--fused-update runs models without dropout; {named.name} has '
                         + ', '.join(f'{k} {v}' for k, v in drop.items()))
  layout = getattr(args, 'layout', 'auto')
  from remat.layout import check_layout
  try:
    check_layout(layout)
  except ValueError as e:
    raise CompareError(str(e)) from None
  if fused and layout != 'auto':
    raise CompareError('--fused-update runs its own reverse loop over the stack; --layout '
                       'applies to the ordinary step')
  return Setup(args.model, arch, named, args.batch_size, size, families, args.steps, fused,
               layout)


def load_torch():
  """Imports torch, transformers and the torch measurement; one-line CompareError if missing."""
  try:
    import torch  # noqa: F401  (imported only to fail early with a one-line hint)
    import transformers  # noqa: F401
    from baselines import torch_measure, torch_models, torch_policies  # noqa: F401
  except ImportError as e:
    raise CompareError(f'the PyTorch side needs torch and transformers ({e}); '
                       f'{TORCH_HINT}') from None
  missing = set(FAMILIES) ^ set(torch_policies.FAMILIES)
  if missing:  # the two family lists must stay in sync
    raise CompareError(f"families differ between baselines.compare and baselines.torch_policies: "
                       f"{', '.join(sorted(missing))}")
  return torch_measure, torch_models, torch_policies


def torch_fields(setup: Setup) -> dict:
  """The torch model's fields: our config's (dataclass values), GPT positions for L + 1 tokens."""
  fields = dataclasses.asdict(setup.named.model)
  if not setup.vision:
    fields['max_len'] = max(fields['max_len'], setup.size + 1)
  return fields


def torch_shape(setup: Setup) -> dict:
  """``measure_torch``'s seq_len / image_size: GPT gets L + 1 tokens (B * L predictions)."""
  if setup.vision:
    return {'seq_len': None, 'image_size': setup.size}
  return {'seq_len': setup.size + 1, 'image_size': None}


def _ratio(a, b):
  return a / b if a is not None and b else None


def jax_figures(m, none_flops: int, steps: int) -> dict:
  """Every figure of one JAX :class:`remat.Measurement` as a JSON-ready dict."""
  from remat.residuals import by_source, by_tag
  mem = m.memory
  return {
      'policy': m.spec, 'method': 'XLA memory_analysis (compiled plan, compile only)',
      'backend': mem.backend,
      **{k: getattr(mem, k) for k in ('argument', 'output', 'alias', 'temp', 'host_temp')},
      'peak_bytes': mem.peak, 'activation_bytes': m.residual_bytes,
      'residual_bytes': m.residual_bytes,
      'residual_by_tag': by_tag(list(m.residuals)),
      'residual_top_sources': by_source(list(m.residuals), top=8),
      'step_flops': m.flops.flops, 'flops_exact': m.flops.exact, 'none_step_flops': none_flops,
      'recompute_ratio': _ratio(m.flops.flops, none_flops),
      'step_seconds': m.step_seconds, 'steps': steps, 'warmup_steps': JAX_WARMUP_STEPS,
  }


def torch_figures(tm) -> dict:
  """Every figure of one :class:`baselines.torch_measure.TorchMeasurement`, plus 'activation_bytes'.

  ``activation_bytes`` here is the torch measurement's ``saved_activation_bytes``
  (what the table shows); the torch measurement's own ``activation_bytes`` (the
  'Activation' category at the moment of the peak) is kept as
  ``activation_bytes_at_peak``.
  """
  d = tm.to_dict()
  d['activation_bytes_at_peak'] = d.pop('activation_bytes')
  d['activation_bytes'] = d['saved_activation_bytes']
  return d


def torch_optimizer(torch_measure) -> dict:
  """The torch side's AdamW settings, read from the optimizer it builds."""
  import torch
  opt = torch_measure.make_optimizer(torch.nn.Linear(1, 1))
  d = opt.defaults
  return {'name': f'torch.optim.{type(opt).__name__} (clip_grad_norm_ first)',
          'b1': d['betas'][0], 'b2': d['betas'][1], 'eps': d['eps'],
          'weight_decay': d['weight_decay'], 'grad_clip': 1.0,
          'lr': f"constant {d['lr']:g}", 'foreach': d.get('foreach'), 'fused': d.get('fused')}


def optimizer_differences(jax_opt: dict, torch_opt: dict) -> list[str]:
  """Names of the settings that differ (the learning rate always does; it changes no figure)."""
  return [k for k in ('b1', 'b2', 'eps', 'weight_decay', 'grad_clip', 'clip')
          if jax_opt.get(k, 'global') != torch_opt.get(k, 'global')]


def environment(setup: Setup) -> dict:
  import jax
  import torch
  import transformers
  try:
    cpus = len(os.sched_getaffinity(0))
  except AttributeError:
    cpus = os.cpu_count()
  shape = ({'image_size': setup.size} if setup.vision else
           {'seq_len': setup.size, 'jax_batch_shape': [setup.batch_size, setup.size + 1],
            'torch_input_ids_shape': [setup.batch_size, setup.size + 1],
            'predicted_tokens': setup.batch_size * setup.size,
            'jax_forward_positions': setup.size, 'torch_forward_positions': setup.size + 1})
  return {
      'jax': jax.__version__, 'jaxlib': _version('jaxlib'),
      'torch': torch.__version__, 'transformers': transformers.__version__,
      'python': platform.python_version(), 'platform': platform.platform(),
      'backend': jax.default_backend(), 'torch_device': 'cpu',
      'cpus_available': cpus, 'torch_threads': torch.get_num_threads(),
      'torch_interop_threads': torch.get_num_interop_threads(),
      'env': {k: os.environ.get(k) for k in ('OMP_NUM_THREADS', 'MKL_NUM_THREADS', 'XLA_FLAGS',
                                             'JAX_PLATFORMS', 'GLIBC_TUNABLES')},
      'host_malloc': host_malloc(),
      'model': setup.model, 'arch': setup.arch, 'config': setup.named.name,
      'batch_size': setup.batch_size, **shape, 'dtype': 'float32', 'steps': setup.steps,
      'jax_step': 'fused update' if setup.fused else 'ordinary', 'jax_layout': setup.layout,
  }


def host_malloc(environ=None) -> str:
  """How this process maps large host blocks, which the time column depends on.

  XLA CPU allocates a step's whole ``temp`` buffer afresh every step, and glibc
  maps a block that large with ``mmap``, so the kernel zero-fills every 4 KiB
  page on first touch, each step. ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``
  (glibc >= 2.35, read at process start) asks for transparent huge pages on
  those blocks instead (README: Faster steps on a Linux CPU).

  Returns:
    'glibc hugetlb=N' when the tunable is set (N in 1, 2), else 'default'.
  """
  environ = os.environ if environ is None else environ
  for item in environ.get('GLIBC_TUNABLES', '').split(':'):
    name, _, value = item.partition('=')
    if name == 'glibc.malloc.hugetlb' and value in ('1', '2'):
      return f'glibc hugetlb={value}'
  return 'default'


def _version(dist: str):
  from importlib import metadata
  try:
    return metadata.version(dist)
  except metadata.PackageNotFoundError:
    return None


def compare(setup: Setup, torch_modules, progress=None) -> dict:
  """Measures every supported requested family on both sides; returns the JSON-ready result."""
  from bench.zoo import measure, step_flops
  from remat.targets import get_target
  torch_measure, _, torch_policies = torch_modules
  supported = torch_policies.supported_families(setup.model)
  families = [f for f in setup.families if f in supported]
  skipped = [f for f in setup.families if f not in supported]
  if not families:
    raise CompareError(f"no requested family applies to {setup.model}; families for "
                       f"{setup.model}: {', '.join(supported)}")
  fields, shape = torch_fields(setup), torch_shape(setup)
  for f in families:  # one-line errors before anything is measured
    torch_policies.check_supported(setup.model, f)
  try:
    from baselines.torch_models import input_shape
    input_shape(setup.model, fields, shape['seq_len'], shape['image_size'])
  except ValueError as e:
    raise CompareError(f'torch side: {e}') from None
  target = get_target('cpu')
  cfg = setup.named.model
  jax_runs, rows = {}, []
  none_flops = None
  if 'none' not in families:  # the JAX recompute ratio needs none's FLOPs (jaxpr walk only)
    none_flops = step_flops(cfg, 'none', setup.batch_size, setup.size, setup.layout).flops
  todo = [(f, side) for f in families for side in ('jax', 'torch')]
  bar = progress(total=len(todo)) if progress else None
  for family in families:
    spec = FAMILY_POLICY[family]
    if bar:
      bar.set_description(f'{family}: JAX {spec}')
    if spec not in jax_runs:
      gc.collect()
      jax_runs[spec] = measure(cfg, spec, setup.batch_size, setup.size, target, run=True,
                               time_steps=setup.steps, fused=setup.fused, layout=setup.layout)
      if spec == 'none':
        none_flops = jax_runs[spec].flops.flops
    if bar:
      bar.update()
      bar.set_description(f'{family}: PyTorch')
    gc.collect()
    tm = torch_measure.measure_torch(setup.model, fields, family, setup.batch_size,
                                     shape['seq_len'], shape['image_size'], steps=setup.steps,
                                     device='cpu', fresh_process=False)
    if bar:
      bar.update()
    rows.append((family, spec, tm))
  if bar:
    bar.close()
  out = []
  for family, spec, tm in rows:
    j, t = jax_figures(jax_runs[spec], none_flops, setup.steps), torch_figures(tm)
    out.append({
        'family': family, 'jax_policy': spec,
        'jax_shared_with': [f for f, s, _ in rows if s == spec and f != family],
        'jax': j, 'torch': t,
        'peak_ratio': _ratio(j['peak_bytes'], t['peak_bytes']),
        'time_ratio': _ratio(j['step_seconds'], t['step_seconds']),
        'activation_ratio': _ratio(j['activation_bytes'], t['activation_bytes']),
        'flops_ratio': _ratio(j['step_flops'], t['step_flops']),
    })
  jax_opt, torch_opt = dict(JAX_OPTIMIZER), torch_optimizer(torch_measure)
  if setup.fused:
    jax_opt.update(name='optax adamw applied layer by layer in the backward pass '
                        '(remat.fused_update; clip_by_global_norm of each layer first)',
                   clip='per layer')
  return {
      'environment': environment(setup),
      'family_policy': {f: FAMILY_POLICY[f] for f in setup.families},
      'jax_model_config': dataclasses.asdict(cfg),
      'torch_model_fields': fields, 'torch_shape': shape,
      'skipped': [{'family': f, 'reason': f'not supported by the {setup.model} torch model '
                   f"(families for {setup.model}: {', '.join(supported)})"} for f in skipped],
      'optimizer': {'jax': jax_opt, 'torch': torch_opt,
                    'differences': optimizer_differences(jax_opt, torch_opt)},
      'families': out,
  }


def main(argv=None) -> int:
  from remat.targets import prefer_cpu_without_gpu
  prefer_cpu_without_gpu()
  try:
    args = build_parser().parse_args(argv)
    setup = resolve(args)
    torch_modules = load_torch()
    from tqdm import tqdm
    result = compare(setup, torch_modules,
                     progress=lambda total: tqdm(total=total, unit='row', file=sys.stderr))
  except (CompareError, ValueError, RuntimeError) as e:
    print(f'{PROG}: error: {e}', file=sys.stderr)
    return 2
  print(format_table(result))
  for line in footer(result):
    print(line)
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(result, f, indent=1)
  if args.plot:
    plot(result, args.plot)
  return 0


if __name__ == '__main__':
  sys.exit(main())
