"""remat: named rematerialization policies for JAX/Flax, and the tools to measure them.

Typical use, one front door per API (docs/own-model.md)::

    from remat import LayerStack, NNXStack, scan_layers
    y = LayerStack(Block, 16, 'full@sqrt')(x)                  # Flax linen
    y = NNXStack(make_block, 16, 'full@sqrt', rngs=rngs)(x)     # Flax NNX
    y = scan_layers(layer_fn, stacked_params, x, policy='full@sqrt')   # plain JAX

For one function or module outside a stack: ``get_policy(spec).checkpoint(fn)``
or ``get_policy(spec).remat(Module)`` (no-ops for ``none``).

Measure your own function under several policies (docs/measuring.md)::

    report = remat.measure(build, params, batch, policies=['full', 'dots'])
    print(report.table())

See where the memory of one policy goes (what is live when, and at the peak)::

    print(remat.explain(build, params, batch, policy='full').summary())
"""

from remat import eqx  # imports Equinox only when called
from remat.explaining import Explanation, explain
from remat.update_in_backward import FusedUpdate, FusedUpdateError, fused_update, read_after
from remat.param_layout import LayoutError, stack_layers, unstack_layers
from remat.measuring import Measurement, Report, TrainStep, measure
from remat.nnx_stack import NNXStack
from remat.patterns import kind_indices
from remat.policies import (PRESETS, Policy, PolicyError, get_policy, list_policies,
                            policy_names)
from remat.jax_stack import scan_layers
from remat.stack_checks import StackSignatureError
from remat.stack import LayerStack

__all__ = ['PRESETS', 'Policy', 'PolicyError', 'get_policy', 'list_policies',
           'policy_names', 'LayerStack', 'NNXStack', 'scan_layers', 'StackSignatureError',
           'measure', 'Measurement', 'Report', 'TrainStep', 'explain', 'Explanation',
           'stack_layers', 'unstack_layers', 'LayoutError', 'fused_update', 'FusedUpdate',
           'FusedUpdateError', 'read_after', 'kind_indices']
