"""bench.report with --lora and --quantize: a LoRA run is planned on a CPU machine before renting a GPU.

The compiled plan of a LoRA step holds less than the full fine-tune's (no float32
master weights, gradients or AdamW moments of the base) and a QLoRA step less
again (the base at its stored size); --fit and --explain take the same flags;
bad adapter flags are bench.report's one-line errors, as they are train.py's.
"""

import json

import pytest

from bench import report

SHAPE = ['--config', 'llama-tiny', '--batch-size', '1', '--seq-len', '16']


def _peak(tmp_path, name, *extra):
  """(environment, peak under `none`) of one report; one compile."""
  out = tmp_path / f'{name}.json'
  assert report.main([*SHAPE, '--policies', 'none', '--json', str(out), *extra]) == 0
  data = json.loads(out.read_text())
  return data['environment'], {r['policy']: r['peak'] for r in data['policies']}['none']


def test_lora_and_qlora_plans_hold_less_than_the_full_fine_tune(tmp_path, capsys):
  _, full = _peak(tmp_path, 'full')
  env, lora = _peak(tmp_path, 'lora', '--lora', '4')
  _, qlora = _peak(tmp_path, 'qlora', '--lora', '4', '--quantize', 'nf4')
  assert env['lora']['rank'] == 4 and env['lora']['quantize'] is None
  assert 'LoRA r=4 alpha=8' in capsys.readouterr().out
  # llama-tiny (1.2 M parameters) at 16 tokens: its state is most of the plan, so each step down
  # (16 bytes a parameter -> the float32 base's 4 -> nf4's ~0.53 a block weight) shows.
  assert qlora < lora < 0.5 * full, (full, lora, qlora)


@pytest.mark.slow
def test_fit_and_explain_take_the_adapter_flags(tmp_path, capsys):
  assert report.main([*SHAPE, '--policies', 'full', '--lora', '4', '--fit', '--budget',
                      'auto:64MiB']) == 0
  text = capsys.readouterr().out
  assert 'LoRA r=4' in text and 'largest batch within 64.00 MiB' in text
  out = tmp_path / 'explain.json'
  assert report.main([*SHAPE, '--policies', 'full', '--lora', '4', '--quantize', 'int8',
                      '--explain', str(out)]) == 0
  assert out.stat().st_size > 0


@pytest.mark.parametrize('argv,needle', [
    (['--lora', '0'], '--lora must be >= 1 (the rank of the adapters), got 0'),
    (['--quantize', 'nf4'], "--quantize stores a LoRA run's frozen base: pass --lora RANK"),
    (['--lora', '4', '--lora-targets', 'qkv'], "'qkv' matches no projection of a llama model; "
     'its projections: self_attn/q_proj'),
])
def test_bad_adapter_flags_are_one_line(argv, needle, capsys, tmp_path):
  out = tmp_path / 'r.json'
  assert report.main([*SHAPE, *argv, '--json', str(out)]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1].startswith('bench.report: error: ') and needle in err[-1]
  assert not out.exists()
