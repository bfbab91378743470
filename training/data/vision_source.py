"""The one place a vision run's data is chosen: procedural shapes, or ``--data DIR`` (an image folder).

Both sources offer ``batch(step, batch_size, seed)`` (a pure function of
(seed, step)) and ``val_batches(n, batch_size)``; this module turns either into
what the trainer consumes: ``batch_at(step)``, the validation batches, and the
facts a run records about its data (class names, image side, normalisation),
which ``python -m training.export`` writes into the exported folder.
"""

from __future__ import annotations

from typing import Any, Callable

import jax.numpy as jnp
import numpy as np

from training.data import DataError
from training.data import image_decode
from training.data.image_folder import (CROP_SCALE, ImageFolderData, class_names,
                                        default_workers, load_image_folder, normalisation)
from training.data.shapes import CLASSES, PIXEL_MEAN, PIXEL_STD, load_images
from training.run import bounds


def num_classes(data: str | None, config_classes: int) -> int:
  """The classifier size a run needs: the image folder's class count, else the config's.

  Raises:
    DataError: one line, for a folder that is not a class-folder layout.
  """
  return len(class_names(data)) if data else config_classes


class _Prefetched:
  """``batch_at(step)`` over a Grain stream: consecutive steps come from the stream that is
  already decoding ahead; any other step (a resume, a jump) starts a new stream there."""

  def __init__(self, data: ImageFolderData, batch_size: int, seed: int, workers: int, rows):
    self.data, self.batch_size, self.seed, self.workers, self.rows = (
        data, batch_size, seed, workers, rows)
    self._stream, self._next = None, None

  def __call__(self, step: int):
    if self._stream is None or step != self._next:
      self._stream = self.data.stream(step, self.batch_size, self.seed, self.workers, self.rows)
    images, labels, failures = next(self._stream)
    image_decode.REPORT(failures)   # named here, once, whichever worker met them
    self._next = step + 1
    return _as_batch((np.asarray(images), np.asarray(labels)))


def _as_batch(pair):
  images, labels = pair
  return {'images': jnp.asarray(images), 'labels': jnp.asarray(labels)}


def open_vision_data(cfg, task, size: int, log: Callable[[str], Any],
                     rows=None) -> tuple[Callable, list, dict]:
  """(batch_at(step), validation batches, what the run records about its data).

  Args:
    cfg: the run's TrainConfig (``data``, ``init_from``, ``batch_size``, ``seed``,
      ``eval_batches``, ``data_workers``).
    task: the vision task (its config already sized for ``size`` and the data's classes).
    rows: the batch rows this process decodes on a mesh (None: all).

  Raises:
    DataError: one line, for an unusable image folder.
  """
  mc = task.config
  if not cfg.data:
    if cfg.augment != 'crop+flip' or cfg.crop_scale is not None:
      raise DataError(f"--{'augment' if cfg.augment != 'crop+flip' else 'crop-scale'} applies to "
                      'an image folder (--data DIR); the procedural shapes are drawn fresh '
                      'every step')
    shapes = load_images(size, min(10, mc.num_classes), mc.channels)
    try:   # drawn up front and kept: --eval-batches 100000000 was a hang
      bounds.check_held_out_memory(cfg.eval_batches, cfg.batch_size, size * size * mc.channels * 4)
    except bounds.BoundsError as e:
      raise DataError(str(e)) from None
    batch_at = lambda step: _as_batch(shapes.batch(step, cfg.batch_size, cfg.seed))
    val = [_as_batch(b) for b in shapes.val_batches(cfg.eval_batches, cfg.batch_size)]
    log(f'data: {shapes.source}: a fresh training batch every step, '
        f'{len(val) * cfg.batch_size} held-out images')
    return batch_at, val, {'classes': list(CLASSES[:shapes.num_classes]), 'image_size': size,
                           'image_mean': [PIXEL_MEAN] * mc.channels,
                           'image_std': [PIXEL_STD] * mc.channels}
  norm = normalisation(task.arch, cfg.init_from, mc.channels)
  scale = tuple(cfg.crop_scale) if cfg.crop_scale is not None else CROP_SCALE
  data = load_image_folder(cfg.data, size, norm, mc.channels, cfg.augment, scale)
  workers = default_workers() if cfg.data_workers is None else cfg.data_workers
  batch_at = _Prefetched(data, cfg.batch_size, cfg.seed, workers, rows)
  val = [_as_batch(b) for b in data.val_batches(cfg.eval_batches, cfg.batch_size, rows=rows)]
  shown = min(len(data.val), len(val) * cfg.batch_size)
  crop = f'random crops of {scale[0]:g}-{scale[1]:g} of the area' if 'crop' in cfg.augment else ''
  flip = 'horizontal flips' if 'flip' in cfg.augment else ''
  log(f"augmentation (--augment {cfg.augment}): {' and '.join(t for t in (crop, flip) if t) or 'none'}"
      ' (held-out images: the centre square)')
  log(f'data: {data.source}; {shown} held-out images per evaluation; '
      f"{f'{workers} Grain worker processes' if workers else 'decoded in this process'}")
  return batch_at, val, {'classes': list(data.classes), 'image_size': size,
                         'image_mean': list(norm.mean), 'image_std': list(norm.std)}
