"""--keep-best and --early-stop (training/run/best.py): the best held-out step is kept apart from
the rotation, exported by default, and the run stops when the metric stops improving.

The run: the tiny Hugging Face Llama of tests/text_fixtures.py learns each
animal's colour, and is evaluated on a held-out file whose completions name
the *wrong* colour. Its loss on that file falls while the model learns the
completions' form, then rises as it learns the right colours (measured: 1.128
at step 32, 1.452 at 40, 1.766 at 48), so the last step is not the best.
"""

import json

import pytest

from test_finetune import _one_error, checkpoint  # noqa: F401  (the module fixture)
from text_fixtures import COLOURS, rows, write_jsonl
from training import cli
from training import export as export_cli
from training.run.best import Best, check_metric


def _wrong(items):
  colours = sorted(set(COLOURS.values()))
  out = []
  for r in items:
    c = colours[(colours.index(r['completion'].split()[0]) + 1) % len(colours)]
    out.append({'prompt': r['prompt'], 'completion': f' {c} {c}.'})
  return out


@pytest.mark.slow
def test_the_best_step_is_kept_exported_and_stops_the_run(checkpoint, tmp_path,  # noqa: F811
                                                          monkeypatch, capsys):
  import numpy as np
  import safetensors.numpy
  monkeypatch.setenv('REMAT_CACHE', str(tmp_path / 'cache'))
  data = write_jsonl(tmp_path / 'train.jsonl', rows(400))
  wrong = write_jsonl(tmp_path / 'wrong.jsonl', _wrong(rows(64, seed=1)))
  run = tmp_path / 'run'
  assert cli.main(['--model', 'llama', '--init-from', str(checkpoint), '--data', str(data),
                   '--eval-data', str(wrong), '--steps', '80', '--batch-size', '16',
                   '--seq-len', '64', '--lr', '1e-2', '--warmup-steps', '10', '--eval-every', '8',
                   '--keep-best', 'eval_wrong_loss', '--early-stop', '2', '--out', str(run),
                   '--no-memory-report']) == 0
  text = capsys.readouterr().out
  evals = [r for r in map(json.loads, (run / 'metrics.jsonl').read_text().splitlines())
           if 'eval_wrong_loss' in r]
  losses = [r['eval_wrong_loss'] for r in evals]
  best = evals[losses.index(min(losses))]['step']
  last = evals[-1]['step']
  print(f'eval_wrong_loss by step: {[(r["step"], r["eval_wrong_loss"]) for r in evals]}')
  # Stopped after two evaluations without a better value, before --steps.
  assert last == best + 2 * 8 < 80
  assert f'early stop at step {last}: eval_wrong_loss has not improved for 2' in text
  assert sorted(int(p.name) for p in (run / 'best' / 'checkpoints').iterdir()) == [best]
  assert last in [int(p.name) for p in (run / 'checkpoints').iterdir()]
  # Export takes the best step by default and says so; --checkpoint last takes the last.
  assert export_cli.main([str(run), str(tmp_path / 'best')]) == 0
  said = capsys.readouterr().out
  assert f'exported step {best} (the best by eval_wrong_loss = {min(losses):g}' in said
  assert f'the last is step {last})' in said
  assert export_cli.main([str(run), str(tmp_path / 'last'), '--checkpoint', 'last']) == 0
  assert f'exported step {last} of' in capsys.readouterr().out
  a, b = (safetensors.numpy.load_file(tmp_path / d / 'model.safetensors') for d in ('best', 'last'))
  assert any(not np.array_equal(a[k], b[k]) for k in a)   # two different states


def test_best_follows_the_metric_direction_and_counts_evaluations_since():
  loss = Best('val_loss', patience=2)
  assert [loss.observe(s, {'val_loss': v}) for s, v in ((1, 3.0), (2, 2.0), (3, 2.5))] == [
      True, True, False]
  assert (loss.step, loss.since, loss.stop) == (2, 1, False)
  assert not loss.observe(4, {'val_loss': float('nan')}) and loss.stop   # NaN is never better
  acc = Best('val_exact_match', patience=None, rows=[{'step': 5, 'val_exact_match': 0.5},
                                                     {'step': 6, 'loss': 1.0},
                                                     {'step': 7, 'val_exact_match': 0.75}])
  assert (acc.step, acc.value, acc.since, acc.stop) == (7, 0.75, 0, False)   # read on resume
  assert not acc.observe(8, {'val_exact_match': 0.5}) and not acc.stop


def test_a_metric_the_run_does_not_log_is_one_line():
  with pytest.raises(ValueError, match='--keep-best val_exact_match: this run logs no such'):
    check_metric('val_exact_match', None, ['val_loss'])
  with pytest.raises(ValueError, match='--early-stop needs --keep-best METRIC'):
    check_metric(None, 3, ['val_loss'])


def test_keep_best_refusals_write_nothing(
    checkpoint, tmp_path, monkeypatch, capsys):  # noqa: F811
  monkeypatch.setenv('REMAT_CACHE', str(tmp_path / 'cache'))
  good = write_jsonl(tmp_path / 'good.jsonl', rows(20))
  base = ['--model', 'llama', '--init-from', str(checkpoint), '--data', str(good), '--steps', '2',
          '--batch-size', '2', '--seq-len', '32', '--no-memory-report',
          '--out', str(tmp_path / 'o')]
  for extra, message in ((['--keep-best', 'val_accuracy'], 'it logs val_loss'),
                         (['--keep-best', 'val_loss', '--early-stop', '0'],
                          '--early-stop must be >= 1')):
    assert cli.main(base + extra) == 2
    err = capsys.readouterr().err
    assert message in err and _one_error(err, 'train.py'), err
    assert not (tmp_path / 'o').exists()


def test_restart_sets_the_best_step_and_the_logs_aside(tmp_path):
  from training.run import rundir, tensorboard
  from training.run.best import BEST_NAME
  out = tmp_path / 'run'
  for name in (f'{BEST_NAME}/checkpoints/8/x', 'generations.jsonl', f'{tensorboard.TB_NAME}/ev',
               'metrics.jsonl'):
    (out / name).parent.mkdir(parents=True, exist_ok=True)
    (out / name).write_text('x')
  dest = rundir.set_previous_aside(out)
  assert sorted(p.name for p in dest.iterdir()) == sorted(
      [BEST_NAME, 'generations.jsonl', tensorboard.TB_NAME, 'metrics.jsonl'])
  assert sorted(p.name for p in out.iterdir()) == [rundir.PREVIOUS_NAME]
