"""LoRA and QLoRA fine-tuning of a Hugging Face Llama on prompt/completion rows, end to end (slow).

``train.py --lora 8`` on a random-weight ``LlamaForCausalLM`` with a BPE
tokenizer trained here (tests/text_fixtures.py): the held-out completion loss
falls far below the initial model's; the base the run trained on is bit for
bit the checkpoint's; the ``--adapter`` export, loaded by ``peft`` onto the
checkpoint, and the merged export, loaded by ``transformers``, give our
logits. The same run with ``--quantize int8`` and ``nf4`` learns as well.

The checkpoint is initialised with ``initializer_range=0.3`` rather than
Hugging Face's 0.02: the base is frozen, and with 0.02 the final RMSNorm
(weight 1) and a random ``lm_head`` of std 0.02 bound every logit by about
``sqrt(32) * 0.02 * sqrt(32) = 0.64``, so no adapter could make an answer
likelier than ~2x the others (measured: the completion loss went 5.70 -> 5.13
nats in 80 steps). A pretrained base has no such bound.
"""

import numpy as np
import pytest

from numerics import assert_trees_close
from text_fixtures import bpe_tokenizer, hf_llama, rows, write_jsonl
from training import cli
from training import export as export_cli
from training.data.tokenizer import load_tokenizer
from training.run import checkpoints as ckpt

pytestmark = pytest.mark.slow


@pytest.fixture(scope='module')
def checkpoint(tmp_path_factory):
  folder = tmp_path_factory.mktemp('llama')
  bpe_tokenizer(folder, [r['prompt'] + r['completion'] for r in rows(200)])
  return hf_llama(folder, vocab_size=300, initializer_range=0.3)


def _losses(logits_of, tok, items):
  """Mean per-token loss of the completion's tokens (with end-of-text) over ``items``."""
  completion = []
  for r in items:
    head = list(tok.encode(r['prompt']))
    ids = head + list(tok.encode(r['completion'], special=False)) + [tok.eot_id]
    logits = np.asarray(logits_of(np.array([ids])), np.float64)[0]
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    completion += list(-logp[np.arange(len(ids) - 1), ids[1:]][len(head) - 1:])
  return float(np.mean(completion))


def _ours(run_dir):
  import jax
  import jax.numpy as jnp
  from training.run.saved_run import load_run
  run = load_run(run_dir)
  model, variables = run.task.model('none'), jax.tree_util.tree_map(jnp.asarray, run.variables)
  return lambda tokens: model.apply(variables, jnp.asarray(tokens))


def _torch(model):
  import torch

  def logits(tokens):
    with torch.no_grad():
      return model(torch.tensor(tokens)).logits.numpy()
  return logits


def _train(checkpoint, data, out, monkeypatch, *extra):
  saved = []
  real = ckpt.save
  monkeypatch.setattr(ckpt, 'save', lambda m, state, *a, **k: (saved.append(state),
                                                                real(m, state, *a, **k))[1])
  assert cli.main(['--model', 'llama', '--init-from', str(checkpoint), '--data', str(data),
                   '--steps', '80', '--batch-size', '16', '--seq-len', '64', '--lr', '3e-2',
                   '--warmup-steps', '10', '--eval-every', '80', '--out', str(out),
                   '--no-memory-report', '--lora', '8', *extra]) == 0
  return saved[-1]   # the final state the run saved, its frozen base included


@pytest.fixture(scope='module')
def held_out():
  return rows(40, seed=1)


def test_lora_learns_keeps_its_base_and_exports_for_peft_and_transformers(
    checkpoint, held_out, tmp_path, monkeypatch):
  import peft
  import transformers
  from models.hf.load import read_safetensors
  data = write_jsonl(tmp_path / 'train.jsonl', rows(400))
  run = tmp_path / 'run'
  final = _train(checkpoint, data, run, monkeypatch)
  # The base after 80 steps is the checkpoint's weights, bit for bit (float32 compute dtype).
  tensors = read_safetensors(checkpoint / 'model.safetensors')
  base = final.frozen['layers']['block']
  for i in range(2):
    np.testing.assert_array_equal(np.asarray(base['self_attn']['q_proj']['kernel'][i]),
                                  tensors[f'model.layers.{i}.self_attn.q_proj.weight'].T)
    np.testing.assert_array_equal(np.asarray(base['mlp']['down_proj']['kernel'][i]),
                                  tensors[f'model.layers.{i}.mlp.down_proj.weight'].T)
  np.testing.assert_array_equal(np.asarray(final.frozen['embed_tokens']['embedding']),
                                tensors['model.embed_tokens.weight'])
  tok = load_tokenizer(checkpoint)
  before = _losses(_torch(transformers.LlamaForCausalLM.from_pretrained(checkpoint)), tok,
                   held_out)
  ours = _ours(run)
  after = _losses(ours, tok, held_out)
  print(f'completion loss (nats/token): initial {before:.3f}, LoRA {after:.3f}')
  assert after < 0.25 * before, (before, after)
  # The PEFT folder on the checkpoint, and the merged folder, compute our model.
  assert export_cli.main([str(run), str(tmp_path / 'adapter'), '--adapter']) == 0
  assert export_cli.main([str(run), str(tmp_path / 'merged')]) == 0
  peft_model = peft.PeftModel.from_pretrained(
      transformers.LlamaForCausalLM.from_pretrained(checkpoint), tmp_path / 'adapter').eval()
  merged = transformers.LlamaForCausalLM.from_pretrained(tmp_path / 'merged')
  tokens = np.random.default_rng(0).integers(0, 300, (4, 24))
  want = np.asarray(ours(tokens))
  # float32 on both sides, a different order of additions (and the merge's W + s A B rounded
  # once): tests/numerics.py's tolerance relative to the logits' scale.
  assert_trees_close(_torch(peft_model)(tokens), want)
  assert_trees_close(_torch(merged)(tokens), want)
  assert _losses(_torch(peft_model), tok, held_out) == pytest.approx(after, rel=1e-4)


@pytest.mark.parametrize('quant', ['int8', 'nf4'])
def test_qlora_learns(checkpoint, held_out, quant, tmp_path, monkeypatch):
  import transformers
  data = write_jsonl(tmp_path / 'train.jsonl', rows(400))
  run = tmp_path / 'run'
  final = _train(checkpoint, data, run, monkeypatch, '--quantize', quant)
  assert 'codes' in final.frozen['layers']['block']['mlp']['up_proj']['kernel']
  tok = load_tokenizer(checkpoint)
  before = _losses(_torch(transformers.LlamaForCausalLM.from_pretrained(checkpoint)), tok,
                   held_out)
  after = _losses(_ours(run), tok, held_out)
  print(f'completion loss (nats/token): initial {before:.3f}, QLoRA {quant} {after:.3f}')
  assert after < 0.25 * before, (before, after)
