"""ViT and ResNet under every policy: equal loss, gradients and BatchNorm statistics; one tree."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util

from configs import config_names, load_config
from models.resnet import TAGS as RESNET_TAGS
from models.resnet import ResNet, ResNetConfig
from models.tasks import Task
from models.vit import TAGS as VIT_TAGS
from models.vit import ViT, ViTConfig
from numerics import assert_trees_close
from remat.memory import compiled_memory
from remat.tags import emitted_tags
from training.step import train_step as st

# 5 layers: sqrt -> segments of 2 plus a remainder of 1. Dropout on.
VIT = ViTConfig(image_size=16, patch_size=4, num_classes=5, num_layers=5, num_heads=2, d_model=32,
                mlp_dim=64, dropout=0.1, attention_dropout=0.1)
# Bottleneck stages of 1, 2 and 4 blocks: a stage with no identical blocks, one whose stack
# has a single block, and one of 3 (sqrt -> 2 + 1).
RESNET = ResNetConfig(embedding_size=8, hidden_sizes=(16, 32, 64), depths=(1, 2, 4),
                      layer_type='bottleneck', num_classes=5, image_size=32)
BASIC = ResNetConfig(embedding_size=8, hidden_sizes=(8, 16), depths=(2, 3), layer_type='basic',
                     num_classes=5, image_size=32)
# GPT's tests run every preset through the same Transformer block code and layer stack; ViT
# takes the rules and a sample of tag policies and segmentings.
VIT_SPECS = ['full', 'everything', 'dots', 'dots_no_batch', 'minimal', 'save_qkv_proj',
             'names:context,mlpwi', 'offload:query_proj', 'sqrt', 'seg:2', 'stage', 'full@stage',
             'minimal@seg:3']
RESNET_SPECS = ['full', 'dots', 'dots_no_batch', 'convs', 'save_conv_narrow',
                'names:shortcut,conv3', 'offload:conv1', 'sqrt', 'seg:2', 'stage', 'full@stage',
                'convs@sqrt', 'save_conv_narrow@stage']
BASIC_SPECS = ['full', 'save_conv_narrow', 'stage']
def _stats(model_state, kind):
  """BatchNorm's running 'mean' or 'var' leaves, flattened by path."""
  flat = traverse_util.flatten_dict(model_state)
  return {k: v for k, v in flat.items() if k[-1] == kind}


CASES = ([('vit', s) for s in VIT_SPECS] + [('resnet', s) for s in RESNET_SPECS]
         + [('basic', s) for s in BASIC_SPECS])
# The default suite takes one of each kind (rule, tags, segmenting, stage, a mix) per model;
# the rest run with -m slow.
DEFAULT_CASES = {('vit', 'full'), ('vit', 'dots'), ('vit', 'names:context,mlpwi'), ('vit', 'sqrt'),
                 ('vit', 'full@stage'), ('resnet', 'full'), ('resnet', 'convs'),
                 ('resnet', 'stage'), ('resnet', 'convs@sqrt'), ('basic', 'stage')}


def _batch(cfg, batch_size=4, size=None):
  size = size or cfg.image_size
  rng = np.random.default_rng(0)
  return {'images': jnp.asarray(rng.normal(size=(batch_size, size, size, 3)), jnp.float32),
          'labels': jnp.asarray(np.arange(batch_size) % cfg.num_classes, jnp.int32)}


def _state(cfg, size=None):
  task = Task(cfg)
  return task.init_variables(task.model('none'), 0, size or cfg.image_size)


def _loss_grads(cfg, spec, params, model_state, batch):
  task = Task(cfg)
  model = task.model(spec)
  fn = lambda p: task.loss(model, p, model_state, batch, jax.random.PRNGKey(42))
  (loss, (new_state, _)), grads = jax.jit(jax.value_and_grad(fn, has_aux=True))(params)
  return loss, grads, new_state


CONFIGS = {'vit': VIT, 'resnet': RESNET, 'basic': BASIC}


@pytest.fixture(scope='module')
def cases():
  """Per model: config, variables, batch and the reference (loss, grads, new state) of none."""
  out = {}
  def get(name):
    if name not in out:
      cfg = CONFIGS[name]
      params, model_state = _state(cfg)
      batch = _batch(cfg)
      out[name] = (cfg, params, model_state, batch,
                   _loss_grads(cfg, 'none', params, model_state, batch))
    return out[name]
  return get


@pytest.fixture(params=list(CONFIGS))
def case(request, cases):
  return cases(request.param)


@pytest.mark.parametrize('name,spec', [c if c in DEFAULT_CASES else
                                       pytest.param(*c, marks=pytest.mark.slow) for c in CASES])
def test_loss_gradients_and_batch_stats_match_none(cases, name, spec):
  cfg, params, model_state, batch, (ref_loss, ref_grads, ref_state) = cases(name)
  loss, grads, new_state = _loss_grads(cfg, spec, params, model_state, batch)
  assert_trees_close(loss, ref_loss)
  assert_trees_close(grads, ref_grads)
  for kind in ('mean', 'var'):   # BatchNorm's running means and variances, each on its own scale
    assert_trees_close(*(_stats(s, kind) for s in (new_state, ref_state)), err_msg=f'{kind}: ')


def test_training_mode_is_really_on(case):
  cfg, params, model_state, batch, (ref_loss, _, ref_state) = case
  task = Task(cfg)
  eval_loss, (same_state, _) = task.loss(task.model('none'), params, model_state, batch)
  assert abs(float(eval_loss) - float(ref_loss)) > 1e-4  # dropout / batch statistics differ
  if model_state:  # BatchNorm running averages moved in training, not in evaluation
    chex.assert_trees_all_equal(same_state, model_state)
    moved = jax.tree_util.tree_map(lambda a, b: float(jnp.abs(a - b).max()), ref_state, model_state)
    assert max(jax.tree_util.tree_leaves(moved)) > 1e-3


# `dots` builds the tree as `full` does (a per-layer rule), so it runs with -m slow.
@pytest.mark.parametrize('spec', ['full', 'sqrt', 'stage', pytest.param('dots', marks=pytest.mark.slow)])
def test_variable_tree_identical_across_policies(case, spec):
  cfg, params, model_state, _, _ = case
  got_params, got_state = Task(cfg).init_variables(Task(cfg).model(spec), 0, cfg.image_size)
  chex.assert_trees_all_equal(got_params, params)  # same structure, shapes and weights
  chex.assert_trees_all_equal(got_state, model_state)


def test_stacked_layout():
  params, stats = _state(RESNET)
  assert params['stages_2_layers']['block']['layer_1']['convolution']['kernel'].shape == (3, 3, 3, 16, 16)
  assert params['stages_2_first']['block']['shortcut']['convolution']['kernel'].shape == (1, 1, 1, 32, 64)
  assert 'stages_0_layers' not in params  # a one-block stage has only its first block
  assert stats['batch_stats']['stages_1_layers']['block']['layer_2']['normalization']['mean'].shape == (1, 32)
  vit, _ = _state(VIT)
  assert vit['encoder']['block']['attention']['query']['kernel'].shape == (5, 32, 32)


@pytest.mark.parametrize('cfg,tags', [(VIT, VIT_TAGS), (RESNET, RESNET_TAGS)], ids=['vit', 'resnet'])
def test_models_emit_documented_tags(cfg, tags):
  params, model_state = _state(cfg)
  model = Task(cfg).model('none')
  got = emitted_tags(lambda v, x: model.apply(v, x), {'params': params, **model_state},
                     _batch(cfg)['images'])
  assert got == set(tags)
  basic = Task(BASIC).model('none')
  p2, s2 = _state(BASIC)
  assert emitted_tags(lambda v, x: basic.apply(v, x), {'params': p2, **s2},
                      _batch(BASIC)['images']) == {'conv1', 'conv2', 'shortcut'}  # no conv3


def test_every_vision_config_loads_with_hf_parameter_counts():
  counts = {}
  for name in config_names():
    named = load_config(name)
    if named.arch not in ('vit', 'resnet'):
      continue
    task = Task(named.model)
    params, _ = jax.eval_shape(lambda t=task: t.init_variables(t.model('none'), 0, 64 if t.arch == 'resnet' else t.config.image_size))
    counts[name] = sum(int(np.prod(p.shape)) for p in jax.tree_util.tree_leaves(params))
  # Hugging Face's parameter counts of the same shapes (ResNetForImageClassification and
  # ViTForImageClassification with 1000 labels).
  assert counts['resnet-18'] == 11_689_512
  assert counts['resnet-50'] == 25_557_032
  assert counts['resnet-152'] == 60_192_808
  assert counts['vit-b16-224'] == 86_567_656
  assert counts['vit-l16-224'] == 304_326_632
  assert counts['vit-b16-384'] - counts['vit-b16-224'] == (577 - 197) * 768  # more positions
  assert {'vit-tiny', 'resnet-tiny', 'vit-b16-1024', 'resnet-101'} <= set(counts)


def _temp(cfg, spec, batch_size, size, target='cpu'):
  from bench.zoo import step_memory
  from remat.targets import get_target
  return step_memory(cfg, spec, batch_size, size, get_target(target)).temp


# Stages wide against the stem, and two identical blocks per stage (a loop of >= 2 iterations).
WIDE = ResNetConfig(embedding_size=4, hidden_sizes=(64, 128), depths=(3, 3),
                    layer_type='bottleneck', num_classes=5, image_size=32)


@pytest.mark.slow
def test_resnet_memory_ordering_on_cpu():
  t = {s: _temp(WIDE, s, 4, 128) for s in ('none', 'convs', 'save_conv_narrow', 'full')}
  assert t['full'] < t['save_conv_narrow'] < t['convs'] < t['none']


def test_stage_saves_in_the_jaxpr_and_on_cpu():
  from bench import zoo
  from remat.measuring import step_residuals

  def residual_bytes(spec):
    case = zoo.case(WIDE, 4, 64)
    return sum(r.nbytes for r in step_residuals(case.train_step(case.policy(spec)),
                                                *case.step_args()))

  assert residual_bytes('stage') < 0.5 * residual_bytes('none')
  cpu = {s: _temp(WIDE, s, 4, 64) for s in ('none', 'stage')}
  assert cpu['stage'] < 0.8 * cpu['none']


@pytest.mark.gpu_plan
def test_stage_saves_in_a_gpu_plan():
  t = {s: _temp(WIDE, s, 4, 64, 'h200') for s in ('none', 'stage')}
  assert t['stage'] < 0.8 * t['none']


@pytest.mark.slow
def test_one_iteration_loops_keep_their_remat_on_cpu():
  # Without CPU_COMPILER_OPTIONS, XLA inlines the one-iteration scans of 'stage' and the CPU
  # backend keeps the activations: the saving vanishes. With them it holds.
  from models.resnet import ResNet
  tx = st.make_optimizer(1e-3, 10, 2, 0.1, 1.0)
  temps = {}
  for spec in ('none', 'stage'):
    model = ResNet(WIDE, spec)
    state, batch = st.abstract_inputs(model, tx, 4, 64)
    for name, opts in (('plain', {}), ('ours', None)):
      temps[spec, name] = compiled_memory(st.compile_train_step(model, tx, 0, state, batch, opts)).temp
  assert temps['stage', 'plain'] >= 0.95 * temps['none', 'plain']
  assert temps['stage', 'ours'] < 0.8 * temps['none', 'ours']


def test_vit_memory_ordering_on_cpu():
  cfg = ViTConfig(image_size=64, patch_size=4, num_classes=5, num_layers=4, num_heads=4,
                  d_model=64, mlp_dim=128)
  t = {s: _temp(cfg, s, 4, 64) for s in ('none', 'minimal', 'full', 'dots', 'sqrt')}
  # Since the dense attention's backward pass runs over chunks of query rows, XLA CPU plans
  # `none` here below `minimal` (18.28 against 19.09 MB; before, 21.47 against 20.36 MB).
  assert t['full'] < t['minimal'] <= 1.06 * t['none']
  assert t['sqrt'] < t['none']
  # Since attention runs on grouped heads (models/attention.py), XLA CPU plans `dots` here
  # 0.9% above `none` (21.67 against 21.47 MB; both were lower before: 22.23 and 23.02 MB):
  # `dots` is no saving at this size, and at most that close to none.
  assert t['dots'] <= 1.02 * t['none']


@pytest.mark.slow   # ~20 s; batch statistics across policies stay in the gradient cases above
def test_one_optimizer_step_updates_batch_stats_equally():
  params, model_state = _state(RESNET)
  batch = _batch(RESNET)
  tx = st.make_optimizer(1e-3, 10, 2, 0.1, 1.0)
  init = st.TrainState(jnp.zeros((), jnp.int32), params, model_state, tx.init(params))
  out = {s: jax.jit(st.make_train_step(ResNet(RESNET, s), tx, 0))(init, batch)
         for s in ('none', 'stage')}
  (state, loss), (ref_state, ref_loss) = out['stage'], out['none']
  assert_trees_close(loss, ref_loss)
  assert_trees_close(state.params, ref_state.params)
  for kind in ('mean', 'var'):
    assert_trees_close(_stats(state.model_state, kind), _stats(ref_state.model_state, kind))
  for moment in ('mu', 'nu'):
    assert_trees_close(*(optax.tree_utils.tree_get(s.opt_state, moment) for s in (state, ref_state)))
  assert not np.allclose(out['none'][0].model_state['batch_stats']['stages_2_layers']['block']
                         ['layer_0']['normalization']['var'],
                         model_state['batch_stats']['stages_2_layers']['block']['layer_0']
                         ['normalization']['var'])


@pytest.mark.parametrize('shape', [(2, 9, 10, 3), (1, 32, 32, 4)])
def test_stem_max_pool_gradient_equals_jax(shape):
  import flax.linen as nn
  from models.resnet import max_pool_3x3_s2
  x = jax.nn.relu(jax.random.normal(jax.random.PRNGKey(0), shape))  # many tied zeros
  w = jax.random.normal(jax.random.PRNGKey(1), max_pool_3x3_s2(x).shape)
  ref = jax.grad(lambda x: (nn.max_pool(x, (3, 3), (2, 2), ((1, 1), (1, 1))) * w).sum())(x)
  got = jax.grad(lambda x: (max_pool_3x3_s2(x) * w).sum())(x)
  assert_trees_close(got, ref)  # overlapping windows add their gradients in another order


@pytest.mark.parametrize('make,needle', [
    (lambda: ViTConfig(image_size=30, patch_size=4), 'must be a multiple of patch_size'),
    (lambda: ResNetConfig(layer_type='dense'), "layer_type must be 'basic' or 'bottleneck'"),
    (lambda: ResNetConfig(depths=(2, 2)), 'must be non-empty and of equal length'),
    (lambda: ResNetConfig.from_depth(20), 'valid depths: 18, 34, 50, 101, 152'),
    (lambda: ViT(VIT).init(jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 3))),
     'do not fit this ViT; it takes [B, 16, 16, 3]'),
    (lambda: ResNet(RESNET).init(jax.random.PRNGKey(0), jnp.zeros((1, 16, 16, 3))),
     'with H, W >= 32'),
])
def test_config_and_input_errors_are_one_line(make, needle):
  with pytest.raises(ValueError) as e:
    make()
  assert needle in str(e.value) and '\n' not in str(e.value)
