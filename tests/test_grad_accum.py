"""``--grad-accum K`` (training/step/accumulate.py): the whole batch's update from K microbatches.

The batches are packed text with loss masks that keep 10% to 90% of a row's labels,
so the microbatches hold different numbers of counted labels: an unweighted mean of
microbatch losses would give another update, and these tests would fail.

Tolerance: the accumulated and the whole-batch step add the same terms in another
order (per microbatch, then across microbatches), so they differ by float32
rounding only: ``numerics.RTOL`` (1e-5 of the parameters' scale, S = 1.0 here: the
RMSNorm scales), the suite's rounding tolerance (docs/testing.md). Measured at
this commit: at most 1.3e-6 after 3 AdamW steps under none, full and sqrt.
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
B, T, K = 16, 32, 4


def packed_batch(step: int, batch: int = B, seq: int = T) -> dict:
  """A packed text batch (tokens, segment ids, positions, loss mask), a function of ``step``."""
  r = np.random.default_rng(step)
  toks = r.integers(0, 256, (batch, seq + 1)).astype(np.int32)
  segs = np.cumsum(r.random((batch, seq + 1)) < 0.1, axis=1).astype(np.int32)
  keep = np.linspace(0.1, 0.9, batch)[:, None]   # row i keeps ~keep[i] of its labels
  mask = (r.random((batch, seq + 1)) < keep).astype(np.int32)
  starts = np.concatenate([np.ones((batch, 1), bool), segs[:, 1:] != segs[:, :-1]], axis=1)
  pos = np.zeros_like(toks)
  for i in range(batch):
    for j in range(seq + 1):
      pos[i, j] = 0 if starts[i, j] else pos[i, j - 1] + 1
  return {'tokens': toks, 'segment_ids': segs, 'positions': pos, 'loss_mask': mask}


def _three_steps(spec: str, microbatches: int, place=None, lora=None, frozen_out=None):
  """Parameters and [loss, grad norm] of 3 guarded steps of llama-tiny from the same init.

  ``lora``: a :class:`models.lora.spec.LoraSpec` (the parameters are then the adapters);
  ``frozen_out``: a list that receives the initial and the final frozen base.
  """
  import dataclasses
  import jax
  from configs import load_config
  from models.tasks import Task
  from training.step import train_step as st
  cfg = load_config('llama-tiny').model
  task = Task(cfg if lora is None else dataclasses.replace(cfg, lora=lora)).at_size(T)
  model, tx = task.model(spec), st.make_optimizer(3e-3, 100, 2, 0.1, 1.0)
  state = jax.jit(lambda: st.init_state(model, tx, 0, T))()
  if frozen_out is not None:
    frozen_out.append(jax.device_get(state.frozen))
  step = st.make_train_step(model, tx, 0, guard=True, microbatches=microbatches)
  if place is None:
    step = jax.jit(step, donate_argnums=0)
  else:
    state = place.put_state(state)
    step = place.jit_train_step(step, state, packed_batch(0))
  stats = []
  for i in range(3):
    batch = packed_batch(i) if place is None else place.put_batch(packed_batch(i))
    state, s = step(state, batch)
    stats.append(np.asarray(s))
  if frozen_out is not None:
    frozen_out.append(jax.device_get(state.frozen))
  return jax.device_get(state.params), np.stack(stats)


def assert_adapters_close(got, want, err_msg: str = ''):
  """LoRA adapters after the same AdamW steps, within the bound the whole model's parameters get.

  The two steps' gradients differ by float32 rounding (the same terms added in another
  order). AdamW divides each gradient element by its own running RMS, so that rounding
  reaches a parameter in units of the step size (lr per step), not of the parameter's
  magnitude: an element whose gradient is small (the adapters' B starts at zero, so A's
  gradient does too) keeps a relative error of its update, not of its value. The whole
  model's comparison allows ``RTOL * (|expected| + S)`` with S = 1.0 (the RMSNorm scales);
  the adapters' own scale is ~0.09, which would allow an eleventh of that for the same
  update error. So the adapters get the whole model's bound, ``RTOL * (|expected| + 1.0)``
  (rtol = RTOL / their scale). Measured at this commit: worst 1.7e-6 to 3.8e-6 (run to run,
  threads) against 1e-5; the whole model's worst is 1.2e-6.
  """
  from numerics import RTOL, assert_trees_close, tree_scale
  assert_trees_close(got, want, rtol=RTOL * max(1.0, 1.0 / tree_scale(want)), err_msg=err_msg)


def _compare(spec: str, place=None):
  from numerics import assert_trees_close
  want_params, want_stats = _three_steps(spec, 1)
  got_params, got_stats = _three_steps(spec, K, place)
  assert_trees_close(got_stats, want_stats, err_msg=f'{spec} loss and grad norm: ')
  assert_trees_close(got_params, want_params, err_msg=f'{spec} parameters: ')
  return got_stats


@pytest.mark.parametrize('spec', ['full', pytest.param('none', marks=pytest.mark.slow),
                                  pytest.param('sqrt', marks=pytest.mark.slow)])
def test_accumulated_steps_give_the_whole_batch_parameters(spec):
  """--grad-accum 4 --batch-size 16 == --batch-size 16 after 3 steps, one device."""
  _compare(spec)


def test_accumulated_lora_steps_give_the_whole_batch_adapters():
  """--lora 4 --grad-accum 4 --batch-size 16 == --lora 4 --batch-size 16 after 3 steps.

  Only the adapters are differentiated and summed; the frozen base goes through each step
  unchanged (bit for bit) in both. Losses and gradient norms within numerics.RTOL, as above;
  adapters within :func:`assert_adapters_close`'s bound.
  """
  import jax
  from models.lora.spec import LoraSpec
  from numerics import assert_trees_close
  spec = LoraSpec(rank=4, alpha=8.0)
  want_frozen, got_frozen = [], []
  want_params, want_stats = _three_steps('full', 1, lora=spec, frozen_out=want_frozen)
  got_params, got_stats = _three_steps('full', K, lora=spec, frozen_out=got_frozen)
  leaves = jax.tree_util.tree_leaves_with_path(got_params)
  assert leaves and all('lora_' in jax.tree_util.keystr(p) for p, _ in leaves)   # adapters only
  assert_trees_close(got_stats, want_stats, err_msg='lora loss and grad norm: ')
  assert_adapters_close(got_params, want_params, err_msg='lora adapters: ')
  for before, after in (want_frozen, got_frozen):
    assert after is not None
    jax.tree_util.tree_map(np.testing.assert_array_equal, after, before)


def test_bfloat16_sums_stay_float32():
  """In bfloat16 the sums are float32 and the gradient is the whole batch's within bf16 rounding.

  Each microbatch's weight gradient leaves its bfloat16 matmul rounded (2^-8 relative, at
  most, of the terms), and the whole batch's is rounded once: tolerance 2^-6 of the tree's
  scale, four such roundings. Measured at this commit: 0.0076 (llama-tiny, full, K=4).
  """
  import jax
  from configs import load_config, with_dtype
  from models.tasks import Task
  from numerics import assert_trees_close
  from training.step.accumulate import accumulated_value_and_grad
  task = Task(with_dtype(load_config('llama-tiny'), 'bfloat16').model).at_size(T)
  model = task.model('full')
  params = jax.jit(lambda: task.init_variables(model, 0, T)[0])()
  batch = packed_batch(0)
  loss_fn = lambda p, s, b, key: task.loss(model, p, s, b, key)
  want = jax.jit(jax.value_and_grad(lambda p: loss_fn(p, {}, batch, None)[0]))(params)
  loss, _, grads = jax.jit(lambda p: accumulated_value_and_grad(loss_fn, p, {}, batch, K,
                                                                None))(params)
  assert {a.dtype for a in jax.tree_util.tree_leaves(grads)} == {np.dtype('float32')}
  assert abs(float(loss) - float(want[0])) <= 1e-5 * float(want[0])   # float32 losses
  assert_trees_close(grads, want[1], rtol=2.0 ** -6)


def test_microbatches_are_strided_rows_and_weights_count_labels():
  import jax.numpy as jnp
  from training.step.accumulate import counted_labels, split
  batch = packed_batch(0)
  micro = split(batch, K)
  assert micro['tokens'].shape == (K, B // K, T + 1)
  np.testing.assert_array_equal(micro['tokens'][1], batch['tokens'][1::K])   # rows k::K
  total = sum(float(counted_labels({k: v[i] for k, v in micro.items()})) for i in range(K))
  assert total == float(counted_labels(batch)) > 0
  assert float(counted_labels(jnp.zeros((6, 9), jnp.int32))) == 6   # no mask: rows


@pytest.mark.parametrize('spec', ['full', pytest.param('none', marks=pytest.mark.slow),
                                  pytest.param('sqrt', marks=pytest.mark.slow)])
def test_activation_plan_of_16_over_4_is_batch_4s(spec):
  """Temp at batch 16 in 4 microbatches, less the float32 gradient sums, <= 1.10 x batch 4's.

  The sums (one float32 copy of the parameters, 4.63 MiB here) are the one buffer
  the accumulated step adds; the rest of temp is activations and the update's
  temporaries. Measured at this commit (llama-tiny, seq 128, CPU plan): temp
  16/4 = 1.09 (none), 1.09 (full), 1.12 (sqrt) x batch 4's, sums included; batch 16
  in one pass 2.98, 1.93, 2.20 x.
  """
  import jax
  from configs import load_config
  from models.tasks import Task
  from remat.memory import compiled_memory
  from training.step import train_step as st
  task = Task(load_config('llama-tiny').model).at_size(128)
  model, tx = task.model(spec), st.make_optimizer(3e-3, 100, 2, 0.1, 1.0)
  temp = {}
  for batch, k in ((4, 1), (16, K), (16, 1)):
    state, example = st.abstract_inputs(model, tx, batch, 128)
    temp[batch, k] = compiled_memory(st.compile_train_step(
        model, tx, 0, state, example, guard=True, microbatches=k)).temp
  sums = sum(a.size * 4 for a in jax.tree_util.tree_leaves(state.params))
  assert temp[16, K] - sums <= 1.10 * temp[4, 1], (temp, sums)
  assert temp[16, K] < 0.75 * temp[16, 1], temp   # and well below the whole batch's


@pytest.mark.parametrize('argv, line', [
    (['--grad-accum=0'], '--grad-accum must be >= 1, got 0'),
    (['--batch-size=10', '--grad-accum=4'],
     '--batch-size 10 does not split into --grad-accum 4 microbatches of equal size; pass a '
     'batch that is a multiple of 4'),
])
def test_bad_grad_accum_is_one_line_exit_2(argv, line, capsys, tmp_path):
  from training import cli
  out = tmp_path / 'never'
  assert cli.main(argv + [f'--out={out}', '--no-memory-report']) == 2
  assert capsys.readouterr().err.strip().splitlines() == [f'train.py: error: {line}']
  assert not out.exists()


def test_microbatches_must_split_over_the_mesh():
  from training.step.accumulate import AccumError, check
  check(4, 16, shards=2)   # 4 microbatches of 4, 2 rows per shard
  with pytest.raises(AccumError, match=r'^--batch-size 8 in --grad-accum 8 microbatches of 1 '
                                       r"does not split over the mesh's 2 batch shards; pass a "
                                       r'batch that is a multiple of 16$'):
    check(8, 8, shards=2)


@pytest.mark.extended
def test_run_with_grad_accum_resumes_exactly_and_counts_tokens(text_file, tmp_path, capsys):
  """train.py --grad-accum 2: the losses of --grad-accum 1 (llama-tiny, no dropout), the same
  tokens per step, and a resume that takes K from the run's record gives the same losses."""
  import json
  import shutil
  from training import cli
  from training.trainer import TrainConfig, train
  base = dict(config='llama-tiny', remat='full', steps=4, batch_size=4, seq_len=32,
              warmup_steps=2, data=str(text_file), eval_every=2, eval_batches=1, save_every=2,
              memory_report=False)
  rows = {}
  for k in (1, 2):
    train(TrainConfig(**base, grad_accum=k, out=str(tmp_path / f'k{k}')), log=lambda *_: None)
    rows[k] = [json.loads(l) for l in
               (tmp_path / f'k{k}' / 'metrics.jsonl').read_text().splitlines()]
  assert [r['tokens'] for r in rows[2]] == [r['tokens'] for r in rows[1]] == [
      128 * s for s in (1, 2, 3, 4)]   # step x batch 4 x seq-len 32
  # Losses are rounded to 5 decimals in metrics.jsonl: compare them at that resolution.
  np.testing.assert_allclose([r['loss'] for r in rows[2]], [r['loss'] for r in rows[1]],
                             atol=2e-5)
  shutil.rmtree(tmp_path / 'k2' / 'checkpoints' / '4')   # as if killed after step 2's save
  metrics = tmp_path / 'k2' / 'metrics.jsonl'
  metrics.write_text(''.join(l + '\n' for l in metrics.read_text().splitlines()[:2]))
  capsys.readouterr()
  assert cli.main(['--resume', f'--out={tmp_path / "k2"}', '--no-memory-report']) == 0
  assert 'grad-accum: 2 microbatches of 2 per step of 4' in capsys.readouterr().out
  again = [json.loads(l) for l in metrics.read_text().splitlines()]
  assert [r['loss'] for r in again] == [r['loss'] for r in rows[2]]


def test_report_plans_the_accumulated_step(capsys):
  """bench.report --grad-accum: the header says so, and residuals are one microbatch's."""
  from bench import report
  argv = ['--config=llama-tiny', '--batch-size=8', '--seq-len=32', '--policies=full']
  rows = {}
  for k in (1, 2):
    assert report.main(argv + [f'--grad-accum={k}', '--json=/dev/null']) == 0
    out = capsys.readouterr().out
    assert ('accumulated over 2 microbatches of 4' in out) == (k == 2)
    rows[k] = {l.split()[0]: l.split() for l in out.splitlines() if l.startswith(('none', 'full'))}
  assert rows[1]['none'][5:7] != rows[2]['none'][5:7]   # 'residual' column: 8 rows vs 4
  assert report.main(argv + ['--grad-accum=2', '--fit']) == 2
  assert capsys.readouterr().err.strip() == ('bench.report: error: --grad-accum plans the policy '
                                            'table, --mesh and --explain: drop --sweep, --fit, '
                                            '--fused-update and --device-peak')


@pytest.mark.slow
def test_accumulated_steps_on_fsdp2_give_the_whole_batch_parameters():
  """The same on --mesh fsdp=2 (2 simulated CPU devices, in a subprocess), none, full, sqrt."""
  env = dict(os.environ)
  flags = ' '.join(f for f in env.get('XLA_FLAGS', '').split()
                   if not f.startswith('--xla_force_host_platform_device_count'))
  env.update(XLA_FLAGS=f'{flags} --xla_force_host_platform_device_count=2'.strip(),
             JAX_PLATFORMS='cpu',
             PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE), env.get('PYTHONPATH', '')]))
  run = subprocess.run([sys.executable, __file__, 'fsdp=2', 'none', 'full', 'sqrt'], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=1200)
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  for spec in ('none', 'full', 'sqrt'):
    assert f'{spec} fsdp=2 K=4: equal' in run.stdout


def _mesh_worker(mesh: str, specs: list[str]):
  import jax
  from training.step.mesh import Placement
  assert jax.device_count() == 2
  place = Placement.from_spec(mesh, B)
  for spec in specs:
    _compare(spec, place)
    print(f'{spec} {mesh} K={K}: equal', flush=True)


if __name__ == '__main__':
  sys.path[:0] = [str(ROOT), str(HERE)]
  _mesh_worker(sys.argv[1], sys.argv[2:])
