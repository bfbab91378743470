"""A mistyped command line is one line on stderr and exit code 2, with nothing written (issue 31).

The commands run as a person runs them, in a fresh process from an empty folder; the
parsers (training/arguments.py and remat/report.py's copy) are also checked in-process.
"""

import argparse
import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from remat.report import _OneLineParser as LibraryParser
from test_train import _plugin_notice
from training.arguments import OneLineParser, positive_int, positive_ints

ROOT = Path(__file__).resolve().parents[1]
TRAIN = str(ROOT / 'train.py')


@pytest.mark.parametrize('command,line', [
    ([TRAIN, '--steps', 'abc'], "train.py: --steps: 'abc' is not an integer (see --help)"),
    ([TRAIN, '--seed', 'x'], "train.py: --seed: 'x' is not an integer (see --help)"),
    ([TRAIN, '--lr', 'fast'], "train.py: --lr: 'fast' is not a number (see --help)"),
    # A value of the right type that the run cannot use: checked by the run's settings (the
    # same check as a config file's value), before anything is read, compiled or written.
    ([TRAIN, '--batch-size', '-1'], 'train.py: error: --batch-size must be >= 1, got -1'),
    ([TRAIN, '--layout', 'unroled'], "train.py: error: unknown layout 'unroled'; valid: auto, "
     'scan, unrolled, loops, groups'),
    (['-m', 'bench.report', '--batch-size', 'abc'],
     "bench.report: --batch-size: 'abc' is not an integer (see --help)"),
    (['-m', 'remat.report', '--fn', 'user_mlp:factory', '--num-layers', 'abc'],
     "remat.report: --num-layers: 'abc' is not an integer (see --help)"),
    (['-m', 'training.export', 'run', 'out', '--max-shard-size', 'abc'],
     "training.export: --max-shard-size: 'abc' is not a size like 5GB, 200MB or 1000 (see --help)"),
    (['-m', 'training.sample', 'run', '--prompt', 'hi', '--max-new-tokens', 'abc'],
     "training.sample: --max-new-tokens: 'abc' is not an integer (see --help)"),
    (['-m', 'training.sample', 'run', '--prompt', 'hi', '--temperature', 'hot'],
     "training.sample: --temperature: 'hot' is not a number (see --help)"),
])
def test_a_typo_is_one_line_and_exit_2(tmp_path, command, line):
  env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=str(ROOT))
  run = subprocess.run([sys.executable] + command, cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300)
  # An installed jax-cuda12 plugin (gpu-plan extra) logs its own notices at `import jax`.
  assert [l for l in run.stderr.splitlines() if not _plugin_notice(l)] == [line]
  assert run.returncode == 2 and run.stdout == ''
  assert list(tmp_path.iterdir()) == []   # no run folder, export or cache written


@pytest.mark.parametrize('parser_class', [OneLineParser, LibraryParser])
@pytest.mark.parametrize('argv,line', [
    (['--count', 'abc'], "--count: 'abc' is not an integer"),
    (['--count', '2.5'], "--count: '2.5' is not an integer"),
    (['--rate', '1e-3x'], "--rate: '1e-3x' is not a number"),
    (['--kind', 'gamma'], "--kind: invalid choice: 'gamma'"),
    (['--colour'], 'unrecognized arguments: --colour'),
    (['--count'], '--count: expected one argument'),
    ([], 'the following arguments are required: --name'),
])
def test_the_parsers_errors(capsys, parser_class, argv, line):
  p = parser_class(prog='python -m tool')
  p.add_argument('--name', required=True)
  p.add_argument('--count', type=int)
  p.add_argument('--rate', type=float)
  p.add_argument('--kind', choices=('alpha', 'beta'))
  with pytest.raises(SystemExit) as e:
    p.parse_args((argv + ['--name', 'n']) if argv else argv)
  assert e.value.code == 2
  captured = capsys.readouterr()
  lines = captured.err.splitlines()
  assert captured.out == '' and len(lines) == 1, lines
  # The prog without `python -m`, the flag, what was wrong, where to look.
  name = 'remat.report' if parser_class is LibraryParser else 'tool'
  assert lines[0].startswith(f'{name}: {line}') and lines[0].endswith(' (see --help)')
  if argv[:1] == ['--kind']:
    assert 'alpha' in lines[0] and 'beta' in lines[0]   # the valid choices are listed


@pytest.mark.parametrize('parser_class', [OneLineParser, LibraryParser])
def test_good_values_and_help_are_unchanged(capsys, parser_class):
  p = parser_class(prog='python -m tool', description='A tool.')
  p.add_argument('--count', type=int, default=3)
  p.add_argument('--rate', type=float, default='0.5')
  args = p.parse_args(['--count', '-7'])
  assert (args.count, args.rate) == (-7, 0.5)
  with pytest.raises(SystemExit) as e:
    p.parse_args(['--help'])
  assert e.value.code == 0
  assert capsys.readouterr().out.startswith('usage: python -m tool [-h]')


def test_positive_counts():
  assert positive_int('3') == 3 and positive_ints('1024, 2048,') == [1024, 2048]
  assert positive_ints('') == []
  for text, message in (('0', "'0' is not a positive integer (>= 1)"),
                        ('-1', "'-1' is not a positive integer (>= 1)"),
                        ('x', "'x' is not an integer")):
    with pytest.raises(argparse.ArgumentTypeError, match=message.replace('(', r'\(')
                       .replace(')', r'\)')):
      positive_int(text)
  with pytest.raises(argparse.ArgumentTypeError, match="'x' is not an integer"):
    positive_ints('16,x')


def test_every_command_uses_the_one_line_parser():
  """No plain argparse.ArgumentParser(...) left in the library or the application."""
  plain = []
  for path in [ROOT / 'train.py'] + sorted(
      p for d in ('remat', 'models', 'configs', 'training', 'bench', 'baselines')
      for p in (ROOT / d).rglob('*.py')):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Call) and getattr(node.func, 'attr', getattr(node.func, 'id', '')) \
          == 'ArgumentParser':
        plain.append(f'{path.relative_to(ROOT)}:{node.lineno}')
  assert plain == []
