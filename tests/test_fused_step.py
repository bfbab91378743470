"""training.step.fused_step: our GPT-2, Llama and ViT cut at their layer stack for remat.fused_update.

One fused step moves every parameter by the ordinary step's gradient (plain SGD,
so the move is the gradient itself: Adam's first step divides each gradient by
its own magnitude, which turns rounding in near-zero gradients into large
relative differences; tests/test_fused_update.py checks AdamW on a plain stack).
The cut needs no model-specific code.
"""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs import load_config
from models.tasks import Task
from training.step import fused_step as fs
from training.step import train_step as st

TX = optax.sgd(1.0)


def _case(name, **changes):
  cfg = load_config(name).model
  if hasattr(cfg, 'dropout'):
    changes.setdefault('dropout', 0.0)
  cfg = dataclasses.replace(cfg, **changes)
  task = Task(cfg)
  size = 16 if not task.is_vision else cfg.image_size
  shape = task.batch_shape(4, size)
  keys = iter(jax.random.split(jax.random.PRNGKey(3), 4))

  def draw(s):
    if s.dtype == jnp.int32:
      high = cfg.vocab_size if not task.is_vision else cfg.num_classes
      return jax.random.randint(next(keys), s.shape, 0, high)
    return jax.random.normal(next(keys), s.shape, s.dtype)
  return task, size, jax.tree_util.tree_map(draw, shape)


@pytest.mark.parametrize('name,spec', [('tiny', 'none'), ('tiny', 'full@sqrt'),
                                       ('llama-tiny', 'dots'), ('vit-tiny', 'full')])
def test_fused_step_equals_the_ordinary_step(name, spec):
  task, size, batch = _case(name)
  model = task.model(spec)
  state = st.init_state(model, TX, 0, size)
  path = fs.stack_path(model, state.params, batch)
  fused_state = fs.init_fused_state(model, TX, state.params, path)
  got, loss = jax.jit(fs.make_fused_train_step(model, TX, path))(fused_state, batch)
  # the ordinary step in eval mode: dropout 0, so train mode would compute the same
  want_loss, grads = jax.value_and_grad(lambda p: task.loss(model, p, {}, batch)[0])(state.params)
  moved = jax.tree_util.tree_map(jnp.subtract, state.params, got.params)
  # float32; the programs differ in summation order only. Per leaf, atol is 1e-4 of the leaf's
  # largest gradient, so a near-zero element is not compared against its own magnitude.
  np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
  for path_, m, g in zip(jax.tree_util.tree_leaves_with_path(moved), jax.tree_util.tree_leaves(moved),
                         jax.tree_util.tree_leaves(grads)):
    np.testing.assert_allclose(m, g, rtol=1e-3, atol=1e-4 * float(jnp.abs(g).max()) + 1e-9,
                               err_msg=jax.tree_util.keystr(path_[0]))
  assert int(got.step) == 1


def test_cut_finds_the_stack_and_refuses_dropout():
  task, size, batch = _case('vit-tiny')
  model = task.model('none')
  params = st.init_state(model, TX, 0, size).params
  path = fs.stack_path(model, params, batch)
  assert path == ('encoder',)
  outer, stacked = fs.split_params(params, path)
  assert 'encoder' not in outer and set(stacked) >= {'attention', 'intermediate'}
  chex.assert_trees_all_equal(fs.join_params(outer, stacked, path), params)
  task, size, batch = _case('tiny', dropout=0.1)
  with pytest.raises(fs.FusedStepError, match='deterministic models only'):
    fs.stack_path(task.model('none'), st.init_state(task.model('none'), TX, 0, size).params, batch)
