"""Held-out image folders: ``--eval-data DIR`` for a vit or resnet run.

``DIR`` holds one folder per class, ``DIR/<class>/*.{png,jpg,jpeg}``, as
``--data``'s class-folder layout does, and every class folder must name a class
of the run (the classes of its ``--data`` folder, or of the procedural shapes):
a label is the class's index in the run's list, so an eval set that holds a few
of the classes is scored against the same labels as training. A folder of
another class is refused in one line before anything is written: the model has
no output for it.

The set is never trained on. Its images are read in folder order (classes
sorted, then file names) and get the held-out transform of ``--data``'s
validation images (the centre square, resized; no augmentation), normalised as
the run's images are. Every readable image is evaluated once per evaluation:
the last batch is filled up with rows of weight 0 (``weights`` in the batch,
:meth:`models.tasks.Task.loss`), so ``eval_<name>_loss`` and
``eval_<name>_accuracy`` are means over the set's images, whatever the batch size.
The batches are decoded once, at start-up, and kept, as the validation split's are.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np

from training.data import DataError
from training.data import image_decode
from training.data.held_out import HeldOutSet
from training.data.image_folder import (ImageFolderData, Normalisation, _images_in, _layout,
                                        _readable)
from training.data.text_source import eval_names
from training.run import bounds


def _names(classes) -> str:
  shown = ', '.join(classes[:6])
  return shown + (f' ... ({len(classes)} in all)' if len(classes) > 6 else '')


def list_eval_folder(path: str, classes: tuple[str, ...]) -> tuple[list[tuple[str, int]], int]:
  """(``(file, label)`` of each readable image in folder order, files skipped as unreadable).

  Raises:
    DataError: one line: not a folder, no class folders, a class folder the run
      does not have, or no readable image.
  """
  root = Path(path)
  layout = f"{path}/<class>/*.png|jpg|jpeg, <class> one of the run's classes ({_names(classes)})"
  if not root.is_dir():
    raise DataError(f"--eval-data '{path}' is not a folder; a vit or resnet run evaluates a folder "
                    f'of class folders, {layout}')
  label = {c: i for i, c in enumerate(classes)}
  try:
    folders = sorted(d for d in root.iterdir() if d.is_dir() and not d.name.startswith('.'))
    if not folders:
      raise DataError(f"--eval-data '{path}' has no class folders; expected {layout}")
    unknown = [d.name for d in folders if d.name not in label]
    if unknown:
      hint = (f" (for a train/ and val/ layout, pass '{root / 'val'}')"
              if {'train', 'val'} & set(unknown) else '')
      more = f' (and {len(unknown) - 1} more)' if len(unknown) > 1 else ''
      raise DataError(f"--eval-data '{path}': class folder '{unknown[0]}'{more} is not a class "
                      f"of the run, whose classes are {_names(classes)}{hint}; the model has no "
                      'output for it: rename or remove it')
    files = [(str(f), label[d.name]) for d in folders for f in _images_in(d)]
  except OSError as e:
    raise DataError(f"--eval-data: cannot read '{e.filename}': {e.strerror}") from None
  kept, skipped = _readable(files)
  if not kept:
    raise DataError(f"--eval-data '{path}' holds no readable images (.png, .jpg, .jpeg) in its "
                    'class folders')
  return kept, skipped


def eval_batches(data: ImageFolderData, batch_size: int, rows=None) -> list[dict]:
  """Every image of ``data.val`` once, in order, in batches of ``batch_size``: ``images``,
  ``labels`` and ``weights`` (1 for an image, 0 for a row that fills up the last batch).

  Args:
    rows: the rows this process decodes on a mesh (None: all); the weights are
      the same in every process.
  """
  out, failures = [], []
  n = len(data.val)
  for start in range(0, n, batch_size):
    s = data.image_size
    images = np.zeros((batch_size, s, s, data.channels), np.float32)
    labels = np.zeros(batch_size, np.int32)
    weights = (np.arange(start, start + batch_size) < n).astype(np.float32)
    for row in range(batch_size) if rows is None else rows:
      if start + int(row) < n:
        im, labels[row] = data._open(data.val, start + int(row), failures)
        images[row] = data._val_image(im)
    out.append({'images': jnp.asarray(images), 'labels': jnp.asarray(labels),
                'weights': jnp.asarray(weights)})
  image_decode.REPORT(failures)
  return out


def _check_memory(path: str, images: int, batch_size: int, image_bytes: int):
  """A set's decoded batches, kept for every evaluation, must fit in half this machine's memory
  (as :func:`training.run.bounds.check_held_out_memory` asks of the validation split)."""
  total, memory = -(-images // batch_size) * batch_size * image_bytes, bounds.physical_memory()
  if memory is not None and total > memory // 2:
    raise DataError(f"--eval-data '{path}': its {images:,} images would hold "
                    f'{total / 2**30:.1f} GiB decoded, more than half of the '
                    f'{memory / 2**30:.1f} GiB of this machine; evaluate a smaller folder (or a '
                    'smaller --image-size)')


def _training_files(data: str | None) -> set[str]:
  """The resolved paths of a run's training images (none for the procedural shapes)."""
  if not data:
    return set()
  return {str(f.resolve()) for f in _layout(data)[1]}


def eval_image_sets(cfg, task, size: int, meta: dict, log, warn, rows=None) -> list[HeldOutSet]:
  """The ``--eval-data`` folders of a vision run, as held-out sets named ``eval_<stem>``.

  Args:
    cfg: the run's TrainConfig (``eval_data``, ``data``, ``batch_size``).
    task: the vision task (its channels).
    size: the image side.
    meta: what the run records about its data: ``classes``, ``image_mean``, ``image_std``.
    rows: the batch rows this process decodes on a mesh (None: all).

  Raises:
    DataError: one line (:func:`list_eval_folder`), or for sets that do not fit in memory.
  """
  if not cfg.eval_data:
    return []
  classes = tuple(meta['classes'])
  norm = Normalisation(tuple(meta['image_mean']), tuple(meta['image_std']), "the run's")
  channels = task.config.channels
  listed = [list_eval_folder(path, classes) for path in cfg.eval_data]   # every check first
  trained = _training_files(cfg.data)
  sets = []
  for name, path, (files, skipped) in zip(eval_names(cfg.eval_data), cfg.eval_data, listed):
    _check_memory(path, len(files), cfg.batch_size, size * size * channels * 4)
    data = ImageFolderData(size, classes, (), tuple(files), norm, channels, skipped,
                           f'--eval-data {path}')
    sets.append(HeldOutSet(name, eval_batches(data, cfg.batch_size, rows)))
    shared = sum(str(Path(f).resolve()) in trained for f, _ in files)
    k = len({label for _, label in files})
    log(f"eval data: {path}: {len(files):,} images of {k} class{'es' if k > 1 else ''}, each "
        f'evaluated once, centre square, no augmentation (metrics {name}_loss, {name}_accuracy)'
        + (f'; {skipped} unreadable files skipped' if skipped else ''))
    if shared:
      warn(f"--eval-data '{path}': {shared:,} of its {len(files):,} images are also training "
           f'images of --data {cfg.data}: its metrics are not held-out ones')
  return sets
