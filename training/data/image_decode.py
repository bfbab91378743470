"""Decoding one image of an image folder: its own bit depth, a size limit, failures named once.

* **Bit depth.** Pillow opens a 16-bit greyscale PNG in mode ``I;16`` (or
  ``I``), whose values run to 65535; ``convert('RGB')`` clips them at 255, so
  97% of a typical 16-bit image's pixels became white. Such images are scaled
  by 255 / 65535 into a float (``F``) image, which crops and resizes as any
  other, so every image reaches the model on the same 0..255 scale. 16-bit
  RGB PNGs Pillow itself reduces to 8 bits per channel, correctly.
* **Size limit.** An image of more than :data:`MAX_PIXELS` pixels (Pillow's
  own decompression-bomb threshold, about 0.25 GiB as RGB) is refused from
  its header, before anything is decoded: one line naming the file and its
  size. A 225-megapixel image used to take 12.5 GB.
* **Failures named once.** A file that identifies but fails to decode (a
  truncated PNG) is replaced by the next image of its split; the process
  that feeds the training loop names it once, with the count so far
  (:class:`Reporter`), however many batches or worker processes meet it.
"""

from __future__ import annotations

import sys
import threading
import warnings

import numpy as np
from PIL import Image, UnidentifiedImageError

from training.data import DataError

MAX_PIXELS = 89_478_485   # PIL.Image.MAX_IMAGE_PIXELS's default
SIXTEEN_BIT = ('I;16', 'I;16L', 'I;16B', 'I;16N', 'I')   # how Pillow opens a 16-bit grey PNG
BAD_DECODE = (OSError, UnidentifiedImageError, ValueError, Image.DecompressionBombError)


class TooLargeError(DataError):
  """An image above :data:`MAX_PIXELS`; the message is one line naming it."""


def _too_large(path, what: str) -> TooLargeError:
  return TooLargeError(f'--data: image {path} is {what}, more than the limit of '
                       f'{MAX_PIXELS:,} pixels (a decompression bomb, or a scan too large to '
                       'train on); shrink it or move it out of the folder')


def open_image(path) -> Image.Image:
  """``Image.open(path)`` (lazy: the header only), refused above :data:`MAX_PIXELS`.

  Raises:
    TooLargeError: one line. Pillow's own errors for a file it cannot identify.
  """
  with warnings.catch_warnings():   # Pillow warns (two lines) between 1x and 2x its limit
    warnings.simplefilter('ignore', Image.DecompressionBombWarning)
    try:
      im = Image.open(path)
    except Image.DecompressionBombError as e:   # above 2x: Pillow refuses to open it at all
      raise _too_large(path, str(e).split(' exceeds')[0].lower().replace('image size ', '')
                       ) from None
  w, h = im.size
  if w * h > MAX_PIXELS:
    im.close()
    raise _too_large(path, f'{w}x{h} ({w * h:,} pixels)')
  return im


def decode(path, channels: int) -> Image.Image:
  """The image at ``path`` in mode ``RGB`` or ``L`` (``channels`` 3 or 1), or ``F`` scaled to
  0..255 for a 16-bit greyscale file.

  Raises:
    TooLargeError, or one of :data:`BAD_DECODE` for a file that does not decode.
  """
  with open_image(path) as im:
    if im.mode in SIXTEEN_BIT:
      scaled = np.asarray(im, np.float32) * np.float32(255 / 65535)
      return Image.fromarray(scaled)   # float32 [H, W]: mode F
    return im.convert('RGB' if channels == 3 else 'L')


def to_channels(x: np.ndarray, channels: int) -> np.ndarray:
  """``[H, W]`` or ``[H, W, C]`` pixels as ``[H, W, channels]`` (a grey image repeated)."""
  if x.ndim == 2:
    x = x[..., None]
  return x if x.shape[-1] == channels else np.repeat(x, channels, axis=-1)


class Reporter:
  """Names each file that failed to decode once per process, with the count so far."""

  def __init__(self, stream=None):
    self.stream = stream
    self.named: set[str] = set()
    self._lock = threading.Lock()

  def __call__(self, failures):
    """``failures``: ``(path, reason)`` pairs met while decoding a batch."""
    for path, reason in failures:
      with self._lock:
        if path in self.named:
          continue
        self.named.add(path)
        count = len(self.named)
      print(f'image_folder: skipped unreadable image {path} ({reason}); the next image of its '
            f'split is used instead ({count} unreadable so far, each named once)',
            file=self.stream or sys.stderr, flush=True)


REPORT = Reporter()   # this process's: a file is named once however many batches meet it
