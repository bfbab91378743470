"""What a run logs for people: the learning rate in metrics.jsonl, TensorBoard scalars
(--tensorboard, training/run/tensorboard.py) and the PNG of training.plot.

One 6-step byte-level run: each row has the rate its step's update used (the
optimizer's schedule: make_optimizer builds AdamW on lr_schedule), the event
file holds the same numbers, and the plot draws them.
"""

import json
import struct

import pytest

from training import cli
from training import plot as plot_cli
from training.step.train_step import lr_schedule


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  tmp = tmp_path_factory.mktemp('logs')
  corpus = tmp / 'corpus.txt'
  corpus.write_text(''.join(f'def f{i}(x):\n    return x * {i}\n' for i in range(200)))
  pytest.importorskip('tensorboardX')
  assert cli.main(['--steps', '6', '--batch-size', '2', '--seq-len', '16', '--lr', '1e-2',
                   '--warmup-steps', '2', '--eval-every', '6', '--eval-batches', '1',
                   '--remat', 'none', '--no-memory-report', '--tensorboard',
                   f'--data={corpus}', f'--out={tmp / "run"}']) == 0
  return tmp / 'run'


def _rows(run):
  return [json.loads(l) for l in (run / 'metrics.jsonl').read_text().splitlines()]


def test_each_row_has_the_rate_of_its_update(run):
  rows = _rows(run)
  schedule = lr_schedule(1e-2, 6, 2)
  # The rows round to 6 significant digits (5e-6 relative at most); the table's jitted values may
  # differ from a call per step in float32's last bit (1e-7).
  assert [r['lr'] for r in rows] == [pytest.approx(float(schedule(s)), rel=1e-5, abs=1e-12)
                                     for s in range(6)]
  assert rows[0]['lr'] == 0.0 and rows[2]['lr'] == 1e-2   # warmup from 0, then the peak


def _scalars(folder):
  """(tag, step, value) of every scalar in the TensorBoard event files (TFRecord framing)."""
  from tensorboardX.proto import event_pb2
  out = []
  for path in folder.iterdir():
    data = path.read_bytes()
    at = 0
    while at < len(data):
      (length,) = struct.unpack('<Q', data[at:at + 8])
      event = event_pb2.Event.FromString(data[at + 12:at + 12 + length])
      at += 12 + length + 4
      out += [(v.tag, event.step, v.simple_value) for v in event.summary.value]
  return out


def test_tensorboard_holds_the_rows(run):
  got = _scalars(run / 'tensorboard')
  rows = _rows(run)
  for name in ('loss', 'lr', 'grad_norm'):
    # float32 in the event file: the rows' values to its 7 significant digits.
    assert [(s, pytest.approx(v, rel=1e-6)) for t, s, v in got if t == name] == [
        (r['step'], r[name]) for r in rows]
  assert [(s, pytest.approx(v, rel=1e-6)) for t, s, v in got if t == 'val_loss'] == [
      (6, rows[-1]['val_loss'])]


def test_plot_writes_a_png(run, capsys, tmp_path):
  assert plot_cli.main([str(run)]) == 0
  png = run / 'metrics.png'
  assert capsys.readouterr().out.strip() == str(png)
  assert png.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
  assert plot_cli.main([str(tmp_path)]) == 2   # no metrics.jsonl: one line
  err = capsys.readouterr().err
  assert err.count('\n') == 1 and 'no ' in err and 'metrics.jsonl' in err


def test_tensorboard_without_its_package_is_one_line(tmp_path, monkeypatch, capsys):
  monkeypatch.setitem(__import__('sys').modules, 'tensorboardX', None)   # import fails
  assert cli.main(['--steps', '1', '--tensorboard', '--no-memory-report',
                   f'--out={tmp_path / "o"}']) == 2
  err = capsys.readouterr().err
  assert '--tensorboard needs the tensorboardX package' in err and err.count('\n') == 1
  assert not (tmp_path / 'o').exists()
