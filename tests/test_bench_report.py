"""bench.report (the zoo CLI): JSON schema, vision tables, one-line errors."""

import json

import pytest

from bench import report


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


@pytest.mark.parametrize('argv,needle', [
    (['--model', 'bert'], "unknown model 'bert'; valid: gpt, llama, vit, resnet"),
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
    (['--dtype', 'bf16'], "--dtype must be one of float32, bfloat16, got 'bf16'"),
    (['--fit', '--budget', 'auto:0.5x'], "a fraction of none's plan depends on the batch"),
    (['--fit', '--budget', 'auto'], 'target cpu has no known device memory'),
    (['--fit', '--budget', 'auto:lots'], "cannot read the budget 'lots'"),
])
def test_errors_are_one_line(argv, needle, capsys):
  assert report.main(argv) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1].startswith('bench.report: error: ') and needle in err[-1]


def test_device_peak_needs_a_gpu(capsys):
  assert report.main(['--device-peak']) == 2
  assert 'needs an attached GPU' in capsys.readouterr().err


@pytest.mark.slow
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


@pytest.mark.slow
def test_fit_table_and_plot(tmp_path, capsys):
  """--fit: per policy the largest batch whose plan fits, which the next batch does not."""
  import json as _json
  out = tmp_path / 'fit.json'
  assert report.main(['--config', 'tiny', '--seq-len', '32', '--fit', '--budget', 'auto:40MiB',
                      '--policies', 'full', '--json', str(out), '--plot',
                      str(tmp_path / 'fit.png')]) == 0
  text = capsys.readouterr().out
  assert 'largest batch within 40.00 MiB' in text
  fits = _json.loads(out.read_text())['fits']
  assert [f['spec'] for f in fits] == ['none', 'full']
  for f in fits:
    assert f['value'] >= 1 and f['peak'] <= 40 * 2**20 < f['next_peak']
  assert fits[1]['value'] >= fits[0]['value']
  assert (tmp_path / 'fit.png').stat().st_size > 0
