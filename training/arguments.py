"""The argument parser of every command line of the application: a mistake is one line.

argparse answers a mistyped value with its whole usage block before the error
(16 lines for ``python train.py --steps abc``). :class:`OneLineParser` prints the
error alone, names the flag and says what was wrong, and exits with code 2 before
anything is read or written::

    train.py: --steps: 'abc' is not an integer (see --help)

Arguments declared ``type=int`` or ``type=float`` get these messages as they are
(the parser registers its own conversions for those two types);
:func:`positive_int` is the type of a count that must be at least 1, :func:`positive_ints`
of a list of them. Checks that
need more than the one value (a size against the model) stay with the command,
which prints them as ``PROG: error: ...``, also one line, also exit code 2.

``remat/report.py`` keeps a copy of the parser: the library imports nothing of the
application.
"""

from __future__ import annotations

import argparse


def integer(text: str) -> int:
  """``int(text)``; a one-line ``ArgumentTypeError`` for anything else."""
  try:
    return int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f'{text!r} is not an integer') from None


def number(text: str) -> float:
  """``float(text)``; a one-line ``ArgumentTypeError`` for anything else."""
  try:
    return float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f'{text!r} is not a number') from None


def positive_int(text: str) -> int:
  """An integer >= 1 (a count of steps, rows, layers)."""
  value = integer(text)
  if value < 1:
    raise argparse.ArgumentTypeError(f'{text!r} is not a positive integer (>= 1)')
  return value


def positive_ints(text: str) -> list[int]:
  """Integers >= 1 separated by ',' (``1024,2048``); an empty text is an empty list."""
  return [positive_int(s.strip()) for s in text.split(',') if s.strip()]


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
  """Adds ``(default: X)`` to a flag's help only where the help does not say its default itself
  and the default is a value (argparse's own appends ``(default: None)`` to every flag whose
  default comes from elsewhere: the config, the resumed run)."""

  def _get_help_string(self, action):
    if '(default' in (action.help or '') or action.default is None:
      return action.help
    return super()._get_help_string(action)


class OneLineParser(argparse.ArgumentParser):
  """``argparse.ArgumentParser`` whose errors are one line on stderr and exit code 2.

  The line is ``NAME: MESSAGE (see --help)``, NAME the ``prog`` without a leading
  ``python -m`` (``python -m bench.report`` -> ``bench.report``), as the commands
  name themselves in their other errors. ``--help`` is unchanged.
  """

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    # argparse looks a type up in this registry before calling it, so every `type=int` and
    # `type=float` argument, in this parser and its groups, converts through these.
    self.register('type', int, integer)
    self.register('type', float, number)

  def error(self, message: str):
    name = self.prog.removeprefix('python -m ')
    # argparse says 'argument --steps: ...'; the flag alone is enough.
    message = ' '.join(message.split()).removeprefix('argument ')
    self.exit(2, f'{name}: {message} (see --help)\n')


def add_lora_flags(p: argparse.ArgumentParser):
  """``--lora`` and its companions (train.py and bench.report take the same; docs/finetuning.md)."""
  p.add_argument('--lora', type=int, default=None, metavar='RANK',
                 help='train LoRA adapters of this rank on a frozen base (stored in the compute '
                      'dtype: no float32 copy, no gradient, no optimizer state); default: every '
                      'parameter trains')
  p.add_argument('--lora-alpha', type=float, default=None, metavar='ALPHA',
                 help='adapter outputs are scaled by ALPHA / RANK (default: 2 x RANK)')
  p.add_argument('--lora-dropout', type=float, default=None, metavar='P',
                 help="dropout on the adapters' inputs in training (default: 0)")
  p.add_argument('--lora-targets', default=None, metavar='NAME,...',
                 help='the projections that get adapters, by name (q_proj, mlp/c_fc, ...; a wrong '
                      'name lists them) (default: every attention and MLP projection)')
  p.add_argument('--quantize', default=None, metavar='int8|nf4',
                 help='QLoRA: store the frozen base quantized (blocks of 64 weights), dequantized '
                      'layer by layer inside the remat region; with --lora')
