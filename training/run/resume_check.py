"""Which settings a ``--resume`` must keep, and the explicit way to change one.

A resumed run continues the computation of the run it resumes only if every
setting that enters that computation is the same. :data:`COMPARED` lists
them, in one place: a new setting that changes what a step computes (a data
source, ...) is one line here. The tokenizer is compared by the digest of its
files against the run's copy (:mod:`training.run.tokenizer_copy`), and cannot
be changed: the ids would mean other text. ``--config``, ``--model``, the
config's model shape and ``--dtype`` are checked by
:func:`training.run.record_check.check_record` (they name what the checkpoint *is*;
no flag changes them).

Not compared, on purpose: ``--steps`` (raising it is how a run is extended; the
cosine decay stretches over the new length), ``--remat`` (every policy
computes the same function with the same parameter tree), ``--layout`` (every
layout computes the same function with the same parameter tree), ``--mesh`` (the
machine's, not the run's: the same function, summed in another order, equal
within float rounding), ``--grad-accum`` (the same update, summed in another
order; a run that ran out of memory may resume with more microbatches) and the settings that only decide what is logged or
kept (``--eval-*``, ``--save-every``, ``--skip-nonfinite``, ``--spike-*``).

``--allow-changed NAME,...`` accepts a change on purpose; the trainer records
it in the run's history (``run.json`` and every later checkpoint's record).
"""

from __future__ import annotations

import dataclasses
import operator
import os
from typing import Any, Callable


def same_path(was, now) -> bool:
  """Equal, or two spellings of the same file (relative, symlinked, ...)."""
  return was == now or (bool(was) and bool(now) and
                        os.path.realpath(str(was)) == os.path.realpath(str(now)))


@dataclasses.dataclass(frozen=True)
class Compared:
  """One compared setting: a :class:`~training.trainer.TrainConfig` field.

  Attributes:
    name: the field (its flag is ``--`` + name with dashes).
    same: whether the recorded and the new value compute the same.
    only: ``'lm'`` or ``'vision'``: the setting applies to those models only.
  """
  name: str
  same: Callable[[Any, Any], bool] = operator.eq
  only: str | None = None


COMPARED = (
    Compared('batch_size'),
    Compared('seq_len', only='lm'),
    Compared('image_size', only='vision'),
    Compared('seed'),
    Compared('data', same_path),
    Compared('lr'),
    Compared('warmup_steps'),
    Compared('weight_decay'),
    Compared('grad_clip'),
    Compared('augment', only='vision'),
    Compared('crop_scale', lambda was, now: list(was or ()) == list(now or ()), only='vision'),
)


class ChangedSettingError(ValueError):
  """A compared setting differs from the run's record; the message is one line."""


def flag(name: str) -> str:
  return '--' + name.replace('_', '-')


def parse_allowed(text: str | None) -> set[str]:
  """The names in ``--allow-changed a,b`` (dashes or underscores).

  Raises:
    ChangedSettingError: a name that is not a compared setting.
  """
  names = {n.strip().replace('-', '_') for n in (text or '').split(',') if n.strip()}
  unknown = sorted(names - {c.name for c in COMPARED})
  if unknown:
    raise ChangedSettingError(
        f"--allow-changed: {', '.join(unknown)} is not a compared setting; valid: "
        f"{', '.join(c.name for c in COMPARED)}")
  return names


def changes(recorded: dict, now: dict, defaults: dict, vision: bool) -> dict[str, list]:
  """``{name: [recorded, now]}`` for each compared setting that differs.

  A setting missing from an older record counts as its default.
  """
  found = {}
  for c in COMPARED:
    if c.only and c.only != ('vision' if vision else 'lm'):
      continue
    was, new = recorded.get(c.name, defaults.get(c.name)), now.get(c.name)
    if not c.same(was, new):
      found[c.name] = [was, new]
  return found


def check(found: dict[str, list], allowed: set[str], out) -> dict[str, list]:
  """Returns the changes in ``found`` (all allowed), or raises naming those that are not.

  Raises:
    ChangedSettingError: one line naming each refused change and the ways on.
  """
  refused = {k: v for k, v in found.items() if k not in allowed}
  if not refused:
    return found
  what = ', '.join(f'{flag(k)} {was}, not {now}' for k, (was, now) in refused.items())
  names = ','.join(refused)
  return_flags = ', '.join(flag(k) for k in refused)
  raise ChangedSettingError(
      f'--resume: {out} was trained with {what}; drop {return_flags} (the run\'s record supplies '
      f'it), pass --allow-changed {names} to continue with the change (it is recorded in the '
      "run's history), or pass another --out for a new run")
