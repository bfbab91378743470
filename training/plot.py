"""``python -m training.plot RUN_DIR``: a run's losses, held-out metrics and learning rate as a PNG.

Reads ``RUN_DIR/metrics.jsonl`` and draws, against the step, up to three panels:
the training loss with every held-out ``*_loss``; the held-out metrics that are
shares (``*_accuracy``, ``*_exact_match``, ``*_token_accuracy``); and the learning
rate (``lr``; runs from before it was logged have none). Writes
``RUN_DIR/metrics.png`` (or ``--out``) and prints its path.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from training.arguments import OneLineParser

SHARES = ('_accuracy', '_exact_match', '_token_accuracy')


class PlotError(ValueError):
  """A run folder without metric rows; the message is one line."""


def read_rows(run_dir: Path) -> list[dict]:
  """The rows of ``metrics.jsonl`` that parse (a line cut by a kill is passed over)."""
  path = Path(run_dir) / 'metrics.jsonl'
  if not path.is_file():
    raise PlotError(f"no {path}: give the --out folder of a train.py run")
  rows = []
  for line in path.read_text().splitlines():
    try:
      row = json.loads(line)
    except ValueError:
      continue
    if isinstance(row, dict) and isinstance(row.get('step'), int):
      rows.append(row)
  if not rows:
    raise PlotError(f'{path} holds no metric rows')
  return rows


def series(rows: list[dict], name: str) -> tuple[list[int], list[float]]:
  """(steps, values) of the rows that have a finite number under ``name``."""
  got = [(r['step'], r[name]) for r in rows
         if isinstance(r.get(name), (int, float)) and r[name] == r[name]]
  return [s for s, _ in got], [v for _, v in got]


def plot(run_dir, out=None) -> Path:
  """Draws the panels (module docstring) to ``out`` (default ``RUN_DIR/metrics.png``)."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  rows = read_rows(Path(run_dir))
  names = sorted({k for r in rows for k in r})
  losses = ['loss'] + [n for n in names if n.endswith('_loss')]
  shares = [n for n in names if n.endswith(SHARES)]
  panels = [('loss (nats per target)', losses)] + (
      [('held-out share', shares)] if shares else []) + (
      [('learning rate', ['lr'])] if 'lr' in names else [])
  fig, axes = plt.subplots(len(panels), 1, figsize=(7, 2.6 * len(panels)), sharex=True,
                           squeeze=False)
  for ax, (title, keys) in zip(axes[:, 0], panels):
    for key in keys:
      steps, values = series(rows, key)
      ax.plot(steps, values, label=key, marker='o' if key != 'loss' and key != 'lr' else None,
              markersize=3)
    ax.set_ylabel(title)
    if len(keys) > 1:
      ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
  axes[-1, 0].set_xlabel('step')
  fig.suptitle(str(run_dir), fontsize=9)
  fig.tight_layout()
  target = Path(out) if out else Path(run_dir) / 'metrics.png'
  fig.savefig(target, dpi=100)
  plt.close(fig)
  return target


def main(argv=None, prog: str = 'python -m training.plot') -> int:
  name = prog.removeprefix('python -m ')   # each error line starts with the command's name
  p = OneLineParser(prog=prog,
                    description="Draw a run's losses, held-out metrics and learning rate to a PNG.")
  p.add_argument('run_dir', metavar='RUN_DIR', help="a train.py run's --out folder")
  p.add_argument('--out', default=None, metavar='PNG', help='where to write (default: '
                 'RUN_DIR/metrics.png)')
  args = p.parse_args(argv)
  try:
    print(plot(args.run_dir, args.out))
  except PlotError as e:
    print(f'{name}: error: {e}', file=sys.stderr)
    return 2
  except OSError as e:
    print(f"{name}: error: cannot write '{e.filename or args.out}': {e.strerror}",
          file=sys.stderr)
    return 2
  return 0


if __name__ == '__main__':
  sys.exit(main())
