"""``--tensorboard``: the metric rows written as TensorBoard scalars beside ``metrics.jsonl``.

Through ``tensorboardX`` (the optional ``tensorboard`` extra: ``pip install -e ".[tensorboard]"``),
into ``<out>/tensorboard/``: every number of a row (``loss``, ``grad_norm``, ``lr``,
``val_*``, ``eval_*``, throughput) at its step. ``metrics.jsonl`` stays the record
(a resume reads it); the event files are for looking.
"""

from __future__ import annotations

from pathlib import Path

TB_NAME = 'tensorboard'
SKIPPED = ('step', 'tokens')   # the x axis, and a count that only grows


class TensorBoardError(ValueError):
  """``--tensorboard`` without its package; the message is one line."""


def check_available():
  """Raises :class:`TensorBoardError` when ``tensorboardX`` is not installed."""
  try:
    import tensorboardX  # noqa: F401
  except ImportError:
    raise TensorBoardError('--tensorboard needs the tensorboardX package: pip install -e '
                           '".[tensorboard]" (or pip install tensorboardX)') from None


class Writer:
  """Writes metric rows as scalars to ``<out>/tensorboard``."""

  def __init__(self, out: Path):
    from tensorboardX import SummaryWriter
    self._w = SummaryWriter(str(Path(out) / TB_NAME))

  def write(self, row: dict):
    for name, value in row.items():
      if name not in SKIPPED and isinstance(value, (int, float)) and not isinstance(value, bool):
        self._w.add_scalar(name, value, row['step'])

  def close(self):
    self._w.close()
