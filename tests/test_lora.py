"""LoRA adapters (models/lora): the adapted matmul, the frozen base, tags and policies, quantization.

The adapted projection ``[x, xd A] [W; s B]`` must equal ``x W + s (xd A) B``
with its written-out derivative; an untrained adapter (``B = 0``) must leave
the model as it was; every remat policy must give the same adapter gradients;
the base must get no gradient and be stored in the compute dtype or quantized.
"""

import dataclasses

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.chunked_loss import chunked_cross_entropy
from models.gpt import GPT, GPTConfig
from models.llama import Llama, LlamaConfig
from models.lora import params as lora_params
from models.lora import quantize as q
from models.lora.dense import lora_matmul
from models.lora.spec import PROJECTIONS, LoraSpec, resolve_targets
from models.tasks import Task
from models.vit import ViT, ViTConfig
from numerics import assert_trees_close
from remat.layout import CHEAP_PRIMITIVES
from training.step import train_step as st

LLAMA = LlamaConfig(vocab_size=64, d_model=32, num_layers=4, num_heads=4, num_kv_heads=2,
                    mlp_dim=64, max_len=32)
GPT2 = GPTConfig(vocab_size=64, max_len=32, num_layers=4, num_heads=2, d_model=32, dropout=0.0)
VIT = ViTConfig(image_size=8, patch_size=4, num_classes=5, num_layers=4, num_heads=2, d_model=32,
                mlp_dim=64)
CONFIGS = {'llama': LLAMA, 'gpt': GPT2, 'vit': VIT}


def _inputs(arch, batch=2, size=16):
  if arch == 'vit':
    return jax.random.uniform(jax.random.PRNGKey(1), (batch, 8, 8, 3))
  return jax.random.randint(jax.random.PRNGKey(1), (batch, size), 0, 64)


def _with_lora(cfg, **kw):
  return dataclasses.replace(cfg, lora=LoraSpec(rank=kw.pop('rank', 4), **kw))


def _trained_adapters(params, arch, seed=3):
  """The model's adapters set to random values (B = 0 would hide every bug in B's path)."""
  frozen, trained = lora_params.split(params, arch)
  leaves, tree = jax.tree_util.tree_flatten(trained)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  trained = tree.unflatten([jax.random.normal(k, l.shape, l.dtype) * 0.05
                            for k, l in zip(keys, leaves)])
  return frozen, trained


def test_lora_matmul_is_the_sum_of_its_products_with_their_gradients():
  k = jax.random.split(jax.random.PRNGKey(0), 5)
  x, xd = jax.random.normal(k[0], (2, 3, 8)), jax.random.normal(k[1], (2, 3, 8))
  w, a, b = (jax.random.normal(k[2], (8, 6)), jax.random.normal(k[3], (8, 2)),
             jax.random.normal(k[4], (2, 6)))
  plain = lambda x, xd, a, b: jnp.sum(jnp.sin(x @ w + 1.5 * (xd @ a) @ b))
  ours = lambda x, xd, a, b: jnp.sum(jnp.sin(lora_matmul(x, xd, w, a, b, 1.5, 'query_proj')))
  assert_trees_close(ours(x, xd, a, b), plain(x, xd, a, b))
  assert_trees_close(jax.grad(ours, argnums=(0, 1, 2, 3))(x, xd, a, b),
                     jax.grad(plain, argnums=(0, 1, 2, 3))(x, xd, a, b))


def test_lora_matmul_never_forms_the_frozen_weight_gradient():
  """The backward pass has dx, dA and dB, no [in, out] product (what differentiating the
  concatenated matmul would add: as many FLOPs as the full fine-tune's weight gradient)."""
  x, w = jnp.ones((64, 32)), jnp.ones((32, 48))
  a, b = jnp.ones((32, 4)), jnp.ones((4, 48))
  jaxpr = jax.make_jaxpr(jax.grad(lambda a, b: jnp.sum(lora_matmul(x, x, w, a, b, 2.0, None)),
                                  argnums=(0, 1)))(a, b)
  shapes = [tuple(e.outvars[0].aval.shape) for e in jaxpr.jaxpr.eqns
            if e.primitive.name == 'dot_general']
  assert (32, 48) not in shapes and (36, 48) not in shapes, shapes


@pytest.mark.parametrize('arch', ['llama', 'gpt', 'vit'])
def test_an_untrained_adapter_leaves_the_model_as_it_was(arch):
  """lora_b starts at zero (as peft's): the adapted model is the base model, value for value."""
  cfg = CONFIGS[arch]
  task, ltask = Task(cfg), Task(_with_lora(cfg))
  x = _inputs(arch)
  params = ltask.model('none').init(jax.random.PRNGKey(0), x)['params']
  base = {k: v for k, v in lora_params.merged(params, ltask.config.lora, arch).items()}
  want = task.model('none').apply({'params': base}, x)
  got = ltask.model('none').apply({'params': params}, x)
  assert_trees_close(got, want)


@pytest.mark.parametrize('arch', ['llama', 'gpt', 'vit'])
def test_merged_adapters_are_the_adapted_model(arch):
  """W + s A B (what a merged export writes) computes what the adapted model computes."""
  cfg = CONFIGS[arch]
  ltask = Task(_with_lora(cfg, alpha=6.0))
  x = _inputs(arch)
  frozen, trained = _trained_adapters(
      ltask.model('none').init(jax.random.PRNGKey(0), x)['params'], arch)
  params = lora_params.merge(frozen, trained)
  want = ltask.model('none').apply({'params': params}, x)
  merged = lora_params.merged(params, ltask.config.lora, arch)
  assert_trees_close(Task(cfg).model('none').apply({'params': merged}, x), want)


def _adapter_grads(cfg, arch, spec, x):
  task = Task(cfg)
  frozen, trained = _trained_adapters(task.model('none').init(jax.random.PRNGKey(0), x)['params'],
                                      arch)
  model = task.model(spec)
  batch = x if arch != 'vit' else {'images': x, 'labels': jnp.arange(x.shape[0]) % 5}
  if arch != 'vit':
    batch = jnp.concatenate([x, x[:, :1]], axis=1)
  loss = lambda p: task.loss(model, lora_params.merge(frozen, p), {}, batch)[0]
  return jax.jit(jax.grad(loss))(trained)


def test_adapter_gradients_are_the_same_under_none_full_sqrt_dots_and_a_preset():
  """The issue's five policies on Llama, float32: recomputing changes no adapter gradient
  beyond float32 rounding (tests/numerics.py's tolerance)."""
  cfg = _with_lora(LLAMA, targets=None)
  x = _inputs('llama')
  want = _adapter_grads(cfg, 'llama', 'none', x)
  for spec in ('full', 'sqrt', 'dots', 'save_qkv_proj'):
    assert_trees_close(_adapter_grads(cfg, 'llama', spec, x), want, err_msg=f'llama {spec}: ')


@pytest.mark.slow
@pytest.mark.parametrize('arch', ['llama', 'gpt', 'vit'])
def test_adapter_gradients_are_the_same_under_every_policy(arch):
  cfg = _with_lora(CONFIGS[arch], targets=None)
  x = _inputs(arch)
  want = _adapter_grads(cfg, arch, 'none', x)
  for spec in ('full', 'sqrt', 'dots', 'save_qkv_proj', 'minimal', 'names:query_proj,mlpwo',
               'full@sqrt', '2xfull+none'):
    assert_trees_close(_adapter_grads(cfg, arch, spec, x), want, err_msg=f'{arch} {spec}: ')


@pytest.mark.slow
def test_adapter_gradients_agree_in_bfloat16_and_under_quantization():
  """bfloat16 and a QLoRA base: the policies still agree (within bf16 rounding of a recompute)."""
  x = _inputs('llama')
  for quant in (None, 'int8', 'nf4'):
    cfg = dataclasses.replace(_with_lora(LLAMA, quantize=quant), dtype='bfloat16')
    want = _adapter_grads(cfg, 'llama', 'none', x)
    for spec in ('full', 'dots', 'sqrt'):
      # bfloat16 keeps 8 significant bits (eps 3.9e-3); a recomputed layer may fuse and round
      # its products differently, and four layers' backward passes compound that: 2e-2 is
      # about five bf16 roundings of the gradients' scale, far below an adapter left out (1).
      assert_trees_close(_adapter_grads(cfg, 'llama', spec, x), want, rtol=2e-2,
                         err_msg=f'{quant} {spec}: ')


@pytest.mark.parametrize('arch', ['llama', 'gpt', 'vit'])
def test_the_adapted_model_emits_the_base_tags(arch):
  assert Task(_with_lora(CONFIGS[arch])).emitted_tags(16 if arch != 'vit' else 8) == \
      Task(CONFIGS[arch]).emitted_tags(16 if arch != 'vit' else 8)


def test_a_named_policy_keeps_the_adapter_with_its_projection():
  """names:query_proj keeps q and the query adapter's rank-r product, nothing of the others."""
  from remat.measuring import step_residuals
  cfg = _with_lora(LLAMA, rank=3)
  task = Task(cfg)
  x = _inputs('llama')
  frozen, trained = _trained_adapters(task.model('none').init(jax.random.PRNGKey(0), x)['params'],
                                      'llama')
  batch = jnp.concatenate([x, x[:, :1]], axis=1)

  def build(spec):
    model = task.model(spec)
    return lambda p, frozen: task.loss(model, lora_params.merge(frozen, p), {}, batch)[0]
  tagged = [r for r in step_residuals(build('names:query_proj'), trained, frozen)
            if r.tag == 'query_proj']
  shapes = sorted(tuple(r.shape) for r in tagged)
  # [N, B, T, H, Dh] (the projection) and [N, B, T, r] (its adapter's product)
  assert shapes == sorted([(4, 2, 16, 4, 8), (4, 2, 16, 3)]), shapes


def test_targets_pick_projections_and_name_the_ones_that_exist():
  assert resolve_targets('llama', 'q_proj,v_proj') == ('self_attn/q_proj', 'self_attn/v_proj')
  assert resolve_targets('gpt', 'c_proj') == ('attn/c_proj', 'mlp/c_proj')
  assert resolve_targets('gpt', 'c_attn') == ('attn/query', 'attn/key', 'attn/value')
  assert resolve_targets('vit', 'all') is None
  with pytest.raises(ValueError, match=r"'qproj' matches no projection of a llama model; its "
                                       r'projections: self_attn/q_proj, self_attn/k_proj'):
    resolve_targets('llama', 'q_proj,qproj')
  with pytest.raises(ValueError, match='--lora applies to gpt, llama, vit models, not resnet'):
    resolve_targets('resnet', None)
  with pytest.raises(ValueError, match='the rank must be an integer >= 1, got 0'):
    LoraSpec(rank=0)


def test_only_the_named_projections_get_adapters():
  cfg = _with_lora(LLAMA, targets=resolve_targets('llama', 'q_proj,down_proj'))
  params = Task(cfg).model('none').init(jax.random.PRNGKey(0), _inputs('llama'))['params']
  trained = flax.traverse_util.flatten_dict(lora_params.split(params, 'llama')[1], sep='/')
  assert sorted(trained) == ['layers/block/mlp/down_proj/lora_a', 'layers/block/mlp/down_proj/lora_b',
                             'layers/block/self_attn/q_proj/lora_a',
                             'layers/block/self_attn/q_proj/lora_b']
  assert trained['layers/block/self_attn/q_proj/lora_a'].shape == (4, 32, 4)


@pytest.mark.parametrize('quant', [None, 'int8', 'nf4'])
def test_the_train_step_trains_the_adapters_alone_on_a_frozen_base(quant):
  """The state's params are the adapters (float32) and the optimizer's state is theirs alone; the
  base (bfloat16, or quantized) comes out of every step bit for bit as it went in."""
  cfg = dataclasses.replace(_with_lora(LLAMA, quantize=quant), dtype='bfloat16')
  model = Task(cfg).model('full')
  tx = st.make_optimizer(1e-2, 10, 0, 0.0, 1.0)
  state = st.init_state(model, tx, 0, 16)
  trained = flax.traverse_util.flatten_dict(state.params, sep='/')
  assert all(k.endswith(('lora_a', 'lora_b')) for k in trained)
  assert all(v.dtype == jnp.float32 for v in trained.values())
  opt_leaves = [l for l in jax.tree_util.tree_leaves(state.opt_state) if l.ndim]
  assert sum(l.size for l in opt_leaves) == 2 * sum(v.size for v in trained.values())
  frozen = lora_params._flat(state.frozen)
  for path, leaf in frozen.items():
    if lora_params.is_quantized(leaf):
      assert quant and leaf['codes'].dtype == (jnp.int8 if quant == 'int8' else jnp.uint8)
    else:
      assert leaf.dtype == jnp.bfloat16, path
  assert any(lora_params.is_quantized(l) for l in frozen.values()) == bool(quant)
  before = jax.device_get(state.frozen)
  step = jax.jit(st.make_train_step(model, tx, 0))
  batch = jax.random.randint(jax.random.PRNGKey(2), (2, 17), 0, 64)
  losses = []
  for _ in range(3):
    state, loss = step(state, batch)
    losses.append(float(loss))
  jax.tree_util.tree_map(np.testing.assert_array_equal, jax.device_get(state.frozen), before)
  assert losses[-1] < losses[0]


def test_quantized_codes_and_their_error():
  w = jax.random.normal(jax.random.PRNGKey(0), (2, 128, 24)) * 0.02
  from qwix._src.core import numerics as qwix_numerics   # the same NF4 table as qwix's
  np.testing.assert_allclose(np.asarray(qwix_numerics.get_nf4_buckets()), q.NF4)
  for kind, bound, per_weight in (('int8', 0.01, 1.0), ('nf4', 0.12, 0.5)):
    stored = q.quantize(w, kind)
    back = q.dequantize(stored, kind, jnp.float32)
    assert float(jnp.linalg.norm(back - w) / jnp.linalg.norm(w)) < bound
    assert stored['scale'].shape == (2, 2, 24) and stored['scale'].dtype == jnp.bfloat16
    assert stored['codes'].size * stored['codes'].dtype.itemsize == w.size * per_weight
    # Every block's largest weight is a code's extreme, so its value comes back up to bf16 scale.
    blocks = np.abs(np.asarray(w)).reshape(2, 2, 64, 24).max(2)
    np.testing.assert_allclose(np.abs(np.asarray(back)).reshape(2, 2, 64, 24).max(2), blocks,
                               rtol=1e-2)


@pytest.mark.parametrize('kind', ['int8', 'nf4'])
def test_dequantizing_is_elementwise_so_no_policy_keeps_the_weights(kind):
  """Only primitives the lean rule rebuilds (remat.layout.CHEAP_PRIMITIVES): a gather would be
  kept by `none`, the dequantized base for every layer at once."""
  stored = q.quantize(jnp.ones((64, 8)), kind)
  jaxpr = jax.make_jaxpr(lambda s: q.dequantize(s, kind, jnp.bfloat16))(stored)
  assert {e.primitive.name for e in jaxpr.jaxpr.eqns} <= CHEAP_PRIMITIVES


def test_a_quantized_base_keeps_no_weights_for_the_backward_pass():
  """Under `none` the residuals of a QLoRA model are those of the LoRA model: activations alone."""
  from remat.measuring import step_residuals
  x = _inputs('llama')
  batch = jnp.concatenate([x, x[:, :1]], axis=1)
  sizes = {}
  for quant in (None, 'nf4'):
    cfg = _with_lora(LLAMA, quantize=quant)
    task = Task(cfg)
    frozen, trained = _trained_adapters(
        task.model('none').init(jax.random.PRNGKey(0), x)['params'], 'llama')
    model = task.model('none')
    loss = lambda p, f: task.loss(model, lora_params.merge(f, p), {}, batch)[0]
    sizes[quant] = sorted(tuple(r.shape) for r in step_residuals(loss, trained, frozen))
  assert sizes['nf4'] == sizes[None]
  # No stacked [N, in, out] weight of the four layers (a dequantized kernel kept for backward).
  assert not any(s in ((4, 32, 32), (4, 32, 16), (4, 32, 64), (4, 64, 32)) for s in sizes['nf4'])


def test_a_frozen_output_layer_gets_no_gradient_and_the_same_loss():
  k = jax.random.split(jax.random.PRNGKey(0), 2)
  h, emb = jax.random.normal(k[0], (40, 16)), jax.random.normal(k[1], (64, 16))
  labels = jnp.arange(40) % 64
  f = lambda h, e, g: chunked_cross_entropy(h, e, labels, 8, None, g)
  want_loss, (want_dh, _) = jax.value_and_grad(lambda h, e: f(h, e, True), argnums=(0, 1))(h, emb)
  got_loss, (got_dh, got_de) = jax.value_and_grad(lambda h, e: f(h, e, False),
                                                  argnums=(0, 1))(h, emb)
  assert_trees_close((got_loss, got_dh), (want_loss, want_dh))
  assert not np.any(np.asarray(got_de))


def test_checkpoints_hold_the_adapters_not_the_base(tmp_path):
  from training.run import checkpoints as ckpt
  cfg = _with_lora(LLAMA)
  model = Task(cfg).model('none')
  tx = st.make_optimizer(1e-2, 10, 0, 0.0, 1.0)
  state = st.init_state(model, tx, 0, 16)
  mngr = ckpt.manager(tmp_path, 1, writer=True)
  ckpt.save(mngr, state, {'config': 'x'}, force=True)
  ckpt.close(mngr)
  shape = jax.eval_shape(lambda: st.init_state(model, tx, 0, 16))
  got, meta = ckpt.restore(tmp_path, shape, warn=pytest.fail)
  assert got.frozen is None
  jax.tree_util.tree_map(np.testing.assert_array_equal, got.params, state.params)
  saved = sum(f.stat().st_size for f in (tmp_path / 'checkpoints').rglob('*') if f.is_file())
  assert saved < lora_params.nbytes(state.frozen), saved
  assert meta['digest'] == ckpt.digest(state.replace(frozen=None))


def test_projection_tables_cover_every_family():
  for arch, cfg in CONFIGS.items():
    params = Task(_with_lora(cfg)).model('none').init(jax.random.PRNGKey(0),
                                                      _inputs(arch))['params']
    trained = lora_params.split(params, arch)[1]
    assert len(jax.tree_util.tree_leaves(trained)) == 2 * len(PROJECTIONS[arch]) + (
        2 if arch == 'vit' else 0)   # ViT's head trains whole
