"""Hugging Face import (models/hf/load.py) against PyTorch: logits, loss and every gradient.

Tiny random GPT2LMHeadModel, ViTForImageClassification and
ResNetForImageClassification (bottleneck and basic blocks) are built in
PyTorch on the CPU, their weights perturbed (so zero biases, unit LayerNorm
scales and fresh BatchNorm statistics cannot hide a mapping error), saved with
``save_pretrained`` and imported. Float32 throughout. Our side runs under
several remat policies; theirs with activation checkpointing off and on.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

from models.gpt import GPTConfig  # noqa: E402
from models.hf.load import HFImportError, from_state_dict, load_hf, load_hf_config  # noqa: E402
from models.tasks import Task  # noqa: E402
from models.vit import ViTConfig  # noqa: E402
from numerics import RTOL, assert_trees_close  # noqa: E402

# Elementwise |ours - torch| <= rtol * (|torch| + S), S the largest gradient of the model
# (tests/numerics.py). ResNet's is twice the default: against a float64 torch reference,
# training-mode BatchNorm leaves float32 errors of up to ~9e-6 of a leaf's largest gradient on
# our side (~4e-6 on torch's).
RESNET_GRAD_RTOL = 2e-5

GPT_KW = dict(vocab_size=256, n_positions=32, n_layer=3, n_head=2, n_embd=32,
              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
VIT_KW = dict(image_size=16, patch_size=4, num_hidden_layers=3, hidden_size=32,
              num_attention_heads=2, intermediate_size=64, num_labels=5,
              hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
RESNET_KW = {
    'resnet': dict(embedding_size=8, hidden_sizes=[16, 32], depths=[2, 3],
                   layer_type='bottleneck', num_labels=5),
    # Stage 0 keeps the width (no shortcut) and has a single block.
    'resnet_basic': dict(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 2],
                         layer_type='basic', num_labels=5),
}
TRANSFORMER_POLICIES = ['none', 'full', 'sqrt', 'dots', 'minimal']
POLICIES = {'gpt': TRANSFORMER_POLICIES, 'vit': TRANSFORMER_POLICIES,
            'resnet': ['none', 'full', 'sqrt', 'dots', 'convs', 'stage'],
            'resnet_basic': ['none', 'full', 'stage']}


def _build(name):
  """A tiny random HF model with perturbed weights and statistics, in eval mode."""
  torch.manual_seed(0)
  if name == 'gpt':
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT_KW))
  elif name == 'vit':
    model = transformers.ViTForImageClassification(transformers.ViTConfig(**VIT_KW))
  else:
    model = transformers.ResNetForImageClassification(transformers.ResNetConfig(**RESNET_KW[name]))
  with torch.no_grad():
    for pname, p in model.named_parameters():
      p.add_(0.05 * torch.randn_like(p))
      if pname.endswith('normalization.weight'):
        p.copy_(torch.empty_like(p).uniform_(0.5, 1.5))
    for bname, b in model.named_buffers():
      if bname.endswith('running_mean'):
        b.copy_(0.2 * torch.randn_like(b))
      elif bname.endswith('running_var'):
        b.copy_(torch.empty_like(b).uniform_(0.5, 1.5))
  return model.eval()


def _batch(name):
  """(our batch, torch inputs, torch labels)."""
  rng = np.random.default_rng(1)
  if name == 'gpt':
    windows = rng.integers(0, GPT_KW['vocab_size'], size=(2, 17)).astype(np.int32)
    return jnp.asarray(windows), torch.from_numpy(windows[:, :-1]).long(), \
        torch.from_numpy(windows[:, 1:]).long()
  side, b = (VIT_KW['image_size'], 2) if name == 'vit' else (32, 4)
  images = rng.normal(size=(b, side, side, 3)).astype(np.float32)
  labels = rng.integers(0, 5, size=(b,)).astype(np.int32)
  batch = {'images': jnp.asarray(images), 'labels': jnp.asarray(labels)}
  return batch, torch.from_numpy(images.transpose(0, 3, 1, 2).copy()), \
      torch.from_numpy(labels).long()


def _torch_logits(model, inputs):
  return model(inputs).logits


def _torch_loss(model, inputs, labels):
  logits = _torch_logits(model, inputs)
  return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           labels.reshape(-1))


def _enable_checkpointing(model):
  kwargs = {'use_reentrant': False}
  if hasattr(model, 'activation_checkpointing_enable'):  # transformers >= 5.x
    model.activation_checkpointing_enable(kwargs)
  else:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _first_block_submodule(name, model):
  if name == 'gpt':
    return model.transformer.h[0].mlp
  # transformers 5 names ViT's modules vit.layers.{i}.mlp (its files keep vit.encoder.layer.{i}).
  vit = model.vit
  return vit.layers[0].mlp if hasattr(vit, 'layers') else vit.encoder.layer[0].intermediate


@functools.lru_cache(maxsize=None)
def _saved(name, tmp_root):
  """Builds, saves and imports one model: (folder, torch model, arch, config, variables)."""
  model = _build(name)
  folder = f'{tmp_root}/{name}'
  model.save_pretrained(folder)
  arch, config, variables = load_hf(folder)
  return folder, model, arch, config, variables


@pytest.fixture(scope='module')
def root(tmp_path_factory):
  """Where this module's models are saved (each once, by :func:`_saved`)."""
  return str(tmp_path_factory.mktemp('hf'))


@functools.lru_cache(maxsize=None)
def _torch_train(name, checkpointing, tmp_root):
  """Torch training-mode loss, gradients (in our layout) and BatchNorm statistics."""
  _, ref, arch, config, _ = _saved(name, tmp_root)
  model = _build(name).train()
  model.load_state_dict(ref.state_dict())
  calls = [0]
  if checkpointing:
    _enable_checkpointing(model)
    sub = _first_block_submodule(name, model)
    forward = sub.forward
    def counted(*a, **k):
      calls[0] += 1
      return forward(*a, **k)
    sub.forward = counted
  bn_sizes = {}
  for mname, m in model.named_modules():
    if isinstance(m, torch.nn.BatchNorm2d):
      m.register_forward_hook(
          lambda mod, inp, out, mname=mname: bn_sizes.__setitem__(mname, inp[0].numel() //
                                                                  inp[0].shape[1]))
  _, inputs, labels = _batch(name)
  loss = _torch_loss(model, inputs, labels)
  loss.backward()
  if checkpointing:  # the block ran again in the backward pass: checkpointing is really on
    assert calls[0] == 2, calls[0]
  tensors = {n: p.grad.numpy() for n, p in model.named_parameters()}
  tensors.update({n: b.numpy() for n, b in model.named_buffers()})
  grads = from_state_dict(arch, tensors, config)['params']
  return loss.item(), grads, model.state_dict(), bn_sizes


@functools.lru_cache(maxsize=None)
def _ours_train(name, policy, tmp_root):
  _, _, _, config, variables = _saved(name, tmp_root)
  task = Task(config)
  model = task.model(policy)
  params = variables['params']
  state = {k: v for k, v in variables.items() if k != 'params'}
  batch, _, _ = _batch(name)
  fn = jax.jit(jax.value_and_grad(
      lambda p: task.loss(model, p, state, batch, dropout_rng=jax.random.PRNGKey(0)), has_aux=True))
  (loss, (new_state, _)), grads = fn(params)
  return float(loss), grads, new_state


ALL = ['gpt', 'vit', 'resnet', 'resnet_basic']


@pytest.mark.parametrize('name', ALL)
def test_tree_and_eval_logits(name, root):
  """The import has our init's exact tree; eval-mode logits equal torch's."""
  _, model, arch, config, variables = _saved(name, root)
  task = Task(config)
  ours = task.model('none')
  shapes = jax.eval_shape(lambda: ours.init(jax.random.PRNGKey(0),
                                            task.init_input(task.default_size)))
  assert jax.tree_util.tree_structure(variables) == jax.tree_util.tree_structure(shapes)
  jax.tree_util.tree_map(lambda a, s: np.testing.assert_equal(a.shape, s.shape), variables, shapes)
  batch, inputs, _ = _batch(name)
  x = batch[:, :-1] if arch == 'gpt' else batch['images']
  logits = jax.jit(lambda v: ours.apply(v, x))(variables)
  with torch.no_grad():
    ref = _torch_logits(model, inputs).numpy()
  assert_trees_close(np.asarray(logits), ref)


CASES = [(n, p, c) for n in ALL for p in POLICIES[n] for c in ((False, True) if n in ('gpt', 'vit')
                                                                else (False,))]


# The default suite: every model without remat, and under full and sqrt (stage for a ResNet)
# against HF's own checkpointing where it has one; every other combination with -m slow.
DEFAULT_CASES = ({(n, 'none', False) for n in ALL} | {(n, p, True) for n in ('gpt', 'vit')
                                                      for p in ('full', 'sqrt')}
                 | {('resnet', 'stage', False), ('resnet_basic', 'stage', False)})


@pytest.mark.parametrize('name,policy,checkpointing', [
    c if c in DEFAULT_CASES else pytest.param(*c, marks=pytest.mark.slow) for c in CASES],
    ids=[f'{n}-{p}-{"hfckpt" if c else "nockpt"}' for n, p, c in CASES])
def test_train_loss_and_every_gradient(name, policy, checkpointing, root):
  """Training-mode loss and every parameter gradient equal torch's."""
  t_loss, t_grads, _, _ = _torch_train(name, checkpointing, root)
  loss, grads, _ = _ours_train(name, policy, root)
  assert_trees_close(loss, t_loss)
  assert_trees_close(grads, t_grads, rtol=RESNET_GRAD_RTOL if name.startswith('resnet') else RTOL)


@pytest.mark.parametrize('name', ['resnet', 'resnet_basic'])
def test_batchnorm_running_statistics(name, root):
  """Running means equal torch's; running variances equal once torch's n/(n-1) is undone.

  torch averages the unbiased batch variance into running_var, Flax the biased
  one, so after a training step the two differ by design.
  """
  _, ref, arch, config, _ = _saved(name, root)
  _, _, t_state, bn_sizes = _torch_train(name, False, root)
  _, _, new_state = _ours_train(name, 'none', root)
  old = ref.state_dict()
  corrected = {}
  for key, value in t_state.items():
    value = value.numpy()
    if key.endswith('running_var'):
      n = bn_sizes[key[:-len('.running_var')]]
      batch_var = (value - 0.9 * old[key].numpy()) / 0.1 * (n - 1) / n
      value = 0.9 * old[key].numpy() + 0.1 * batch_var
    corrected[key] = value
  expected = from_state_dict(arch, corrected, config)['batch_stats']
  for kind in ('mean', 'var'):
    assert_trees_close(*({k: v for k, v in traverse_util.flatten_dict(s).items() if k[-1] == kind}
                         for s in (new_state['batch_stats'], expected)), err_msg=f'{kind}: ')


def test_base_model_without_prefix(root):
  """A base model's keys (no ``transformer.`` prefix, no lm_head) import the same."""
  _, model, arch, config, variables = _saved('gpt', root)
  base = {k[len('transformer.'):]: v.numpy() for k, v in model.state_dict().items()
          if k.startswith('transformer.')}
  chex.assert_trees_all_equal(from_state_dict(arch, base, config), variables)


def test_sharded_checkpoint(root, tmp_path):
  """A checkpoint split over several safetensors files (with an index) imports the same."""
  _, model, _, _, variables = _saved('gpt', root)
  model.save_pretrained(tmp_path, max_shard_size='20KB')
  assert (tmp_path / 'model.safetensors.index.json').is_file()
  chex.assert_trees_all_equal(load_hf(tmp_path, expect_arch='gpt')[2], variables)


def _one_line_error(fn, match):
  with pytest.raises(HFImportError, match=match) as info:
    fn()
  assert '\n' not in str(info.value)


def _folder(tmp_path, name, config_text, **files):
  folder = tmp_path / name
  folder.mkdir()
  (folder / 'config.json').write_text(config_text)
  for file, data in files.items():
    (folder / file.replace('_bin', '.bin')).write_bytes(data)
  return folder


def test_folder_errors(root, tmp_path):
  """Missing folder, no config.json, another model_type, a variant, a pickle only: one line each."""
  folder = _saved('gpt', root)[0]
  _one_line_error(lambda: load_hf(tmp_path / 'missing'), 'no Hugging Face checkpoint folder')
  _one_line_error(lambda: load_hf(tmp_path), 'has no config.json')
  bert = _folder(tmp_path, 'bert', '{"model_type": "bert"}')
  _one_line_error(lambda: load_hf_config(bert), "model_type 'bert' is not supported; supported:")
  odd = _folder(tmp_path, 'odd', '{"model_type": "gpt2", "scale_attn_by_inverse_layer_idx": true}')
  _one_line_error(lambda: load_hf_config(odd), 'scale_attn_by_inverse_layer_idx=true is not')
  pickled = _folder(tmp_path, 'pickled', open(f'{folder}/config.json').read(),
                    pytorch_model_bin=b'never unpickled')
  _one_line_error(lambda: load_hf(pickled), 'only pytorch_model.bin.*safe_serialization')


def test_fit_errors(root):
  """Another expected architecture or config, a shape mismatch, unknown and missing keys."""
  folder, model, arch, config, _ = _saved('gpt', root)
  wider = GPTConfig(vocab_size=256, max_len=32, num_layers=3, num_heads=2, d_model=64)
  _one_line_error(lambda: load_hf(folder, config=wider),
                  r'shape mismatch at h/block/attn/c_proj/bias .*\(3, 32\).*\(3, 64\)')
  _one_line_error(lambda: load_hf(folder, expect_arch='vit'), 'GPT-2 checkpoint, not the expected')
  _one_line_error(lambda: load_hf(folder, config=ViTConfig()), 'GPT-2 checkpoint, which does not')
  tensors = {k: v.numpy() for k, v in model.state_dict().items()}
  extra = {**tensors, 'transformer.extra.weight': np.zeros(1)}
  _one_line_error(lambda: from_state_dict(arch, extra, config), 'not use: transformer.extra.weight')
  del tensors['transformer.h.1.ln_2.bias']
  _one_line_error(lambda: from_state_dict(arch, tensors, config), 'lacks transformer.h.1.ln_2.bias')
