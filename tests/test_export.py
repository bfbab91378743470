"""Export to Hugging Face folders (models/hf/export.py, training/export.py) and sampling.

The writers are the inverse of the import (models.hf.load.from_state_dict reads
their output back to the very arrays), and ``transformers`` loads the folders
with no missing or unexpected keys and computes our logits.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

from models.gpt import GPTConfig  # noqa: E402
from models.hf.export import WRITERS  # noqa: E402
from models.hf.load import from_state_dict  # noqa: E402
from models.llama import LlamaConfig, RopeScaling  # noqa: E402
from models.tasks import Task  # noqa: E402
from numerics import assert_trees_close  # noqa: E402
from text_fixtures import bpe_tokenizer, rows, write_jsonl  # noqa: E402
from training import cli  # noqa: E402
from training import export as export_cli  # noqa: E402
from training import sample as sample_cli  # noqa: E402
from training.data.text_source import load_named  # noqa: E402
from training.export import write_weights  # noqa: E402
from training.trainer import matching_config  # noqa: E402

CONFIGS = {
    'gpt': GPTConfig(vocab_size=50, max_len=16, num_layers=2, num_heads=2, d_model=16),
    'llama-untied': LlamaConfig(vocab_size=50, d_model=16, num_layers=2, num_heads=4,
                                num_kv_heads=2, mlp_dim=24, max_len=32, tie_embeddings=False,
                                rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8)),
    'llama-tied': LlamaConfig(vocab_size=50, d_model=16, num_layers=2, num_heads=2,
                              num_kv_heads=2, mlp_dim=24, max_len=32, tie_embeddings=True),
}


def _variables(cfg, seed=0):
  """Random variables of our model's tree (traced, not run): every leaf distinct, norms too."""
  shapes = jax.eval_shape(lambda: Task(cfg).model('none').init(jax.random.PRNGKey(seed),
                                                               jnp.zeros((1, 8), jnp.int32)))
  rng = np.random.default_rng(seed)
  return jax.tree_util.tree_map(
      lambda a: rng.normal(0, 0.2, a.shape).astype(np.float32), shapes)


@pytest.mark.parametrize('name', sorted(CONFIGS))
def test_writer_is_the_inverse_of_the_import(name):
  cfg = CONFIGS[name]
  arch = Task(cfg).arch
  variables = _variables(cfg)
  sd, hf = WRITERS[arch](variables, cfg)
  back = from_state_dict(arch, sd, cfg)
  jax.tree_util.tree_map(np.testing.assert_array_equal, back, dict(variables))
  assert hf['vocab_size'] == 50


@pytest.mark.parametrize('name,shard', [('gpt', None), ('llama-untied', 4096),
                                        ('llama-tied', None)])
def test_transformers_loads_the_folder_and_gives_our_logits(name, shard, tmp_path):
  cfg = CONFIGS[name]
  arch = Task(cfg).arch
  variables = _variables(cfg)
  sd, hf = WRITERS[arch](variables, cfg)
  (tmp_path / 'config.json').write_text(json.dumps(hf))
  files = write_weights(tmp_path, sd, shard or 10**9)
  if shard:   # 4 KiB shards: several files and an index, as save_pretrained above 5 GB
    assert 'model.safetensors.index.json' in files and len(files) > 3
  model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path,
                                                                  output_loading_info=True)
  assert not info['missing_keys'] and not info['unexpected_keys'], info
  tokens = np.random.default_rng(0).integers(0, 50, (2, 12))
  ours = np.asarray(jax.jit(Task(cfg).model('none').apply)(variables, tokens))
  with torch.no_grad():
    theirs = model.eval()(torch.tensor(tokens)).logits.numpy()
  assert_trees_close(theirs, ours, rtol=1e-5)


def test_unshipped_shape_builds_from_config_json(tmp_path):
  cfg = CONFIGS['llama-untied']
  sd, hf = WRITERS['llama'](_variables(cfg), cfg)
  (tmp_path / 'config.json').write_text(json.dumps(hf))
  name = matching_config(str(tmp_path))
  assert name == f'hf:{tmp_path}'
  named = load_named(name)
  assert named.arch == 'llama' and named.model == cfg


def test_run_export_and_sample(tmp_path, monkeypatch, capsys):
  """A GPT trained from scratch with a BPE tokenizer: exported, loaded, sampled greedily."""
  monkeypatch.setenv('REMAT_CACHE', str(tmp_path / 'cache'))
  tok = bpe_tokenizer(tmp_path / 'tok', [r['prompt'] + r['completion'] for r in rows(100)])
  data = write_jsonl(tmp_path / 'd.jsonl', [{'text': r['prompt'] + r['completion']}
                                           for r in rows(50)])
  run = tmp_path / 'run'
  assert cli.main(['--model', 'gpt', '--tokenizer', str(tok), '--data', str(data), '--steps', '2',
                   '--batch-size', '2', '--seq-len', '16', '--eval-every', '2',
                   '--eval-batches', '1', '--out', str(run), '--no-memory-report']) == 0
  text = capsys.readouterr().out
  assert 'nats/token' in text and 'tokenized and cached' in text
  rows_ = [json.loads(l) for l in (run / 'metrics.jsonl').read_text().splitlines()]
  assert rows_[-1]['tokens'] == 2 * 2 * 16
  out = tmp_path / 'hf'
  assert export_cli.main([str(run), str(out), '--dtype', 'bfloat16']) == 0
  capsys.readouterr()
  config = json.loads((out / 'config.json').read_text())
  assert config['vocab_size'] == 300 and config['eos_token_id'] == 0   # the tokenizer's size
  assert (out / 'tokenizer.json').read_bytes() == tok.read_bytes()
  model = transformers.AutoModelForCausalLM.from_pretrained(out)
  assert next(model.parameters()).dtype == torch.bfloat16
  assert sample_cli.main([str(run), '--prompt', 'which colour', '--max-new-tokens', '3']) == 0
  alone = capsys.readouterr().out.rstrip('\n')
  assert alone.strip()
  # --prompts: one JSON line per prompt, in one batch; each what --prompt gives alone.
  prompts = write_jsonl(tmp_path / 'p.jsonl', [{'prompt': 'which colour'}, {'prompt': 'the cat'},
                                               {'prompt': 'question 5: which'}])
  assert sample_cli.main([str(run), '--prompts', str(prompts), '--max-new-tokens', '3']) == 0
  got = [json.loads(l) for l in capsys.readouterr().out.splitlines()]
  assert [g['prompt'] for g in got] == ['which colour', 'the cat', 'question 5: which']
  assert got[0]['completion'] == alone
  (tmp_path / 'bad.jsonl').write_text('{"text": "x"}\n')
  assert sample_cli.main([str(run), '--prompts', str(tmp_path / 'bad.jsonl')]) == 2
  err = capsys.readouterr().err
  assert err.count('\n') == 1 and 'line 1: a row needs a string "prompt"' in err
  assert export_cli.main([str(run), str(out)]) == 2   # OUT_DIR exists: nothing overwritten
  assert 'already exists' in capsys.readouterr().err
