"""remat.report: JSON schema, Pareto front, depth-sweep slopes, GPU targets, one-line errors."""

import dataclasses
import json

import pytest

from models.gpt import GPTConfig
from remat import report
from remat.measure import measure, step_memory
from remat.sweep import depth_sweep, loglog_slope
from remat.targets import TargetError, get_target

SMALL = GPTConfig(vocab_size=256, max_len=32, num_layers=4, num_heads=2, d_model=32, dropout=0.1)


def test_pareto_front():
  pts = {'a': (10, 1.0), 'b': (5, 1.2), 'c': (6, 1.3), 'd': (10, 1.1), 'e': (5, 1.2)}
  assert report.pareto_front(pts) == {'a', 'b', 'e'}


def test_loglog_slope():
  assert loglog_slope([2, 4, 8], [3, 6, 12]) == pytest.approx(1.0)
  assert loglog_slope([4, 16, 64], [2, 4, 8]) == pytest.approx(0.5)


def test_json_schema(tmp_path, capsys):
  out = tmp_path / 'r.json'
  code = report.main(['--config', 'tiny', '--batch-size', '2', '--seq-len', '16',
                      '--policies', 'full;names:query_proj,context', '--json', str(out),
                      '--plot', str(tmp_path / 'r.png')])
  assert code == 0
  text = capsys.readouterr().out
  assert 'target cpu' in text and 'names:query_proj,context' in text
  data = json.loads(out.read_text())
  env = data['environment']
  assert {'jax', 'backend', 'target', 'device', 'config', 'batch_size', 'seq_len', 'dtype'} <= set(env)
  rows = {r['policy']: r for r in data['policies']}
  assert list(rows) == ['none', 'full', 'names:query_proj,context']
  for r in rows.values():
    assert {'temp', 'peak', 'host_temp', 'residual_bytes', 'residual_by_tag', 'flops',
            'memory_ratio', 'recompute_ratio', 'time_ratio', 'pareto'} <= set(r)
  assert rows['none']['memory_ratio'] == 1.0 and rows['none']['recompute_ratio'] == 1.0
  assert rows['full']['temp'] < rows['none']['temp']
  assert set(rows['names:query_proj,context']['residual_by_tag']) >= {'query_proj', 'context'}
  assert (tmp_path / 'r.png').stat().st_size > 10_000


def test_time_ratio_measured_in_one_run():
  cpu = get_target('cpu')
  none = measure(SMALL, 'none', 2, 16, cpu, run=True)
  full = measure(SMALL, 'full', 2, 16, cpu, run=True)
  assert none.step_seconds > 0 and full.step_seconds > 0


def test_depth_sweep_slopes():
  cfg = dataclasses.replace(SMALL, max_len=64)
  sweep = depth_sweep(cfg, [4, 16, 64], 4, 64, get_target('cpu'), policies=('none', 'sqrt'))
  none, sqrt = ([q['activation_bytes'] for q in sweep['points'][p]] for p in ('none', 'sqrt'))
  # Without remat the memory is affine in depth: the same bytes per layer from 4
  # to 16 as from 16 to 64; the constant (logits and their gradient) keeps the
  # log-log slope over 4..64 a little under 1.
  assert (none[2] - none[1]) / 48 == pytest.approx((none[1] - none[0]) / 12, rel=0.02)
  assert sweep['slopes']['none'] >= 0.8
  # sqrt: each layer added costs less the deeper the stack.
  assert (sqrt[2] - sqrt[1]) / 48 < 0.7 * (sqrt[1] - sqrt[0]) / 12
  assert sweep['slopes']['sqrt'] <= 0.6


@pytest.mark.parametrize('argv,needle', [
    (['--model', 'bert'], "unknown model 'bert'; valid: gpt, vit, resnet"),
    (['--model', 'vit', '--config', 'tiny'], '--model vit does not match config tiny'),
    (['--image-size', '64'], '--image-size applies to vit and resnet'),
    (['--model', 'vit', '--image-size', '30'], 'image size 30 is not a multiple of the patch size 4'),
    (['--model', 'resnet', '--policies', 'minimal'], 'unknown tag(s) query_proj'),
    (['--model', 'resnet', '--sweep', 'depth=20,50'], 'ResNet depths must be standard ones'),
    (['--sweep', 'resolution=32,64'], 'expected depth=N,...'),
    (['--target', 'tpu'], "unknown target 'tpu'; valid: cpu, h100, h200"),
    (['--policies', 'nope'], "unknown remat policy 'nope'"),
    (['--config', 'gpt9'], "unknown config 'gpt9'"),
    (['--sweep', 'width=1,2'], "expected depth=N,..."),
    (['--seq-len', '4096'], 'exceeds the model max_len'),
])
def test_errors_are_one_line(argv, needle, capsys):
  assert report.main(argv) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1].startswith('remat.report: error: ') and needle in err[-1]


@pytest.mark.gpu_plan
# h100 goes through the same code as h200 with other device facts: kept for -m slow.
@pytest.mark.parametrize('name', [pytest.param('h100', marks=pytest.mark.slow), 'h200'])
def test_gpu_target_plans_offload_to_host(name):
  target = get_target(name)
  assert target.description.startswith(f'NVIDIA {name.upper()}')
  none, full, off = (step_memory(SMALL, s, 4, 32, target)
                     for s in ('none', 'full', 'minimal_offloaded'))
  assert full.temp < none.temp
  assert none.host_temp == 0 and off.host_temp > 0
  assert off.backend == name


def test_gpu_target_error_without_plugin(monkeypatch):
  from remat import targets
  monkeypatch.setattr(targets, 'gpu_plugin_available', lambda: False)
  with pytest.raises(TargetError, match='needs the jax-cuda12 plugin'):
    targets.get_target('h200')


def test_device_peak_runs_in_a_fresh_process():
  from remat.device_peak import measured_device_peak
  got = measured_device_peak('tiny', 'full', 2, 16)
  assert got['backend'] == 'cpu' and got['peak_bytes'] is None  # CPU keeps no allocator stats


def test_device_peak_needs_a_gpu(capsys):
  assert report.main(['--device-peak']) == 2
  assert 'needs an attached GPU' in capsys.readouterr().err


def test_vision_reports(tmp_path, capsys):
  out = tmp_path / 'r.json'
  assert report.main(['--model', 'resnet', '--batch-size', '2', '--image-size', '64',
                      '--policies', 'full,convs', '--json', str(out)]) == 0
  text = capsys.readouterr().out
  assert 'resnet resnet-tiny, batch 2 x image 64x64' in text
  data = json.loads(out.read_text())
  assert data['environment']['image_size'] == 64 and data['environment']['model'] == 'resnet'
  rows = {r['policy']: r for r in data['policies']}
  # convs saves by primitive: the conv outputs it keeps are the values before their tag.
  assert rows['convs']['residual_bytes'] > rows['full']['residual_bytes']
  assert rows['convs']['recompute_ratio'] == 1.0 and rows['full']['recompute_ratio'] > 1.2


def test_resolution_sweep_slopes(capsys):
  # Activations of a convnet grow as the image area: slope ~2 against the side S.
  from remat.sweep import resolution_sweep
  from models.resnet import ResNetConfig
  cfg = ResNetConfig(embedding_size=4, hidden_sizes=(32, 64), depths=(3, 3), num_classes=5,
                     image_size=32)
  sweep = resolution_sweep(cfg, [64, 128, 256], 2, get_target('cpu'), policies=('none', 'full'))
  assert sweep['axis'] == 'image_size' and sweep['values'] == [64, 128, 256]
  assert 1.7 <= sweep['slopes']['none'] <= 2.1
  assert all(f < n for f, n in zip(*(
      [p['activation_bytes'] for p in sweep['points'][k]] for k in ('full', 'none'))))
