"""Residual bytes are exact on a hand-computable stack, and tags appear in the breakdown."""

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from models.gpt import GPT
from remat.residuals import by_tag, saved_residuals
from training.step import train_step as st

L, M, K = 6, 8, 16
LAYER = M * K * 4  # one float32 [M, K] activation


def _stack(policy):
  def body(c, w):
    return jnp.tanh(checkpoint_name(c @ w, 'pre')), None
  body = jax.checkpoint(body, policy=policy, prevent_cse=False)
  return lambda ws, x: jax.lax.scan(body, x, ws)[0].sum()


ARGS = (jnp.ones((L, K, K)), jnp.ones((M, K)))


def test_saving_a_tag_keeps_it_and_the_layer_inputs():
  res = saved_residuals(_stack(jax.checkpoint_policies.save_only_these_names('pre')), *ARGS)
  tags = by_tag(res)
  assert tags['pre'] == L * LAYER  # stacked over the scan: [L, M, K]
  assert tags['(untagged)'] == L * LAYER  # each layer's input c, needed for dW
  assert sum(r.nbytes for r in res) == 2 * L * LAYER


def test_full_remat_keeps_only_layer_inputs():
  res = saved_residuals(_stack(jax.checkpoint_policies.nothing_saveable), *ARGS)
  assert by_tag(res) == {'(untagged)': L * LAYER}


def test_parameters_are_not_residuals():
  res = saved_residuals(lambda w, x: jnp.tanh(x @ w).sum(), jnp.ones((K, K)), jnp.ones((M, K)))
  # JAX's tanh rule keeps its output and 1 - tanh^2; w and x are inputs and do not count.
  assert sorted(r.where.split(' ')[0] for r in res) == ['sub', 'tanh']
  assert sum(r.nbytes for r in res) == 2 * LAYER


def test_gpt_tags_in_breakdown(small_config, small_params, windows):
  cfg = small_config
  loss = lambda p, w: st.lm_loss(GPT(cfg, 'minimal'), p, w, jax.random.PRNGKey(0))
  tags = by_tag(saved_residuals(loss, small_params, windows))
  b, t, d = windows.shape[0], windows.shape[1] - 1, cfg.d_model
  for tag in ('query_proj', 'key_proj', 'value_proj', 'out_proj'):
    assert tags[tag] == cfg.num_layers * b * t * d * 4, tag
  assert tags['mlpwi'] == cfg.num_layers * b * t * 4 * d * 4
  assert 'context' not in tags  # minimal does not allow it
  assert 'mlpwo' not in tags  # allowed, but the backward pass never needs it (linear after it)
  none = by_tag(saved_residuals(
      lambda p, w: st.lm_loss(GPT(cfg, 'full'), p, w, jax.random.PRNGKey(0)), small_params, windows))
  assert set(none) == {'(untagged)'}


def _biased_stack(policy):
  # The tag sits on the matmul output plus a bias, as in nn.Dense: a policy that keeps what the
  # matmul produced (dots, the stack's lean rule) saves the dot_general output, not the tagged sum.
  def body(c, wb):
    w, b = wb
    return jnp.tanh(checkpoint_name((c @ w + b).reshape(M, K), 'pre')), None
  body = jax.checkpoint(body, policy=policy, prevent_cse=False)
  return lambda p, x: jax.lax.scan(body, x, p)[0].sum()


def test_a_saved_matmul_output_carries_the_tag_of_the_value_built_from_it():
  from remat.layout import lean_saveable
  params = (jnp.ones((L, K, K)), jnp.ones((L, K)))
  for policy in (lean_saveable, jax.checkpoint_policies.dots_with_no_batch_dims_saveable):
    res = saved_residuals(_biased_stack(policy), params, jnp.ones((M, K)))
    saved = {r.tag for r in res if r.shape == (L, M, K) and r.where.startswith('name')}
    assert by_tag(res)['pre'] == L * LAYER, (policy, res)
    assert saved == {'pre'}
