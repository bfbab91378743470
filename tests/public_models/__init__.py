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
  """
  name: str
  untouched: Callable
  stacked: Callable
  params: Any
  batch: Any
  stack: Callable
  num_layers: int
