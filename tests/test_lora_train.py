"""LoRA runs of train.py on a tiny Hugging Face Llama: resume, export, sampling and bad input.

Fast cases (a 2-layer, width-32 Llama with a BPE tokenizer trained here, a few
steps): a resumed LoRA run equals the uninterrupted one bit for bit; its
checkpoints hold no base; the --adapter export loads under peft and gives our
logits; the merged export loads under transformers and gives them too; the
sampler runs on a LoRA and a QLoRA run (whose merged export gives its logits
too); and each bad input is one line that writes nothing.
tests/test_lora_finetune.py (slow) checks that such runs learn.
"""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from numerics import assert_trees_close
from text_fixtures import bpe_tokenizer, hf_llama, rows, write_jsonl
from training import cli
from training import export as export_cli
from training import sample as sample_cli
from training.run import checkpoints as ckpt

# Logits of our float32 model and of torch's differ by float32 rounding over a few layers;
# 1e-5 of the logits' scale (tests/numerics.py) is what the full-model export tests use too.
RTOL = 1e-5


@pytest.fixture(scope='module')
def checkpoint(tmp_path_factory):
  """A tiny HF Llama folder holding its BPE tokenizer (300 ids)."""
  folder = tmp_path_factory.mktemp('llama')
  bpe_tokenizer(folder, [r['prompt'] + r['completion'] for r in rows(200)])
  return hf_llama(folder, vocab_size=300)


@pytest.fixture(scope='module')
def data(tmp_path_factory):
  return write_jsonl(tmp_path_factory.mktemp('data') / 'train.jsonl', rows(64))


def _args(checkpoint, data, out, *extra):
  return ['--model', 'llama', '--init-from', str(checkpoint), '--data', str(data),
          '--batch-size', '4', '--seq-len', '32', '--lr', '1e-2', '--warmup-steps', '1',
          '--eval-every', '100', '--eval-batches', '1', '--no-memory-report', '--remat', 'full',
          '--out', str(out), *extra]


@pytest.fixture(scope='module')
def lora_run(checkpoint, data, tmp_path_factory):
  """Four steps of --lora 4 (saved at 2 and 4) on the checkpoint; (run folder, metric rows)."""
  out = tmp_path_factory.mktemp('runs') / 'lora'
  assert cli.main(_args(checkpoint, data, out, '--lora', '4', '--lora-alpha', '8', '--steps', '4',
                        '--save-every', '2')) == 0
  return out, [json.loads(l) for l in (out / 'metrics.jsonl').read_text().splitlines()]


def _state(out):
  from training.run.saved_run import load_run
  return load_run(out, base=False)


def test_a_resumed_lora_run_equals_the_uninterrupted_one(lora_run, tmp_path, capsys):
  out, ref = lora_run
  again = tmp_path / 'run'
  shutil.copytree(out, again)
  shutil.rmtree(again / 'checkpoints' / '4')
  assert cli.main(['--resume', f'--out={again}', '--no-memory-report']) == 0
  printed = capsys.readouterr().out
  assert 'resumed step 2' in printed and 'lora: LoRA r=4 alpha=8' in printed
  rows_ = [json.loads(l) for l in (again / 'metrics.jsonl').read_text().splitlines()]
  assert [r['loss'] for r in rows_] == [r['loss'] for r in ref]
  a, b = _state(again), _state(out)
  jax.tree_util.tree_map(np.testing.assert_array_equal, a.variables, b.variables)


def test_lora_checkpoints_hold_the_adapters_and_a_digest_of_the_base(lora_run, checkpoint):
  from training.run import base as lora_base
  out, _ = lora_run
  meta = ckpt.read_meta(out)[1]
  assert meta['base'] == {'init_from': str(checkpoint),
                          'sha256': lora_base.checkpoint_digest(checkpoint)}
  run = _state(out)
  leaves = jax.tree_util.tree_flatten_with_path(run.variables['params'])[0]
  assert leaves and all(jax.tree_util.keystr(p).endswith(("['lora_a']", "['lora_b']"))
                        for p, _ in leaves)
  # The arrays the checkpoint holds (orbax's metadata: the adapters, their moments, counters) are
  # fewer bytes than the base's weights: the base is not in it. (Its files' total size is not a
  # measure: orbax's file layout varies by some 10 KB from run to run, about the margin here.)
  import orbax.checkpoint as ocp
  meta = ocp.StandardCheckpointer().metadata(out / 'checkpoints' / '4' / 'state')
  arrays = jax.tree_util.tree_flatten_with_path(getattr(meta, 'item_metadata', meta))[0]
  assert all(jax.tree_util.keystr(p).endswith(("['lora_a']", "['lora_b']", "['count']", "['step']"))
             for p, _ in arrays), [jax.tree_util.keystr(p) for p, _ in arrays]
  saved = sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for _, a in arrays)
  assert saved < (checkpoint / 'model.safetensors').stat().st_size


def _our_logits(run_dir, tokens):
  from training.run.saved_run import load_run
  run = load_run(run_dir)
  model = run.task.model('none')
  return np.asarray(model.apply(jax.tree_util.tree_map(jnp.asarray, run.variables),
                                jnp.asarray(tokens)))


def test_adapter_export_loads_under_peft_with_our_logits(lora_run, checkpoint, tmp_path):
  import peft
  import torch
  import transformers
  out, _ = lora_run
  folder = tmp_path / 'adapter'
  assert export_cli.main([str(out), str(folder), '--adapter']) == 0
  assert {'adapter_config.json', 'adapter_model.safetensors'} <= {p.name for p in folder.iterdir()}
  config = json.loads((folder / 'adapter_config.json').read_text())
  assert config['r'] == 4 and config['lora_alpha'] == 8 and config['target_modules'] == [
      'down_proj', 'gate_proj', 'k_proj', 'o_proj', 'q_proj', 'up_proj', 'v_proj']
  base = transformers.LlamaForCausalLM.from_pretrained(checkpoint)
  tokens = np.random.default_rng(0).integers(0, 300, (2, 24))
  with torch.no_grad():   # before peft wraps the base (it adds the adapters in place)
    plain = base(torch.tensor(tokens)).logits.numpy()
  model = peft.PeftModel.from_pretrained(base, folder).eval()
  with torch.no_grad():
    theirs = model(torch.tensor(tokens)).logits.numpy()
  ours = _our_logits(out, tokens)
  assert np.abs(ours - plain).max() > 100 * RTOL * np.abs(plain).max()   # the adapters matter
  assert_trees_close(theirs, ours, rtol=RTOL)


def test_merged_export_loads_under_transformers_with_our_logits(lora_run, tmp_path):
  import torch
  import transformers
  out, _ = lora_run
  folder = tmp_path / 'merged'
  assert export_cli.main([str(out), str(folder)]) == 0
  model, info = transformers.LlamaForCausalLM.from_pretrained(folder, output_loading_info=True)
  assert not info['missing_keys'] and not info['unexpected_keys']
  tokens = np.random.default_rng(1).integers(0, 300, (2, 24))
  with torch.no_grad():
    theirs = model(torch.tensor(tokens)).logits.numpy()
  assert_trees_close(theirs, _our_logits(out, tokens), rtol=RTOL)


def test_sampling_a_lora_run(lora_run, capsys):
  out, _ = lora_run
  assert sample_cli.main([str(out), '--prompt', 'question 5: which colour is the fox?',
                          '--max-new-tokens', '3']) == 0
  assert capsys.readouterr().out.strip() != ''


def test_a_qlora_run_samples_and_exports_merged_with_our_logits(checkpoint, data, tmp_path,
                                                               capsys):
  """An nf4 base: the sampler loads and runs it; the merged export (the base dequantized, the
  adapters added) computes what the run computes, nf4's rounding included."""
  import torch
  import transformers
  out = tmp_path / 'qlora'
  assert cli.main(_args(checkpoint, data, out, '--lora', '4', '--quantize', 'nf4',
                        '--steps', '2')) == 0
  capsys.readouterr()
  assert sample_cli.main([str(out), '--prompt', 'question 5: which colour is the fox?',
                          '--max-new-tokens', '3']) == 0
  assert capsys.readouterr().out.strip() != ''
  folder = tmp_path / 'merged'
  assert export_cli.main([str(out), str(folder)]) == 0
  model = transformers.LlamaForCausalLM.from_pretrained(folder)
  tokens = np.random.default_rng(2).integers(0, 300, (2, 24))
  with torch.no_grad():
    theirs = model(torch.tensor(tokens)).logits.numpy()
  # float32 on both sides (the run's compute dtype): the dequantized kernels are the same
  # numbers, so only float32 summation order differs, as for the LoRA exports above.
  assert_trees_close(theirs, _our_logits(out, tokens), rtol=RTOL)


def _one_error(err: str, prog: str) -> bool:
  lines = [l for l in err.replace('\r', '\n').split('\n') if l.strip() and 'it/s' not in l]
  return ('Traceback' not in err and len([l for l in lines if l.startswith(prog)]) == 1
          and lines[-1].startswith(f'{prog}: error: '))


def _snapshot(folder: Path) -> dict:
  return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.stat().st_size)
          for p in folder.rglob('*')}


def test_bad_lora_input_is_one_line_and_writes_nothing(lora_run, checkpoint, data, tmp_path,
                                                       capsys):
  cases = [(['--lora', '0'], '--lora must be >= 1 (the rank of the adapters), got 0'),
           (['--lora', '4', '--lora-targets', 'q_proj,qkv'],
            "'qkv' matches no projection of a llama model; its projections: self_attn/q_proj, "
            'self_attn/k_proj, self_attn/v_proj, self_attn/o_proj, mlp/gate_proj, mlp/up_proj, '
            'mlp/down_proj'),
           (['--quantize', 'nf4'], "--quantize stores a LoRA run's frozen base: pass --lora RANK"),
           (['--lora', '4', '--quantize', 'int4'], "--quantize must be one of int8, nf4, got 'int4'"),
           (['--lora-alpha', '8'], '--lora-alpha sets up a LoRA run: pass --lora RANK')]
  for i, (extra, message) in enumerate(cases):
    out = tmp_path / f'out{i}'
    code = cli.main(_args(checkpoint, data, out, '--steps', '1', *extra))
    err = capsys.readouterr().err
    assert code == 2 and message in err and _one_error(err, 'train.py'), err
    assert not out.exists()
  # --adapter export of a run trained without --lora.
  full = tmp_path / 'full'
  assert cli.main(_args(checkpoint, data, full, '--steps', '1')) == 0
  capsys.readouterr()
  assert export_cli.main([str(full), str(tmp_path / 'x'), '--adapter']) == 2
  err = capsys.readouterr().err
  assert 'was trained without --lora, so it has no adapters' in err, err
  assert _one_error(err, 'training.export') and not (tmp_path / 'x').exists()
  # Resuming a LoRA run against another base: one line, the run folder untouched.
  out, _ = lora_run
  run = tmp_path / 'resume'
  shutil.copytree(out, run)
  other = tmp_path / 'other'
  shutil.copytree(checkpoint, other)
  hf_llama(other, vocab_size=300, seed=1)   # same shape, other weights
  before = _snapshot(run)
  code = cli.main(['--resume', f'--out={run}', '--steps', '6', '--init-from', str(other),
                   '--no-memory-report'])
  err = capsys.readouterr().err
  assert code == 2 and _one_error(err, 'train.py'), err
  assert f'was trained on the base {checkpoint} (weights sha256' in err
  assert f'not on {other} (weights sha256' in err and f'pass --init-from {checkpoint}' in err
  assert _snapshot(run) == before
  # A LoRA run resumed without --lora, or with another rank: named, nothing written.
  code = cli.main(['--resume', f'--out={run}', '--steps', '6', '--lora', '8',
                   '--no-memory-report'])
  err = capsys.readouterr().err
  assert code == 2 and _one_error(err, 'train.py'), err
  # (the recorded --lora-alpha 8 comes back with the resume, as every recorded setting does)
  assert 'was trained with --lora 4 --lora-alpha 8, not with --lora 8 --lora-alpha 8' in err
  assert _snapshot(run) == before


def test_gpt2_adapters_export_as_one_fused_c_attn_adapter_for_peft(data, tmp_path):
  """GPT-2's query and value adapters become one rank-2r adapter of HF's fused c_attn (with
  rank_pattern/alpha_pattern), mlp.c_fc's its own; peft on the checkpoint gives our logits."""
  import peft
  import torch
  import transformers
  folder = tmp_path / 'gpt2'
  torch.manual_seed(0)
  transformers.GPT2LMHeadModel(transformers.GPT2Config(
      vocab_size=256, n_positions=64, n_embd=32, n_layer=2, n_head=2)).save_pretrained(folder)
  out = tmp_path / 'run'
  # --seq-len 60: rows are packed whole, and the longest byte row is 53 tokens.
  assert cli.main(['--init-from', str(folder), '--data', str(data), '--tokenizer', 'bytes',
                   '--batch-size', '4', '--seq-len', '60', '--lr', '1e-2', '--warmup-steps', '1',
                   '--steps', '3', '--eval-every', '100', '--eval-batches', '1',
                   '--no-memory-report', '--out', str(out), '--lora', '2',
                   '--lora-targets', 'query,value,c_fc']) == 0
  adapter = tmp_path / 'adapter'
  assert export_cli.main([str(out), str(adapter), '--adapter']) == 0
  config = json.loads((adapter / 'adapter_config.json').read_text())
  assert config['target_modules'] == ['c_attn', 'c_fc'] and config['fan_in_fan_out']
  assert config['rank_pattern'] == {'c_attn': 4} and config['alpha_pattern'] == {'c_attn': 8.0}
  base = transformers.GPT2LMHeadModel.from_pretrained(folder)
  model = peft.PeftModel.from_pretrained(base, adapter).eval()
  tokens = np.random.default_rng(0).integers(0, 256, (2, 24))
  with torch.no_grad():
    theirs = model(torch.tensor(tokens)).logits.numpy()
  assert_trees_close(theirs, _our_logits(out, tokens), rtol=RTOL)
