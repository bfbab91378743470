"""Procedural image classification that needs no download: one shape per image.

Each image shows one pattern of its class (``CLASSES``) at a random position and
size, in a random foreground colour on a different random background colour, with
mild Gaussian noise. Positions and sizes are fractions of the image side, so the
task is the same at every resolution (16 pixels per side and up). Masks are numpy
arithmetic on the pixel-centre coordinate grid, one image at a time.

Images are a pure function of (seed, split, step): the training stream is split 0
and the held-out stream is split 1, each drawn from ``np.random.default_rng``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from training.data import DataError

# Ordered so that a prefix (num_classes < 10) keeps the most distinct patterns.
CLASSES = ('disk', 'plus', 'horizontal stripes', 'vertical stripes', 'ring', 'triangle',
           'checkerboard', 'diagonal line', 'square', 'hollow square')
MIN_SIZE = 16
TRAIN_SPLIT, VAL_SPLIT = 0, 1
HALF_SIZE = (0.15, 0.32)  # the shape's half-extent, as a fraction of the image side
MIN_CONTRAST = 0.3        # each channel of foreground and background differ by at least this
NOISE = 0.05              # std of the pixel noise, on the [0, 1] colour scale
# Pixel statistics over many images (uniform colours plus noise), for standardising.
PIXEL_MEAN, PIXEL_STD = 0.5, 0.29


def _mask(label: int, dx: np.ndarray, dy: np.ndarray, r: float, flip: bool) -> np.ndarray:
  """The boolean [S, S] mask of class ``label``; dx is [1, S] and dy is [S, 1] (offsets from centre)."""
  ax, ay = np.abs(dx), np.abs(dy)
  box = np.maximum(ax, ay)  # [S, S]; the square of half-side r is box < r
  name = CLASSES[label]
  if name == 'disk':
    return dx * dx + dy * dy < r * r
  if name == 'plus':
    w = 0.28 * r
    return ((ax < w) & (ay < r)) | ((ay < w) & (ax < r))
  if name in ('horizontal stripes', 'vertical stripes'):
    along = dy if name == 'horizontal stripes' else dx
    band = np.floor((along + r) / (0.4 * r)) % 2 == 0  # 5 bands across 2r: on, off, on, off, on
    return (box < r) & band
  if name == 'ring':
    d2 = dx * dx + dy * dy
    return (d2 < r * r) & (d2 > (0.55 * r) ** 2)
  if name == 'triangle':  # apex up (y grows downwards), base 2r wide
    return (dy < r) & (ax < (dy + r) / 2)
  if name == 'checkerboard':  # 4 x 4 cells across 2r
    cell = 0.5 * r
    return (box < r) & ((np.floor((dx + r) / cell) + np.floor((dy + r) / cell)) % 2 == 0)
  if name == 'diagonal line':  # either diagonal, at random
    w = 0.22 * r * np.sqrt(2)
    return (box < r) & (np.abs(dx - dy if flip else dx + dy) < w)
  if name == 'square':
    return box < r
  return (box < r) & (box > 0.6 * r)  # hollow square


@dataclasses.dataclass(frozen=True)
class ShapesData:
  """Procedurally generated shape images, ``image_size`` pixels per side.

  Attributes:
    image_size: pixels per side (at least 16).
    num_classes: how many of ``CLASSES`` (a prefix) to use, 2 to 10.
    channels: 3 for colour, 1 for greyscale.
    source: a human description; filled in from the other fields when empty.
  """
  image_size: int
  num_classes: int = 10
  channels: int = 3
  source: str = ''

  def __post_init__(self):
    _validate(self.image_size, self.num_classes, self.channels)
    if not self.source:
      s = self.image_size
      desc = f'procedural shapes ({self.num_classes} classes, {s}x{s}, {self.channels} channel'
      object.__setattr__(self, 'source', desc + ('s)' if self.channels > 1 else ')'))

  def _make(self, split: int, step: int, batch_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    if batch_size < 1:
      raise DataError(f'batch_size must be at least 1, got {batch_size}')
    rng = np.random.default_rng((seed, split, step))
    b, s, c = batch_size, self.image_size, self.channels
    labels = rng.permutation(np.arange(b) % self.num_classes).astype(np.int32)
    half = rng.uniform(*HALF_SIZE, size=b)
    centre = rng.uniform(half[:, None], 1 - half[:, None], size=(b, 2))  # (x, y); the shape stays inside
    flips = rng.random(b) < 0.5
    background = rng.random((b, c))
    # A per-channel offset in [0.3, 0.7] taken modulo 1 keeps the foreground uniform and
    # at least MIN_CONTRAST away from the background in every channel.
    foreground = (background + rng.uniform(MIN_CONTRAST, 1 - MIN_CONTRAST, size=(b, c))) % 1.0
    grid = ((np.arange(s) + 0.5) / s).astype(np.float32)  # pixel centres in [0, 1)
    # Uniform noise in [-a, a] has std NOISE; it costs a quarter of Gaussian noise at 1024+ pixels.
    a = NOISE * np.sqrt(3.0)
    colours = np.stack([background, foreground], axis=1)  # [B, 2, C]: index 0 off the shape, 1 on it
    colours = ((colours - a - PIXEL_MEAN) / PIXEL_STD).astype(np.float32)
    images = np.empty((b, s, s, c), np.float32)
    noise = np.empty((s, s, c), np.float32)  # reused: fresh large temporaries dominate the time at 1024+
    for i in range(b):
      dx = (grid - np.float32(centre[i, 0]))[None, :]
      dy = (grid - np.float32(centre[i, 1]))[:, None]
      mask = _mask(int(labels[i]), dx, dy, np.float32(half[i]), bool(flips[i]))
      np.take(colours[i], mask.view(np.uint8), axis=0, out=images[i])
      rng.random(dtype=np.float32, out=noise)
      noise *= np.float32(2 * a / PIXEL_STD)
      images[i] += noise
    return images, labels

  def batch(self, step: int, batch_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The training batch for ``step``: a pure function of (seed, step).

    Returns:
      images float32 [B, S, S, C], standardised to roughly mean 0 / std 1, and labels
      int32 [B] in ``range(num_classes)``, balanced within the batch as far as B allows.
    """
    return self._make(TRAIN_SPLIT, step, batch_size, seed)

  def val_batches(self, n: int, batch_size: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """A fixed held-out set of ``n`` batches, drawn from a different stream than training."""
    return [self._make(VAL_SPLIT, i, batch_size, seed) for i in range(n)]


def _validate(image_size, num_classes, channels) -> None:
  if isinstance(image_size, bool) or not isinstance(image_size, (int, np.integer)) or image_size < MIN_SIZE:
    raise DataError(f'image_size must be an integer >= {MIN_SIZE}, got {image_size!r}')
  if isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)) \
      or not 2 <= num_classes <= len(CLASSES):
    raise DataError(f'num_classes must be an integer from 2 to {len(CLASSES)}, got {num_classes!r}')
  if channels not in (1, 3) or isinstance(channels, bool):
    raise DataError(f'channels must be 1 (greyscale) or 3 (colour), got {channels!r}')


def load_images(image_size: int, num_classes: int = 10, channels: int = 3) -> ShapesData:
  """Validates the settings and returns the procedural shapes data set.

  Args:
    image_size: pixels per side, at least 16 (any size; shapes scale with the side).
    num_classes: how many pattern classes, 2 to 10 (a prefix of ``CLASSES``).
    channels: 3 for colour images, 1 for greyscale.

  Raises:
    DataError: a setting out of range; the message is one line naming the valid range.
  """
  return ShapesData(image_size, num_classes, channels)
