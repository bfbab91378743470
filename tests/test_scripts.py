"""export.py and sample.py beside train.py: the export and sampling commands from any folder.

pyproject.toml installs the library alone, so ``python -m training.export`` finds
``training`` only when the working directory is the checkout; the scripts run as
``python /path/to/checkout/export.py`` from anywhere (Python puts a script's own
folder first on ``sys.path``), as train.py does. Each runs here as a person runs
it: a fresh process, an empty working folder elsewhere, no PYTHONPATH.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_train import _plugin_notice
from training import cli
from training import sample as sample_cli

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  """One step of the tiny byte-level GPT on a small text file."""
  tmp = tmp_path_factory.mktemp('scripts')
  data = tmp / 'text.txt'
  data.write_text('the quick brown fox jumps over the lazy dog. ' * 200)
  out = tmp / 'run'
  assert cli.main(['--model', 'gpt', '--data', str(data), '--steps', '1', '--batch-size', '2',
                   '--seq-len', '16', '--eval-every', '1', '--eval-batches', '1', '--out',
                   str(out), '--no-memory-report']) == 0
  return out


def _script(name: str, *args, cwd: Path) -> subprocess.CompletedProcess:
  env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'}
  env['JAX_PLATFORMS'] = 'cpu'
  return subprocess.run([sys.executable, str(ROOT / name), *args], cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=300)


@pytest.mark.extended
def test_export_and_sample_run_from_another_folder(run, tmp_path, capsys):
  elsewhere = tmp_path / 'elsewhere'
  elsewhere.mkdir()
  got = _script('export.py', str(run), 'hf', cwd=elsewhere)
  assert got.returncode == 0, got.stderr
  assert {'config.json', 'model.safetensors'} <= {p.name for p in (elsewhere / 'hf').iterdir()}
  got = _script('sample.py', str(run), '--prompt', 'the quick', '--max-new-tokens', '4',
                cwd=elsewhere)
  assert got.returncode == 0, got.stderr
  capsys.readouterr()
  # The same command as the module's, run in this process from the checkout.
  assert sample_cli.main([str(run), '--prompt', 'the quick', '--max-new-tokens', '4']) == 0
  assert got.stdout == capsys.readouterr().out and got.stdout.strip()


def test_the_scripts_name_themselves(tmp_path):
  got = _script('export.py', 'no-such-run', 'hf', cwd=tmp_path)
  lines = [l for l in got.stderr.splitlines() if not _plugin_notice(l)]
  assert got.returncode == 2 and len(lines) == 1, got.stderr
  assert lines[0].startswith('export.py: error: ') and 'no-such-run' in lines[0]
  assert list(tmp_path.iterdir()) == []   # nothing written
  got = _script('sample.py', '--help', cwd=tmp_path)
  assert got.returncode == 0 and got.stdout.startswith('usage: sample.py [-h]')


def test_plot_runs_from_another_folder(run, tmp_path):
  got = _script('plot.py', str(run), '--out', 'm.png', cwd=tmp_path)
  assert got.returncode == 0, got.stderr
  assert (tmp_path / 'm.png').stat().st_size > 0
  bad = _script('plot.py', str(tmp_path / 'no-such-run'), cwd=tmp_path)
  assert bad.returncode == 2 and bad.stderr.startswith('plot.py: error: ')
  assert bad.stderr.count('\n') == 1
