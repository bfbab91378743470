"""The loss guard: keeps a blown-up (but finite) state out of the checkpoints.

A non-finite loss is caught inside the compiled step (:mod:`training.step.train_step`).
A *finite* blow-up is not: at a too-high learning rate one update can throw
the parameters far away while every number stays finite, and the next losses
read 1e4, 1e9, ... This guard compares each step's loss with the run's own
recent history:

* ``limit = max(factor * ref, ref + margin)``, ``ref`` being the median of the
  last ``WINDOW`` healthy losses (the run's earlier rows count, read back from
  ``metrics.jsonl`` on ``--resume``). A loss above it is a *spike*. Both
  conditions must hold: the ratio keeps noise at a high loss from counting,
  the margin (in nats) noise at a low one. The median of a falling loss lags
  above it, so the early drop only loosens the limit.
* ``patience`` spikes in a row stop the run (exit 3): a state that keeps
  scoring far above its history is blown up, not fed one odd batch.
* A checkpoint is written only after a healthy step (the final one also when
  the held-out loss of the final state is under the limit), and a checkpoint is
  *suspect* until a later step scores healthily with it (the loss of step
  k + 1 is the loss of checkpoint k's parameters). When the run stops, a
  suspect checkpoint is set aside (``<out>/damaged/``), so the newest
  checkpoint left is one that passed the guard; the rotation (two kept) never
  reaches it, as each save comes after the previous one was settled.
* At the end, a run whose last losses sit far above where it started (the same
  ``limit`` of its first loss) or above the uniform-guess loss plus the margin
  (``ln(vocabulary)`` or ``ln(classes)``: what a model that knows nothing
  scores) exits 3 as well.

Defaults (``--spike-factor 2 --spike-margin 1 --spike-patience 3``) leave the
tiny config's runs untouched: their largest step-to-step rise is well under a
factor of 2 (docs/training-safety.md has the measurement).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics

WINDOW = 20  # healthy losses behind the reference median


@dataclasses.dataclass(frozen=True)
class GuardConfig:
  """Thresholds of :class:`LossGuard`.

  Attributes:
    factor: a spike is above ``factor`` times the reference (and above
      ``reference + margin``); ``inf`` turns the guard off.
    margin: nats; see ``factor``.
    patience: spikes in a row that stop the run.
  """
  factor: float = 2.0
  margin: float = 1.0
  patience: int = 3

  def limit(self, ref: float) -> float:
    return max(self.factor * ref, ref + self.margin)


class LossGuard:
  """Watches one run's losses; see the module docstring.

  Args:
    config: thresholds.
    history: the run's earlier rows (``metrics.jsonl``), oldest first.
    uniform: the uniform-guess loss of the model (None: unknown).
  """

  def __init__(self, config: GuardConfig, history=(), uniform: float | None = None):
    self.config = config
    self.uniform = uniform
    self._healthy = collections.deque(maxlen=WINDOW)  # the reference's window
    self._recent = collections.deque(maxlen=WINDOW)   # every finite loss (the end check)
    self.initial = None
    for row in history:
      loss = row.get('loss')
      if row.get('step') == 1 and isinstance(loss, (int, float)):
        self.initial = float(loss)
      if isinstance(loss, (int, float)) and math.isfinite(loss):
        self._recent.append(float(loss))
        if not row.get('spike'):
          self._healthy.append(float(loss))
    self.streak = 0          # spikes in a row
    self.last_healthy = True  # the last step's loss was finite and no spike
    self.mark_step = None     # the checkpoint the state came from (saved or restored)
    self.confirmed = True     # a healthy loss was seen since ``mark_step``

  def limit(self) -> float | None:
    """The spike limit now (None before the first healthy loss)."""
    if not self._healthy:
      return None
    return self.config.limit(statistics.median(self._healthy))

  def observe(self, step: int, loss: float) -> bool:
    """Takes step ``step``'s loss; returns whether it is healthy (finite and no spike).

    A non-finite loss (its update was dropped in the step) neither counts as
    a spike nor ends a streak; :func:`training.trainer` counts those itself.
    """
    if not math.isfinite(loss):
      self.last_healthy = False
      return False
    if self.initial is None and step == 1:
      self.initial = loss
    self._recent.append(loss)
    limit = self.limit()
    if limit is not None and loss > limit:
      self.streak += 1
      self.last_healthy = False
      return False
    self.streak = 0
    self.last_healthy = True
    self.confirmed = True
    self._healthy.append(loss)
    return True

  def healthy(self, loss) -> bool:
    """Whether ``loss`` (e.g. a held-out loss of the state about to be saved) is under the limit."""
    limit = self.limit()
    return isinstance(loss, (int, float)) and math.isfinite(loss) and (limit is None or loss <= limit)

  @property
  def stop(self) -> bool:
    return self.streak >= self.config.patience

  def mark(self, step: int):
    """A checkpoint of ``step`` was written or restored: suspect until a healthy loss follows."""
    self.mark_step = step
    self.confirmed = False

  @property
  def suspect(self) -> int | None:
    """The step of the checkpoint no healthy loss has vouched for, if any."""
    return None if self.confirmed else self.mark_step

  def spike_line(self, step: int, loss: float) -> str:
    """The warning for a spike at ``step``."""
    ref = statistics.median(self._healthy)
    return (f'step {step}: loss {loss:.4g} is a spike (above {self.config.limit(ref):.4g}: '
            f'--spike-factor {self.config.factor:g} x or --spike-margin '
            f'{self.config.margin:g} nats over {ref:.4g}, the median of the last '
            f'{len(self._healthy)} healthy steps); {self.streak} in a row of '
            f'--spike-patience {self.config.patience}')

  def stop_line(self, step: int, loss: float) -> str:
    """Why the run stopped at ``step`` (the error, less what happened to the checkpoints)."""
    ref = statistics.median(self._healthy)
    return (f'blew up at step {step}: loss {loss:.4g}, spike {self.streak} in a row '
            f'(--spike-patience {self.config.patience}) above {self.config.limit(ref):.4g} '
            f'(the median of the last healthy steps was {ref:.4g}); stopped without saving')

  def end_problem(self) -> str | None:
    """One line if the run ends far above where it started or above a uniform guess, else None."""
    if not self._recent:
      return None
    end = statistics.median(self._recent)
    bounds = []
    if self.initial is not None and math.isfinite(self.initial):
      bounds.append((self.config.limit(self.initial), f'far above where it started ({self.initial:.4g})'))
    if self.uniform is not None:
      bounds.append((self.uniform + self.config.margin,
                     f'above the {self.uniform:.4g} of a uniform guess'))
    for bound, what in bounds:
      if end > bound:
        return (f'the run ended at loss {end:.4g} (median of its last {len(self._recent)} steps), '
                f'{what} by more than the guard allows (limit {bound:.4g}): it did not learn; '
                'lower --lr (or --grad-clip) and start over with --restart')
    return None
