"""remat: named rematerialization policies for JAX/Flax, and the tools to measure them.

Typical use::

    from remat import get_policy
    policy = get_policy('dots_no_batch')
    Block = nn.remat(MyBlock, policy=policy.jax_policy)
"""

from remat.policies import (PRESETS, Policy, PolicyError, get_policy, list_policies,
                            policy_names)
from remat.stack import LayerStack

__all__ = ['PRESETS', 'Policy', 'PolicyError', 'get_policy', 'list_policies',
           'policy_names', 'LayerStack']
