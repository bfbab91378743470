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
from training.run import checkpoints as ckpt
from training import cli
from training.run import record_check, resume_check, rundir
from training.run.loss_guard import GuardConfig, LossGuard
from training.step import train_step as st
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


@pytest.mark.extended
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


@pytest.mark.slow  # test_lr_50_stops_before_a_blown_up_state_is_saved: the same path (-m extended, CI)
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
    injected.memory_analysis = step_fn.memory_analysis   # the run records the compiled plan
    return injected
  monkeypatch.setattr(st, 'compile_train_step', compile_train_step)


def test_nonfinite_steps_are_skipped_up_to_the_limit(base, tmp_path, monkeypatch):
  cfg, _ = base
  _inject_nan_at(monkeypatch, {3, 5, 6})
  out = tmp_path / 'run'
  warnings = []
  # Checkpoint 4 was followed by non-finite steps only: nothing vouches for it, so it goes to
  # damaged/ and 2 (step 4 scored healthily with its parameters... after step 3's skip) is named.
  with pytest.raises(DivergedError, match=r'diverged at step 6: loss nan, gradient norm inf '
                                          r'after 1 skipped steps in a row.*checkpoint 4 was set '
                                          r'aside.*checkpoint 2 in .* is the last good one'):
    train(_cfg(out, cfg.data, skip_nonfinite=1), log=lambda *_: None, warn=warnings.append)
  assert len(warnings) == 2 and all('update skipped (1 in a row' in w for w in warnings)
  rows = _strict_rows(out)
  assert [r['step'] for r in rows] == list(range(1, 7))
  assert [r['step'] for r in rows if r.get('skipped')] == [3, 5]  # 6 is where it stopped
  assert rows[5]['loss'] is None and rows[5]['skipped'] is False
  assert ckpt.steps(out) == [2] and (out / 'damaged' / '4').is_dir()


def test_nonfinite_state_is_never_saved(tmp_path):
  out = tmp_path / 'run'
  mngr = ckpt.manager(out, 1, writer=True)
  state = st.TrainState(step=jnp.array(1), params={'w': jnp.array([1.0, jnp.nan])},
                        model_state={}, opt_state=())
  with pytest.raises(ckpt.CheckpointError, match=r"step 1: non-finite values in \.params\['w'\]"):
    ckpt.save(mngr, state, {'config': 'tiny'}, force=True)
  mngr.close()
  assert ckpt.steps(out) == []


def test_loss_guard_spikes_streaks_and_suspects():
  guard = LossGuard(GuardConfig(factor=2.0, margin=1.0, patience=3),
                    history=[{'step': 1, 'loss': 5.5}, {'step': 2, 'loss': 4.0},
                             {'step': 3, 'loss': 3.0, 'spike': True}, {'step': 4, 'loss': None}],
                    uniform=np.log(256))
  assert guard.initial == 5.5 and guard.limit() == 2 * 4.75  # median of 5.5 and 4.0, not the spike
  guard.mark(4)
  assert guard.suspect == 4
  assert not guard.observe(5, float('nan')) and guard.streak == 0 and guard.suspect == 4
  assert guard.observe(6, 9.0) and guard.suspect is None  # 9.0 <= 9.5: healthy, vouches for 4
  guard.mark(6)
  assert not guard.observe(7, 2 * 9.0 * 1.01) and guard.streak == 1 and not guard.last_healthy
  assert guard.observe(8, 3.0) and guard.streak == 0  # one odd batch: the streak ends
  for step in (9, 10, 11):
    assert not guard.observe(step, 1e4)
  assert guard.stop and 'spike 3 in a row' in guard.stop_line(11, 1e4)
  # Low losses: the margin (1 nat) decides, not the factor.
  low = LossGuard(GuardConfig(), history=[{'step': s, 'loss': 0.05} for s in range(1, 21)])
  assert low.limit() == 1.05 and low.observe(21, 0.5) and not low.observe(22, 1.2)
  off = LossGuard(GuardConfig(factor=float('inf')), history=[{'step': 1, 'loss': 1.0}])
  assert off.observe(2, 1e30)


def test_end_check_flags_a_run_that_ends_above_its_start():
  """The issue's --lr 20 run ended at a loss of 135.9 (started at 5.4, a uniform guess: 5.55)."""
  uniform = float(np.log(256))
  ended_high = LossGuard(GuardConfig(), [{'step': 1, 'loss': 5.41}] + [
      {'step': s, 'loss': 135.9} for s in range(2, 40)], uniform)
  msg = ended_high.end_problem()
  assert msg.startswith('the run ended at loss 135.9 (median of its last 20 steps), far above '
                        'where it started (5.41)') and '--restart' in msg
  above_uniform = LossGuard(GuardConfig(), [{'step': s, 'loss': 6.8} for s in range(1, 30)],
                            uniform)  # started there too: only the uniform bound catches it
  assert 'above the 5.545 of a uniform guess' in above_uniform.end_problem()
  learned = LossGuard(GuardConfig(), [{'step': 1, 'loss': 5.41}, {'step': 2, 'loss': 2.6}], uniform)
  assert learned.end_problem() is None


def test_guard_passes_the_healthy_runs(base):
  """The tiny runs here (2 x 16 bytes: the noisiest there are) never come near the limit."""
  guard = LossGuard(GuardConfig(), uniform=float(np.log(256)))
  for row in base[1]:
    assert guard.observe(row['step'], row['loss']), row
  assert guard.end_problem() is None


@pytest.mark.extended
def test_lr_50_stops_before_a_blown_up_state_is_saved(base, tmp_path, capsys):
  """Issue 26 (2): at --lr 50 the first update throws the parameters far away while every
  number stays finite; the guard stops the run and the last good checkpoint stays."""
  cfg = _copy(base, tmp_path)
  out = Path(cfg.out)
  code = cli.main(['--resume', f'--out={out}', '--lr=50', '--allow-changed=lr', '--steps=40'])
  err = capsys.readouterr().err.strip().splitlines()
  errors = [l for l in err if l.startswith('train.py: error: ')]
  spikes = [l for l in err if l.startswith('train.py: warning: ') and 'is a spike' in l]
  assert code == 3 and len(errors) == 1 and len(errors) + len(spikes) == len(err)
  assert errors[0].startswith('train.py: error: blew up at step 12: ')
  assert f'checkpoint 8 in {out} is the last good one' in errors[0]
  rows = _strict_rows(out)
  assert [r['step'] for r in rows] == list(range(1, 13))
  assert [r['step'] for r in rows if r.get('spike')] == [10, 11, 12]
  # Step 9's loss is checkpoint 8's parameters on batch 9: below where the run started.
  assert rows[8]['loss'] < rows[0]['loss'] and rows[9]['loss'] > 100 * rows[0]['loss']
  assert ckpt.steps(out) == [8, 6]  # no save after the blow-up; nothing rotated out
  _assert_same_params(_params(out, cfg, 8), _params(base[0].out, cfg, 8))


@pytest.mark.slow  # 40 steps; the end check itself is tested above
def test_lr_20_without_the_spike_guard_ends_nonzero(base, tmp_path, capsys):
  cfg, _ = base
  out = tmp_path / 'run'
  code = cli.main(FLAGS[1:] + ['--steps=40', '--lr=20', '--spike-factor=inf', f'--out={out}',
                               f'--data={cfg.data}'])
  err = [l for l in capsys.readouterr().err.splitlines() if l.startswith('train.py: error: ')]
  # With the factor off, only the uniform-guess bound (5.545 + 1 nat) is left to catch it.
  assert code == 3 and len(err) == 1 and 'above the 5.545 of a uniform guess' in err[0]
  assert 'it did not learn' in err[0]


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
  # Rows of redone steps and older duplicates are kept beside it, never deleted.
  aside = [json.loads(l) for l in (tmp_path / 'metrics.redone.jsonl').read_text().splitlines()]
  assert [(r['step'], r['loss']) for r in aside] == [(2, 2), (3, 3), (4, 4)]
  assert {r['redone_after'] for r in aside} == {3}


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


def test_retry_after_no_intact_checkpoint_refuses_every_time_and_keeps_rows(base, tmp_path,
                                                                           capsys):
  """Issue 26 (1): a retry loop must not turn a run whose checkpoints are all damaged into a
  new run from step 0 that truncates metrics.jsonl."""
  cfg = _copy(base, tmp_path)
  out = Path(cfg.out)
  for step in (6, 8):
    _overwrite(out / 'checkpoints' / str(step))
  assert cli.main(['--resume', f'--out={out}']) == 2
  err = [l for l in capsys.readouterr().err.splitlines() if not l.startswith('train.py: warning')]
  assert len(err) == 1 and err[0].startswith('train.py: error: --resume: no intact checkpoint')
  assert f"kept in {out / 'damaged'}" in err[0] and '--restart' in err[0]
  for argv in (['--resume', f'--out={out}'], ['--resume', f'--out={out}', '--steps=20'],
               [f'--out={out}', f'--data={cfg.data}']):  # the retries, and a plain run
    msg = _one_error(argv, capsys)
    assert str(out / 'damaged') in msg or 'already holds a run' in msg
    assert '--restart' in msg
  assert _strict_rows(out) == base[1]  # every row kept, untouched
  assert sorted(p.name for p in (out / 'damaged').iterdir()) == ['6', '8']
  assert rundir.read_record(out)['meta']['train']['batch_size'] == 2  # the run remembers itself


@pytest.mark.slow  # a whole 8-step run
def test_restart_starts_over_on_purpose_and_keeps_the_previous_files(base, tmp_path, capsys):
  cfg = _copy(base, tmp_path)
  out = Path(cfg.out)
  (out / 'damaged').mkdir()
  for step in (6, 8):  # as a resume that found both damaged leaves them
    shutil.move(str(out / 'checkpoints' / str(step)), out / 'damaged' / str(step))
  assert cli.main(['--restart', f'--out={out}']) == 0  # the run's recorded settings, from 0
  assert f"moved to {out / 'previous' / '1'}" in capsys.readouterr().out
  assert _strict_rows(out / 'previous' / '1') == base[1]
  assert sorted(p.name for p in (out / 'previous' / '1' / 'damaged').iterdir()) == ['6', '8']
  assert [r['loss'] for r in _strict_rows(out)] == [r['loss'] for r in base[1]]
  assert rundir.read_record(out)['history'][-1]['event'].startswith('restart')


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
    (['--batch-size=4'], 'was trained with --batch-size 2, not 4; drop --batch-size'),
    (['--seq-len=8', '--seed=1'], 'with --seq-len 16, not 8, --seed 0, not 1; drop --seq-len, '
                                  '--seed (the run\'s record supplies it), pass --allow-changed '
                                  'seq_len,seed'),
    (['--lr=50'], 'was trained with --lr 0.003, not 50.0'),
    (['--allow-changed=batch_size,colour'], '--allow-changed: colour is not a compared setting'),
    (['--restart', '--resume'], 'not allowed with argument'),
])
def test_resume_settings_are_checked_before_compiling(base, tmp_path, capsys, monkeypatch, extra,
                                                      needle):
  cfg = _copy(base, tmp_path)
  extra = [f'--data={_corpus(tmp_path / "other.txt")}' if a == '--data=OTHER' else a for a in extra]
  monkeypatch.setattr(st, 'compile_train_step', lambda *a, **k: pytest.fail('compiled'))
  if '--restart' in extra:  # the parser's own error (training.arguments): one line, exit 2
    with pytest.raises(SystemExit) as e:
      cli.main([f'--out={cfg.out}'] + extra)
    err = capsys.readouterr().err.splitlines()
    assert e.value.code == 2 and len(err) == 1 and needle in err[0]
    return
  assert needle in _one_error(['--resume', f'--out={cfg.out}'] + extra, capsys)
  assert _strict_rows(cfg.out) == base[1]


@pytest.mark.slow  # compiles for the new batch; the refusal is in the default suite above
def test_changed_batch_size_is_accepted_with_the_flag_and_recorded(base, tmp_path, capsys):
  """Issue 26 (3): refused above; with --allow-changed the change runs and enters the history."""
  cfg = _copy(base, tmp_path)
  out = Path(cfg.out)
  assert cli.main(['--resume', f'--out={out}', '--steps=10', '--batch-size=4',
                   '--allow-changed=batch-size']) == 0
  assert 'changed on purpose (--allow-changed): --batch-size 2 -> 4' in capsys.readouterr().out
  record = rundir.read_record(out)
  assert record['history'][-1] == {**record['history'][-1], 'event': 'resume', 'step': 8,
                                   'changed': {'batch_size': [2, 4]}}
  _, meta = ckpt.read_meta(out)
  assert meta['train']['batch_size'] == 4
  assert meta['changes'] == [{'step': 8, 'settings': {'batch_size': [2, 4]}}]
  # The record now says 4: a plain --resume continues with it, and 2 is the change now.
  assert 'was trained with --batch-size 4, not 2' in _one_error(
      ['--resume', f'--out={out}', '--steps=12', '--batch-size=2'], capsys)


def test_record_from_before_a_new_config_field_still_resumes(base, tmp_path, monkeypatch):
  """A run saved before a config gained a field (say ``attention``) reads it as the default."""
  cfg = _copy(base, tmp_path)
  step, meta = ckpt.read_meta(Path(cfg.out))
  named = load_config('tiny')
  older = {**meta, 'model': {k: v for k, v in meta['model'].items() if k != 'attention'}}
  monkeypatch.setattr(ckpt, 'read_meta', lambda out: (step, older))
  assert record_check.check_record(cfg, named, Path(cfg.out)) == (step, {})
  reshaped = {**meta, 'model': {**meta['model'], 'd_model': 64}}
  monkeypatch.setattr(ckpt, 'read_meta', lambda out: (step, reshaped))
  with pytest.raises(trainer.RunError, match='config tiny has changed shape'):
    record_check.check_record(cfg, named, Path(cfg.out))


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
  # --out in tmp_path: the default folder may hold the README's main job (runs/tiny-sqrt), whose
  # error would come first
  assert 'is not a regular file or a folder' in _one_error(
      ['--data=/dev/null', f'--out={tmp_path / "run"}'], capsys)
  assert not (tmp_path / 'run').exists()
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


def _launch(out, data, cache, *extra, script=('train.py',), env=None) -> subprocess.Popen:
  env = {**os.environ, 'JAX_COMPILATION_CACHE_DIR': str(cache),
         'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS': '0',
         'JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES': '0', **(env or {})}
  return subprocess.Popen([sys.executable, *script, *FLAGS, f'--data={data}', f'--out={out}',
                           *extra], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)


def _ours(err: str) -> list[str]:
  """stderr less the CUDA plugin's start-up notices (see tests/test_train.py)."""
  return [l for l in err.splitlines()
          if not (l.startswith('WARNING: All log messages before absl::InitializeLog()') or
                  ('cudart_stub.cc' in l and 'Could not find cuda drivers' in l))]


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


@pytest.mark.extended
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


# --- a full disk, an interrupted save (subprocesses: all of stderr, orbax's threads too) -----

# train.py whose file system fills up while checkpoint $ENOSPC_AT_STEP is written: the write of
# its record (the JSON item, which orbax writes from Python in a writer thread, while
# TensorStore writes the arrays) fails with ENOSPC, as on a full disk.
ENOSPC = """
import errno, os, sys
from etils.epath import abstract_path
real = abstract_path.Path.write_text
def write_text(self, *args, **kwargs):
  if self.name == 'metadata' and f"/{os.environ['ENOSPC_AT_STEP']}.orbax-checkpoint-tmp" in str(self):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
  return real(self, *args, **kwargs)
abstract_path.Path.write_text = write_text
from training.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow  # a subprocess and a resume; test_full_disk_in_a_save_... is the light case
def test_full_disk_is_one_line_and_the_previous_checkpoint_resumes_exactly(base, tmp_path,
                                                                          xla_cache, capsys):
  """Issue 26 (4): a full disk printed 319 lines (36 tracebacks); now one, naming the path."""
  cfg, ref = base
  out = tmp_path / 'run'
  proc = _launch(out, cfg.data, xla_cache, script=('-c', ENOSPC), env={'ENOSPC_AT_STEP': '6'})
  _, err = proc.communicate(timeout=300)
  assert proc.returncode == 2 and _ours(err) == [
      f'train.py: error: no space left on device writing checkpoint 6 to {out / "checkpoints"} '
      f'({err.split("checkpoints (")[1].split(")")[0]}); checkpoint 4 in {out / "checkpoints"} '
      'is intact: free space there and rerun with --resume'], err[-3000:]
  assert ckpt.steps(out) == [4, 2]  # and the partial folder of 6 is gone
  assert sorted(p.name for p in (out / 'checkpoints').iterdir()) == ['2', '4']
  assert cli.main(['--resume', f'--out={out}']) == 0
  assert 'resumed step 4' in capsys.readouterr().out
  assert [r['loss'] for r in _strict_rows(out)] == [r['loss'] for r in ref]
  _assert_same_params(_params(out, cfg, 8), _params(cfg.out, cfg, 8))


def _interrupt_during_save(base, tmp_path, xla_cache, sig) -> tuple[Path, str]:
  """Sends ``sig`` as soon as checkpoint 4 is being written; returns (out, stderr)."""
  cfg, _ = base
  out = tmp_path / 'run'
  proc = _launch(out, cfg.data, xla_cache)
  writing = lambda: (out / 'checkpoints').is_dir() and any(
      p.name.startswith('4.orbax-checkpoint-tmp') for p in (out / 'checkpoints').iterdir())
  assert _wait_for(writing, proc), 'ended before its save of step 4'
  proc.send_signal(sig)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 130, err[-3000:]
  return out, err


@pytest.mark.slow  # a subprocess; test_interrupt_waits_for_the_save is the light case
def test_sigint_during_a_save_is_one_line_and_the_save_completes(base, tmp_path, xla_cache):
  """Issue 26 (5): SIGINT mid-save printed a 44-line orbax traceback after the clean line."""
  out, err = _interrupt_during_save(base, tmp_path, xla_cache, signal.SIGINT)
  assert _ours(err) == ['train.py: interrupted; rerun with --resume to continue from the last '
                        'checkpoint'], err[-3000:]
  assert ckpt.steps(out) == [4, 2]  # the save under way finished before the interrupt was taken
  assert [r['step'] for r in _strict_rows(out)] == [1, 2, 3, 4]


@pytest.mark.slow  # the same path as SIGINT (deferred_interrupts handles both)
def test_sigterm_during_a_save_is_one_line_and_the_save_completes(base, tmp_path, xla_cache):
  out, err = _interrupt_during_save(base, tmp_path, xla_cache, signal.SIGTERM)
  assert len(_ours(err)) == 1 and 'Traceback' not in err
  assert ckpt.steps(out) == [4, 2]


def test_full_disk_in_a_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
  """In-process: the ENOSPC of ENOSPC above, raised inside orbax's save of step 2."""
  from etils.epath import abstract_path
  from training.run import orbax_noise
  real = abstract_path.Path.write_text

  def write_text(self, *args, **kwargs):
    if self.name == 'metadata' and '/2.orbax-checkpoint-tmp' in str(self):
      raise OSError(28, os.strerror(28), str(self))
    return real(self, *args, **kwargs)
  monkeypatch.setattr(abstract_path.Path, 'write_text', write_text)
  settled = []  # the process-wide silencing is the subprocess test's; here: that it is called
  monkeypatch.setattr(orbax_noise, 'after_failed_save',
                      lambda: settled.append(orbax_noise.wait_for_writers()))
  mngr = ckpt.manager(tmp_path, 1, writer=True)
  state = lambda step: st.TrainState(step=jnp.array(step), params={'w': jnp.arange(4.0) + step},
                                     model_state={}, opt_state=())
  assert ckpt.save(mngr, state(1), {'config': 'tiny'})
  with pytest.raises(rundir.DiskFullError, match=r'^no space left on device writing checkpoint 2 '
                                                 r'to .*checkpoints \(.* MiB free after removing'):
    ckpt.save(mngr, state(2), {'config': 'tiny'})
  mngr.wait_until_finished()
  ckpt.close(mngr)
  assert settled and sorted(p.name for p in (tmp_path / 'checkpoints').iterdir()) == ['1']
  got, meta = ckpt.restore(tmp_path, jax.eval_shape(lambda: state(1)), warn=pytest.fail)
  np.testing.assert_array_equal(got.params['w'], np.arange(4.0) + 1)


def test_interrupt_waits_for_the_save():
  """SIGINT (or SIGTERM) in a save is taken when the save ends; a second one at once."""
  # What was installed before (a shell's background job starts with SIGINT ignored).
  before = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
  done = []
  with pytest.raises(KeyboardInterrupt):
    with ckpt.deferred_interrupts():
      os.kill(os.getpid(), signal.SIGTERM)
      os.kill(os.getpid(), signal.SIGINT)  # a second one: interrupts the block itself
      done.append('never')
  assert not done
  with pytest.raises(KeyboardInterrupt):
    with ckpt.deferred_interrupts():
      os.kill(os.getpid(), signal.SIGINT)
      done.append('finished')
  assert done == ['finished']
  # The handlers put back.
  assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def _mount_tmpfs(path: Path, size: str) -> bool:
  path.mkdir()
  return subprocess.run(['mount', '-t', 'tmpfs', '-o', f'size={size}', 'tmpfs', str(path)],
                        capture_output=True).returncode == 0


@pytest.mark.slow
def test_real_full_disk_on_a_small_tmpfs_is_one_line(base, tmp_path, xla_cache):
  """The same on a real full file system (needs root to mount; skipped elsewhere)."""
  cfg, _ = base
  disk = tmp_path / 'disk'
  if not _mount_tmpfs(disk, '22m'):  # the tiny config's checkpoints: 14 MB; the second fails
    pytest.skip('cannot mount a tmpfs here (needs root)')
  try:
    proc = _launch(disk / 'run', cfg.data, xla_cache)
    _, err = proc.communicate(timeout=300)
    ours = _ours(err)
    assert proc.returncode == 2 and len(ours) == 1, err[-3000:]
    assert ours[0].startswith('train.py: error: no space left on device writing checkpoint ')
    assert 'is intact: free space there and rerun with --resume' in ours[0]
    assert not [p for p in (disk / 'run' / 'checkpoints').iterdir() if 'tmp' in p.name]
  finally:
    subprocess.run(['umount', str(disk)], check=False)
