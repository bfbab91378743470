"""The two hangs end in one line, and the failure paths of issue 36 (3), (5) are one line each.

``train.py --eval-batches 100000000`` drew batches until memory ran out and
``training.sample --max-new-tokens 1000000000`` generated for days, both without
a word; ``training.export`` into a read-only or full file system, or under a
file, printed tracebacks; an export racing the trainer's rotation said "no
intact checkpoint"; ``--spike-factor inf`` called a checkpoint the guard never
checked "the last good one"; a second Ctrl-C during a save printed 421 lines.
"""

import errno
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_refusals import visible
from training import cli, export as export_cli, sample as sample_cli
from training import loop
from training.run import checkpoints as ckpt
from training.run.loss_guard import GuardConfig, LossGuard
from training.trainer import TrainConfig, train

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.filterwarnings('ignore::pytest.PytestUnraisableExceptionWarning')


@pytest.fixture(scope='module')
def run(tmp_path_factory) -> TrainConfig:
  """A finished byte-level run of 4 steps (checkpoints 2 and 4)."""
  tmp = tmp_path_factory.mktemp('run')
  corpus = tmp / 'corpus.txt'
  corpus.write_text(''.join(f'def f{i}(x):\n    return x * {i} + {i % 7}\n' for i in range(400)))
  cfg = TrainConfig(config='tiny', remat='none', steps=4, batch_size=2, seq_len=16,
                    warmup_steps=1, eval_every=4, eval_batches=1, save_every=2,
                    memory_report=False, out=str(tmp / 'run'), data=str(corpus))
  train(cfg, log=lambda *_: None, warn=pytest.fail)
  return cfg


def _one_line(main, argv, capsys, prog, code=2) -> str:
  assert main(argv) == code
  err = visible(capsys.readouterr().err)
  assert len(err) == 1 and err[0].startswith(f'{prog}: '), err
  return err[0]


def test_eval_batches_beyond_the_held_out_windows_is_one_line(run, tmp_path, capsys):
  line = _one_line(cli.main, [f'--data={run.data}', '--seq-len=16', '--batch-size=2',
                              '--eval-batches=100000000', f'--out={tmp_path / "new"}'],
                   capsys, 'train.py')
  assert '--eval-batches 100000000 x --batch-size 2 asks for 200,000,000 held-out windows' in line
  assert 'pass --eval-batches' in line and not (tmp_path / 'new').exists()


def test_max_new_tokens_beyond_the_context_is_one_line(run, capsys):
  line = _one_line(sample_cli.main, [run.out, '--prompt', 'def', '--max-new-tokens',
                                     '1000000000'], capsys, 'training.sample')
  assert "--max-new-tokens must be <= the model's context of 128 tokens" in line
  assert 'seed must be >= 0' in _one_line(
      sample_cli.main, [run.out, '--prompt', 'def', '--seed', '-1'], capsys, 'training.sample')


@pytest.mark.parametrize('size', ['1e400', '0.5', '-3GB', 'nan'])
def test_export_shard_sizes_out_of_range_are_one_line(size, tmp_path, capsys):
  with pytest.raises(SystemExit) as e:
    export_cli.main(['run', str(tmp_path / 'x'), '--max-shard-size', size])
  err = capsys.readouterr().err.splitlines()
  assert e.value.code == 2 and len(err) == 1 and '--max-shard-size' in err[0], err


def test_export_where_it_cannot_write_is_one_line_and_leaves_nothing(run, tmp_path, capsys,
                                                                     monkeypatch):
  a_file = tmp_path / 'a_file'
  a_file.write_text('x')
  line = _one_line(export_cli.main, [run.out, str(a_file / 'hf')], capsys, 'training.export')
  assert f"'{a_file}' is a file" in line
  real_access = os.access
  monkeypatch.setattr(os, 'access', lambda p, mode: False if str(p) == str(tmp_path / 'ro')
                      else real_access(p, mode))   # root ignores chmod: a read-only folder
  (tmp_path / 'ro').mkdir()
  line = _one_line(export_cli.main, [run.out, str(tmp_path / 'ro' / 'hf')], capsys,
                   'training.export')
  assert 'is not writable' in line and list((tmp_path / 'ro').iterdir()) == []
  monkeypatch.undo()

  def full(folder, *args):
    (folder / 'model.safetensors').write_bytes(b'partial')
    raise OSError(errno.ENOSPC, 'No space left on device', str(folder / 'model.safetensors'))
  monkeypatch.setattr(export_cli, 'write_weights', full)
  (tmp_path / 'disk').mkdir()
  line = _one_line(export_cli.main, [run.out, str(tmp_path / 'disk' / 'hf')], capsys,
                   'training.export')
  assert line.startswith('training.export: error: no space left on device writing')
  assert list((tmp_path / 'disk').iterdir()) == []   # the temporary folder is gone


def test_export_racing_the_rotation_reads_the_newer_checkpoint(run, tmp_path, capsys, monkeypatch):
  """The trainer saves 6 and rotates 2 and 4 out while the export reads 4."""
  out = tmp_path / 'run'
  shutil.copytree(run.out, out)
  real = ckpt._restore_item
  calls = []

  def rotating(out_, step, *args, **kwargs):
    if not calls:
      shutil.copytree(ckpt.folder(out) / '4', ckpt.folder(out) / '6')
      shutil.rmtree(ckpt.folder(out) / '4')
      shutil.rmtree(ckpt.folder(out) / '2')
    calls.append(step)
    return real(out_, step, *args, **kwargs)
  monkeypatch.setattr(ckpt, '_restore_item', rotating)
  assert export_cli.main([str(out), str(tmp_path / 'hf')]) == 0
  captured = capsys.readouterr()
  assert captured.err == '' and 'exported step 4' in captured.out   # 6 holds step 4's state
  assert calls[0] == 4 and calls[-1] == 6


def test_a_checkpoint_the_guard_did_not_check_is_not_called_good(run, tmp_path):
  out = tmp_path / 'run'
  shutil.copytree(run.out, out)
  on = loop.kept_line(LossGuard(GuardConfig()), out)
  assert 'checkpoint 4 in' in on and 'is the last good one' in on
  off = loop.kept_line(LossGuard(GuardConfig(factor=float('inf'))), out)
  assert 'is the last good one' not in off
  assert 'with the loss guard off (--spike-factor inf) it may hold a blown-up state' in off


def _launch(argv, cwd) -> subprocess.Popen:
  env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=str(ROOT))
  return subprocess.Popen([sys.executable, str(ROOT / 'train.py'), *argv], cwd=cwd, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _ours(err: bytes) -> list[str]:
  """The lines of stderr a terminal shows (bytes: text mode would turn carriage returns into
  line ends), less the CUDA plugin's notices."""
  from test_train import _plugin_notice
  return [l for l in visible(err.decode(errors='replace')) if not _plugin_notice(l)]


def _wait(predicate, proc, timeout=300.0) -> bool:
  end = time.monotonic() + timeout
  while not predicate():
    if proc.poll() is not None:
      return False
    assert time.monotonic() < end, 'timed out'
    time.sleep(0.002)
  return True


@pytest.mark.slow   # a subprocess run to its second save
def test_a_second_ctrl_c_during_a_save_is_one_line(run, tmp_path):
  out = tmp_path / 'run'
  proc = _launch([f'--data={run.data}', '--steps=6', '--batch-size=2', '--seq-len=16',
                  '--save-every=2', '--eval-every=6', '--eval-batches=1', '--no-memory-report',
                  f'--out={out}'], tmp_path)
  writing = lambda: (out / 'checkpoints').is_dir() and any(
      p.name.startswith('4.orbax-checkpoint-tmp') for p in (out / 'checkpoints').iterdir())
  assert _wait(writing, proc), 'ended before its save of step 4'
  proc.send_signal(signal.SIGINT)
  proc.send_signal(signal.SIGINT)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 130
  lines = _ours(err)
  assert len(lines) == 1 and lines[0].startswith('train.py: interrupted'), err[-3000:].decode(errors='replace')
  assert 2 in ckpt.steps(out)   # the last complete checkpoint; the next run removes the rest


@pytest.mark.slow   # a subprocess interrupted while it imports JAX
def test_ctrl_c_while_the_libraries_load_is_one_line(tmp_path):
  proc = _launch(['--steps=abc'], tmp_path)   # would fail after the imports: never gets there
  maps = Path(f'/proc/{proc.pid}/maps')
  loading = lambda: maps.exists() and 'numpy' in maps.read_text()
  if not _wait(loading, proc, timeout=60):
    pytest.skip('the imports ended before they could be interrupted')
  proc.send_signal(signal.SIGINT)
  _, err = proc.communicate(timeout=120)
  lines = _ours(err)
  assert len(lines) == 1 and lines[0] in ('train.py: interrupted',
                                          "train.py: --steps: 'abc' is not an integer (see --help)"
                                          ), err[-3000:].decode(errors='replace')
  assert list(tmp_path.iterdir()) == []


def test_a_full_disk_when_the_lock_is_claimed_is_one_line(tmp_path, monkeypatch):
  from training.run import rundir

  def full(*args):
    raise OSError(errno.ENOSPC, 'No space left on device')
  lock = rundir.RunLock(tmp_path)
  lock.acquire()
  monkeypatch.setattr(os, 'pwrite', full)
  with pytest.raises(rundir.DiskFullError, match=f"no space left on device writing "
                                                 f"{tmp_path / '.lock'}$"):
    lock.claim()
  lock.release()
