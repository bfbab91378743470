"""Training on a device mesh (training/step/mesh.py): sharding rules, numerics, memory, processes, resume.

The pytest process has one CPU device and must keep it (the rest of the suite runs
there), so everything that needs 8 devices runs in a subprocess of this file
(``python tests/test_mesh.py WORKER ...``) with
``XLA_FLAGS=--xla_force_host_platform_device_count=N``; a worker asserts and exits
non-zero on a mismatch.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
# Small enough that a train run is mostly compile time; batch 8 splits over 8 devices.
RUN = ['--config=tiny', '--steps=4', '--batch-size=8', '--seq-len=32', '--warmup-steps=2',
       '--eval-every=2', '--eval-batches=2', '--save-every=2', '--no-memory-report',
       '--remat=full']


def _env(devices: int) -> dict:
  env = dict(os.environ)   # conftest's XLA_FLAGS (-O0) and JAX_PLATFORMS=cpu carry over
  flags = ' '.join(f for f in env.get('XLA_FLAGS', '').split()
                   if not f.startswith('--xla_force_host_platform_device_count'))
  env['XLA_FLAGS'] = f'{flags} --xla_force_host_platform_device_count={devices}'.strip()
  env['JAX_PLATFORMS'] = 'cpu'
  env['PYTHONPATH'] = os.pathsep.join([str(ROOT), str(HERE), env.get('PYTHONPATH', '')])
  return env


def _worker(*args: str, devices: int = 8, timeout: int = 900):
  run = subprocess.run([sys.executable, __file__, *args], cwd=ROOT, env=_env(devices),
                       capture_output=True, text=True, timeout=timeout)
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  return run


def _train(*args: str, devices: int, env: dict | None = None, **popen):
  return subprocess.Popen([sys.executable, 'train.py', *args], cwd=ROOT,
                          env={**_env(devices), **(env or {})}, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, **popen)


def _finish(proc, timeout: int = 900):
  out, err = proc.communicate(timeout=timeout)
  assert proc.returncode == 0, out[-2000:] + err[-3000:]
  return out


def _losses(out: Path) -> list[float]:
  rows = [json.loads(l) for l in (out / 'metrics.jsonl').read_text().splitlines()]
  assert [r['step'] for r in rows] == list(range(1, len(rows) + 1))
  return [r['loss'] for r in rows] + [r['val_loss'] for r in rows if 'val_loss' in r]


# In-process: parsing and the sharding rule ---------------------------------------------------
def test_parse_mesh_and_sharding_rule():
  from jax.sharding import PartitionSpec as P
  from training.step.mesh import array_spec, parse_mesh
  assert parse_mesh('fsdp=8') == {'data': 1, 'fsdp': 8}
  assert parse_mesh(' data=2 , fsdp=4') == {'data': 2, 'fsdp': 4}
  assert array_spec((6, 128, 512), 8) == P(None, None, 'fsdp')     # largest axis
  assert array_spec((6, 128, 128), 8) == P(None, None, 'fsdp')     # ties: the later axis
  assert array_spec((50257, 1600), 8) == P(None, 'fsdp')          # vocab not divisible
  assert array_spec((25,), 8) == P() and array_spec((), 8) == P()  # replicated
  assert array_spec((6, 128), 1) == P()


# What the rule gives Llama (docs/sharding.md's table): [N, ...] leaves are layer stacks.
_LLAMA_SPECS = {
    "['embed_tokens']['embedding']": ('fsdp',),              # [V, d]: the vocabulary
    "['layers']['block']['input_layernorm']['scale']": (None, 'fsdp'),
    "['layers']['block']['post_attention_layernorm']['scale']": (None, 'fsdp'),
    "['layers']['block']['self_attn']['q_proj']['kernel']": (None, None, 'fsdp'),  # tie: later
    "['layers']['block']['self_attn']['k_proj']['kernel']": (None, 'fsdp'),  # [N, d, K*Dh]: d
    "['layers']['block']['self_attn']['v_proj']['kernel']": (None, 'fsdp'),
    "['layers']['block']['self_attn']['o_proj']['kernel']": (None, None, 'fsdp'),
    "['layers']['block']['mlp']['gate_proj']['kernel']": (None, None, 'fsdp'),  # [N, d, F]: F
    "['layers']['block']['mlp']['up_proj']['kernel']": (None, None, 'fsdp'),
    "['layers']['block']['mlp']['down_proj']['kernel']": (None, 'fsdp'),        # [N, F, d]: F
    "['norm']['scale']": ('fsdp',),
}


@pytest.mark.parametrize('config, extra', [
    ('llama-tiny', {}),
    ('llama-3.1-8b', {"['lm_head']['kernel']": (None, 'fsdp')}),   # untied [d, V]: V
])
def test_llama_partition_specs(config, extra):
  """Every Llama parameter is split along fsdp (8 and 4), on the axis docs/sharding.md names."""
  import jax
  from jax.sharding import PartitionSpec as P
  from configs import load_config
  from training.step.mesh import array_spec
  from models.tasks import Task
  task = Task(load_config(config).model)
  model = task.model('none')
  params = jax.eval_shape(lambda: task.init_variables(model, 0, 8)[0])   # shapes only
  for fsdp in (8, 4):
    got = {jax.tree_util.keystr(path): array_spec(tuple(a.shape), fsdp)
           for path, a in jax.tree_util.tree_flatten_with_path(params)[0]}
    assert got == {k: P(*v) for k, v in {**_LLAMA_SPECS, **extra}.items()}, (config, fsdp)


@pytest.mark.parametrize('mesh, needle', [
    ('tensor=2', "axis 'tensor' (tensor parallelism) is not supported; valid: data, fsdp "
                 "(docs/sharding.md)"),
    ('pipe=2', "unknown axis 'pipe'; valid: data, fsdp"),
    ('fsdp=0', "size of 'fsdp' must be a positive integer, got '0'"),
    ('fsdp=-2', "size of 'fsdp' must be a positive integer, got '-2'"),
    ('fsdp=two', "size of 'fsdp' must be a positive integer, got 'two'"),
    ('fsdp', 'expected AXIS=N[,AXIS=N...]'),
    ('fsdp=2,fsdp=2', "axis 'fsdp' given twice"),
    ('data=2,fsdp=4', '--mesh data=2,fsdp=4 has 8 devices, this run has 1 (cpu); simulate CPU '
                      'devices with XLA_FLAGS=--xla_force_host_platform_device_count=8'),
])
def test_bad_mesh_is_one_line_exit_2(mesh, needle, capsys, tmp_path):
  from training import cli
  out = tmp_path / 'never'
  assert cli.main([f'--mesh={mesh}', f'--out={out}', '--no-memory-report']) == 2
  lines = capsys.readouterr().err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith('train.py: error: --mesh') and needle in lines[0]
  assert not out.exists()


@pytest.mark.parametrize('argv, needle', [
    (['--coordinator=localhost:1234', '--num-processes=2'], 'needs --process-id too'),
    (['--coordinator=localhost', '--num-processes=2', '--process-id=0'], 'expected HOST:PORT'),
    (['--coordinator=localhost:1', '--num-processes=2', '--process-id=2'], 'must be in 0..1'),
])
def test_bad_process_flags_are_one_line_exit_2(argv, needle, capsys, tmp_path):
  from training import cli
  assert cli.main(argv + [f'--out={tmp_path / "never"}']) == 2
  lines = capsys.readouterr().err.strip().splitlines()
  assert len(lines) == 1 and needle in lines[0]


def test_process_variables_fill_in_for_flags(capsys, tmp_path, monkeypatch):
  """A partial set of the JAX_* process variables is one line, as of the flags."""
  from training import cli
  monkeypatch.setenv('JAX_COORDINATOR_ADDRESS', 'localhost:1234')
  monkeypatch.setenv('JAX_NUM_PROCESSES', '2')
  assert cli.main([f'--out={tmp_path / "never"}']) == 2
  lines = capsys.readouterr().err.strip().splitlines()
  assert len(lines) == 1 and 'needs --process-id too' in lines[0]
  monkeypatch.setenv('JAX_PROCESS_ID', 'one')
  assert cli.main([f'--out={tmp_path / "never"}']) == 2
  lines = capsys.readouterr().err.strip().splitlines()
  assert lines == ["train.py: error: JAX_PROCESS_ID='one' is not an integer"]


def test_variables_alone_start_a_run():
  """The three variables and no flags join a run (a 1-process one here: no second process).

  jax.distributed.initialize() without arguments reads only the address and, outside a cluster
  JAX detects, raises 'Number of processes must be defined.'; start_processes passes all three.
  """
  with socket.socket() as s:
    s.bind(('localhost', 0))
    port = s.getsockname()[1]
  env = {**_env(1), 'JAX_COORDINATOR_ADDRESS': f'localhost:{port}', 'JAX_NUM_PROCESSES': '1',
         'JAX_PROCESS_ID': '0'}
  code = ('import jax; from training.step.mesh import start_processes; '
          'assert start_processes(None, None, None); '
          'print("processes", jax.process_count(), "index", jax.process_index())')
  run = subprocess.run([sys.executable, '-c', code], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
  assert run.returncode == 0, run.stderr[-3000:]
  assert 'processes 1 index 0' in run.stdout


def test_report_bad_mesh_is_one_line_exit_2(capsys):
  from bench import report
  assert report.main(['--mesh', 'fsdp=8,tensor=2']) == 2
  lines = capsys.readouterr().err.strip().splitlines()
  assert lines == ["bench.report: error: --mesh 'fsdp=8,tensor=2': axis 'tensor' (tensor "
                   "parallelism) is not supported; valid: data, fsdp (docs/sharding.md)"]


# 8 simulated devices, in a subprocess ----------------------------------------------------------
def test_full_on_a_mesh_equals_one_device_and_fsdp_divides_the_state():
  """`full` on data=2,fsdp=4 (both axes at once); per-device state bytes on fsdp=8.

  One process, so that the default suite pays one JAX start-up and three compiles.
  """
  run = _worker('grads', 'full', 'data=2,fsdp=4', '--memory')
  assert 'full data=2,fsdp=4: loss' in run.stdout and 'ratio 0.125' in run.stdout


@pytest.mark.slow
@pytest.mark.parametrize('spec', ['none', 'full', 'sqrt', 'qkv_proj_offloaded'])
def test_policies_on_meshes_equal_one_device(spec):
  _worker('grads', spec, 'fsdp=8', 'data=2,fsdp=4')


def test_a_program_on_a_mesh_keeps_no_saved_values_in_gradient_rows():
  """Traced for a GPU, the stack keeps its saved values in gradient rows on one device
  (remat.stored_scan) but not over a mesh, where XLA gathered the batch-split activations whole
  into the fsdp-split rows (Llama-3.1-8B, 8 x 8192 over fsdp=8, H200 plan, `none`: 160.02 GiB
  of peak per device, 39.41 GiB without). The program knows it is split only when its abstract
  inputs carry their shardings (Placement.step_inputs), as a program called on placed arrays does."""
  run = _worker('rows')
  assert 'one device: stored; fsdp=8: plain' in run.stdout, run.stdout


@pytest.mark.slow
def test_one_device_program_takes_the_whole_state():
  _worker('memory')


@pytest.mark.slow
@pytest.mark.parametrize('spec', ['none', 'full', 'sqrt'])
def test_llama_policies_on_meshes_equal_one_device(spec):
  """The tiny Llama (tied embedding, grouped-query attention, SwiGLU) as GPT's cases above."""
  run = _worker('grads', '--config=llama-tiny', spec, 'fsdp=8', 'data=2,fsdp=4')
  assert f'llama-tiny {spec} data=2,fsdp=4: loss' in run.stdout


@pytest.mark.slow
def test_llama_fsdp_divides_the_state():
  """Per-device state under fsdp=8 <= 1/8 of one device's + 5%; one device's compiled too."""
  run = _worker('memory', '--config=llama-tiny')
  assert 'llama-tiny state bytes per device' in run.stdout and 'ratio 0.125' in run.stdout


@pytest.mark.slow
def test_two_processes_resume_on_other_meshes_equal_one_program(tmp_path):
  """2 processes x 4 devices == 1 x 8; saved on fsdp=8, resumed on fsdp=4 and on one device.

  Process 0 joins by flags, process 1 by the JAX_* variables alone.
  """
  data = tmp_path / 'corpus.txt'
  data.write_text(''.join(f'def f{i}(x):\n    return x * {i} + {i % 7}\n' for i in range(400)))
  ref = tmp_path / 'ref'
  _finish(_train(*RUN, f'--data={data}', '--mesh=fsdp=8', f'--out={ref}', devices=8))
  want = _losses(ref)

  with socket.socket() as s:   # a free port for the coordinator
    s.bind(('localhost', 0))
    port = s.getsockname()[1]
  multi = tmp_path / 'multi'
  # Process 0 joins by flags, process 1 by the variables alone: both routes into one run.
  procs = [_train(*RUN, f'--data={data}', '--mesh=fsdp=8', f'--out={multi}',
                  f'--coordinator=localhost:{port}', '--num-processes=2', '--process-id=0',
                  devices=4),
           _train(*RUN, f'--data={data}', '--mesh=fsdp=8', f'--out={multi}', devices=4,
                  env={'JAX_COORDINATOR_ADDRESS': f'localhost:{port}', 'JAX_NUM_PROCESSES': '2',
                       'JAX_PROCESS_ID': '1'})]
  outs = [_finish(p) for p in procs]
  assert 'done: step 4' in outs[0] and 'done' not in outs[1]  # process 0 speaks for the run
  np.testing.assert_allclose(_losses(multi), want, rtol=1e-5, atol=1e-5)
  assert sorted(p.name for p in (multi / 'checkpoints').iterdir()) == ['2', '4']

  for mesh, devices in (('--mesh=fsdp=4', 4), ('--mesh=data=2,fsdp=2', 4), (None, 1)):
    out = tmp_path / f'resumed-{devices}-{mesh}'
    shutil.copytree(ref, out)
    shutil.rmtree(out / 'checkpoints' / '4')   # as if the run had died after step 2's save
    args = ['--resume', f'--out={out}', '--no-memory-report'] + ([mesh] if mesh else [])
    stdout = _finish(_train(*args, devices=devices))
    assert 'resumed step 2' in stdout
    np.testing.assert_allclose(_losses(out), want, rtol=1e-5, atol=1e-5, err_msg=str(mesh))


# Workers -------------------------------------------------------------------------------------
# The embedding leaf of each tiny model: [vocab 256, d_model 128], split on the vocabulary axis
# (the larger one); tied, so its gradient sums the input lookup and the output layer's.
_EMBEDDING = {'tiny': ('wte', 'embedding'), 'llama-tiny': ('embed_tokens', 'embedding')}


def _grads_worker(config: str, spec: str, meshes: list[str]):
  import jax
  from configs import load_config
  from numerics import assert_trees_close
  from training.step.mesh import Placement
  from models.tasks import Task
  assert jax.device_count() == 8
  task = Task(load_config(config).model)
  model = task.model(spec)
  # One jitted init, not hundreds of eagerly dispatched ops (the same values).
  params = jax.jit(lambda: task.init_variables(model, 0, 32)[0])()
  batch = np.random.default_rng(0).integers(0, 256, size=(8, 33)).astype(np.int32)
  rng = jax.random.PRNGKey(1)   # dropout on (GPT): its masks must not depend on the sharding
  loss = lambda p, b: task.loss(model, p, {}, b, rng)[0]
  want_loss, want_grads = jax.jit(jax.value_and_grad(loss))(params, batch)
  for mesh in meshes:
    place = Placement.from_spec(mesh, 8)
    p_sh, b_sh = place.state_shardings(params), place.batch_shardings(batch)
    fn = jax.jit(jax.value_and_grad(loss), in_shardings=(p_sh, b_sh),
                 out_shardings=(place.replicated(), p_sh))
    got_loss, got_grads = fn(place.put(params, p_sh), place.put(batch, b_sh))
    outer, inner = _EMBEDDING[config]
    emb = got_grads[outer][inner]
    assert emb.sharding.spec == jax.sharding.PartitionSpec('fsdp'), emb.sharding
    assert len(emb.addressable_shards) == 8 and emb.addressable_shards[0].data.shape == (
        256 // place.mesh.shape['fsdp'], 128)
    assert_trees_close(got_loss, want_loss, err_msg=f'{config} {spec} {mesh} loss: ')
    assert_trees_close(got_grads, want_grads, err_msg=f'{config} {spec} {mesh} grads: ')
    print(f'{config} {spec} {mesh}: loss {float(got_loss):.6f} == {float(want_loss):.6f}')


def _memory_worker(config: str, full: bool):
  import jax
  from configs import load_config
  from remat.memory import compiled_memory
  from training.step import train_step as st
  from training.step.mesh import Placement
  from models.tasks import Task
  task = Task(load_config(config).model)
  model, tx = task.model('full'), st.make_optimizer(1e-3, 100, 10, 0.1, 1.0)
  state, batch = st.abstract_inputs(model, tx, 8, 32)
  batch_bytes = batch.size * batch.dtype.itemsize
  eight = compiled_memory(Placement.from_spec('fsdp=8', 8).compile_train_step(
      model, tx, 0, state, batch, True))
  # Arguments are the state (parameters + optimizer state + step) and the batch (also split 8
  # ways). One device's program takes the whole state: the sum of its arrays' bytes (the slow
  # test compiles it to check that this is what XLA reports).
  one_state = sum(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves(state))
  if full:
    one = compiled_memory(Placement(None).compile_train_step(model, tx, 0, state, batch, True))
    assert one.argument - batch_bytes == one_state, (one.argument, one_state)
  eight_state = eight.argument - batch_bytes // 8
  print(f'{config} state bytes per device: fsdp=8 {eight_state}, one device {one_state}, '
        f'ratio {eight_state / one_state:.5f}')
  assert eight_state <= one_state / 8 * 1.05, (eight_state, one_state)


def _rows_worker():
  import jax
  import remat.stored_scan
  from configs import load_config
  from models.tasks import Task
  from remat import kept_in_gradients
  from remat.layout import compiling_for
  from training.step.mesh import Placement
  task = Task(load_config('llama-tiny').model)
  model = task.model('none')
  params = jax.eval_shape(lambda: task.init_variables(model, 0, 32)[0])
  batch = jax.ShapeDtypeStruct((8, 33), np.int32)
  loss = lambda p, b: task.loss(model, p, {}, b, jax.random.PRNGKey(1))[0]
  calls, run = [], remat.stored_scan.run
  remat.stored_scan.run = lambda *a, **k: calls.append(1) or run(*a, **k)
  seen = []
  kept = kept_in_gradients.partitioned
  kept_in_gradients.partitioned = lambda tree: seen.append(kept(tree)) or seen[-1]
  out = []
  with compiling_for('gpu'):
    jax.jit(jax.value_and_grad(loss)).trace(params, batch)
    out.append('stored' if calls and seen == [False] * len(seen) else f'plain {seen}')
    calls.clear(), seen.clear()
    place = Placement.from_spec('fsdp=8', 8)
    shardings = (place.state_shardings(params), place.batch_shardings(batch))
    jax.jit(jax.value_and_grad(loss), in_shardings=shardings).trace(
        *place.step_inputs(params, batch))
    out.append('plain' if not calls and seen and all(seen) else f'stored {seen}')
  print(f'one device: {out[0]}; fsdp=8: {out[1]}')


if __name__ == '__main__':
  sys.path[:0] = [str(ROOT), str(HERE)]
  # python tests/test_mesh.py WORKER [--config=NAME] [--memory] [SPEC MESH...]
  options = [a for a in sys.argv[2:] if a.startswith('--')]
  positional = [a for a in sys.argv[2:] if not a.startswith('--')]
  config = next((o.split('=', 1)[1] for o in options if o.startswith('--config=')), 'tiny')
  if sys.argv[1] == 'grads':
    _grads_worker(config, positional[0], positional[1:])
    if '--memory' in options:
      _memory_worker(config, full=False)
  elif sys.argv[1] == 'memory':
    _memory_worker(config, full=True)
  elif sys.argv[1] == 'rows':
    _rows_worker()
  else:
    raise SystemExit(f'unknown worker {sys.argv[1]}')
