"""Rows packed whole into training windows: a completion is never trained without its prompt.

A row (a document of :mod:`training.data.packed_text`) that has tokens masked
out of the loss (a prompt, or the non-assistant turns of a chat row) is put
into one window whole, so every token the loss counts is in the window with
everything before it in its row. Such a row longer than a window is refused,
with the count and the longest (:func:`long_rows`): cutting it would train its
tail without its prompt, and repeating the prompt would train the completion's
middle without its start. A row every token of which is trained on (``text``)
has no prompt to lose, so a long one is cut into window-sized pieces, as a
language model's pre-training stream is.

Pieces are packed into windows of ``capacity`` tokens first come, first served
(next-fit: a piece that does not fit closes the window); the rest of a window
is padding: a segment of its own, positions from 0, loss mask 0, so padding is
never attended to from a row and never counted. :attr:`Packing.fraction` is
the share of window tokens that are rows.
"""

from __future__ import annotations

import dataclasses

import numpy as np


def row_bounds(starts: np.ndarray, total: int) -> tuple[np.ndarray, np.ndarray]:
  """(starts, lengths) of the non-empty rows of a stream whose rows start at ``starts``."""
  starts = np.asarray(starts, np.int64)
  lengths = np.diff(np.append(starts, total))
  keep = lengths > 0
  return starts[keep], lengths[keep]


def has_prompt(mask: np.ndarray, starts: np.ndarray) -> np.ndarray:
  """Per non-empty row: True when some token of it is masked out of the loss."""
  if len(starts) == 0:
    return np.zeros(0, bool)
  return np.minimum.reduceat(np.asarray(mask), starts) == 0


def long_rows(lengths: np.ndarray, whole: np.ndarray, capacity: int) -> tuple[int, int]:
  """(how many rows that must stay whole exceed ``capacity`` tokens, the longest of them)."""
  over = lengths[whole & (lengths > capacity)]
  return len(over), int(over.max()) if len(over) else 0


@dataclasses.dataclass(frozen=True)
class Packing:
  """Where each window's pieces come from.

  Attributes:
    capacity: tokens per window (``seq_len + 1``).
    piece_start: int64 [P], each piece's offset in the split's token stream, in window order.
    piece_len: int64 [P], its length.
    piece_offset: int64 [P], its offset in its window.
    window_first: int64 [W + 1]: window ``w`` holds pieces ``window_first[w]:window_first[w + 1]``.
    rows: the rows packed (a row cut into pieces counts once).
  """
  capacity: int
  piece_start: np.ndarray
  piece_len: np.ndarray
  piece_offset: np.ndarray
  window_first: np.ndarray
  rows: int

  def __len__(self) -> int:
    return len(self.window_first) - 1

  @property
  def fraction(self) -> float:
    """Row tokens / window tokens: the share of the windows that is not padding."""
    return float(self.piece_len.sum()) / max(1, len(self) * self.capacity)

  def windows(self, tokens: np.ndarray, mask: np.ndarray, which: np.ndarray,
              pad_id: int = 0) -> dict[str, np.ndarray]:
    """Windows ``which`` as int32 ``[len(which), capacity]`` arrays: tokens, segment ids,
    positions and loss mask (:data:`models.tasks.PACKED_KEYS`); padding as in the module
    docstring."""
    which = np.asarray(which, np.int64)
    b, cap = len(which), self.capacity
    first, last = self.window_first[which], self.window_first[which + 1]
    counts = last - first
    piece = np.concatenate([np.arange(f, l) for f, l in zip(first, last)]).astype(np.int64) \
        if b else np.zeros(0, np.int64)
    row = np.repeat(np.arange(b), counts)
    seg = piece - np.repeat(first, counts)
    length = self.piece_len[piece]
    within = np.arange(length.sum()) - np.repeat(np.cumsum(length) - length, length)
    r, col = np.repeat(row, length), np.repeat(self.piece_offset[piece], length) + within
    src = np.repeat(self.piece_start[piece], length) + within
    used = np.zeros(b, np.int64)
    np.add.at(used, row, length)
    # Padding first (a segment after the window's last row, positions from 0), then the rows.
    col_ids = np.arange(cap)[None, :]
    out = {'tokens': np.full((b, cap), pad_id, np.int32),
           'segment_ids': np.broadcast_to(counts[:, None], (b, cap)).astype(np.int32),
           'positions': np.maximum(col_ids - used[:, None], 0).astype(np.int32),
           'loss_mask': np.zeros((b, cap), np.int32)}
    out['tokens'][r, col] = tokens[src]
    out['segment_ids'][r, col] = np.repeat(seg, length)
    out['positions'][r, col] = within
    out['loss_mask'][r, col] = mask[src]
    return out


def pack(starts: np.ndarray, lengths: np.ndarray, whole: np.ndarray, capacity: int,
         order: np.ndarray | None = None) -> Packing:
  """Packs rows into windows of ``capacity`` tokens (module docstring).

  Args:
    starts, lengths: the rows' offsets and lengths in the split (:func:`row_bounds`).
    whole: per row, whether it must stay whole (:func:`has_prompt`); each such row must be
      at most ``capacity`` long (:func:`long_rows` finds those that are not).
    capacity: tokens per window.
    order: the order rows are packed in (default: as they are).
  """
  if order is not None:
    starts, lengths, whole = starts[order], lengths[order], whole[order]
  if len(lengths) and lengths[whole].max(initial=0) > capacity:
    raise ValueError('a row that must stay whole is longer than a window; see long_rows')
  n = -(-lengths // capacity)   # pieces per row: 1 for a row that fits
  row = np.repeat(np.arange(len(lengths)), n)
  k = np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n)
  piece_start = starts[row] + k * capacity
  piece_len = np.minimum(capacity, lengths[row] - k * capacity)
  offsets = np.empty(len(piece_len), np.int64)
  firsts = [0]
  used = 0
  for i, size in enumerate(piece_len.tolist()):   # next-fit: one pass, in order
    if used + size > capacity:
      firsts.append(i)
      used = 0
    offsets[i] = used
    used += size
  if len(piece_len):
    firsts.append(len(piece_len))
  return Packing(capacity, piece_start.astype(np.int64), piece_len.astype(np.int64), offsets,
                 np.asarray(firsts, np.int64), int(len(lengths)))
