"""Compiled memory of a jitted function, from XLA's buffer assignment.

Figures (bytes), as reported by ``Compiled.memory_analysis()`` for the backend
the function was compiled for:

* ``argument``: inputs (parameters, optimizer state, batch).
* ``output``: results.
* ``alias``: outputs that reuse a donated input buffer (counted in both above).
* ``temp``: every other buffer XLA allocates for the step: activations kept for
  the backward pass, recompute working sets, gradients, optimizer temporaries.
  This is where remat policies differ.
* ``host_temp``: temporaries placed in host memory (offloaded residuals on GPU
  targets; always 0 on the CPU backend, where offload is a no-op).
* ``host_argument`` / ``host_output``: inputs and results that live in host
  memory (``pinned_host`` arguments, e.g. optimizer state offloaded between
  steps); not in ``argument``, ``output`` or ``peak``, which are device bytes.
* ``peak = argument + output - alias + temp``: an upper bound on device bytes
  live during the step under the compiled plan (XLA reports no tighter peak on
  CPU). It is a plan, not an allocator measurement.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class MemoryStats:
  """Compiled memory of one executable; see the module docstring for definitions."""
  argument: int
  output: int
  alias: int
  temp: int
  host_temp: int
  backend: str
  host_argument: int = 0
  host_output: int = 0

  @property
  def peak(self) -> int:
    return self.argument + self.output - self.alias + self.temp


def compiled_memory(compiled: Any, backend: str | None = None) -> MemoryStats:
  """Reads :class:`MemoryStats` from a ``jax.stages.Compiled``."""
  import jax
  ma = compiled.memory_analysis()
  return MemoryStats(
      argument=int(ma.argument_size_in_bytes), output=int(ma.output_size_in_bytes),
      alias=int(ma.alias_size_in_bytes), temp=int(ma.temp_size_in_bytes),
      host_temp=int(getattr(ma, 'host_temp_size_in_bytes', 0)),
      backend=backend or jax.default_backend(),
      host_argument=int(getattr(ma, 'host_argument_size_in_bytes', 0)),
      host_output=int(getattr(ma, 'host_output_size_in_bytes', 0)))


def format_bytes(n: float) -> str:
  """Human-readable binary size, e.g. '3.50 GiB'."""
  for unit in ('B', 'KiB', 'MiB', 'GiB', 'TiB'):
    if abs(n) < 1024 or unit == 'TiB':
      return f'{n:.0f} {unit}' if unit == 'B' else f'{n:.2f} {unit}'
    n /= 1024
  raise AssertionError('unreachable')
