"""bfloat16 mixed precision (docs/precision.md): float32 master weights, bfloat16 activations.

Every family runs forward and backward in bfloat16; parameters, their gradients, BatchNorm's
running statistics and the optimizer state stay float32; what the backward pass keeps is
bfloat16; the variable tree does not depend on the dtype; every policy gives ``none``'s
gradients in bfloat16, bit for bit where remat recomputes the same operations; bad dtypes are
one-line errors.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import DEFAULT_EMITTERS, SMALL
from models.gpt import GPT, TAGS, GPTConfig
from models.resnet import ResNetConfig
from models.vit import ViTConfig
from numerics import assert_trees_close
from remat.policies import registered_specs
from remat.residuals import saved_residuals
from test_vision import RESNET, VIT, _batch, _loss_grads, _state, _stats
from training.step import train_step as st
from models.tasks import Task

BF16 = 'bfloat16'
DROPOUT = jax.random.PRNGKey(42)
GPT_BF16 = dataclasses.replace(SMALL, dtype=BF16)
# The same segmentings as test_gradients.py (5 layers: remainder segments), every rule and preset.
GPT_SPECS = registered_specs(model_tags=TAGS) + [
    'sqrt', 'seg:2', 'seg:3', 'full@sqrt', 'dots@seg:3', 'names:context,mlpwi@seg:2',
    'offload:out_proj@sqrt', 'stage', 'full@stage']


def _bf16(cfg):
  return dataclasses.replace(cfg, dtype=BF16)


def _dtypes(tree) -> set[str]:
  return {str(x.dtype) for x in jax.tree_util.tree_leaves(tree)}


def _gpt_value_and_grad(cfg, spec, params, windows):
  model = GPT(cfg, spec)
  return jax.jit(jax.value_and_grad(lambda p: st.lm_loss(model, p, windows, DROPOUT)))(params)


@pytest.fixture(scope='module')
def gpt_reference(small_params, windows):
  return _gpt_value_and_grad(GPT_BF16, 'none', small_params, windows)


@pytest.mark.parametrize('cls', [GPTConfig, ViTConfig, ResNetConfig])
@pytest.mark.parametrize('bad', ['bf16', 'float16', 'float64', None])
def test_bad_dtype_is_a_one_line_error(cls, bad):
  assert cls().dtype == 'float32'
  with pytest.raises(ValueError) as e:
    cls(dtype=bad)
  msg = str(e.value)
  assert msg == f"{cls.__name__}.dtype must be 'float32' or 'bfloat16', got {bad!r}"


@pytest.mark.parametrize('cfg', [SMALL, VIT, RESNET], ids=['gpt', 'vit', 'resnet'])
def test_variables_are_the_same_float32_tree_under_either_dtype(cfg):
  # A float32 checkpoint loads under bfloat16 and back: same tree, shapes, float32 leaves,
  # and the same initial values for a seed.
  task32, task16 = Task(cfg), Task(_bf16(cfg))
  size = task32.default_size if task32.is_vision else 16
  init = lambda task, spec: jax.jit(lambda: task.init_variables(task.model(spec), 0, size),
                                    compiler_options=DEFAULT_EMITTERS)()
  v32, v16 = init(task32, 'none'), init(task16, 'sqrt')
  assert _dtypes(v32) == _dtypes(v16) == {'float32'}
  assert jax.tree_util.tree_structure(v32) == jax.tree_util.tree_structure(v16)
  for a, b in zip(jax.tree_util.tree_leaves(v32), jax.tree_util.tree_leaves(v16)):
    np.testing.assert_array_equal(a, b)


def test_gpt_runs_in_bfloat16(small_params, windows, gpt_reference):
  loss, grads = gpt_reference
  assert loss.dtype == jnp.float32 and np.isfinite(float(loss))
  assert _dtypes(grads) == {'float32'}
  assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(small_params)
  hidden = GPT(GPT_BF16).apply({'params': small_params}, windows[:, :-1], return_hidden=True)
  logits = GPT(GPT_BF16).apply({'params': small_params}, windows[:, :-1])
  assert hidden.dtype == jnp.bfloat16 and logits.dtype == jnp.float32
  # bfloat16 computes the same function: the loss within a few bfloat16 roundings of float32's.
  loss32, grads32 = _gpt_value_and_grad(SMALL, 'none', small_params, windows)
  assert abs(float(loss) - float(loss32)) < 0.02 * float(loss32)
  cos = lambda a, b: float(jnp.vdot(a, b) / (jnp.linalg.norm(a) * jnp.linalg.norm(b)))
  flat = lambda g: jnp.concatenate([x.ravel() for x in jax.tree_util.tree_leaves(g)])
  assert cos(flat(grads), flat(grads32)) > 0.99


# One of each kind in the default suite (rule, preset, tags, segmentings with a remainder,
# stage); every spec with -m slow.
_GPT_DEFAULT = {'full', 'dots', 'minimal', 'sqrt', 'dots@seg:3', 'stage'}


@pytest.mark.parametrize('spec', [s if s in _GPT_DEFAULT else pytest.param(s, marks=pytest.mark.slow)
                                  for s in GPT_SPECS if s != 'none'])
def test_every_policy_gives_nones_gradients_bit_for_bit(spec, small_params, windows,
                                                        gpt_reference):
  # Remat recomputes the same bfloat16 operations in the same order, so, as in float32
  # (docs/testing.md), the loss and every gradient equal none's exactly.
  loss, grads = _gpt_value_and_grad(GPT_BF16, spec, small_params, windows)
  np.testing.assert_array_equal(loss, gpt_reference[0])
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads),
                          jax.tree_util.tree_leaves(gpt_reference[1])):
    np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


# XLA may compute a chain of bfloat16 operations in float32 inside one fusion and skip the
# roundings between them (xla_allow_excess_precision, on by default). A policy that saves a
# value in the middle of such a chain rounds it where `none` does not, so the results differ
# by bfloat16 roundings: measured on ResNet's `convs` and `save_conv_narrow`, whose saved conv
# outputs feed BatchNorm (docs/precision.md). Compiled to round where the program says, every
# policy recomputes exactly what none computes; that is checked bit for bit here.
STRICT = {'xla_allow_excess_precision': False}
VISION_SPECS = [('vit', s) for s in ('full', 'dots', 'minimal', 'sqrt', 'stage')] + [
    ('resnet', s) for s in ('full', 'convs', 'save_conv_narrow', 'sqrt', 'stage')]


def _vision_strict(name, spec):
  base = {'vit': VIT, 'resnet': RESNET}[name]
  params, model_state = _state(base)
  batch = _batch(base)
  task = Task(_bf16(base))
  model = task.model(spec)
  fn = lambda p: task.loss(model, p, model_state, batch, DROPOUT)
  step = jax.jit(jax.value_and_grad(fn, has_aux=True)).lower(params).compile(
      compiler_options=STRICT)
  (loss, (new_state, _)), grads = step(params)
  return loss, grads, new_state


@pytest.fixture(scope='module')
def vision_reference():
  cache = {}
  def get(name):
    if name not in cache:
      cache[name] = _vision_strict(name, 'none')
    return cache[name]
  return get


# ResNet's cases (its `none` reference alone compiles for ~15 s) with -m slow; ResNet in bfloat16
# stays in the default suite through test_resnet_runs_in_bfloat16.
_VISION_DEFAULT = {('vit', 'full')}


@pytest.mark.parametrize('name,spec', [c if c in _VISION_DEFAULT else
                                       pytest.param(*c, marks=pytest.mark.slow)
                                       for c in VISION_SPECS])
def test_vision_policies_give_nones_gradients_bit_for_bit(name, spec, vision_reference):
  got, want = _vision_strict(name, spec), vision_reference(name)
  assert _dtypes(got[1]) == {'float32'}
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got),
                          jax.tree_util.tree_leaves(want)):
    np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


def _activation_residuals(fn, params, *args):
  """Residuals of activation size (not per-row statistics, not the loss's [.., V] softmax).

  A reduction's output is a statistic (a norm's float32 sum per row, by design); the stack's
  lean `none` keeps them, so they are left out by what made them, not only by a keepdims axis.
  """
  return [r for r in saved_residuals(fn, params, *args)
          if r.dtype in ('float32', 'bfloat16') and r.shape[-1] != 1
          and not r.where.startswith('reduce_')
          and 'softmax_cross_entropy' not in r.where]


@pytest.mark.parametrize('spec', ['none', 'dots', 'sqrt', 'full'])
def test_gpt_residuals_are_bfloat16(spec, small_params, windows):
  loss = lambda cfg: lambda p, w: st.lm_loss(GPT(cfg, spec), p, w, DROPOUT)
  kept = _activation_residuals(loss(GPT_BF16), small_params, windows)
  assert kept and {r.dtype for r in kept} == {'bfloat16'}, [
      (r.shape, r.dtype, r.where) for r in kept if r.dtype != 'bfloat16']
  # Tagged activations (what names:/dots policies choose between) are half float32's bytes.
  tagged = lambda rs: sum(r.nbytes for r in rs if r.tag)
  kept32 = _activation_residuals(loss(SMALL), small_params, windows)
  assert 2 * tagged(kept) == tagged(kept32)


def test_vit_runs_in_bfloat16_and_keeps_bfloat16():
  cfg = _bf16(VIT)
  params, model_state = _state(VIT)
  batch = _batch(VIT)
  loss, grads, _ = _loss_grads(cfg, 'none', params, model_state, batch)
  assert loss.dtype == jnp.float32 and np.isfinite(float(loss)) and _dtypes(grads) == {'float32'}
  task = Task(cfg)
  fn = lambda p, b: task.loss(task.model('none'), p, {}, b, DROPOUT)[0]
  kept = _activation_residuals(fn, params, batch)
  assert kept and {r.dtype for r in kept} == {'bfloat16'}


def test_resnet_runs_in_bfloat16():
  # BatchNorm (Flax's, differentiated as written) keeps float32 [B, H, W, C] arrays in the
  # backward pass: its statistics are float32 by design. The convolution outputs are bfloat16.
  cfg = _bf16(RESNET)
  params, model_state = _state(RESNET)
  batch = _batch(RESNET)
  loss, grads, new_state = _loss_grads(cfg, 'none', params, model_state, batch)
  assert loss.dtype == jnp.float32 and np.isfinite(float(loss)) and _dtypes(grads) == {'float32'}
  assert _dtypes(new_state) == {'float32'}   # running statistics
  leaves = lambda s: jax.tree_util.tree_leaves(_stats(s, 'mean'))
  assert any(not np.array_equal(a, b) for a, b in zip(leaves(new_state), leaves(model_state)))
  task = Task(cfg)
  # A policy that saves the tagged conv outputs (under none, BatchNorm's own arrays are kept).
  model = task.model('names:conv1,conv2,conv3,shortcut')
  fn = lambda p, b: task.loss(model, p, model_state, b, DROPOUT)[0]
  tagged = [r for r in saved_residuals(fn, params, batch) if r.tag]
  assert tagged and {r.dtype for r in tagged} == {'bfloat16'}


def test_optimizer_step_keeps_float32_state(small_params, windows):
  tx = st.make_optimizer(1e-3, 10, 2, 0.1, 1.0)
  state = st.TrainState(jnp.zeros((), jnp.int32), small_params, {}, tx.init(small_params))
  step = jax.jit(st.make_train_step(GPT(GPT_BF16, 'sqrt'), tx, seed=3))
  new, loss = step(state, windows)
  new, loss = step(new, windows)   # step 0 has learning rate 0 (warmup): take a second one
  assert np.isfinite(float(loss))
  assert _dtypes(new.params) == {'float32'}
  for moment in ('mu', 'nu'):
    assert _dtypes(optax.tree_utils.tree_get(new.opt_state, moment)) == {'float32'}
  # Some weights moved by less than half a bfloat16 ulp of themselves (LayerNorm scales of 1.0
  # by ~lr): steps that a bfloat16 master copy would have rounded away.
  old = np.concatenate([np.asarray(x).ravel() for x in jax.tree_util.tree_leaves(small_params)])
  now = np.concatenate([np.asarray(x).ravel() for x in jax.tree_util.tree_leaves(new.params)])
  half_ulp = np.abs(old) * 2.0 ** -9
  assert np.any((now != old) & (np.abs(now - old) < half_ulp))


def test_chunked_loss_in_bfloat16_equals_plain(small_params, windows):
  # The chunked output layer and the plain one both form float32 logits from bfloat16 operands.
  chunked = dataclasses.replace(GPT_BF16, loss_chunk=8)
  plain = _gpt_value_and_grad(GPT_BF16, 'none', small_params, windows)
  got = _gpt_value_and_grad(chunked, 'none', small_params, windows)
  # The chunked loss accumulates in another order in float32, then its dL/dh is rounded to
  # bfloat16 where the plain path's is: a bfloat16 ulp (2^-8 of the value) on some elements.
  assert_trees_close(got[0], plain[0])
  assert_trees_close(got[1], plain[1], rtol=2 ** -7)


@pytest.mark.extended
def test_train_py_dtype_flag_and_resume_check(text_file, tmp_path, capsys):
  from training import cli
  out = tmp_path / 'run'
  common = ['--steps=2', '--batch-size=2', '--seq-len=16', '--eval-every=2', '--eval-batches=1',
            '--save-every=2', '--no-memory-report', f'--data={text_file}', f'--out={out}']
  assert cli.main(['--dtype=bfloat16'] + common) == 0
  assert '| dtype: bfloat16 |' in capsys.readouterr().out
  rows = [json.loads(l) for l in (out / 'metrics.jsonl').read_text().splitlines()]
  assert np.isfinite(rows[-1]['val_loss'])
  assert cli.main(['--resume', '--dtype=float32', '--steps=3'] + common[1:]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and 'was trained with --dtype bfloat16, not float32' in err[0]


def test_bench_report_header_and_json(tmp_path, capsys):
  from bench import report
  out = tmp_path / 'r.json'
  assert report.main(['--config', 'tiny', '--batch-size', '2', '--seq-len', '16', '--dtype', BF16,
                      '--policies', 'full', '--json', str(out)]) == 0
  header = capsys.readouterr().out.splitlines()[0]
  assert 'bfloat16, target cpu' in header
  assert json.loads(out.read_text())['environment']['dtype'] == BF16
