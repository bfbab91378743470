"""Prints docs/own-model.md's table: each public model's loss-gradient temp, untouched and stacked.

    PYTHONPATH=. python -m tests.public_models.table [--targets cpu,h200] [--ours] [--yardsticks]
        [--rules dots_no_batch,save_qkv_proj] [--models vit,lm1b,ours]

With ``--ours``, the rows of our own GPT, ViT and Llama (tests/public_models/ours.py)
instead, each against its unrolled form (``remat.layout.unrolled_reference``).
With ``--yardsticks``, the three references side by side at >= 8 layers
(:func:`tests.public_models.deep_case`, ``ours.DEEP``): the untouched model, its
blocks under a per-block ``nn.remat`` (the authors' own for the public models,
``remat.layout.per_block_reference`` for ours) and the stack under the default
``layout='auto'``. With ``--rules``, other rules there: the per-block habit, the
stack scanned and under ``auto``.
"""

import argparse
import contextlib
import time

from remat.targets import prefer_cpu_without_gpu

prefer_cpu_without_gpu()

import jax  # noqa: E402

from remat.measuring import step_memory  # noqa: E402
from remat.memory import format_bytes  # noqa: E402
from remat.targets import get_target  # noqa: E402
from tests.public_models import bert, gemma, gemma3, lm1b, unet, vit  # noqa: E402

MODELS = {'Flax lm1b Transformer LM (linen)': lm1b.case, 'Gemma-style (NNX)': gemma.case,
          'big_vision ViT (linen)': vit.case, 'Equinox BERT': bert.case,
          'Gemma 3-style, 5 local + 1 global (linen)': gemma3.case,
          'diffusers Flax U-Net (linen)': unet.case}
SPECS = ('none', 'full', 'sqrt', 'dots')


def ours_rows(targets):
  """Prints our zoo models' rows: temp per spec, and its ratio to the unrolled model's."""
  from bench.zoo import grad_memory
  from remat.layout import unrolled_reference
  from tests.public_models import ours
  print('| config (layers) | plan | unrolled | ' + ' | '.join(f'`{s}`' for s in SPECS)
        + ' | compile unrolled / none |')
  print('|---|---|---|' + '---|' * len(SPECS) + '---|')
  for config, (batch, size) in ours.ZOO.items():
    cfg = ours.model_config(config)
    for tname in targets:
      t = get_target(tname)
      t0 = time.perf_counter()
      with unrolled_reference():
        ref = grad_memory(cfg, 'none', batch, size, t).temp
      t_ref = time.perf_counter() - t0
      cells, t_none = [], None
      for spec in SPECS:
        t0 = time.perf_counter()
        temp = grad_memory(cfg, spec, batch, size, t).temp
        t_none = t_none or time.perf_counter() - t0
        cells.append(f'{format_bytes(temp)} ({temp / ref:.2f}x)')
      print(f'| `{config}` ({cfg.num_layers}) | {tname.upper()} | {format_bytes(ref)} | '
            + ' | '.join(cells) + f' | {t_ref:.1f} s / {t_none:.1f} s |', flush=True)


YARDSTICK_MODELS = ('vit', 'lm1b', 'gemma', 'bert', 'gemma3', 'unet')


def _yardstick_row(label, tname, untouched, per_block, stack) -> str:
  """A table row: untouched; per-block and stack under full, dots; stack none (MiB, ratios)."""
  mib = lambda b: f'{b / 2 ** 20:.2f}'
  pb_full, pb_dots = per_block('full'), per_block('dots')
  full, dots, none = stack('full'), stack('dots'), stack('none')
  return (f'| {label} | {tname.upper()} | {mib(untouched)} | {mib(pb_full)} | {mib(full)} '
          f'({full / pb_full:.2f}x) | {mib(pb_dots)} | {mib(dots)} ({dots / pb_dots:.2f}x) | '
          f'{mib(none)} ({none / untouched:.2f}x) |')


def _deep_models(targets, names, ours_too: bool):
  """Per model (>= 8 layers) and target: ``(label, target, untouched(), per_block(rule), stack(spec))``.

  Each yields temp in bytes, compiled when called: the public models ``names``
  (their yardsticks as their authors wrote them), then, with ``ours_too``, our
  GPT, ViT and Llama (their yardsticks traced with :mod:`remat.layout`'s references).
  """
  from tests.public_models import deep_case
  for name in names:
    c = deep_case(name)
    sp = c.stack(c.params)
    for tname in targets:
      t = get_target(tname)
      yield (f'{name} ({c.num_layers})', tname,
             lambda c=c, t=t: step_memory(c.untouched, c.params, c.batch, target=t).temp,
             lambda r, c=c, t=t: step_memory(c.per_block(r), c.params, c.batch, target=t).temp,
             lambda s, c=c, t=t, sp=sp: step_memory(c.stacked(s), sp, c.batch, target=t).temp)
  if not ours_too:
    return
  from bench.zoo import grad_memory
  from remat.layout import per_block_reference, unrolled_reference
  from tests.public_models import ours

  def within(context, spec, cfg, batch, size, t):
    with context:
      return grad_memory(cfg, spec, batch, size, t).temp
  for config, (batch, size) in ours.ZOO.items():
    cfg = ours.model_config(config, ours.DEEP)
    for tname in targets:
      t = get_target(tname)
      args = (cfg, batch, size, t)   # bound now: the caller may hold the functions past this step
      yield (f'`{config}` ({cfg.num_layers})', tname,
             lambda a=args: within(unrolled_reference(), 'none', *a),
             lambda r, a=args: within(per_block_reference(r), 'none', *a),
             lambda s, a=args: within(contextlib.nullcontext(), s, *a))


def yardstick_rows(targets, names, ours_too: bool):
  """Prints untouched, per-block full/dots and the stack's full/dots/none (temp MiB) per model."""
  print('| model (layers) | plan | untouched | per-block `full` | stack `full` (/pb) | '
        'per-block `dots` | stack `dots` (/pb) | stack `none` (/untouched) |')
  print('|---|---|---|---|---|---|---|---|')
  for label, tname, untouched, per_block, stack in _deep_models(targets, names, ours_too):
    print(_yardstick_row(label, tname, untouched(), per_block, stack), flush=True)


def rule_rows(targets, names, rules, ours_too: bool):
  """Prints, per model and rule, the per-block habit and the stack scanned and under ``auto``.

  For the rules outside issue 34's bounds (presets, ``dots_no_batch``, ``names:``): which layout
  plans less is model-dependent, and ``auto`` (unrolled for them on a GPU) is not always it. A
  preset that needs tags a public model does not emit (they emit none) is left out.
  """
  import remat.layout
  from remat.policies import PolicyError
  chosen = remat.layout.choose_layout
  mib = lambda b: f'{b / 2 ** 20:.2f}'
  print('| model (layers) | plan | rule | per-block | stack `scan` (/pb) | stack `auto` (/pb) |')
  print('|---|---|---|---|---|---|')
  for label, tname, _, per_block, stack in _deep_models(targets, names, ours_too):
    for rule in rules:
      try:
        pb, auto = per_block(rule), stack(rule)
      except PolicyError:
        continue
      remat.layout.choose_layout = lambda *args, **kwargs: 'scan'
      try:
        scan = stack(rule)
      finally:
        remat.layout.choose_layout = chosen
      print(f'| {label} | {tname.upper()} | `{rule}` | {mib(pb)} | {mib(scan)} '
            f'({scan / pb:.2f}x) | {mib(auto)} ({auto / pb:.2f}x) |', flush=True)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument('--targets', default='cpu,h200')
  ap.add_argument('--ours', action='store_true',
                  help='our GPT, ViT and Llama against their unrolled form instead')
  ap.add_argument('--yardsticks', action='store_true',
                  help='untouched, per-block nn.remat and the stack side by side (>= 8 layers)')
  ap.add_argument('--models', default=','.join(YARDSTICK_MODELS) + ',ours',
                  help="with --yardsticks or --rules: public models, and 'ours' for our GPT, ViT, "
                       'Llama')
  ap.add_argument('--rules', default=None,
                  help='other rules at >= 8 layers: the per-block habit, the scan and auto each')
  args = ap.parse_args()
  if args.rules:
    names = args.models.split(',')
    print(f'jax {jax.__version__}; loss-gradient temp (MiB, XLA memory_analysis)')
    rule_rows(args.targets.split(','), [n for n in names if n != 'ours'], args.rules.split(','),
              'ours' in names)
    return
  if args.yardsticks:
    names = args.models.split(',')
    print(f'jax {jax.__version__}; loss-gradient temp (MiB, XLA memory_analysis), layout auto')
    yardstick_rows(args.targets.split(','), [n for n in names if n != 'ours'], 'ours' in names)
    return
  if args.ours:
    print(f'jax {jax.__version__}; loss-gradient temp (XLA memory_analysis), stack / unrolled')
    ours_rows(args.targets.split(','))
    return
  print(f'jax {jax.__version__}; loss-gradient temp (XLA memory_analysis), stack / untouched')
  print('| model | plan | untouched | ' + ' | '.join(f'`{s}`' for s in SPECS) + ' | compile untouched / none |')
  print('|---|---|---|' + '---|' * len(SPECS) + '---|')
  for name, make in MODELS.items():
    c = make()
    for tname in args.targets.split(','):
      t = get_target(tname)
      t0 = time.perf_counter()
      ref = step_memory(c.untouched, c.params, c.batch, target=t).temp
      t_ref = time.perf_counter() - t0
      cells, t_none = [], None
      for spec in SPECS:
        t0 = time.perf_counter()
        temp = step_memory(c.stacked(spec), c.stack(c.params), c.batch, target=t).temp
        t_none = t_none or time.perf_counter() - t0
        cells.append(f'{format_bytes(temp)} ({temp / ref:.2f}x)')
      print(f'| {name} | {tname.upper()} | {format_bytes(ref)} | ' + ' | '.join(cells)
            + f' | {t_ref:.1f} s / {t_none:.1f} s |', flush=True)


if __name__ == '__main__':
  main()
