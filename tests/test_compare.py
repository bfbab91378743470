"""baselines.compare: JAX and PyTorch rows per family, ratios from the measured values, one-line errors."""

import json
import sys

import pytest

torch = pytest.importorskip('torch')
pytest.importorskip('transformers')

from baselines import compare  # noqa: E402

SIDE_KEYS = {'peak_bytes', 'activation_bytes', 'step_flops', 'recompute_ratio', 'step_seconds'}


@pytest.fixture(scope='module', autouse=True)
def one_thread():
  """Tiny ops on 2 shared cores run many times faster on one intra-op thread."""
  threads = torch.get_num_threads()
  torch.set_num_threads(1)
  yield
  torch.set_num_threads(threads)


def _run(tmp_path, capsys, argv):
  out = tmp_path / 'c.json'
  code = compare.main(argv + ['--steps', '1', '--json', str(out)])
  captured = capsys.readouterr()
  assert code == 0, captured.err
  return json.loads(out.read_text()), captured.out


def _check_rows(data, families):
  rows = {r['family']: r for r in data['families']}
  assert list(rows) == families
  for family, r in rows.items():
    assert r['jax_policy'] == compare.FAMILY_POLICY[family]
    j, t = r['jax'], r['torch']
    assert SIDE_KEYS <= set(j) and SIDE_KEYS <= set(t)
    assert j['policy'] == r['jax_policy'] and t['family'] == family
    for side in (j, t):
      assert side['peak_bytes'] > 0 and side['activation_bytes'] > 0
      assert side['step_flops'] > 0 and side['step_seconds'] > 0
    assert {'argument', 'output', 'alias', 'temp', 'residual_bytes', 'residual_by_tag'} <= set(j)
    assert j['peak_bytes'] == j['argument'] + j['output'] - j['alias'] + j['temp']
    assert t['activation_bytes'] == t['saved_activation_bytes'] and t['method'] == 'MemTracker'
    assert r['peak_ratio'] == pytest.approx(j['peak_bytes'] / t['peak_bytes'])
    assert r['time_ratio'] == pytest.approx(j['step_seconds'] / t['step_seconds'])
    assert r['flops_ratio'] == pytest.approx(j['step_flops'] / t['step_flops'])
  return rows


@pytest.mark.extended
def test_gpt2_both_sides_per_family(tmp_path, capsys):
  png = tmp_path / 'c.png'
  data, text = _run(tmp_path, capsys, ['--model', 'gpt2', '--config', 'tiny', '--batch-size', '2',
                                       '--seq-len', '32', '--families', 'none,hf,block',
                                       '--plot', str(png)])
  env = data['environment']
  assert {'jax', 'jaxlib', 'torch', 'transformers', 'backend', 'torch_threads', 'cpus_available',
          'config', 'batch_size', 'seq_len', 'predicted_tokens'} <= set(env)
  assert env['backend'] == 'cpu' and env['torch_threads'] == 1
  assert env['predicted_tokens'] == 2 * 32 and env['torch_input_ids_shape'] == [2, 33]
  assert data['optimizer']['differences'] == []
  rows = _check_rows(data, ['none', 'hf', 'block'])
  none, hf, block = rows['none'], rows['hf'], rows['block']
  assert none['jax']['recompute_ratio'] == 1.0 and none['torch']['recompute_ratio'] == 1.0
  assert none['jax']['peak_bytes'] > hf['jax']['peak_bytes']        # JAX none > full
  assert none['torch']['peak_bytes'] > block['torch']['peak_bytes']  # torch none > block
  assert hf['jax'] == block['jax'] and hf['jax_shared_with'] == ['block']  # full measured once
  assert hf['jax']['recompute_ratio'] > 1.0 and block['torch']['recompute_ratio'] > 1.0
  # Same predicted tokens: torch's forward covers 33 positions, JAX's 32.
  assert none['torch']['step_flops'] / none['jax']['step_flops'] == pytest.approx(33 / 32, rel=0.02)
  lines = text.splitlines()
  assert lines[0].startswith('# train step, gpt2 tiny, batch 2 x seq 32')
  for family, policy in (('none', 'none'), ('hf', 'full'), ('block', 'full')):
    assert any(l.split()[:3] == [family, 'JAX', policy] for l in lines)
    assert any(l.split()[:2] == ['PyTorch', family] for l in lines)
  assert any(l.startswith('# peak:') and 'allocator' in l for l in lines)
  assert any(l.startswith('# optimizer:') for l in lines)
  assert env['host_malloc'] == compare.host_malloc()
  assert f"host malloc {env['host_malloc']}" in lines[0]
  assert any(l.startswith(f"# host malloc: {env['host_malloc']} for both sides") for l in lines)
  assert png.stat().st_size > 10_000


@pytest.mark.parametrize('tunables,expected', [
    (None, 'default'),
    ('glibc.malloc.hugetlb=1', 'glibc hugetlb=1'),
    ('glibc.malloc.arena_max=1:glibc.malloc.hugetlb=2', 'glibc hugetlb=2'),
    ('glibc.malloc.hugetlb=0', 'default'),
    ('glibc.malloc.hugetlb_x=1', 'default'),
])
def test_host_malloc_reads_glibc_tunables(tunables, expected):
  environ = {} if tunables is None else {'GLIBC_TUNABLES': tunables}
  assert compare.host_malloc(environ) == expected


@pytest.mark.slow
@pytest.mark.parametrize('argv,families,skipped', [
    (['--model', 'vit', '--config', 'vit-tiny', '--batch-size', '2', '--families', 'none,block'],
     ['none', 'block'], []),
    # ResNet has no HF checkpointing: hf is skipped with a note (one family keeps the test short).
    (['--model', 'resnet', '--config', 'resnet-tiny', '--batch-size', '2', '--image-size', '32',
      '--families', 'none,hf'], ['none'], ['hf']),
])
def test_vision(tmp_path, capsys, argv, families, skipped):
  data, text = _run(tmp_path, capsys, argv)
  assert data['environment']['image_size'] == 32
  rows = _check_rows(data, families)
  assert [s['family'] for s in data['skipped']] == skipped
  for family in skipped:
    assert any(l.startswith(f'# skipped {family}:') for l in text.splitlines())
  if 'block' in rows:
    assert rows['none']['jax']['peak_bytes'] > rows['block']['jax']['peak_bytes']
    assert rows['none']['torch']['peak_bytes'] > rows['block']['torch']['peak_bytes']


@pytest.mark.parametrize('argv,message', [
    (['--model', 'gpt3', '--batch-size', '2'], "unknown model 'gpt3'"),
    (['--model', 'gpt2', '--config', 'nope', '--batch-size', '2'], "unknown config 'nope'"),
    (['--model', 'vit', '--config', 'tiny', '--batch-size', '2'], 'does not match config tiny'),
    (['--model', 'gpt2', '--config', 'tiny', '--batch-size', '2', '--families', 'none,fsdp'],
     "unknown policy family 'fsdp'"),
    (['--model', 'gpt2', '--config', 'tiny', '--batch-size', '0'], '--batch-size must be >= 1'),
    (['--model', 'gpt2', '--config', 'tiny', '--batch-size', '2', '--seq-len', '999'],
     'exceeds the model max_len'),
    (['--model', 'gpt2', '--config', 'tiny', '--batch-size', '2', '--image-size', '32'],
     '--image-size applies to vit and resnet'),
    (['--model', 'vit', '--config', 'vit-tiny', '--batch-size', '2', '--image-size', '30'],
     'not a multiple of the patch size'),
    (['--model', 'resnet', '--config', 'resnet-tiny', '--batch-size', '2', '--image-size', '16'],
     'too small for a ResNet'),
    (['--model', 'vit', '--config', 'vit-tiny', '--batch-size', '2', '--seq-len', '16'],
     '--seq-len applies to gpt2'),
    (['--model', 'resnet', '--config', 'resnet-tiny', '--batch-size', '2', '--families', 'hf'],
     'no requested family applies to resnet'),
    (['--model', 'gpt2', '--config', 'tiny', '--batch-size', '2', '--steps', '0'],
     '--steps must be >= 1'),
    (['--model', 'resnet', '--config', 'resnet-tiny', '--batch-size', '2', '--fused-update'],
     'a ResNet has one per stage'),
    (['--model', 'gpt2', '--config', 'tiny', '--batch-size', '2', '--fused-update'],
     'runs models without dropout; tiny has dropout 0.1'),
    (['--model', 'gpt2', '--config', 'tiny', '--batch-size', '2', '--layout', 'rolled'],
     "unknown layout 'rolled'; valid: auto, scan, unrolled, loops, groups"),
    (['--model', 'vit', '--config', 'vit-tiny', '--batch-size', '2', '--fused-update',
      '--layout', 'unrolled'], '--layout applies to the ordinary step'),
])
def test_one_line_errors(capsys, argv, message):
  assert compare.main(argv) == 2
  captured = capsys.readouterr()
  assert captured.out == ''
  lines = captured.err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith('baselines.compare: error: ')
  assert message in lines[0]


@pytest.mark.parametrize('argv,line', [
    (['--model', 'gpt2', '--config', 'tiny', '--batch-size', 'x'],
     "baselines.compare: --batch-size: 'x' is not an integer (see --help)"),
    (['--batch-size', '2'],
     'baselines.compare: the following arguments are required: --model (see --help)'),
])
def test_command_line_mistakes_are_one_line(capsys, argv, line):
  with pytest.raises(SystemExit) as e:   # argparse's exit, before anything is measured
    compare.main(argv)
  assert e.value.code == 2
  captured = capsys.readouterr()
  assert captured.out == '' and captured.err.splitlines() == [line]


# slow: two baselines.compare runs (about 35 s); the fused step itself is in test_fused_update.py
# and its report table in test_bench_report.py, which stay in the default suite.
@pytest.mark.slow
def test_fused_update_rows(tmp_path, capsys):
  argv = ['--model', 'vit', '--config', 'vit-tiny', '--batch-size', '2', '--families', 'none,block']
  plain, _ = _run(tmp_path, capsys, argv)
  fused, text = _run(tmp_path, capsys, argv + ['--fused-update'])
  rows = _check_rows(fused, ['none', 'block'])
  assert fused['environment']['jax_step'] == 'fused update'
  assert '(--fused-update)' in text.splitlines()[0]
  assert '# optimizer: DIFFERENT settings: clip JAX per layer vs torch global' in text
  for family in ('none', 'block'):
    ordinary = {r['family']: r for r in plain['families']}[family]['jax']
    j = rows[family]['jax']
    # the same model, loss and policy: the same matmuls and residuals; no [N, ...] gradient,
    # so the plan is smaller (vit-tiny: its 4 layers' gradients are most of the stack's bytes)
    assert j['step_flops'] == ordinary['step_flops']
    assert j['residual_bytes'] == ordinary['residual_bytes']
    assert j['peak_bytes'] < ordinary['peak_bytes']


# slow: two baselines.compare runs; the layouts' gradients and plans are tests/test_layouts.py's and
# tests/test_unrolled_cpu.py's, in the default suite.
@pytest.mark.slow
def test_layout_rows(tmp_path, capsys):
  argv = ['--model', 'vit', '--config', 'vit-tiny', '--batch-size', '2', '--families', 'none,block']
  scanned, _ = _run(tmp_path, capsys, argv)
  unrolled, text = _run(tmp_path, capsys, argv + ['--layout', 'unrolled'])
  rows = _check_rows(unrolled, ['none', 'block'])
  assert unrolled['environment']['jax_layout'] == 'unrolled'
  assert text.splitlines()[0].endswith('; JAX layout unrolled')
  for family in ('none', 'block'):
    scan = {r['family']: r for r in scanned['families']}[family]['jax']
    # another program for the same model and policy: the same matmuls, another plan
    assert rows[family]['jax']['step_flops'] == scan['step_flops']
    assert rows[family]['jax']['temp'] != scan['temp']


def test_missing_torch_is_a_one_line_error(capsys, monkeypatch):
  monkeypatch.setitem(sys.modules, 'torch', None)  # import torch now raises ImportError
  assert compare.main(['--model', 'gpt2', '--config', 'tiny', '--batch-size', '2']) == 2
  lines = capsys.readouterr().err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith('baselines.compare: error: ')
  assert 'pip install -e ".[torch]"' in lines[0] and 'torch==2.13.0' in lines[0]


def test_family_map_matches_torch_families():
  from baselines.torch_policies import FAMILIES
  assert set(compare.FAMILY_POLICY) == set(FAMILIES)
  assert compare.FAMILY_POLICY == {'none': 'none', 'hf': 'full', 'block': 'full', 'sqrt': 'sqrt',
                                   'selective': 'dots'}
