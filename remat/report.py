"""The policy table of your own function: ``python -m remat.report --fn package.module:factory``.

``factory()`` (no arguments) returns ``(build, example_args)``, what
:func:`remat.measure` takes: ``build(policy)`` returns the loss (or a
:class:`remat.TrainStep`) under that policy, and ``example_args`` is a tuple
of arrays or ``jax.ShapeDtypeStruct``. The module is imported by name, so run
from the directory that holds it (``-m`` puts the current directory on the
path). Compile only unless ``--time``; figures are defined in docs/measuring.md.
``--reference package.module:factory`` names your untouched model: ``factory()``
returns its loss (or TrainStep) on the same example arguments, or ``(loss,
own_args)`` to measure it on its own arguments (its own, per-layer parameter
tree); it is the first row and every ratio is to it.
The shipped models have their own report: ``python -m bench.report``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Callable

import jax

from remat.measuring import DEFAULT_POLICIES, TrainStep, measure
from remat.policies import PolicyError
from remat.table import footer, plot_front, write_json
from remat.targets import TARGETS, TargetError, get_target, prefer_cpu_without_gpu

PROG = 'remat.report'


class FnError(ValueError):
  """A --fn value that does not name a usable factory; the message is one line."""


def _import_factory(text: str, flag: str) -> tuple[Callable, str]:
  """The callable named ``package.module:factory`` and its attribute name; FnError otherwise."""
  module_name, sep, attr = text.partition(':')
  if not sep or not module_name or not attr:
    raise FnError(f"{flag} '{text}': expected package.module:factory")
  try:
    module = importlib.import_module(module_name)
  except ImportError as e:
    raise FnError(f"{flag} '{text}': cannot import {module_name}: {e}") from None
  factory = module
  for part in attr.split('.'):
    factory = getattr(factory, part, None)
    if factory is None:
      raise FnError(f"{flag} '{text}': {module_name} has no attribute {attr}")
  if not callable(factory):
    raise FnError(f"{flag} '{text}': {attr} is not callable")
  return factory, attr


def load_reference(text: str):
  """Imports ``package.module:factory``: ``(the untouched loss or TrainStep, its own args or None)``.

  Raises:
    FnError: one line saying which part is wrong.
  """
  factory, attr = _import_factory(text, '--reference')
  made = factory()
  own = None
  if isinstance(made, tuple) and len(made) == 2 and isinstance(made[1], (tuple, list)):
    made, own = made[0], tuple(made[1])
  if not (callable(made) or isinstance(made, TrainStep)):
    raise FnError(f"--reference '{text}': {attr}() must return the untouched loss function (or a "
                  'TrainStep) taking the example arguments of --fn, or (loss, its own args), got '
                  f'{type(made).__name__}')
  return made, own


def load_factory(text: str) -> tuple[Callable, tuple]:
  """Imports ``package.module:factory``, calls it, and checks it returned ``(build, example_args)``.

  Raises:
    FnError: one line saying which part is wrong.
  """
  factory, attr = _import_factory(text, '--fn')
  made = factory()
  if not (isinstance(made, tuple) and len(made) == 2 and callable(made[0])
          and isinstance(made[1], (tuple, list))):
    raise FnError(f"--fn '{text}': {attr}() must return (build, example_args), "
                  f'got {type(made).__name__}')
  return made[0], tuple(made[1])


def parse_specs(text: str) -> list[str]:
  """Specs separated by ',' (by ';' when one of them holds ',', as names:a,b)."""
  return [s.strip() for s in (text.split(';') if ';' in text else text.split(',')) if s.strip()]


def _integer(text: str) -> int:
  try:
    return int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f'{text!r} is not an integer') from None


def _number(text: str) -> float:
  try:
    return float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f'{text!r} is not a number') from None


def _positive_int(text: str) -> int:
  value = _integer(text)
  if value < 1:
    raise argparse.ArgumentTypeError(f'{text!r} is not a positive integer (>= 1)')
  return value


class _OneLineParser(argparse.ArgumentParser):
  """argparse whose errors are one line and exit code 2, without the usage block.

  ``remat.report: --num-layers: 'x' is not an integer (see --help)``: the
  application's ``training.arguments.OneLineParser``, which the library cannot import.
  """

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    # argparse looks a type up here before calling it
    self.register('type', int, _integer)
    self.register('type', float, _number)

  def error(self, message: str):
    message = ' '.join(message.split()).removeprefix('argument ')
    self.exit(2, f'{PROG}: {message} (see --help)\n')


def build_parser() -> argparse.ArgumentParser:
  p = _OneLineParser(prog=f'python -m {PROG}', description=__doc__.splitlines()[0])
  p.add_argument('--fn', required=True, metavar='package.module:factory',
                 help='factory() returns (build, example_args); see remat.measure')
  p.add_argument('--policies', default=','.join(DEFAULT_POLICIES),
                 help="specs separated by ',' (by ';' when a spec holds ','); "
                      f"'none' is always added (default: {','.join(DEFAULT_POLICIES)})")
  p.add_argument('--reference', metavar='package.module:factory|unrolled',
                 help='your untouched model: factory() returns its loss (or TrainStep) on the '
                      "example arguments of --fn; the first row, and every ratio is to it. "
                      "'unrolled': build's own model with every stack a Python loop and no "
                      'checkpoint (remat.layout.unrolled_reference)')
  p.add_argument('--per-block', metavar='RULE,...', default='',
                 help="per-layer rules (full,dots): a row per rule, build's model with each layer "
                      'in jax.checkpoint(policy=RULE) in a Python loop (the nn.remat habit; '
                      'remat.layout.per_block_reference), beside the stack under that rule')
  p.add_argument('--target', default='cpu', help=f"compile for: {', '.join(TARGETS)}")
  p.add_argument('--time', action='store_true',
                 help='also run each program (median of 5 after 2 warm-up; local backend only)')
  p.add_argument('--json', metavar='FILE', help='write every figure and the environment as JSON')
  p.add_argument('--plot', metavar='FILE', help='write a PNG of memory against recompute')
  p.add_argument('--auto', metavar='BUDGET',
                 help='instead of the table: the policy of least recompute whose plan fits BUDGET '
                      '(auto:SIZE, auto:Fx or auto; docs/auto.md)')
  p.add_argument('--num-layers', type=_positive_int, default=None,
                 help="with --auto: N of build's layer stack, to search segmentings and mixes too")
  p.add_argument('--explain', metavar='FILE|DIR',
                 help="instead of the table: what is live when in XLA's plan of each policy in "
                      '--policies (one policy: FILE.json/.png/.svg; several: DIR with one set '
                      'per policy and overlay.png); docs/measuring.md')
  return p


def _auto(args, build, example_args, target) -> int:
  from remat import auto
  choice = auto.choose(build, *example_args, budget=args.auto, target=target,
                       num_layers=args.num_layers,
                       log=lambda s: print(s, file=sys.stderr, flush=True))
  print(choice.summary())
  print(choice.spec)
  if args.json:
    write_json(args.json, {'jax': jax.__version__, 'target': target.name, 'fn': args.fn},
               {'auto': choice.to_json()})
  return 0


def main(argv=None) -> int:
  prefer_cpu_without_gpu()
  args = build_parser().parse_args(argv)
  try:
    build, example_args = load_factory(args.fn)
    target = get_target(args.target)
    if args.auto:
      return _auto(args, build, example_args, target)
    if args.explain:
      from remat.explaining import run_cli
      return run_cli(build, example_args, parse_specs(args.policies), target, args.explain,
                     {'jax': jax.__version__, 'target': target.name, 'fn': args.fn},
                     f'{args.fn}, target {target.name}', args.num_layers)
    kind = 'train step' if isinstance(build(_none()), TrainStep) else 'value_and_grad of loss'
    header = (f'# {kind}, {args.fn}, target {target.name} ({target.description}), compile only'
              f'{" + timed on the local backend" if args.time else ""} (jax {jax.__version__})')
    reference, reference_args = (None, None) if not args.reference else (
        ('unrolled', None) if args.reference == 'unrolled' else load_reference(args.reference))
    report = measure(build, *example_args, policies=parse_specs(args.policies), target=target,
                     time=args.time, progress=True, reference=reference,
                     reference_args=reference_args, per_block=parse_specs(args.per_block))
  except (PolicyError, TargetError, ValueError) as e:
    print(f'{PROG}: error: {e}', file=sys.stderr)
    return 2
  rows = report.rows()
  print(report.table(header))
  print('\n'.join(footer(rows, target.name)))
  if args.plot:
    plot_front(rows, args.plot, header.lstrip('# '))
  if args.json:
    env = {'jax': jax.__version__, 'backend': jax.default_backend(), 'target': target.name,
           'device': target.description, 'fn': args.fn, 'program': kind,
           'reference': args.reference,
           'example_args': [str(a) for a in jax.tree_util.tree_leaves(
               jax.eval_shape(lambda *a: a, *example_args))]}
    write_json(args.json, env, {'policies': rows})
  return 0


def _none():
  from remat.policies import get_policy
  return get_policy('none')


if __name__ == '__main__':
  sys.exit(main())
