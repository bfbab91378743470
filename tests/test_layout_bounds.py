"""Issue 34's second yardstick on the H100 plan: the stack (``layout='auto'``) against the per-block habit.

The per-block habit is the untouched model with each block in ``nn.remat``
(``nnx.remat``) under a rule's ``jax.checkpoint`` policy, as its users write it
(tests/public_models/: ``Case.per_block``). On a GPU plan, where a checkpoint
in straight-line code is kept, the stack should plan no more than that habit
under the same rule, and no more than the untouched model under ``none``.
docs/own-model.md has the figures for every public model and ours; two
representative models are checked here (>= 8 layers, slow: six compiles each).
Where the stack does not meet a bound yet, the ratio measured is held so that
it does not grow (docs/own-model.md says which buffers make the difference).
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
