"""PyTorch baselines: each family gives the gradients of none; measured costs order as they must."""

import pytest

torch = pytest.importorskip('torch')
pytest.importorskip('transformers')

from baselines.torch_measure import measure_torch  # noqa: E402
from baselines.torch_models import (blocks, build_model, gpt2_config, make_batch,  # noqa: E402
                                    resnet_config, vit_config)
from baselines.torch_policies import (FAMILIES, apply_policy, sqrt_segments,  # noqa: E402
                                      supported_families)
from numerics import assert_trees_close  # noqa: E402

# Tiny shapes; dropout on where the model has it, so the check covers the RNG replay of recompute.
GPT = {'vocab_size': 256, 'max_len': 64, 'num_layers': 4, 'num_heads': 2, 'd_model': 64,
       'dropout': 0.1}
VIT = {'image_size': 32, 'patch_size': 8, 'channels': 3, 'num_classes': 10, 'num_layers': 4,
       'num_heads': 2, 'd_model': 64, 'mlp_dim': 128, 'dropout': 0.1, 'attention_dropout': 0.1}
RESNET_BASIC = {'embedding_size': 16, 'hidden_sizes': [16, 32, 64], 'depths': [2, 2, 2],
                'layer_type': 'basic', 'num_classes': 10, 'channels': 3, 'image_size': 32,
                'bn_momentum': 0.9, 'bn_eps': 1e-5}
RESNET_BOTTLENECK = dict(RESNET_BASIC, hidden_sizes=[32, 64], depths=[2, 3],
                         layer_type='bottleneck')

# (model, fields, batch size, seq_len, image_size)
CASES = {
    'gpt2': ('gpt2', GPT, 4, 64, None),
    'vit': ('vit', VIT, 4, None, 32),
    'resnet-basic': ('resnet', RESNET_BASIC, 4, None, 32),
    'resnet-bottleneck': ('resnet', RESNET_BOTTLENECK, 2, None, 32),
}
MEASURED = ('gpt2', 'vit', 'resnet-basic')


@pytest.fixture(scope='module', autouse=True)
def one_thread():
  """Tiny ops on 2 shared cores run many times faster on one intra-op thread."""
  threads = torch.get_num_threads()
  torch.set_num_threads(1)
  yield
  torch.set_num_threads(threads)


def _loss_and_grads(case, family):
  model, fields, b, seq_len, image_size = CASES[case]
  net = apply_policy(model, build_model(model, fields, seed=0), family)
  batch = make_batch(model, fields, b, seq_len, image_size, seed=0)
  torch.manual_seed(1)
  loss = net(**batch).loss
  loss.backward()
  return loss.detach(), {n: p.grad for n, p in net.named_parameters()}


@pytest.fixture(scope='module')
def reference():
  return {case: _loss_and_grads(case, 'none') for case in CASES}


@pytest.mark.parametrize('case,family', [(c, f) for c in CASES
                                         for f in supported_families(CASES[c][0]) if f != 'none'])
def test_family_gives_the_loss_and_gradients_of_none(reference, case, family):
  loss, grads = _loss_and_grads(case, family)
  ref_loss, ref_grads = reference[case]
  assert_trees_close(loss.numpy(), ref_loss.numpy())
  assert grads.keys() == ref_grads.keys()
  assert all(g is not None for g in grads.values()), [n for n, g in grads.items() if g is None]
  assert_trees_close({n: g.numpy() for n, g in grads.items()},
                     {n: g.numpy() for n, g in ref_grads.items()})


@pytest.fixture(scope='module')
def measured():
  out = {}
  for case in MEASURED:
    model, fields, b, seq_len, image_size = CASES[case]
    out[case] = {f: measure_torch(model, fields, f, b, seq_len, image_size, steps=1)
                 for f in supported_families(model)}
  return out


@pytest.mark.parametrize('case', MEASURED)
def test_checkpointing_keeps_less_for_backward(measured, case):
  m = measured[case]
  none = m['none']
  for family, r in m.items():
    assert r.loss == none.loss and r.forward_flops == none.forward_flops, family
    if family != 'none':
      assert r.saved_activation_bytes < none.saved_activation_bytes, family
  # Per-block recompute keeps only block inputs: below the matmul outputs that selective keeps.
  assert m['block'].saved_activation_bytes < m['selective'].saved_activation_bytes
  assert m['block'].activation_bytes < none.activation_bytes
  assert m['block'].peak_bytes <= none.peak_bytes
  if case != 'resnet-basic':  # a tiny ResNet peaks in the optimizer step, where no activation lives
    assert m['block'].peak_bytes < none.peak_bytes
    assert m['sqrt'].activation_bytes < none.activation_bytes
  if 'hf' in m:
    assert m['hf'].activation_bytes < none.activation_bytes
    # HF checkpoints the same blocks the same way.
    assert m['hf'].saved_activation_bytes == m['block'].saved_activation_bytes
    assert m['hf'].step_flops == m['block'].step_flops


@pytest.mark.parametrize('case', MEASURED)
def test_memory_breakdown_adds_up(measured, case):
  for family, r in measured[case].items():
    cats = {k: v for k, v in r.breakdown.items() if k != 'Total'}
    assert sum(cats.values()) == r.peak_bytes, family
    assert r.activation_bytes == r.breakdown['Activation']
    assert r.breakdown['Parameter'] == 4 * r.num_params  # float32, tied weights once
    assert r.after_forward['Gradient'] == 0  # steady state: gradients freed by the last step
    assert r.after_forward['Optstate'] >= 2 * r.breakdown['Parameter']  # AdamW's two moments
    assert r.method == 'MemTracker' and r.device == 'cpu' and r.step_seconds > 0


@pytest.mark.parametrize('case', MEASURED)
def test_recompute_flops(measured, case):
  m = measured[case]
  none = m['none']
  assert none.recompute_ratio == 1.0 and none.none_step_flops == none.step_flops
  assert 2 * none.forward_flops < none.step_flops < 4 * none.forward_flops  # backward ~ 2 forwards
  block = m['block'].recompute_ratio
  assert m['block'].step_flops > none.step_flops
  assert 1.1 < block < 1.5  # about one more forward of the blocks: at most 4/3 of the step
  assert 1.0 < m['sqrt'].recompute_ratio < block  # the last segment is not recomputed
  # selective saves every op that FlopCounterMode counts, so it recomputes no counted FLOP.
  assert m['selective'].step_flops == none.step_flops
  for r in m.values():
    assert r.none_step_flops == none.step_flops


@pytest.mark.extended
def test_fresh_process_measures_the_same(measured, monkeypatch):
  monkeypatch.setenv('OMP_NUM_THREADS', '1')
  model, fields, b, seq_len, image_size = CASES['gpt2']
  r = measure_torch(model, fields, 'sqrt', b, seq_len, image_size, steps=1, fresh_process=True)
  same = measured['gpt2']['sqrt']
  assert r.to_dict() | {'step_seconds': 0} == same.to_dict() | {'step_seconds': 0}


def test_hf_config_mapping():
  g = gpt2_config(dict(GPT, layer_norm_eps=1e-6, unknown_field=1))
  assert (g.vocab_size, g.n_positions, g.n_layer, g.n_head, g.n_embd) == (256, 64, 4, 2, 64)
  assert g.embd_pdrop == g.attn_pdrop == g.resid_pdrop == 0.1
  assert g.layer_norm_epsilon == 1e-6 and g.activation_function == 'gelu_new'
  assert g.tie_word_embeddings and g.n_inner is None  # MLP 4 * d_model
  v = vit_config(VIT)
  assert (v.image_size, v.patch_size, v.num_channels, v.num_labels) == (32, 8, 3, 10)
  assert (v.num_hidden_layers, v.num_attention_heads, v.hidden_size, v.intermediate_size) == (
      4, 2, 64, 128)
  assert v.hidden_dropout_prob == v.attention_probs_dropout_prob == 0.1
  assert v.hidden_act == 'gelu' and v.qkv_bias
  assert vit_config(VIT, image_size=48).image_size == 48
  r = resnet_config(RESNET_BOTTLENECK)  # image_size, bn_momentum, bn_eps are not HF fields
  assert (r.embedding_size, list(r.hidden_sizes), list(r.depths), r.layer_type) == (
      16, [32, 64], [2, 3], 'bottleneck')
  assert r.num_labels == 10 and r.num_channels == 3
  assert not r.downsample_in_first_stage and not r.downsample_in_bottleneck


def test_models_have_the_config_shapes():
  gpt = build_model('gpt2', GPT)
  assert len(blocks('gpt2', gpt)) == 4 and gpt.lm_head.weight is gpt.transformer.wte.weight
  assert len(blocks('vit', build_model('vit', VIT))) == 4
  assert len(blocks('resnet', build_model('resnet', RESNET_BOTTLENECK))) == 5
  a, b = build_model('vit', VIT, seed=3), build_model('vit', VIT, seed=3)
  assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
  batch = make_batch('gpt2', GPT, 2, 16, seed=5)
  assert torch.equal(batch['input_ids'], make_batch('gpt2', GPT, 2, 16, seed=5)['input_ids'])
  assert make_batch('resnet', RESNET_BASIC, 2)['pixel_values'].shape == (2, 3, 32, 32)
  assert [sqrt_segments(n) for n in (1, 4, 12, 16, 48)] == [1, 2, 3, 4, 7]


def _one_line_error(fn, *args, match):
  with pytest.raises(ValueError, match=match) as e:
    fn(*args)
  assert '\n' not in str(e.value)


def test_bad_names_are_one_line_value_errors():
  assert list(FAMILIES) == ['none', 'hf', 'block', 'sqrt', 'selective']
  _one_line_error(measure_torch, 'gpt2', GPT, 'dots', 1, 8, None,
                  match=r"^unknown policy family 'dots'; valid families: none, hf, block, sqrt, "
                        r'selective$')
  _one_line_error(measure_torch, 'bert', GPT, 'none', 1, 8, None,
                  match=r"^unknown model 'bert'; valid models: gpt2, llama, vit, resnet$")
  _one_line_error(build_model, 'bert', GPT, match=r"^unknown model 'bert'")
  _one_line_error(measure_torch, 'resnet', RESNET_BASIC, 'hf', 1, None, 32,
                  match=r"'hf' .*ResNetForImageClassification.*; families for resnet: none, block, "
                        r'sqrt, selective$')
  _one_line_error(apply_policy, 'resnet', build_model('resnet', RESNET_BASIC), 'hf',
                  match='families for resnet')
  _one_line_error(apply_policy, 'gpt2', apply_policy('gpt2', build_model('gpt2', GPT), 'block'),
                  'sqrt', match='already applied')
  _one_line_error(measure_torch, 'gpt2', GPT, 'none', 1, 65, None,
                  match=r'seq_len 65 must be in 1\.\.64')
  _one_line_error(measure_torch, 'vit', VIT, 'none', 1, None, 36,
                  match='image_size 36 must be a multiple of patch_size 8')
