"""Memory budgets of ``--remat=auto``: ``auto:40GiB``, ``auto:0.5x``, ``auto`` (the device's memory).

A budget bounds the compiled plan's **peak** (``argument + output - alias +
temp``, :mod:`remat.memory`): what the device must hold during the step. The
three forms:

* ``auto:SIZE``: bytes, with a binary (KiB, MiB, GiB, TiB) or decimal (KB, MB,
  GB, TB) unit, or B; e.g. ``auto:40GiB``, ``auto:1.5GB``.
* ``auto:Fx``: F times the peak of ``none``'s plan, 0 < F; e.g. ``auto:0.5x``.
* ``auto``: the target device's memory times JAX's preallocated fraction
  (``XLA_PYTHON_CLIENT_MEM_FRACTION``, 0.75 unless set): the pool a JAX
  process allocates from by default, so the headroom is the other 25% (CUDA
  context, cuDNN/cuBLAS workspaces, fragmentation). Needs a GPU target.
"""

from __future__ import annotations

import dataclasses
import os
import re

from remat.memory import format_bytes
from remat.policies import PolicyError

_UNITS = {'b': 1, 'kib': 2**10, 'mib': 2**20, 'gib': 2**30, 'tib': 2**40,
          'kb': 10**3, 'mb': 10**6, 'gb': 10**9, 'tb': 10**12}
_SIZE = re.compile(r'^(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]+)$')
_FRACTION = re.compile(r'^(\d+(?:\.\d*)?|\.\d+)x$')
DEFAULT_MEM_FRACTION = 0.75   # JAX's default XLA_PYTHON_CLIENT_MEM_FRACTION


class BudgetError(PolicyError):
  """An ``auto`` spec that cannot be read or resolved; the message is one line."""


@dataclasses.dataclass(frozen=True)
class Budget:
  """A parsed budget; exactly one of ``nbytes``, ``fraction`` is set unless ``device``.

  Attributes:
    text: the spec as given, e.g. 'auto:40GiB'.
    nbytes: an absolute budget in bytes.
    fraction: a budget relative to none's peak.
    device: True for plain ``auto`` (the target's memory times the preallocated fraction).
  """
  text: str
  nbytes: int | None = None
  fraction: float | None = None
  device: bool = False

  def resolve(self, none_peak: int, device_memory: int | None, target_name: str) -> int:
    """The budget in bytes, given none's peak and the target's memory."""
    if self.nbytes is not None:
      return self.nbytes
    if self.fraction is not None:
      return int(self.fraction * none_peak)
    fraction = mem_fraction()
    if not device_memory:
      raise BudgetError(f"'{self.text}': target {target_name} has no known device memory; give "
                        'a budget: auto:SIZE (e.g. auto:8GiB) or auto:Fx (e.g. auto:0.6x)')
    return int(device_memory * fraction)

  def describe(self, nbytes: int) -> str:
    """The budget for humans, e.g. '40.00 GiB' or '3.27 GiB (0.5x none)'."""
    if self.fraction is not None:
      return f'{format_bytes(nbytes)} ({self.fraction:g}x none)'
    if self.device:
      return f'{format_bytes(nbytes)} ({mem_fraction():g} of device memory)'
    return format_bytes(nbytes)


def mem_fraction() -> float:
  """The fraction of GPU memory JAX preallocates: XLA_PYTHON_CLIENT_MEM_FRACTION or 0.75."""
  text = os.environ.get('XLA_PYTHON_CLIENT_MEM_FRACTION', '')
  try:
    value = float(text) if text else DEFAULT_MEM_FRACTION
  except ValueError:
    value = DEFAULT_MEM_FRACTION
  return value if 0 < value <= 1 else DEFAULT_MEM_FRACTION


def is_auto(spec) -> bool:
  """True for 'auto' and 'auto:...' specs (a budget rather than a policy)."""
  return isinstance(spec, str) and (spec.strip() == 'auto' or spec.strip().startswith('auto:'))


def parse_budget(spec: str) -> Budget:
  """Parses ``auto``, ``auto:SIZE`` or ``auto:Fx``.

  Raises:
    BudgetError: one line naming the valid forms.
  """
  text = spec.strip()
  forms = 'auto, auto:SIZE (e.g. auto:40GiB, auto:512MiB, auto:2GB) or auto:Fx (e.g. auto:0.5x)'
  if text == 'auto':
    return Budget(text, device=True)
  head, sep, arg = text.partition(':')
  if head != 'auto' or not sep:
    raise BudgetError(f"'{spec}' is not a budget; valid: {forms}")
  arg = arg.strip()
  m = _FRACTION.match(arg)
  if m:
    f = float(m.group(1))
    if f <= 0:
      raise BudgetError(f"'{spec}': the fraction of none's plan must be > 0, got {m.group(1)}")
    return Budget(text, fraction=f)
  m = _SIZE.match(arg)
  if m and m.group(2).lower() in _UNITS:
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
      raise BudgetError(f"'{spec}': the budget must be > 0 bytes")
    return Budget(text, nbytes=n)
  raise BudgetError(f"'{spec}': cannot read the budget '{arg}'; valid: {forms}")
