"""Training never loses work: divergence, blow-ups, kill -9, damaged files, a full disk, an
interrupted save, two writers, wrong and changed flags.

Every run is the tiny GPT with very small settings (8 steps of 2 x 16 bytes,
checkpoints every 2 steps), so each compiles and finishes in seconds. Runs in
subprocesses share a persistent XLA compilation cache, which makes each start
cheaper and gives every process the very same executable (results stay
bit-exact against an in-process run, which compiles the same program).
"""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import load_config
from conftest import DEFAULT_EMITTERS
from models.gpt import GPT, GPTConfig
from training import checkpoints as ckpt
from training import cli, rundir
from training import steps as st
from training import trainer
from training.trainer import DivergedError, TrainConfig, resolve, train

ROOT = Path(__file__).resolve().parents[1]
# A failed restore of a damaged checkpoint leaves TensorStore objects for the garbage collector.
pytestmark = pytest.mark.filterwarnings('ignore::pytest.PytestUnraisableExceptionWarning')
SMALL = dict(config='tiny', remat='sqrt', steps=8, batch_size=2, seq_len=16, lr=3e-3,
             warmup_steps=2, eval_every=4, eval_batches=2, save_every=2, memory_report=False)
FLAGS = ['--steps=8', '--batch-size=2', '--seq-len=16', '--lr=0.003', '--warmup-steps=2',
         '--eval-every=4', '--eval-batches=2', '--save-every=2', '--no-memory-report']


def _corpus(path: Path) -> Path:
  path.write_text(''.join(f'def f{i}(x):\n    return x * {i} + {i % 7}\n' for i in range(400)))
  return path


def _cfg(out, data, **kw) -> TrainConfig:
  return TrainConfig(**{**SMALL, 'out': str(out), 'data': str(data), **kw})


def _strict_rows(out) -> list[dict]:
  def no_constants(name):
    raise AssertionError(f'metrics.jsonl holds {name}: not strict JSON')
  text = (Path(out) / 'metrics.jsonl').read_text()
  return [json.loads(l, parse_constant=no_constants) for l in text.splitlines()]


def _state_shape(cfg: TrainConfig):
  _, task, size, policy = resolve(cfg)
  tx = st.make_optimizer(cfg.lr, cfg.steps, cfg.warmup_steps, cfg.weight_decay, cfg.grad_clip)
  return st.abstract_inputs(task.model(policy), tx, cfg.batch_size, size, cfg.seed)[0]


def _params(out, cfg, step=None):
  """Parameters of checkpoint ``step`` (default: newest) of ``out``, as numpy arrays."""
  state, _ = ckpt.restore(Path(out), _state_shape(cfg), warn=pytest.fail)
  if step is not None:
    assert int(state.step) == step
  return jax.tree_util.tree_leaves(jax.device_get(state.params))


def _assert_same_params(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x, y)  # resume is bit-exact


@pytest.fixture(scope='module')
def base(tmp_path_factory):
  """An uninterrupted run: (config, rows); its folder holds checkpoints 6 and 8."""
  tmp = tmp_path_factory.mktemp('base')
  cfg = _cfg(tmp / 'run', _corpus(tmp / 'corpus.txt'))
  train(cfg, log=lambda *_: None, warn=pytest.fail)
  return cfg, _strict_rows(cfg.out)


def _copy(base, tmp_path) -> TrainConfig:
  cfg, _ = base
  out = tmp_path / 'run'
  shutil.copytree(cfg.out, out)
  return _cfg(out, cfg.data, resume=True)


# --- divergence -----------------------------------------------------------------------------


def test_guarded_step_equals_plain_step_and_keeps_state_on_nan(windows):
  model = GPT(GPTConfig(vocab_size=256, max_len=16, num_layers=2, num_heads=1, d_model=8), 'sqrt')
  tx = st.make_optimizer(3e-3, 10, 2, 0.1, 1.0)
  state = st.init_state(model, tx, 0, 16)
  plain_state, plain_loss = jax.jit(st.make_train_step(model, tx, 0),
                                    compiler_options=DEFAULT_EMITTERS)(state, windows)
  guarded = jax.jit(st.make_train_step(model, tx, 0, guard=True),
                    compiler_options=DEFAULT_EMITTERS)
  new, stats = guarded(state, windows)
  assert float(stats[0]) == float(plain_loss) and np.isfinite(float(stats[1]))
  for a, b in zip(jax.tree_util.tree_leaves(new), jax.tree_util.tree_leaves(plain_state)):
    np.testing.assert_array_equal(a, b)  # the guard changes nothing in a healthy step
  leaves, tree = jax.tree_util.tree_flatten(state.params)
  poisoned = state.replace(params=jax.tree_util.tree_unflatten(
      tree, [leaves[0].at[0].set(jnp.nan)] + leaves[1:]))
  kept, stats = guarded(poisoned, windows)
  assert not np.isfinite(np.asarray(stats)).all() and int(kept.step) == 1
  for a, b in zip(jax.tree_util.tree_leaves((kept.params, kept.opt_state)),
                  jax.tree_util.tree_leaves((poisoned.params, poisoned.opt_state))):
    np.testing.assert_array_equal(a, b)  # update dropped: nothing moved


def test_divergence_stops_with_one_line_and_keeps_good_checkpoints(base, tmp_path, capsys):
  cfg = _copy(base, tmp_path)
  code = cli.main(['--resume', f'--out={cfg.out}', '--lr=1e6', '--steps=40',
                   '--allow-changed=lr', '--skip-nonfinite=3'])
  err = capsys.readouterr().err.strip().splitlines()
  ours = [l for l in err if not l.startswith('train.py: warning: ')]
  assert code == 3
  assert len(ours) == 1 and ours[0].startswith('train.py: error: ')
  assert 'checkpoint 8 in ' in ours[0] and 'is the last good one' in ours[0]
  assert '--resume' in ours[0] and '--allow-changed lr' in ours[0]
  rows = _strict_rows(cfg.out)  # strict JSON: a non-finite loss is null
  assert [r['step'] for r in rows] == list(range(1, len(rows) + 1))
  assert all(r['loss'] is None or r.get('spike') for r in rows[9:])  # nothing healthy after 9
  assert ckpt.steps(Path(cfg.out)) == [8, 6]  # no save after the blow-up, none rotated out
  # Both verify and are finite; the newest is bit for bit the base run's.
  _assert_same_params(_params(cfg.out, cfg, 8), _params(base[0].out, cfg, 8))
  shutil.rmtree(Path(cfg.out) / 'checkpoints' / '8')
  _params(cfg.out, cfg, 6)


def _inject_nan_at(monkeypatch, bad_steps):
  """Makes the compiled step report a non-finite loss (and drop its update) at ``bad_steps``."""
  real = st.compile_train_step

  def compile_train_step(*args, **kw):
    step_fn = real(*args, **kw)

    def injected(state, batch):
      if int(state.step) + 1 in bad_steps:  # what the guard returns for a non-finite step
        return state.replace(step=state.step + 1), jnp.array([jnp.nan, jnp.inf])
      return step_fn(state, batch)
    return injected
  monkeypatch.setattr(st, 'compile_train_step', compile_train_step)


def test_nonfinite_steps_are_skipped_up_to_the_limit(base, tmp_path, monkeypatch):
  cfg, _ = base
  _inject_nan_at(monkeypatch, {3, 5, 6})
  out = tmp_path / 'run'
  warnings = []
  with pytest.raises(DivergedError, match=r'diverged at step 6: loss nan, gradient norm inf '
                                          r'after 1 skipped steps in a row.*checkpoint 4'):
    train(_cfg(out, cfg.data, skip_nonfinite=1), log=lambda *_: None, warn=warnings.append)
  assert len(warnings) == 2 and all('update skipped (1 in a row' in w for w in warnings)
  rows = _strict_rows(out)
  assert [r['step'] for r in rows] == list(range(1, 7))
  assert [r['step'] for r in rows if r.get('skipped')] == [3, 5]  # 6 is where it stopped
  assert rows[5]['loss'] is None and rows[5]['skipped'] is False
  assert ckpt.steps(out) == [4, 2]


def test_nonfinite_state_is_never_saved(tmp_path):
  out = tmp_path / 'run'
  mngr = ckpt.manager(out, 1, writer=True)
  state = st.TrainState(step=jnp.array(1), params={'w': jnp.array([1.0, jnp.nan])},
                        model_state={}, opt_state=())
  with pytest.raises(ckpt.CheckpointError, match=r"step 1: non-finite values in \.params\['w'\]"):
    ckpt.save(mngr, state, {'config': 'tiny'}, force=True)
  mngr.close()
  assert ckpt.steps(out) == []


@pytest.mark.parametrize('flag,value', [('lr', 'inf'), ('lr', 'nan'), ('grad-clip', 'nan'),
                                        ('grad-clip', '0'), ('weight-decay', 'nan'),
                                        ('weight-decay', '-0.1'), ('skip-nonfinite', '-1')])
def test_bad_hyperparameters_are_refused_up_front(flag, value, tmp_path, capsys):
  code = cli.main([f'--{flag}={value}', f'--out={tmp_path / "never"}'])
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and len(err) == 1 and err[0].startswith(f'train.py: error: --{flag} must be')
  assert not (tmp_path / 'never').exists()


# --- metrics --------------------------------------------------------------------------------


def test_metrics_log_keeps_each_step_once(tmp_path):
  path = tmp_path / 'metrics.jsonl'
  path.write_text(''.join(json.dumps({'step': s, 'loss': s}) + '\n' for s in (1, 2, 3, 2, 3, 4))
                  + '{"step": 5, "lo')  # a torn last line: killed mid-write
  log = rundir.MetricsLog(tmp_path, through_step=3)
  log.write({'step': 4, 'loss': float('nan')})
  log.close()
  rows = _strict_rows(tmp_path)
  assert [r['step'] for r in rows] == [1, 2, 3, 4] and rows[3]['loss'] is None


# --- damaged checkpoints --------------------------------------------------------------------


def _biggest_array_file(step_dir: Path) -> Path:
  return max((p for p in (step_dir / 'state').rglob('*') if p.is_file()),
             key=lambda p: p.stat().st_size)


def _truncate(d):
  p = _biggest_array_file(d)
  os.truncate(p, p.stat().st_size // 2)


def _overwrite(d):
  p = _biggest_array_file(d)
  p.write_bytes(bytes(p.stat().st_size))


def _flip_bit(d):
  # Orbax compresses arrays; a flipped bit in a compressed block may still decode, to
  # other numbers. Seeded positions; the digest must catch every one.
  p = _biggest_array_file(d)
  data = bytearray(p.read_bytes())
  data[random.Random(0).randrange(len(data) // 4, len(data) // 2)] ^= 0x10
  p.write_bytes(bytes(data))


@pytest.mark.parametrize('damage,needle', [
    (_truncate, 'state: '), (_overwrite, 'state: '), (_flip_bit, 'SHA-256 digest'),
    (lambda d: (d / 'state' / '_METADATA').unlink(), 'state: FileNotFoundError'),
    (lambda d: (d / 'meta' / 'metadata').write_text('{garbled'), 'meta/metadata: JSONDecodeError'),
])
def test_damaged_latest_checkpoint_falls_back_to_previous(base, tmp_path, damage, needle):
  cfg = _copy(base, tmp_path)
  out = Path(cfg.out)
  damage(out / 'checkpoints' / '8')
  warnings = []
  state, meta = ckpt.restore(out, _state_shape(cfg), warn=warnings.append)
  assert int(state.step) == 6 and meta['config'] == 'tiny'
  assert len(warnings) == 1 and warnings[0].startswith('checkpoint 8 in ') and needle in warnings[0]
  assert ckpt.steps(out) == [6] and (out / 'damaged' / '8').is_dir()  # set aside, not deleted


def test_resume_warns_and_continues_from_previous_checkpoint(base, tmp_path, capsys):
  cfg = _copy(base, tmp_path)
  _truncate(Path(cfg.out) / 'checkpoints' / '8')
  assert cli.main(['--resume', f'--out={cfg.out}']) == 0
  cap = capsys.readouterr()
  warning = [l for l in cap.err.splitlines() if l.startswith('train.py: warning: ')]
  assert len(warning) == 1 and 'checkpoint 8' in warning[0] and 'resumed step 6' in cap.out
  rows = _strict_rows(cfg.out)
  assert [r['step'] for r in rows] == list(range(1, 9))
  assert [r['loss'] for r in rows] == [r['loss'] for r in base[1]]
  _assert_same_params(_params(cfg.out, cfg, 8), _params(base[0].out, cfg, 8))


def test_no_intact_checkpoint_is_one_line(base, tmp_path, capsys):
  cfg = _copy(base, tmp_path)
  for step in (6, 8):
    _overwrite(Path(cfg.out) / 'checkpoints' / str(step))
  assert cli.main(['--resume', f'--out={cfg.out}']) == 2
  err = [l for l in capsys.readouterr().err.splitlines() if not l.startswith('train.py: warning')]
  assert len(err) == 1 and err[0].startswith('train.py: error: --resume: no intact checkpoint')


def test_interrupted_first_save_is_not_a_checkpoint(tmp_path):
  # The end-to-end case (kill -9 during the first save, then --resume) is in the kill test.
  leftover = tmp_path / 'checkpoints' / '2.orbax-checkpoint-tmp-1700000000'
  leftover.mkdir(parents=True)
  assert ckpt.steps(tmp_path) == [] and leftover.exists()  # a reader leaves it alone
  ckpt.manager(tmp_path, 2, writer=True).close()
  assert not leftover.exists()  # the writer (holding the lock) clears it


# --- settings, paths, second writer ---------------------------------------------------------


def _one_error(argv, capsys, code=2) -> str:
  assert cli.main(argv) == code
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith('train.py: error: '), err
  return err[0]


@pytest.mark.parametrize('extra,needle', [
    (['--config=gpt2-small'], 'was trained with --config tiny, not gpt2-small'),
    (['--model=vit'], '--model vit does not match config tiny'),
    (['--data=OTHER'], 'was trained with --data '),
    (['--steps=5'], 'is at step 8, past --steps 5; pass --steps above 8'),
])
def test_resume_settings_are_checked_before_compiling(base, tmp_path, capsys, monkeypatch, extra,
                                                      needle):
  cfg = _copy(base, tmp_path)
  extra = [f'--data={_corpus(tmp_path / "other.txt")}' if a == '--data=OTHER' else a for a in extra]
  monkeypatch.setattr(st, 'compile_train_step', lambda *a, **k: pytest.fail('compiled'))
  assert needle in _one_error(['--resume', f'--out={cfg.out}'] + extra, capsys)


def test_record_from_before_a_new_config_field_still_resumes(base, tmp_path, monkeypatch):
  """A run saved before a config gained a field (say ``attention``) reads it as the default."""
  cfg = _copy(base, tmp_path)
  step, meta = ckpt.read_meta(Path(cfg.out))
  named = load_config('tiny')
  older = {**meta, 'model': {k: v for k, v in meta['model'].items() if k != 'attention'}}
  monkeypatch.setattr(ckpt, 'read_meta', lambda out: (step, older))
  assert trainer._check_record(cfg, named, Path(cfg.out)) == step
  reshaped = {**meta, 'model': {**meta['model'], 'd_model': 64}}
  monkeypatch.setattr(ckpt, 'read_meta', lambda out: (step, reshaped))
  with pytest.raises(trainer.RunError, match='config tiny has changed shape'):
    trainer._check_record(cfg, named, Path(cfg.out))


def test_resume_at_the_last_step_has_nothing_to_do(base, tmp_path, capsys):
  cfg = _copy(base, tmp_path)
  assert cli.main(['--resume', f'--out={cfg.out}']) == 0
  assert 'nothing to do: ' in capsys.readouterr().out
  assert len(_strict_rows(cfg.out)) == 8


def test_bad_out_paths_are_one_line(text_file, tmp_path, capsys, monkeypatch):
  a_file = tmp_path / 'a_file'
  a_file.write_text('x')
  assert 'is a file, not a folder' in _one_error([f'--out={a_file}', f'--data={text_file}'],
                                                 capsys)
  assert "a_file' is a file" in _one_error([f'--out={a_file / "run"}'], capsys)
  assert 'longer than 255 bytes' in _one_error([f'--out={tmp_path / ("x" * 300)}'], capsys)
  real_access = os.access
  monkeypatch.setattr(os, 'access', lambda p, mode: False if str(p) == str(tmp_path)
                      else real_access(p, mode))  # root ignores chmod: fake a read-only folder
  assert 'no write permission in' in _one_error([f'--out={tmp_path / "run"}'], capsys)
  assert set(tmp_path.iterdir()) == {a_file, text_file}  # nothing half-written


def test_long_remat_spec_gets_a_short_default_folder(monkeypatch, tmp_path):
  spec = 'names:' + ','.join(['query_proj', 'key_proj', 'value_proj', 'out_proj', 'context'] * 8)
  name = TrainConfig(remat=spec).out_dir.name
  assert len(name) < 100 and name.startswith('tiny-names_query_proj')
  assert name != TrainConfig(remat=spec + ',mlp_in').out_dir.name  # the hash keeps them apart


def test_bad_data_paths_are_one_line(tmp_path, capsys, monkeypatch):
  assert 'is not a regular file or a folder' in _one_error(['--data=/dev/null'], capsys)
  folder = tmp_path / 'corpus'
  folder.mkdir()
  _corpus(folder / 'a.txt')

  def denied(self):
    raise PermissionError(13, 'Permission denied', str(self))
  monkeypatch.setattr(Path, 'read_bytes', denied)  # root ignores chmod: fake an unreadable file
  msg = _one_error([f'--data={folder}', f'--out={tmp_path / "never"}'], capsys)
  assert f"cannot read '{folder / 'a.txt'}': Permission denied" in msg
  assert not (tmp_path / 'never').exists()


def test_held_lock_names_its_pid(base, tmp_path, capsys):
  cfg = _copy(base, tmp_path)
  with rundir.RunLock(Path(cfg.out)):
    msg = _one_error(['--resume', f'--out={cfg.out}', '--steps=10'], capsys)
  assert f'is in use by another train.py run (pid {os.getpid()})' in msg
  assert ckpt.steps(Path(cfg.out)) == [8, 6] and len(_strict_rows(cfg.out)) == 8


# --- subprocesses: a second writer, kill -9 -------------------------------------------------


@pytest.fixture(scope='module')
def xla_cache(tmp_path_factory):
  return tmp_path_factory.mktemp('xla-cache')


def _launch(out, data, cache, *extra) -> subprocess.Popen:
  env = {**os.environ, 'JAX_COMPILATION_CACHE_DIR': str(cache),
         'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS': '0',
         'JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES': '0'}
  return subprocess.Popen([sys.executable, 'train.py', *FLAGS, f'--data={data}', f'--out={out}',
                           *extra], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)


def _wait_for(predicate, proc, timeout=120.0):
  end = time.monotonic() + timeout
  while not predicate():
    if proc.poll() is not None:
      return False
    assert time.monotonic() < end, 'timed out'
    time.sleep(0.005)
  return True


def _lock_taken(out, proc):
  path = Path(out) / rundir.LOCK_NAME
  return lambda: path.exists() and path.read_text().strip() == str(proc.pid)


@pytest.mark.slow  # test_held_lock_names_its_pid checks the same lock in-process
def test_second_writer_exits_2_and_first_is_unaffected(base, tmp_path, xla_cache):
  cfg, ref = base
  out = tmp_path / 'run'
  first = _launch(out, cfg.data, xla_cache)
  assert _wait_for(_lock_taken(out, first), first)
  second = _launch(out, cfg.data, xla_cache)
  _, err = second.communicate(timeout=120)
  ours = [l for l in err.splitlines() if l.startswith('train.py')]
  assert second.returncode == 2 and len(ours) == 1
  assert f'is in use by another train.py run (pid {first.pid})' in ours[0]
  _, err = first.communicate(timeout=300)
  assert first.returncode == 0, err[-2000:]
  assert [r['loss'] for r in _strict_rows(out)] == [r['loss'] for r in ref]


def _kill_moments(seed: int, count: int) -> list[tuple[str, float]]:
  """Seeded kill moments: ('time', seconds after the run took its lock: start-up, compiling,
  restoring), ('step', k: k steps after the step it resumed from, then 0-200 ms) or ('save', k:
  k steps on, then as soon as the next checkpoint is being written)."""
  rng = random.Random(seed)
  kinds = rng.choices(['time', 'step', 'save'], weights=[2, 5, 3], k=count)
  return [(k, rng.uniform(0.0, 4.0) if k == 'time' else rng.randint(1, 5)) for k in kinds]


def _kill_at(moment, out: Path, proc, steps: int, rng: random.Random) -> bool:
  """Kills ``proc`` (SIGKILL) at ``moment``; False if it ended first."""
  kind, value = moment
  saved = ckpt.steps(out)  # the run resumes from the newest (nothing here is damaged)
  target = min(steps, (saved[0] if saved else 0) + int(value))
  if not _wait_for(_lock_taken(out, proc), proc):
    return False
  metrics = out / 'metrics.jsonl'
  old = metrics.stat().st_ino if metrics.exists() else None
  # Each run rewrites metrics.jsonl (a new inode) before its first step; rows seen
  # before that are the previous run's.
  fresh_row = lambda: (metrics.exists() and metrics.stat().st_ino != old and
                       f'"step": {target},' in metrics.read_text())
  until = lambda seconds: (lambda end=time.monotonic() + seconds: time.monotonic() >= end)
  if kind == 'time':
    ok = _wait_for(until(value), proc)
  elif kind == 'step':
    ok = _wait_for(fresh_row, proc) and _wait_for(until(rng.uniform(0, 0.2)), proc)
  else:
    tmp = lambda: any('orbax-checkpoint-tmp' in p.name for p in (out / 'checkpoints').glob('*'))
    ok = _wait_for(fresh_row, proc) and _wait_for(tmp, proc)
  if not ok:
    return False
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  return True


def _kill_and_resume(base, tmp_path, xla_cache, moments, steps):
  cfg, ref = base
  out = tmp_path / 'run'
  extra = [f'--steps={steps}']
  rng = random.Random(1)
  kills = 0
  proc = _launch(out, cfg.data, xla_cache, *extra)
  for moment in moments:
    kills += _kill_at(moment, out, proc, steps, rng)
    if proc.poll() is None:
      proc.kill()
    proc.wait()
    proc = _launch(out, cfg.data, xla_cache, '--resume', *extra)
  _, err = proc.communicate(timeout=300)
  assert proc.returncode == 0, err[-2000:]
  assert 'Traceback' not in err
  rows = _strict_rows(out)
  assert [r['step'] for r in rows] == list(range(1, steps + 1))  # each step exactly once
  return out, rows, kills


def test_kill_9_then_resume_loses_nothing(base, tmp_path, xla_cache):
  moments = [('save', 1), ('step', 3)]  # mid-save of the first checkpoint, then mid-steps
  out, rows, kills = _kill_and_resume(base, tmp_path, xla_cache, moments, 8)
  cfg, ref = base
  assert kills == 2
  assert [r['loss'] for r in rows] == [r['loss'] for r in ref]
  _assert_same_params(_params(out, cfg, 8), _params(cfg.out, cfg, 8))


@pytest.mark.slow
def test_kill_9_at_20_random_moments_of_40_steps(base, tmp_path, xla_cache):
  cfg, _ = base
  moments = _kill_moments(seed=13, count=20)
  out, rows, kills = _kill_and_resume(base, tmp_path, xla_cache, moments, 40)
  ref_out = tmp_path / 'ref'
  train(_cfg(ref_out, cfg.data, steps=40), log=lambda *_: None, warn=pytest.fail)
  ref = _strict_rows(ref_out)
  assert kills >= 15, kills  # most moments land before the run ends
  assert [r['loss'] for r in rows] == [r['loss'] for r in ref]
  long_cfg = _cfg(out, cfg.data, steps=40)
  _assert_same_params(_params(out, long_cfg, 40), _params(ref_out, long_cfg, 40))
