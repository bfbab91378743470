"""remat.measure on a user's own function: the table, memory order, exact FLOP ratios, residuals."""

import contextlib
import jax
import jax.numpy as jnp
import pytest

import remat
import user_mlp
from remat.measuring import TrainStep
from user_mlp import B, D, H, L

# The forward of every layer: h @ w1 and tanh(.) @ w2, each 2 B D H FLOPs.
UP = L * 2 * B * D * H
FORWARD = 2 * UP


@pytest.fixture(scope='module')
def report():
  return remat.measure(user_mlp.build, *user_mlp.example_args(),
                       policies=['full', 'dots', 'names:up'])


def test_table_for_a_user_function(report):
  assert list(report.results) == ['none', 'full', 'dots', 'names:up']
  text = report.table()
  assert text.splitlines()[0] == '# target cpu (local cpu backend)'
  assert all(spec in text for spec in report.results)
  rows = {r['policy']: r for r in report.rows()}
  assert rows['none']['memory_ratio'] == 1.0 and rows['none']['recompute_ratio'] == 1.0
  assert report.front == {r for r, row in rows.items() if row['pareto']}


def test_full_uses_less_temp_than_none(report):
  assert report.results['full'].memory.temp < report.results['none'].memory.temp


def test_flops_exact(report):
  # Without remat: the forward (2 matmuls a layer) and the backward (2 matmuls per forward
  # matmul: one for the input's gradient, one for the weight's) = 3 forwards.
  flops = {s: m.flops.flops for s, m in report.results.items()}
  assert flops['none'] == 3 * FORWARD
  # full recomputes what the backward needs: up = h @ w1 (tanh's and w2's gradients need
  # tanh(up)). The down matmul's output feeds only the residual add, whose gradient needs no
  # value, so JAX does not recompute it: half a forward more, not a whole one.
  assert flops['full'] == 3 * FORWARD + UP
  # dots and names:up recompute no matmul (up is saved; tanh(up) is rebuilt by a tanh).
  assert flops['dots'] == flops['names:up'] == flops['none']
  assert all(m.flops.exact for m in report.results.values())


def test_residuals_by_tag(report):
  from remat.residuals import by_tag
  tags = by_tag(list(report.results['names:up'].residuals))
  assert tags['up'] == L * B * H * 4          # one [B, H] float32 per layer, stacked
  assert 'down' not in tags
  assert 'up' not in by_tag(list(report.results['full'].residuals))


def test_unknown_tag_is_one_line_before_compiling():
  with pytest.raises(remat.PolicyError, match=r"unknown tag\(s\) qkv; this model emits: down, up"):
    remat.measure(user_mlp.build, *user_mlp.example_args(), policies=['names:qkv'])


def _sgd(policy):
  """A whole train step (SGD on a dict state) around the same loss; donates the state."""
  loss = user_mlp.build(policy)

  def step(state, x):
    value, grads = jax.value_and_grad(loss)(state['params'], x)
    params = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, state['params'], grads)
    return {'params': params}, value
  return TrainStep(step, loss, loss_args=lambda state, x: (state['params'], x))


def test_train_step_donates_and_times_on_real_arrays():
  params, x = user_mlp.example_args()
  state = {'params': jax.tree_util.tree_map(lambda s: jnp.full(s.shape, 0.01, s.dtype), params)}
  x = jnp.ones(x.shape, x.dtype)
  report = remat.measure(_sgd, state, x, policies=['full'], time=True, time_steps=1)
  none, full = report.results['none'], report.results['full']
  assert none.memory.alias > 0                     # the state was donated
  assert full.flops.flops == 3 * FORWARD + UP      # the SGD update has no matmul
  assert none.step_seconds > 0 and full.step_seconds > 0 and report.timed
  assert float(state['params'][0][0, 0, 0]) == pytest.approx(0.01)  # the caller's arrays survive


def test_reference_is_the_first_row_and_every_ratio_is_to_it():
  """measure(..., reference=fn): the untouched model is row one and the ratios' denominator."""
  report = remat.measure(user_mlp.build, *user_mlp.example_args(), policies=['full'],
                         reference=user_mlp.untouched)
  assert list(report.results) == ['reference', 'none', 'full'] and report.baseline == 'reference'
  ref = report.results['reference']
  # The same matmuls as the stack's none, less one: no gradient flows into x, so the unrolled
  # program drops the first layer's h @ w1 input gradient, which a scan body computes every layer.
  assert ref.flops.flops == 3 * FORWARD - 2 * B * D * H
  rows = {r['policy']: r for r in report.rows()}
  for spec, m in report.results.items():
    assert rows[spec]['memory_ratio'] == m.memory.temp / ref.memory.temp
    assert rows[spec]['peak_ratio'] == m.memory.peak / ref.memory.peak
    assert rows[spec]['recompute_ratio'] == m.flops.flops / ref.flops.flops
  lines = report.table().splitlines()
  assert "# 'reference' measured on the example arguments" in lines[1]
  assert 'temp/ref' in lines[2] and 'peak/ref' in lines[2] and 'mem/none' not in lines[2]
  assert [line.split()[0] for line in lines[3:]] == ['reference', 'none', 'full']
  # Without a reference nothing changes: none is the first row and the baseline.
  assert remat.measure(user_mlp.build, *user_mlp.example_args(), policies=[]).baseline == 'none'


def test_reference_on_its_own_tree():
  """reference_args: the untouched model is measured exactly as written, on its own parameter tree."""
  from remat.measuring import step_memory
  own = user_mlp.own_args()
  report = remat.measure(user_mlp.build, *user_mlp.example_args(), policies=['full'],
                         reference=user_mlp.untouched_own, reference_args=own)
  ref = report.results['reference']
  assert ref.memory == step_memory(user_mlp.untouched_own, *own)
  # The same program on the stacked tree (a loop that slices it) is another compiled program.
  assert ref.flops.flops == report.results['none'].flops.flops - 2 * B * D * H
  rows = {r['policy']: r for r in report.rows()}
  assert rows['reference']['arguments'] == 'reference_args'
  assert rows['full']['arguments'] == 'example_args'
  assert rows['full']['memory_ratio'] == report.results['full'].memory.temp / ref.memory.temp
  assert "'reference' measured on its own arguments (reference_args)" in report.table()
  with pytest.raises(ValueError, match='without a reference'):
    remat.measure(user_mlp.build, *user_mlp.example_args(), reference_args=own)


def _stack_build(policy):
  """The user's MLP on remat.scan_layers (its layers stacked), for the stack's own yardsticks."""
  def layer(w, h):
    return h + jnp.tanh(h @ w[0]) @ w[1]
  return lambda params, x: jnp.mean(remat.scan_layers(layer, params, x, policy=policy) ** 2)


def test_per_block_rows_beside_the_stack():
  """per_block=[...]: the per-block nn.remat yardstick of each rule, and temp/pb of the stack's rows."""
  from remat.layout import unrolled_reference
  from remat.measuring import step_memory
  args = user_mlp.example_args()
  report = remat.measure(_stack_build, *args, policies=['full', 'dots', 'sqrt'],
                         reference='unrolled', per_block=['full', 'dots'])
  assert list(report.results) == ['reference', 'per-block:full', 'per-block:dots', 'none',
                                  'full', 'dots', 'sqrt']
  res = report.results
  with unrolled_reference():
    assert res['reference'].memory == step_memory(_stack_build(remat.get_policy('none')), *args)
  # The yardsticks recompute what their rule recomputes: the stack's FLOPs under the same rule.
  assert res['per-block:full'].flops.flops == res['full'].flops.flops
  assert res['per-block:dots'].flops.flops == res['dots'].flops.flops
  rows = {r['policy']: r for r in report.rows()}
  assert rows['full']['per_block_ratio'] == res['full'].memory.temp / res[
      'per-block:full'].memory.temp
  assert rows['sqrt']['per_block_ratio'] is None and rows['none']['per_block_ratio'] is None
  text = report.table()
  assert 'temp/pb' in text.splitlines()[2]
  assert any(line.startswith('# per-block:RULE') for line in
             remat.table.footer(report.rows(), 'cpu'))
  for bad in ('sqrt', 'none', '2xfull+none'):
    with pytest.raises(remat.PolicyError, match='per-layer rules'):
      remat.measure(_stack_build, *args, per_block=[bad])


def test_per_block_yardstick_keeps_what_its_rule_keeps():
  """The yardsticks' saved bytes (jaxpr, any backend): full < dots < the unrolled model's, as the rules say."""
  report = remat.measure(_stack_build, *user_mlp.example_args(), policies=['full'],
                         reference='unrolled', per_block=['full', 'dots'])
  kept = {s: m.residual_bytes for s, m in report.results.items()}
  assert kept['per-block:full'] < kept['per-block:dots'] < kept['reference']


@pytest.mark.gpu_plan
def test_per_block_yardstick_orders_on_a_gpu_plan_and_unrolled_is_it():
  """On the H100 plan, where checkpoints outside loops are kept: per-block full < dots < unrolled.

  The stack under layout='unrolled' is that habit, its saved layer inputs waiting in gradient
  rows written later (remat.kept_in_gradients): each rule plans less than its yardstick
  (100656 against 125232 bytes under full, 297272 against 321848 under dots).
  """
  from remat.layout import per_block_reference, unrolled_reference
  from remat.measuring import step_memory
  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  args = ((jax.random.normal(k1, (8, D, H)) * 0.1, jax.random.normal(k2, (8, H, D)) * 0.1),
          jnp.ones((B, D)))   # 8 layers of the user's MLP

  def temp(spec, layout='scan', context=contextlib.nullcontext()):
    def layer(w, h):
      return h + jnp.tanh(h @ w[0]) @ w[1]
    loss = lambda params, x: jnp.mean(
        remat.scan_layers(layer, params, x, policy=spec, layout=layout) ** 2)
    with context:
      return step_memory(loss, *args, target='h100').temp
  ref, full, dots = (temp('none', context=c) for c in (
      unrolled_reference(), per_block_reference('full'), per_block_reference('dots')))
  assert full < dots < ref
  assert temp('full', 'unrolled') < full and temp('dots', 'unrolled') < dots
