"""Hugging Face Llama import (models/hf/load.py) against ``transformers.LlamaForCausalLM``.

Tiny random models (grouped-query and multi-head attention, tied and untied
output embeddings, Llama 3 rotary scaling) are built in PyTorch on the CPU,
their weights perturbed (so unit RMSNorm scales cannot hide a mapping error),
saved with ``save_pretrained`` and imported. Float32 throughout, compared with
tests/numerics.py's default tolerance: logits, loss and every gradient, ours
under none/full/sqrt and theirs with activation checkpointing off and on.
"""

import dataclasses
import functools
import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

from configs import load_config  # noqa: E402
from models.hf.load import from_state_dict, load_hf, load_hf_config  # noqa: E402
from models.llama import RopeScaling  # noqa: E402
from models.tasks import Task  # noqa: E402
from numerics import assert_trees_close  # noqa: E402
from test_hf_parity import _enable_checkpointing, _one_line_error  # noqa: E402
from training import cli  # noqa: E402
from training.run.checkpoints import restore  # noqa: E402
from training.step import train_step as st  # noqa: E402

BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
            num_attention_heads=4, max_position_embeddings=128, rms_norm_eps=1e-5)
LLAMA3 = {'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
          'original_max_position_embeddings': 64}
MODELS = {
    # Two query heads per key/value head, untied head, Llama 3 scaling (all three regimes).
    'gqa_untied_llama3': dict(BASE, num_key_value_heads=2, tie_word_embeddings=False,
                              rope_scaling=LLAMA3),
    # Multi-head attention, tied embeddings, plain rotary with another base.
    'mha_tied': dict(BASE, num_key_value_heads=4, tie_word_embeddings=True, rope_theta=500.0),
    # One key/value head (multi-query), tied, Llama 3 scaling.
    'mqa_tied_llama3': dict(BASE, num_key_value_heads=1, tie_word_embeddings=True,
                            rope_scaling=LLAMA3),
}
POLICIES = ['none', 'full', 'sqrt']


def _build(name, **overrides):
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**MODELS[name], **overrides}))
  with torch.no_grad():
    for pname, p in model.named_parameters():
      if pname.endswith('norm.weight'):
        p.copy_(torch.empty_like(p).uniform_(0.5, 1.5))
      else:
        p.add_(0.05 * torch.randn_like(p))
  return model.eval()


def _windows(vocab=64, b=2, t=16):
  return np.random.default_rng(1).integers(0, vocab, size=(b, t + 1)).astype(np.int32)


def _torch_loss(model, windows):
  inputs, labels = (torch.from_numpy(windows[:, s]).long() for s in (slice(None, -1),
                                                                     slice(1, None)))
  logits = model(inputs).logits
  return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           labels.reshape(-1))


@functools.lru_cache(maxsize=None)
def _saved(name, tmp_root):
  model = _build(name)
  folder = f'{tmp_root}/{name}'
  model.save_pretrained(folder)
  arch, config, variables = load_hf(folder)
  return folder, model, arch, config, variables


@pytest.fixture(scope='module')
def root(tmp_path_factory):
  return str(tmp_path_factory.mktemp('hf_llama'))


@functools.lru_cache(maxsize=None)
def _torch_grads(name, checkpointing, tmp_root):
  _, ref, arch, config, _ = _saved(name, tmp_root)
  model = _build(name).train()
  model.load_state_dict(ref.state_dict())
  calls = [0]
  if checkpointing:
    _enable_checkpointing(model)
    mlp = model.model.layers[0].mlp
    forward = mlp.forward
    def counted(*a, **k):
      calls[0] += 1
      return forward(*a, **k)
    mlp.forward = counted
  loss = _torch_loss(model, _windows())
  loss.backward()
  if checkpointing:  # the layer ran again in the backward pass: checkpointing is really on
    assert calls[0] == 2, calls[0]
  grads = {n: p.grad.numpy() for n, p in model.named_parameters()}
  return loss.item(), from_state_dict(arch, grads, config)['params']


@functools.lru_cache(maxsize=None)
def _our_grads(name, policy, tmp_root):
  _, _, _, config, variables = _saved(name, tmp_root)
  task = Task(config)
  model = task.model(policy)
  windows = jnp.asarray(_windows())
  loss, grads = jax.jit(jax.value_and_grad(
      lambda p: task.loss(model, p, {}, windows)[0]))(variables['params'])
  return float(loss), grads


@pytest.mark.parametrize('name', list(MODELS))
def test_config_tree_and_logits(name, root):
  """The config is read right, the import has our init's exact tree, and logits equal torch's."""
  _, model, arch, config, variables = _saved(name, root)
  hf = MODELS[name]
  assert arch == 'llama' and config.num_kv_heads == hf['num_key_value_heads']
  assert config.tie_embeddings == hf['tie_word_embeddings']
  assert (config.rope_scaling is not None) == ('rope_scaling' in hf)
  assert config.rope_theta == hf.get('rope_theta', 10000.0)
  task = Task(config)
  shapes = jax.eval_shape(lambda: task.model('none').init(jax.random.PRNGKey(0),
                                                          task.init_input(16)))
  assert jax.tree_util.tree_structure(variables) == jax.tree_util.tree_structure(shapes)
  tokens = _windows()[:, :-1]
  logits = jax.jit(lambda v: task.model('none').apply(v, jnp.asarray(tokens)))(variables)
  with torch.no_grad():
    ref = model(torch.from_numpy(tokens).long()).logits.numpy()
  assert_trees_close(np.asarray(logits), ref)


CASES = [(n, p, c) for n in MODELS for p in POLICIES for c in (False, True)]
# The default suite: every config under none, and the first one under each policy with HF's
# checkpointing on; the other combinations with -m slow.
_FIRST = next(iter(MODELS))
_DEFAULT = {(n, POLICIES[0], False) for n in MODELS} | {(_FIRST, p, True) for p in POLICIES}


@pytest.mark.parametrize('name,policy,checkpointing', [
    c if c in _DEFAULT else pytest.param(*c, marks=pytest.mark.slow) for c in CASES],
    ids=[f'{n}-{p}-{"hfckpt" if c else "nockpt"}' for n, p, c in CASES])
def test_loss_and_every_gradient(name, policy, checkpointing, root):
  t_loss, t_grads = _torch_grads(name, checkpointing, root)
  loss, grads = _our_grads(name, policy, root)
  assert_trees_close(loss, t_loss)
  assert_trees_close(grads, t_grads)


def test_sharded_bfloat16_checkpoint(root, tmp_path):
  """A bf16 save split over several files (with an index) imports as the bf16 values, in float32."""
  _, model, arch, config, _ = _saved('gqa_untied_llama3', root)
  model.to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size='20KB')
  model.to(torch.float32)
  index = json.loads((tmp_path / 'model.safetensors.index.json').read_text())
  assert len(set(index['weight_map'].values())) > 1
  _, _, variables = load_hf(tmp_path, expect_arch='llama')
  rounded = {k: v.to(torch.bfloat16).float().numpy() for k, v in model.state_dict().items()}
  chex.assert_trees_all_equal(variables, from_state_dict(arch, rounded, config))
  assert all(x.dtype == np.float32 for x in jax.tree_util.tree_leaves(variables))


def test_transformers4_config_fields(root, tmp_path):
  """A config.json with transformers 4's rope_theta / rope_scaling reads the same."""
  folder, _, _, config, _ = _saved('gqa_untied_llama3', root)
  hf = json.loads(open(f'{folder}/config.json').read())
  params = hf.pop('rope_parameters')
  hf['rope_theta'] = params.pop('rope_theta')
  hf['rope_scaling'] = params
  (tmp_path / 'config.json').write_text(json.dumps(hf))
  assert load_hf_config(tmp_path) == ('llama', config)
  assert config.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 64)


def _edited(folder, tmp_path, name, **fields):
  out = tmp_path / name
  out.mkdir()
  hf = json.loads(open(f'{folder}/config.json').read())
  hf.update(fields)
  (out / 'config.json').write_text(json.dumps(hf))
  return out


def test_errors_are_one_line(root, tmp_path):
  folder, model, arch, config, _ = _saved('gqa_untied_llama3', root)
  yarn = _edited(folder, tmp_path, 'yarn', rope_parameters={'rope_type': 'yarn', 'factor': 4.0})
  _one_line_error(lambda: load_hf_config(yarn), "rope_type 'yarn' is not supported")
  biased = _edited(folder, tmp_path, 'biased', attention_bias=True)
  _one_line_error(lambda: load_hf_config(biased), 'attention_bias=true is not supported')
  bad_kv = _edited(folder, tmp_path, 'kv', num_key_value_heads=3)
  _one_line_error(lambda: load_hf_config(bad_kv), r'num_kv_heads \(3\) must divide num_heads')
  # A tied config cannot take this untied checkpoint's distinct lm_head.
  tied = dataclasses.replace(config, tie_embeddings=True)
  _one_line_error(lambda: load_hf(folder, config=tied), 'lm_head.weight differs')
  _one_line_error(lambda: load_hf(folder, expect_arch='gpt'), 'Llama checkpoint, not the expected')
  tensors = {k: v.numpy() for k, v in model.state_dict().items()}
  del tensors['lm_head.weight']
  _one_line_error(lambda: from_state_dict(arch, tensors, config), 'lacks lm_head.weight')
  narrow = {**tensors, 'lm_head.weight': np.zeros((64, 16), np.float32)}
  _one_line_error(lambda: from_state_dict(arch, narrow, config),
                  r'shape mismatch at lm_head/kernel \(lm_head.weight\)')
  damaged = _edited(folder, tmp_path, 'damaged')
  (damaged / 'model.safetensors').write_bytes(b'\xff' * 16)
  _one_line_error(lambda: load_hf(damaged), 'cannot read .*header length')
  sharded = tmp_path / 'sharded'
  model.save_pretrained(sharded, max_shard_size='20KB')
  shard = sorted(sharded.glob('model-*.safetensors'))[1]
  shard.unlink()
  _one_line_error(lambda: load_hf(sharded), f'names weight files that are missing: {shard.name}')


@pytest.mark.slow
def test_init_from_fine_tunes_the_tiny_config(tmp_path, capsys):
  """train.py --init-from a folder with llama-tiny's shape finds the config and starts there."""
  cfg = load_config('llama-tiny').model
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
      vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.mlp_dim,
      num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
      num_key_value_heads=cfg.num_kv_heads, max_position_embeddings=cfg.max_len,
      rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta, tie_word_embeddings=True))
  model.to(torch.bfloat16).save_pretrained(tmp_path / 'hf')
  out = tmp_path / 'run'
  assert cli.main([f'--init-from={tmp_path / "hf"}', '--steps=1', '--batch-size=2',
                   '--seq-len=16', '--lr=1e-12', '--eval-every=1', '--eval-batches=1',
                   f'--out={out}', '--no-memory-report', '--remat=sqrt']) == 0
  text = capsys.readouterr().out
  assert 'model: llama-tiny' in text and 'initialised from the Hugging Face checkpoint' in text
  _, _, variables = load_hf(tmp_path / 'hf')
  model_ = Task(cfg).model('sqrt')
  tx = st.make_optimizer(1e-12, 1, 20, 1e-4, 1.0)
  state, _ = st.abstract_inputs(model_, tx, 2, 16)
  restored, meta = restore(out, state, warn=pytest.fail)
  assert meta['config'] == 'llama-tiny'
  assert_trees_close(restored.params, variables['params'])


# The baselines' torch Llama (baselines.compare --model llama) is built from our config's fields.
BASELINE_FIELDS = {'vocab_size': 64, 'd_model': 32, 'num_layers': 4, 'num_heads': 4,
                   'num_kv_heads': 2, 'mlp_dim': 48, 'max_len': 32, 'rms_norm_eps': 1e-5,
                   'rope_theta': 10000.0, 'tie_embeddings': False,
                   'rope_scaling': {'factor': 8.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
                                    'original_max_position_embeddings': 16}}


def _baseline_grads(family):
  from baselines.torch_models import build_model, make_batch
  from baselines.torch_policies import apply_policy
  net = apply_policy('llama', build_model('llama', BASELINE_FIELDS, seed=0), family)
  batch = make_batch('llama', BASELINE_FIELDS, 2, 16, seed=0)
  loss = net(**batch).loss
  loss.backward()
  return net, batch, loss.item(), {n: p.grad.numpy() for n, p in net.named_parameters()}


def test_baseline_llama_is_our_config():
  """The torch side's model computes what ours computes from the same config and weights."""
  from models.llama import LlamaConfig
  net, batch, t_loss, t_grads = _baseline_grads('none')
  config = LlamaConfig(**BASELINE_FIELDS)
  params = from_state_dict('llama', {k: v.detach().numpy() for k, v in net.state_dict().items()},
                           config)['params']
  task = Task(config)
  ids = batch['input_ids'].numpy().astype(np.int32)   # HF shifts labels = inputs
  loss, grads = jax.value_and_grad(
      lambda p: task.loss(task.model('none'), p, {}, jnp.asarray(ids))[0])(params)
  # Ours predicts from L - 1 positions of the L ids, HF's forward runs over all L: same loss.
  assert_trees_close(float(loss), t_loss)
  assert_trees_close(grads, from_state_dict('llama', t_grads, config)['params'])


@pytest.mark.parametrize('family', ['hf', 'block', 'sqrt', 'selective'])
def test_baseline_families_give_the_gradients_of_none(family):
  _, _, loss, grads = _baseline_grads(family)
  ref_loss, ref_grads = _baseline_grads('none')[2:]
  assert_trees_close(loss, ref_loss)
  assert_trees_close(grads, ref_grads)
