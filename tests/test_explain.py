"""remat.explain: XLA's live memory over the schedule of a compiled step, and what is live at its peak.

The default suite explains the plain-JAX MLP of tests/user_mlp.py (compiles in
about a second); the zoo's tiny GPT and llama-tiny under none, full and sqrt,
and the H200 plan, are slow.
"""

import dataclasses
import json

import numpy as np
import pytest

import remat
from remat import PolicyError, kept_in_gradients
from remat.explaining import (BACKWARD, CATEGORIES, GRADS, PARAMS, SAVED, ExplainError,
                              write)
from remat.targets import TargetError
from tests import user_mlp


def _check_plan(e):
  """What must hold of any explanation, against XLA's own figures."""
  plan = e.xla
  # Our parse of XLA's live ranges reproduces XLA's own list at the moment it calls its peak.
  assert plan.live_value_bytes(plan.xla_peak_time) == plan.xla_peak_bytes
  # The live peak is the timeline's maximum, within the plan's bytes (packing loss >= 0) ...
  assert e.peak_bytes == max(e.timeline)
  assert 0 <= e.packing_loss < e.plan.peak
  # ... and the categories split exactly the live bytes at the peak.
  assert sum(e.categories.values()) == e.peak_bytes
  assert set(e.categories) <= set(CATEGORIES)
  assert sum(b.size for b in e.buffers) == e.peak_bytes
  # XLA packed the temp heap by these live ranges: no two values live at the peak overlap in it
  # unless they are the same bytes (aliases).
  temp = {i for i, a in plan.allocations.items() if a.kind == 'temp'}
  live = sorted({(v.allocation, v.offset, v.size) for v in plan.values
                 if v.allocation in temp and v.start is not None
                 and v.start <= e.peak_time <= v.end})
  for (a1, o1, s1), (a2, o2, s2) in zip(live, live[1:]):
    assert a1 != a2 or o1 == o2 or o1 + s1 <= o2, (o1, s1, o2, s2)


@pytest.fixture(scope='module')
def mlp_full():
  return remat.explain(user_mlp.build, *user_mlp.example_args(), policy='full')


def test_user_function_under_full(mlp_full):
  e = mlp_full
  _check_plan(e)
  assert e.phase_at(e.peak_time) == 'backward'
  # full saves each layer's input: the scan carry stacked over the L layers, and scalars at most
  # (XLA may keep the mean's 1/n from the forward pass).
  saved = [b for b in e.buffers if b.category == SAVED]
  assert (saved[0].shape, saved[0].size) == (f'f32[{user_mlp.L},{user_mlp.B},{user_mlp.D}]',
                                             user_mlp.L * user_mlp.B * user_mlp.D * 4)
  assert all(b.size <= 8 for b in saved[1:]), saved
  # A loss program's gradients are its outputs: the stacked weight gradients, live at the peak.
  assert e.categories[GRADS] == e.categories[PARAMS] == user_mlp.L * 2 * user_mlp.D * user_mlp.H * 4
  assert [s.label for s in e.phases] == ['forward', 'backward']
  assert [s.trips for s in e.loops] == [user_mlp.L, user_mlp.L]
  assert e.loops[1].label.startswith('backward')
  summary = e.summary()
  assert 'saved for backward' in summary and 'packing loss' in summary
  assert len([l for l in summary.splitlines() if 'MiB  ' in l or 'KiB  ' in l]) >= 3


def test_json_and_pictures(mlp_full, tmp_path):
  paths = write([mlp_full], str(tmp_path / 'full.json'), {'fn': 'user_mlp'})
  assert sorted(p.rsplit('.', 1)[1] for p in paths) == ['json', 'png', 'svg']
  data = json.loads((tmp_path / 'full.json').read_text())
  assert data['environment'] == {'fn': 'user_mlp'}
  body = data['explain']
  assert body['peak_bytes'] == max(body['timeline']) == sum(body['categories'].values())
  assert body['packing_loss'] == body['plan']['peak'] - body['peak_bytes']
  assert (tmp_path / 'full.png').read_bytes()[:4] == b'\x89PNG'


def test_report_cli_overlay(tmp_path, capsys):
  from remat import report
  out = tmp_path / 'explained'
  assert report.main(['--fn', 'tests.user_mlp:factory', '--policies', 'none,full',
                      '--explain', str(out)]) == 0
  assert sorted(p.name for p in out.iterdir()) == [
      'full.json', 'full.png', 'full.svg', 'none.json', 'none.png', 'none.svg', 'overlay.png',
      'overlay.svg']
  text = capsys.readouterr().out
  assert text.count('live peak') == 2 and 'top 10 buffers' in text
  none = json.loads((out / 'none.json').read_text())['explain']
  full = json.loads((out / 'full.json').read_text())['explain']
  assert full['categories'][SAVED] < none['categories'][SAVED]
  assert full['peak_bytes'] < none['peak_bytes']


def test_one_line_errors(capsys):
  args = user_mlp.example_args()
  with pytest.raises(TargetError, match='unknown target'):
    remat.explain(user_mlp.build, *args, policy='full', target='tpu')
  with pytest.raises(PolicyError, match='bogus'):
    remat.explain(user_mlp.build, *args, policy='names:bogus')
  with pytest.raises(ExplainError, match='out_shardings= needs shardings='):
    remat.explain(user_mlp.build, *args, policy='full', out_shardings=object())

  def broken(policy):
    def loss(params, x):
      return (x @ params[1]).sum()   # [B, D] @ [L, H, D]: shapes that do not multiply
    return loss
  with pytest.raises(ExplainError) as err:
    remat.explain(broken, *args, policy='full')
  assert len(str(err.value).splitlines()) == 1 and "build('none') does not trace" in str(err.value)

  def full_only_fails(policy):   # a function that cannot take this policy
    if policy.spec == 'full':
      raise NotImplementedError('this model has no full remat\nsecond line')
    return user_mlp.build(policy)
  with pytest.raises(ExplainError) as err:
    remat.explain(full_only_fails, *args, policy='full')
  assert str(err.value) == ("build('full') does not compile for cpu: "
                            'NotImplementedError: this model has no full remat')
  from remat import report
  assert report.main(['--fn', 'tests.user_mlp:factory', '--policies', 'names:bogus',
                      '--explain', 'unused']) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith('remat.report: error:')


def _zoo(config: str, spec: str, target: str = 'cpu', dropout: bool = True):
  from bench import zoo
  from configs import load_config
  model = load_config(config).model
  if not dropout:
    model = dataclasses.replace(model, dropout=0.0)
  case = zoo.case(model, 8, 128)
  return case, remat.explain(case.train_step, *case.step_args(), policy=spec, target=target)


def _layer_inputs(case) -> int:
  cfg = case.task.config
  return cfg.num_layers * case.batch_size * case.size * cfg.d_model * 4


# The tiny GPT without dropout: with it the plan also keeps the embedding dropout's random bits
# for the backward pass (1 MiB at batch 8 x 128), which are saved too but are no layer input.
@pytest.mark.slow
@pytest.mark.parametrize('config,dropout', [('tiny', False), ('llama-tiny', True)])
@pytest.mark.parametrize('spec', ['none', 'full', 'sqrt'])
def test_zoo_models(config, dropout, spec):
  case, e = _zoo(config, spec, dropout=dropout)
  _check_plan(e)
  assert e.phase_at(e.peak_time) == 'backward'
  assert [s.label for s in e.phases] == ['forward', 'backward', 'update']
  saved = e.categories[SAVED]
  if spec == 'full':
    # The layer inputs N x B x T x D, within 5%: RoPE tables and the token indices are the rest.
    assert abs(saved / _layer_inputs(case) - 1) < 0.05
  if spec == 'none':
    # Every stacked [N, ...] residual is held whole through the backward loop, so all of them
    # are live at the peak; the jaxpr's other residuals (the loss head's) may be freed by then.
    n = case.num_layers
    stacked = sum(r.nbytes for r in remat.measuring.step_residuals(
        case.train_step(case.policy('none')), *case.step_args()) if r.shape[:1] == (n,))
    assert stacked <= saved <= e.jaxpr_residual_bytes + e.saved_by_tag.get('(not in the jaxpr)', 0)
    # Within 5% of the stacked residuals the backward loop reads (measured: +0.01% tiny GPT,
    # +0.11% llama-tiny; the rest is token indices and RoPE tables).
    assert saved / stacked - 1 < 0.05, (saved, stacked)
    # The model's checkpoint_name tags name the saved matmul outputs (remat.residuals).
    # (Buffers are matched to residuals by dtype and shape, so tags sharing a shape read 'a/b'.)
    tags = {t for joined in e.saved_by_tag for t in joined.split('/')}
    assert {'query_proj', 'key_proj', 'value_proj', 'out_proj', 'context'} <= tags, e.saved_by_tag
  assert e.categories[BACKWARD] > 0


@pytest.mark.slow
@pytest.mark.gpu_plan
def test_h200_plan():
  # The plain scan keeps full's layer inputs as one saved stack ...
  with kept_in_gradients.suspended():
    case, e = _zoo('llama-tiny', 'full', target='h200')
  _check_plan(e)
  assert e.target == 'h200'
  assert abs(e.categories[SAVED] / _layer_inputs(case) - 1) < 0.05
  assert not any(e.host_timeline)
  # ... the default scan on a GPU plan keeps them in the gradient rows its backward loop writes
  # later (remat.stored_scan), which count as gradients
  _, stored = _zoo('llama-tiny', 'full', target='h200')
  _check_plan(stored)
  assert stored.categories.get(SAVED, 0) < 0.05 * _layer_inputs(case)
  assert stored.categories[GRADS] >= _layer_inputs(case)


@pytest.mark.slow
@pytest.mark.gpu_plan
def test_h200_offload_is_host_memory():
  _, e = _zoo('llama-tiny', 'qkv_proj_offloaded', target='h200')
  _check_plan(e)
  # The Q, K and V projections of every layer in pinned host memory: [6, 8, 128, H, 32] f32
  # with 4 query and 2 + 2 key/value heads.
  assert max(e.host_timeline) >= 6 * 8 * 128 * (4 + 2 + 2) * 32 * 4
  assert not any(b.category for b in e.buffers if 'S(5)' in b.shape)
  assert np.argmax(e.timeline) == e.peak_time


_MESH_SCRIPT = """
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import remat
from remat.explaining import INPUTS, SAVED
from tests import user_mlp
params, x = user_mlp.example_args()
mesh = Mesh(np.array(jax.devices()), ('data',))
rep = NamedSharding(mesh, P())
shardings = (jax.tree_util.tree_map(lambda _: rep, params), NamedSharding(mesh, P('data')))
e = remat.explain(user_mlp.build, params, x, policy='full', shardings=shardings)
assert e.mesh == {'data': 2} and 'per device of mesh data=2 (2 devices)' in e.summary(), e.mesh
assert e.to_json()['per_device'] and e.to_json()['devices'] == 2
# Per device: half the batch, so half the batch input and of each saved layer input, whose
# global [L, B, D] residual the tag matching finds from the shard.
assert e.categories[INPUTS] == user_mlp.B // 2 * user_mlp.D * 4, e.categories
saved = [b for b in e.buffers if b.category == SAVED]
assert (saved[0].shape, saved[0].tag) == (f'f32[{user_mlp.L},{user_mlp.B // 2},{user_mlp.D}]',
                                          '(untagged)'), saved
# Besides it, scalars only (the partitioned mean keeps its 4-byte count).
assert all(b.size <= 8 for b in saved[1:]), saved
print('ok')
"""


@pytest.mark.slow
def test_per_device_plan_on_a_mesh():
  import os
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu', 'PYTHONPATH': root,
         'XLA_FLAGS': os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=2'}
  run = subprocess.run([sys.executable, '-c', _MESH_SCRIPT], cwd=root, env=env,
                       capture_output=True, text=True, timeout=300)
  assert run.returncode == 0 and run.stdout.strip() == 'ok', run.stderr[-2000:]


@pytest.mark.slow
def test_a_forward_peak_counts_the_residuals_being_stacked():
  """GPT-2 small at 8 x 1024 under none peaks in the forward scan (one layer's [B, H, T, T]
  attention buffers on top of the residuals stacked so far): the stacked buffers the forward
  loop writes, which the backward reads, are "saved for backward" there too."""
  from bench import zoo
  from configs import load_config
  case = zoo.case(load_config('gpt2-small').model, 8, 1024)
  e = remat.explain(case.train_step, *case.step_args(), policy='none')
  _check_plan(e)
  assert e.phase_at(e.peak_time) == 'forward'
  n = case.num_layers
  stacked = sum(r.nbytes for r in remat.measuring.step_residuals(
      case.train_step(case.policy('none')), *case.step_args()) if r.shape[:1] == (n,))
  # Every stacked residual buffer is allocated whole while the forward loop fills it.
  assert stacked <= e.categories[SAVED] <= e.jaxpr_residual_bytes + e.saved_by_tag.get(
      '(not in the jaxpr)', 0) + e.saved_by_tag.get('(a copy of a parameter)', 0)
  assert not any(b.category != SAVED and b.shape.startswith(f'f32[{n},') and b.size > 2**20
                 and b.op.startswith('jvp(') for b in e.buffers), e.buffers[:12]
