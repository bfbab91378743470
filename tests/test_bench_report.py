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


def test_yardsticks_rows_and_layout(tmp_path, capsys):
  """--reference unrolled --per-block full: the two yardsticks first, temp/pb beside full; --layout stamped."""
  out = tmp_path / 'r.json'
  # vit-tiny (4 layers, no dropout): the unrolled compiles take half the time of tiny's 6.
  code = report.main(['--config', 'vit-tiny', '--batch-size', '2', '--policies',
                      'full', '--reference', 'unrolled', '--per-block', 'full', '--layout',
                      'unrolled', '--json', str(out)])
  assert code == 0
  text = capsys.readouterr().out
  assert 'layout unrolled' in text.splitlines()[0] and 'temp/pb' in text
  data = json.loads(out.read_text())
  assert data['environment']['layout'] == 'unrolled'
  rows = {r['policy']: r for r in data['policies']}
  assert list(rows) == ['reference', 'per-block:full', 'none', 'full']
  assert rows['reference']['memory_ratio'] == 1.0
  assert rows['full']['per_block_ratio'] == rows['full']['temp'] / rows['per-block:full']['temp']
  assert rows['per-block:full']['flops'] == rows['full']['flops']   # the same rule recomputes


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
    # --explain with --mesh explains per device, after the same checks as either alone:
    (['--mesh', 'fsdp=2', '--explain', 'unused'],
     '--mesh data=1,fsdp=2 has 2 devices, this run has 1 (cpu); simulate CPU devices with '
     'XLA_FLAGS=--xla_force_host_platform_device_count=2'),
    (['--mesh', 'fsdp=2', '--explain', 'unused', '--fit'],
     '--explain explains the train step at one shape: drop --sweep, --fit'),
    (['--mesh', 'tensor=2', '--explain', 'unused'], "axis 'tensor' (tensor parallelism) is not"),
    (['--mesh', 'fsdp=2', '--fit'], '--mesh plans the policy table only: drop --sweep, --fit'),
    (['--fused-update', '--sweep', 'depth=2,4'], '--fused-update measures the policy table only'),
    (['--config', 'tiny', '--fused-update'], 'the fused update runs deterministic models only'),
    (['--layout', 'unroled'], "unknown layout 'unroled'; valid: auto, scan, unrolled, loops, groups"),
    (['--per-block', 'sqrt'], '--per-block takes per-layer rules that checkpoint'),
])
def test_errors_are_one_line(argv, needle, capsys):
  assert report.main(argv) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1].startswith('bench.report: error: ') and needle in err[-1]


@pytest.mark.extended
def test_fused_update_table(tmp_path, capsys):
  argv = ['--config', 'vit-tiny', '--batch-size', '2', '--policies', 'none,full,sqrt']
  temps = {}
  for flag in ([], ['--fused-update']):
    out = tmp_path / 'r.json'
    assert report.main(argv + flag + ['--json', str(out)]) == 0
    temps[bool(flag)] = {r['policy']: r for r in json.loads(out.read_text())['policies']}
  assert 'fused train step (AdamW per layer in the backward pass)' in capsys.readouterr().out
  # vit-tiny: 4 layers of width 96, MLP 192, 64 patches + 1 class token, batch 2; sqrt: 2 segments.
  # The ordinary step's segments run their layers in turn, so JAX drops the one matmul whose
  # output only the segment's output needs (the last layer's MLP output projection) from each
  # segment's recompute; the fused step's segments are scans, which recompute it.
  unused = {'none': 0, 'full': 0, 'sqrt': 2 * 2 * (2 * 65) * 192 * 96}
  for spec in ('none', 'full', 'sqrt'):
    ordinary, fused = temps[False][spec], temps[True][spec]
    # the same matmuls and residuals, without the stacked gradient buffer
    assert fused['flops'] - unused[spec] == ordinary['flops']
    assert fused['residual_bytes'] == ordinary['residual_bytes']
    assert fused['temp'] < ordinary['temp']


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


# --explain on a mesh ---------------------------------------------------------------------------
_TINY = ['--config', 'tiny', '--batch-size', '4', '--seq-len', '32', '--policies', 'full']


def _whole_bytes():
  """(parameter bytes, batch bytes) of the tiny GPT's train step on one device (abstract)."""
  import jax
  from bench import zoo
  from configs import load_config
  state, batch = zoo.case(load_config('tiny').model, 4, 32).step_args()
  nbytes = lambda tree: sum(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves(tree))
  return nbytes((state.params, state.model_state)), nbytes(batch)


def _check_mesh_explain(path, table_path, mesh: dict, text: str):
  """The explanation at ``path`` is the mesh table's per-device program, split per device."""
  data = json.loads(path.read_text())
  e, env = data['explain'], data['environment']
  names = ','.join(f'{a}={n}' for a, n in mesh.items())
  assert (e['per_device'], e['mesh'], e['devices']) == (True, mesh, 2)
  assert (env['mesh'], env['devices'], env['per_device']) == (names, 2, True)
  assert f'# full on {e["target"]}, per device of mesh {names} (2 devices): live peak' in text
  assert e['peak_bytes'] == max(e['timeline']) == sum(e['categories'].values())
  # The same program as the mesh table's row (training.step.mesh_plan.plan_row): XLA's figures agree.
  row = json.loads(table_path.read_text())['mesh_plan'][-1]
  assert row['policy'] == 'full'
  assert {k: e['plan'][k] for k in ('argument', 'output', 'alias', 'temp')} == {
      k: row[k] for k in ('argument', 'output', 'alias', 'temp')}
  params, batch = _whole_bytes()
  # Each device holds half the batch on either mesh; fsdp=2 also halves every parameter array
  # (each of the tiny GPT's has an even axis), data=2 keeps them whole.
  assert e['categories']['inputs'] == row['batch'] == batch // 2
  assert e['categories']['parameters'] == row['params'] == (
      params // 2 if mesh['fsdp'] == 2 else params)


_MESH_EXPLAIN = """
import sys
from bench import report
out = sys.argv[1]
for mesh in ('fsdp=2', 'data=2'):
  assert report.main({tiny} + ['--mesh', mesh, '--explain', f'{{out}}/{{mesh}}.json']) == 0
  assert report.main({tiny} + ['--mesh', mesh, '--json', f'{{out}}/{{mesh}}-table.json']) == 0
"""


@pytest.mark.slow
def test_explain_on_a_cpu_mesh_is_per_device(tmp_path):
  """--mesh fsdp=2 and data=2 over 2 simulated CPU devices (a subprocess: JAX reads the flag once)."""
  import os
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu', 'PYTHONPATH': root,
         'XLA_FLAGS': os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=2'}
  run = subprocess.run([sys.executable, '-c', _MESH_EXPLAIN.format(tiny=_TINY), str(tmp_path)],
                       cwd=root, env=env, capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stderr[-3000:]
  _check_mesh_explain(tmp_path / 'fsdp=2.json', tmp_path / 'fsdp=2-table.json',
                      {'data': 1, 'fsdp': 2}, run.stdout)
  _check_mesh_explain(tmp_path / 'data=2.json', tmp_path / 'data=2-table.json',
                      {'data': 2, 'fsdp': 1}, run.stdout)


@pytest.mark.slow
@pytest.mark.gpu_plan
def test_explain_on_an_h200_mesh_is_per_device(tmp_path, capsys):
  """--target h200 --mesh fsdp=2: two abstract H200s (no subprocess, no GPU)."""
  args = _TINY + ['--target', 'h200', '--mesh', 'fsdp=2']
  assert report.main(args + ['--explain', str(tmp_path / 'e.json')]) == 0
  text = capsys.readouterr().out
  assert report.main(args + ['--json', str(tmp_path / 't.json')]) == 0
  _check_mesh_explain(tmp_path / 'e.json', tmp_path / 't.json', {'data': 1, 'fsdp': 2}, text)
