"""Issue 34's second yardstick on the H100 plan: the stack (``layout='auto'``) against the per-block habit.

The per-block habit is the untouched model with each block in ``nn.remat``
(``nnx.remat``) under a rule's ``jax.checkpoint`` policy, as its users write it
(tests/public_models/: ``Case.per_block``). On a GPU plan, where a checkpoint
in straight-line code is kept, the stack should plan no more than that habit
under the same rule, and no more than the untouched model under ``none``.
docs/own-model.md has the figures for every public model and ours; two
representative public models and our GPT (its yardsticks traced with
:mod:`remat.layout`'s references) are checked here, at 8 layers (slow: six
compiles each). Where the stack does not meet a bound yet, the ratio measured is
held so that it does not grow (docs/own-model.md says which buffers make the
difference).
"""

import pytest

from remat.measuring import step_memory
from remat.targets import get_target, gpu_plugin_available
from tests.public_models import deep_case

# (stack spec, the yardstick it is held to): the per-block habit under the same rule, or untouched.
BOUNDS = (('full', 'per-block:full'), ('dots', 'per-block:dots'), ('none', 'untouched'))
# Measured on the H100 plan at the commit that added this file: stack / yardstick > 1 (issue 34).
# Under full the scan holds its N saved layer inputs as one [N, ...] buffer until its backward
# loop ends, where the per-block loop frees each after its layer's backward.
MEASURED_ABOVE = {('vit', 'full'): 1.03, ('lm1b', 'full'): 1.025, ('lm1b', 'none'): 1.015}


def temps(name: str, target: str) -> dict:
  c, t = deep_case(name), get_target(target)
  out = {'untouched': step_memory(c.untouched, c.params, c.batch, target=t).temp}
  for rule in ('full', 'dots'):
    out[f'per-block:{rule}'] = step_memory(c.per_block(rule), c.params, c.batch, target=t).temp
  stacked = c.stack(c.params)
  for spec, _ in BOUNDS:
    out[spec] = step_memory(c.stacked(spec), stacked, c.batch, target=t).temp
  return out


def our_temps(config: str, target: str) -> dict:
  """The same for our zoo model ``config`` at the tests' shape with 8 layers, its yardsticks traced."""
  from bench.zoo import grad_memory
  from remat.layout import per_block_reference, unrolled_reference
  from tests.public_models import ours
  cfg, (batch, size), t = ours.model_config(config, ours.DEEP), ours.ZOO[config], get_target(target)
  out = {}
  for label, context in (('untouched', unrolled_reference()),
                         ('per-block:full', per_block_reference('full')),
                         ('per-block:dots', per_block_reference('dots'))):
    with context:
      out[label] = grad_memory(cfg, 'none', batch, size, t).temp
  for spec, _ in BOUNDS:
    out[spec] = grad_memory(cfg, spec, batch, size, t).temp
  return out


@pytest.mark.gpu_plan
@pytest.mark.slow
@pytest.mark.skipif(not gpu_plugin_available(), reason='needs the gpu-plan extra')
def test_our_gpt_meets_every_bound_h100():
  """Our tiny GPT (8 layers) meets all three, with no held ratio; its dots is the habit, unrolled."""
  t = our_temps('tiny', 'h100')
  assert t['full'] < t['per-block:full'] and t['none'] < t['untouched'], t
  assert t['dots'] == t['per-block:dots'], t


@pytest.mark.gpu_plan
@pytest.mark.slow
@pytest.mark.skipif(not gpu_plugin_available(), reason='needs the gpu-plan extra')
@pytest.mark.parametrize('name', ['vit', 'lm1b'])
def test_stack_plans_no_more_than_the_per_block_habit_h100(name):
  assert deep_case(name).num_layers >= 8
  t = temps(name, 'h100')
  assert t['per-block:full'] < t['per-block:dots'] < t['untouched'], t   # the habit works here
  for spec, yardstick in BOUNDS:
    bound = MEASURED_ABOVE.get((name, spec), 1.0)
    assert t[spec] <= bound * t[yardstick], (name, spec, yardstick, t[spec] / t[yardstick])
