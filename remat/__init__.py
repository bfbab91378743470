"""remat: named rematerialization policies for JAX/Flax, and the tools to measure them.

Typical use::

    from remat import get_policy
    policy = get_policy('dots_no_batch')
    Block = nn.remat(MyBlock, policy=policy.jax_policy)

Measure your own function under several policies (docs/measuring.md)::

    report = remat.measure(build, params, batch, policies=['full', 'dots'])
    print(report.table())
"""

from remat.measuring import Measurement, Report, TrainStep, measure
from remat.policies import (PRESETS, Policy, PolicyError, get_policy, list_policies,
                            policy_names)
from remat.stack import LayerStack

__all__ = ['PRESETS', 'Policy', 'PolicyError', 'get_policy', 'list_policies',
           'policy_names', 'LayerStack', 'measure', 'Measurement', 'Report', 'TrainStep']
