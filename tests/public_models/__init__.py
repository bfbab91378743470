"""Public models written by others, re-implemented small and faithfully, each untouched and stacked.

Every module gives the model as its authors wrote it (layers applied in a Python
loop, per-layer parameters ``..._0 .. _{N-1}``) and the same model on a
:mod:`remat` front door, plus ``stack(per_layer)``: the untouched model's
parameters in the stacked layout. tests/test_public_models.py checks gradients
and compiled memory of the two. The sources are Apache-2.0; each file says which
file it follows and what was left out (decoding caches, pretrained loading).
"""

import dataclasses
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class Case:
  """One public model, untouched and stacked, at a small size.

  Attributes:
    name: the model.
    untouched: ``loss(params, batch)`` of the model as its authors wrote it.
    stacked: ``stacked(spec) -> loss(stacked_params, batch)`` on a front door.
    params: the untouched model's parameters.
    batch: the example batch.
    stack: maps the untouched parameter tree (or its gradient) to the stacked one.
    num_layers: N.
    per_block: ``per_block(rule) -> loss(params, batch)``: the untouched model with
      each block in ``nn.remat`` (``nnx.remat``, ``eqx.filter_checkpoint``) under the
      rule's ``jax.checkpoint`` policy, the one-line habit; on ``params``.
  """
  name: str
  untouched: Callable
  stacked: Callable
  params: Any
  batch: Any
  stack: Callable
  num_layers: int
  per_block: Callable | None = None


def block_policy(rule: str):
  """The ``jax.checkpoint`` policy a per-block ``nn.remat`` takes for ``rule`` ('full', 'dots', ...)."""
  import remat
  return remat.get_policy(rule).jax_policy


# Issue 34's bounds against the per-block habit are stated for stacks of at least 8 layers.
DEEP = 8


def deep_case(name: str) -> Case:
  """The public model ``name`` with at least :data:`DEEP` layers per stack, else its own shapes."""
  import dataclasses as dc
  from tests.public_models import bert, gemma, gemma3, lm1b, unet, vit
  module = {'bert': bert, 'gemma': gemma, 'gemma3': gemma3, 'lm1b': lm1b, 'unet': unet,
            'vit': vit}[name]
  cfg = module.Config()
  field = next(f for f in ('num_layers', 'depth', 'layers_per_block') if hasattr(cfg, f))
  return module.case(dc.replace(cfg, **{field: max(getattr(cfg, field), DEEP)}))
