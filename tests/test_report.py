"""python -m remat.report --fn: the table of a user's own function; a bad --fn is one line, exit 2."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from remat import report

TESTS = Path(__file__).parent


def test_fn_prints_the_table_and_json(tmp_path, capsys):
  out = tmp_path / 'r.json'
  assert report.main(['--fn', 'user_mlp:factory', '--policies', 'full', '--json', str(out)]) == 0
  text = capsys.readouterr().out
  assert 'value_and_grad of loss, user_mlp:factory, target cpu' in text
  lines = text.splitlines()
  assert lines[1].split()[:4] == ['policy', 'temp', 'peak', 'residual']
  assert [l.split()[0] for l in lines[2:4]] == ['none', 'full']
  data = json.loads(out.read_text())
  assert data['environment']['fn'] == 'user_mlp:factory'
  assert [r['policy'] for r in data['policies']] == ['none', 'full']
  assert data['policies'][1]['recompute_ratio'] == pytest.approx(7 / 6)  # test_measuring


def test_reference_is_the_first_row(capsys):
  assert report.main(['--fn', 'user_mlp:factory', '--policies', 'full',
                      '--reference', 'user_mlp:reference']) == 0
  lines = capsys.readouterr().out.splitlines()
  assert "'reference' measured on the example arguments" in lines[1]
  assert 'temp/ref' in lines[2]
  assert [l.split()[0] for l in lines[3:6]] == ['reference', 'none', 'full']
  row = lines[3].split()
  assert row[row.index('100.0%'):][:3] == ['100.0%', '100.0%', '1.000x']   # temp, peak, flops


def test_reference_on_its_own_arguments(capsys):
  """A --reference factory returning (loss, its own args): the untouched model on its own tree."""
  assert report.main(['--fn', 'user_mlp:factory', '--policies', 'full',
                      '--reference', 'user_mlp:reference_own']) == 0
  lines = capsys.readouterr().out.splitlines()
  assert "'reference' measured on its own arguments (reference_args)" in lines[1]
  assert [l.split()[0] for l in lines[3:6]] == ['reference', 'none', 'full']


@pytest.mark.parametrize('ref,needle', [
    ('user_mlp', "--reference 'user_mlp': expected package.module:factory"),
    ('user_mlp:nope', 'user_mlp has no attribute nope'),
    ('user_mlp:example_args', 'must return the untouched loss function (or a TrainStep)'),
])
def test_bad_reference_is_one_line(ref, needle, capsys):
  assert report.main(['--fn', 'user_mlp:factory', '--reference', ref]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith('remat.report: error: ') and needle in err[0]


@pytest.mark.parametrize('fn,needle', [
    ('user_mlp', "expected package.module:factory"),
    ('no_such_module_xyz:factory', 'cannot import no_such_module_xyz'),
    ('user_mlp:nope', 'user_mlp has no attribute nope'),
    ('user_mlp:L', 'L is not callable'),
    ('user_mlp:not_a_pair', 'must return (build, example_args), got function'),
])
def test_bad_fn_is_one_line(fn, needle, capsys):
  assert report.main(['--fn', fn]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith('remat.report: error: ') and needle in err[0]


def test_command_line_from_the_users_directory():
  # As a user runs it: python -m from the folder holding their module; a bad --fn exits 2.
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  run = subprocess.run([sys.executable, '-m', 'remat.report', '--fn', 'user_mlp:missing'],
                       cwd=TESTS, capture_output=True, text=True, env=env, timeout=120)
  assert run.returncode == 2
  assert 'Traceback' not in run.stderr
  assert run.stderr.strip().splitlines()[-1] == (
      "remat.report: error: --fn 'user_mlp:missing': user_mlp has no attribute missing")


def test_auto_prints_the_chosen_spec(tmp_path, monkeypatch, capsys):
  monkeypatch.setenv('REMAT_CACHE', str(tmp_path))
  assert report.main(['--fn', 'user_mlp:factory', '--auto', 'auto:1x']) == 0
  out = capsys.readouterr().out.splitlines()
  assert out[0].startswith('auto:1x -> none: peak ') and out[-1] == 'none'


def test_auto_bad_budget_is_one_line(capsys):
  assert report.main(['--fn', 'user_mlp:factory', '--auto', 'auto:big']) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("remat.report: error: 'auto:big': cannot read") and '\n' not in err
