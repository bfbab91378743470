"""A folder of a person's own images, one subfolder per class, for ``--model vit|resnet --data DIR``.

Layouts (class names are the subfolder names, sorted; label ``i`` is the ``i``-th):

* ``DIR/train/<class>/*.{png,jpg,jpeg}`` and ``DIR/val/<class>/...``;
* ``DIR/<class>/...``: :data:`VAL_FRACTION` of each class is held out, chosen by a
  hash of the file name (the same split on every machine and every run; adding
  files does not move the others).

Images are decoded with Pillow and converted to RGB (or greyscale for a
1-channel model). Training images get the usual augmentation (a random resized
crop with torchvision's default scale and ratio ranges, resized to the image
side with bilinear filtering, and a horizontal flip with probability 1/2; ``--augment``
picks either, both or none, and ``--crop-scale`` the crop's area range);
validation images none: the centre square, resized to the image side (for a
square image that is exactly what ``transformers``' ``ViTImageProcessor`` does).
Pixels are scaled to [0, 1] and normalised with the checkpoint's mean and std
(:func:`normalisation`).

A batch is a pure function of (seed, step): the example at global position
``p = step * B + row`` is image ``perm_e[p % N]`` of epoch ``e = p // N``,
where ``perm_e`` is a permutation drawn from ``(seed, e)``, and its
augmentation is drawn from ``(seed, step, row)``. So resume is exact, and a
process on a mesh decodes only the rows its devices hold (``rows``). Grain
(:meth:`ImageFolderData.stream`) computes the batches of the steps ahead in
worker processes, which only changes when a batch is ready, never what it holds.

Files that Pillow cannot identify are skipped when the folder is read, and
counted; an image above the size limit is refused then, in one line; an image
that fails later, while being decoded, is replaced by the next readable image
of its split (deterministically) and named once on stderr
(:mod:`training.data.image_decode`, which also decodes 16-bit images at their
own depth).

Decoding runs ahead of the training step by a bounded number of batches: at
most :data:`PREFETCH_BATCHES` decoded ahead in this process (``--data-workers
0``), or that many per worker process. Grain's defaults (16 threads and 500
elements per process) held 500 batches: 6.0 GB against 2.9 GB for the same
model on procedural images.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from pathlib import Path

import numpy as np
from PIL import Image

from training.data import DataError
from training.data import image_decode
from training.data.image_decode import BAD_DECODE, decode, open_image, to_channels

IMAGE_SUFFIXES = ('.png', '.jpg', '.jpeg')
VAL_FRACTION = 0.1
CROP_SCALE = (0.08, 1.0)      # torchvision's RandomResizedCrop defaults: area fraction ...
CROP_RATIO = (3 / 4, 4 / 3)   # ... and aspect ratio (w / h) of the crop
AUGMENTS = ('none', 'flip', 'crop', 'crop+flip')   # --augment; crop+flip is the default
RESAMPLE = Image.Resampling.BILINEAR  # transformers' ViTImageProcessor default (resample=2)
PREFETCH_BATCHES = 2  # batches decoded ahead per process: the next step's, and one in reserve
# The normalisation a model family's Hugging Face processor uses when the checkpoint names
# none: ViTImageProcessor's (0.5, 0.5) and ResNet's ImageNet statistics (microsoft/resnet-*).
DEFAULT_NORMALISATION = {'vit': ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
                         'resnet': ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))}


@dataclasses.dataclass(frozen=True)
class Normalisation:
  """Per-channel ``(x / 255 - mean) / std``, and where the numbers came from."""
  mean: tuple[float, ...]
  std: tuple[float, ...]
  source: str


def normalisation(arch: str, init_from: str | None, channels: int) -> Normalisation:
  """The checkpoint's ``preprocessor_config.json`` mean and std, else the family's default.

  Raises:
    DataError: one line, for a preprocessor config that cannot be read or whose
      mean/std do not have one entry per channel.
  """
  file = Path(init_from) / 'preprocessor_config.json' if init_from else None
  if file is not None and file.is_file():
    try:
      raw = json.loads(file.read_text())
      mean, std = raw['image_mean'], raw['image_std']
      mean, std = (tuple(float(v) for v in (x if isinstance(x, list) else [x] * channels))
                   for x in (mean, std))
    except (OSError, ValueError, KeyError, TypeError) as e:
      raise DataError(f'cannot read image_mean/image_std from {file}: '
                      f'{type(e).__name__} {str(e).splitlines()[0] if str(e) else ""}') from None
    source = str(file)
  else:
    mean, std = (m[:channels] for m in DEFAULT_NORMALISATION[arch])
    source = f'the {arch} default (no preprocessor_config.json to read)'
  if len(mean) != channels or len(std) != channels or min(std) <= 0:
    raise DataError(f'{source}: image_mean {list(mean)} / image_std {list(std)} do not fit a '
                    f'{channels}-channel model (one value per channel, std > 0)')
  return Normalisation(mean, std, source)


def _images_in(folder: Path) -> list[Path]:
  return sorted(p for p in folder.iterdir()
                if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file() and not p.name.startswith('.'))


def _class_folders(root: Path, what: str) -> dict[str, list[Path]]:
  """Class name -> its image files; every class folder must hold at least one image."""
  classes = {d.name: _images_in(d) for d in sorted(root.iterdir())
             if d.is_dir() and not d.name.startswith('.')}
  if not classes:
    raise DataError(f"--data '{what}' has no class folders; expected {what}/<class>/*.png|jpg|jpeg "
                    f'(or train/ and val/ holding class folders)')
  if not any(classes.values()):
    raise DataError(f"--data '{what}' holds no images (.png, .jpg, .jpeg) in its class folders "
                    f"({', '.join(list(classes)[:4])}{' ...' if len(classes) > 4 else ''})")
  empty = [c for c, files in classes.items() if not files]
  if empty:
    raise DataError(f"--data '{what}': class folder '{empty[0]}' holds no images (.png, .jpg, "
                    f'.jpeg){f" (nor do {len(empty) - 1} more)" if len(empty) > 1 else ""}; '
                    'remove it or add images')
  return classes


def _readable(files: list[tuple[str, int]]) -> tuple[list[tuple[str, int]], int]:
  """Keeps the files Pillow identifies (it reads only the header); counts the others.

  Raises:
    TooLargeError: one line, for an image above the size limit.
  """
  kept = []
  for path, label in files:
    try:
      with open_image(path):   # identification (and the size check) is what we need
        kept.append((path, label))
    except DataError:
      raise
    except BAD_DECODE:
      pass
  return kept, len(files) - len(kept)


def _held_out(path: Path) -> float:
  """A number in [0, 1) fixed by the file name: the hash that picks the held-out files."""
  return int.from_bytes(hashlib.sha1(path.name.encode()).digest()[:8], 'big') / 2.0 ** 64


def _split(classes: dict[str, list[Path]]) -> tuple[list[Path], list[Path]]:
  train, val = [], []
  for files in classes.values():
    ranked = sorted(files, key=_held_out)
    n_val = max(1, round(VAL_FRACTION * len(files))) if len(files) > 1 else 0
    val += ranked[:n_val]
    train += ranked[n_val:]
  return train, val


@dataclasses.dataclass(frozen=True)
class ImageFolderData:
  """A class-folder image set at one image side; the same interface as ``ShapesData``.

  Attributes:
    image_size: pixels per side of every batch image.
    classes: class names; label ``i`` is ``classes[i]``.
    train, val: ``(path, label)`` of each readable image.
    norm: the normalisation applied.
    channels: 3 (RGB) or 1 (greyscale).
    skipped: files with an image suffix that Pillow could not identify.
    source: a one-line description.
    augment: the training images' augmentation (:data:`AUGMENTS`): a random resized crop of
      ``crop_scale`` of the area, a horizontal flip, both or none (then the held-out transform).
  """
  image_size: int
  classes: tuple[str, ...]
  train: tuple[tuple[str, int], ...]
  val: tuple[tuple[str, int], ...]
  norm: Normalisation
  channels: int = 3
  skipped: int = 0
  source: str = ''
  augment: str = 'crop+flip'
  crop_scale: tuple[float, float] = CROP_SCALE

  @property
  def num_classes(self) -> int:
    return len(self.classes)

  # Decoding ---------------------------------------------------------------------------------
  def _open(self, records, index: int, failures: list) -> tuple[Image.Image, int]:
    """(image, label) of record ``index``, or of the next one that decodes; each that does not
    is added to ``failures`` as ``(path, reason)``."""
    for k in range(len(records)):
      path, label = records[(index + k) % len(records)]
      try:
        return decode(path, self.channels), label
      except BAD_DECODE as e:
        failures.append((path, f'{type(e).__name__}: {str(e).splitlines()[0]}' if str(e)
                         else type(e).__name__))
    image_decode.REPORT(failures)
    raise DataError(f'no image of {self.source} could be decoded')

  def _to_array(self, im: Image.Image) -> np.ndarray:
    x = to_channels(np.asarray(im, np.float32), self.channels)
    mean = np.asarray(self.norm.mean, np.float32)
    std = np.asarray(self.norm.std, np.float32)
    return (x * np.float32(1 / 255) - mean) / std

  def _train_image(self, im: Image.Image, rng: np.random.Generator) -> np.ndarray:
    """Random resized crop (torchvision's algorithm: 10 tries, then the centre) and flip, as
    ``augment`` says; without the crop, the held-out transform (the centre square)."""
    if 'crop' not in self.augment:
      out = self._centre(im)
      if 'flip' in self.augment and rng.random() < 0.5:
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
      return self._to_array(out)
    w, h = im.size
    box = None
    for _ in range(10):
      area = w * h * rng.uniform(*self.crop_scale)
      ratio = math.exp(rng.uniform(math.log(CROP_RATIO[0]), math.log(CROP_RATIO[1])))
      cw, ch = round(math.sqrt(area * ratio)), round(math.sqrt(area / ratio))
      if 0 < cw <= w and 0 < ch <= h:
        x0, y0 = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
        box = (x0, y0, x0 + cw, y0 + ch)
        break
    if box is None:  # the whole image, clipped to the ratio range, centred
      cw, ch = w, h
      if w / h < CROP_RATIO[0]:
        ch = round(w / CROP_RATIO[0])
      elif w / h > CROP_RATIO[1]:
        cw = round(h * CROP_RATIO[1])
      box = ((w - cw) // 2, (h - ch) // 2, (w - cw) // 2 + cw, (h - ch) // 2 + ch)
    s = self.image_size
    out = im.resize((s, s), RESAMPLE, box=box)
    if 'flip' in self.augment and rng.random() < 0.5:
      out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return self._to_array(out)

  def _centre(self, im: Image.Image) -> Image.Image:
    w, h = im.size
    side = min(w, h)
    box = ((w - side) // 2, (h - side) // 2, (w - side) // 2 + side, (h - side) // 2 + side)
    return im.resize((self.image_size, self.image_size), RESAMPLE, box=box)

  def _val_image(self, im: Image.Image) -> np.ndarray:
    return self._to_array(self._centre(im))

  # Batches ----------------------------------------------------------------------------------
  def _empty(self, batch_size: int) -> np.ndarray:
    s = self.image_size
    return np.zeros((batch_size, s, s, self.channels), np.float32)

  def batch(self, step: int, batch_size: int, seed: int,
            rows=None) -> tuple[np.ndarray, np.ndarray]:
    """The training batch of ``step``: a pure function of (seed, step).

    Args:
      rows: the batch rows to decode (a process's share on a mesh); the other
        rows are zeros with label 0. None: all.

    Returns:
      images float32 [B, S, S, C] (normalised) and labels int32 [B]. Files that failed to
      decode are named on stderr (once per process).
    """
    images, labels, failures = self.batch_and_failures(step, batch_size, seed, rows)
    image_decode.REPORT(failures)
    return images, labels

  def batch_and_failures(self, step: int, batch_size: int, seed: int, rows=None):
    """:meth:`batch` and the ``(path, reason)`` of each file that failed to decode, unreported
    (a worker process hands them to the training process, which names each once)."""
    if batch_size < 1:
      raise DataError(f'batch_size must be at least 1, got {batch_size}')
    n = len(self.train)
    images, labels = self._empty(batch_size), np.zeros(batch_size, np.int32)
    perms, failures = {}, []
    for row in range(batch_size) if rows is None else rows:
      pos = step * batch_size + int(row)
      epoch = pos // n
      if epoch not in perms:
        perms[epoch] = np.random.default_rng((seed, epoch)).permutation(n)
      index = int(perms[epoch][pos % n])
      im, labels[row] = self._open(self.train, index, failures)
      images[row] = self._train_image(im, np.random.default_rng((seed, step, int(row))))
    return images, labels, failures

  def val_batches(self, n: int, batch_size: int, seed: int = 0,
                  rows=None) -> list[tuple[np.ndarray, np.ndarray]]:
    """The held-out images in folder order, at most ``n`` batches.

    The last batch is filled up by starting the held-out images again, so every
    batch has ``batch_size`` rows (one compiled shape, a batch that splits over
    a mesh); a held-out set smaller than a batch counts each image equally often
    when ``batch_size`` is a multiple of its size. ``seed`` is unused (the set is fixed).
    """
    del seed
    count = min(n, math.ceil(len(self.val) / batch_size))
    out, failures = [], []
    for b in range(count):
      images, labels = self._empty(batch_size), np.zeros(batch_size, np.int32)
      for row in range(batch_size) if rows is None else rows:
        index = (b * batch_size + int(row)) % len(self.val)
        im, labels[row] = self._open(self.val, index, failures)
        images[row] = self._val_image(im)
      out.append((images, labels))
    image_decode.REPORT(failures)
    return out

  def stream(self, start: int, batch_size: int, seed: int, workers: int, rows=None):
    """An iterator over ``(images, labels, failures)`` of steps ``start, start + 1, ...`` (see
    :meth:`batch_and_failures`; the caller names the failures).

    With ``workers > 0``, Grain computes the coming batches in that many worker
    processes (each decodes whole batches; the order is kept); with 0, in one
    thread of this process. Either way at most :data:`PREFETCH_BATCHES` batches
    per process are decoded ahead.
    """
    import grain
    steps = grain.MapDataset.range(start, 1 << 62).map(_BatchOf(self, batch_size, seed, rows))
    if workers <= 0:   # one thread decodes while the step runs (XLA releases the GIL)
      return iter(steps.to_iter_dataset(grain.ReadOptions(
          num_threads=1, prefetch_buffer_size=PREFETCH_BATCHES)))
    # Grain reads an absl flag in its workers; a script that never parsed absl flags would
    # stop there (google/grain#1355), so mark them parsed (their defaults) first.
    from absl import flags
    if not flags.FLAGS.is_parsed():
      flags.FLAGS.mark_as_parsed()
    # A worker decodes its next batch when its buffer has room: no threads of its own.
    return iter(steps.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
                .mp_prefetch(grain.MultiprocessingOptions(
                    num_workers=workers, per_worker_buffer_size=PREFETCH_BATCHES)))


@dataclasses.dataclass(frozen=True)
class _BatchOf:
  """step -> ImageFolderData.batch(step, ...); a picklable Grain map function."""
  data: ImageFolderData
  batch_size: int
  seed: int
  rows: tuple[int, ...] | None

  def __call__(self, step):
    images, labels, failures = self.data.batch_and_failures(int(step), self.batch_size,
                                                            self.seed, self.rows)
    return images, labels, tuple(failures)


def default_workers() -> int:
  """Grain worker processes: none on a machine of 2 cores or fewer (the step needs them), else
  up to 8, leaving two cores to the training process."""
  cores = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()
  return 0 if (cores or 1) <= 2 else min(8, cores - 2)


def _layout(path: str) -> tuple[tuple[str, ...], list[Path], list[Path], str]:
  """(class names, training files, held-out files, how they were split) of a folder."""
  root = Path(path)
  if not root.is_dir():
    raise DataError(f"--data '{path}' is not a folder; for a ViT or ResNet give a folder of "
                    'class folders (DIR/<class>/*.png|jpg|jpeg, or DIR/train/ and DIR/val/)')
  try:
    if not (root / 'train').is_dir():
      classes = _class_folders(root, str(path))
      return (tuple(classes), *_split(classes), f'{VAL_FRACTION:.0%} of each class held out')
    train_classes = _class_folders(root / 'train', f'{path}/train')
    if not (root / 'val').is_dir():
      raise DataError(f"--data '{path}' has train/ but no val/; add val/<class>/ folders, or put "
                      'the class folders directly in it for a held-out split')
    val_classes = _class_folders(root / 'val', f'{path}/val')
  except OSError as e:
    raise DataError(f"--data: cannot read '{e.filename}': {e.strerror}") from None
  unknown = sorted(set(val_classes) - set(train_classes))
  if unknown:
    raise DataError(f"--data '{path}': val/ has classes that train/ lacks: {', '.join(unknown[:4])}")
  return (tuple(train_classes), [f for files in train_classes.values() for f in files],
          [f for files in val_classes.values() for f in files], 'train/ and val/')


def class_names(path: str) -> tuple[str, ...]:
  """The class names of an image folder (sorted), after the checks of :func:`load_image_folder`
  that need no decoding.

  Raises:
    DataError: one line (see :func:`load_image_folder`).
  """
  return _layout(path)[0]


def load_image_folder(path: str, image_size: int, norm: Normalisation,
                      channels: int = 3, augment: str = 'crop+flip',
                      crop_scale: tuple[float, float] = CROP_SCALE) -> ImageFolderData:
  """Reads a class-folder layout (module docstring); nothing is decoded yet.

  Raises:
    DataError: one line: a missing folder, no class folders, no images, an
      empty class folder, val/ classes that train/ lacks, or a split with no images.
  """
  names, train_files, val_files, split = _layout(path)
  label = {c: i for i, c in enumerate(names)}
  train, bad_train = _readable([(str(f), label[f.parent.name]) for f in train_files])
  val, bad_val = _readable([(str(f), label[f.parent.name]) for f in val_files])
  for what, got in (('training', train), ('held-out', val)):
    if not got:
      raise DataError(f"--data '{path}' has no readable {what} images ({split}); each split "
                      'needs at least one (a class with one image goes to training only)')
  skipped = bad_train + bad_val
  source = (f"image folder {path} ({len(names)} classes, {len(train)} train / {len(val)} val "
            f"images, {split}{f', {skipped} unreadable files skipped' if skipped else ''}; "
            f"{image_size}x{image_size}, normalised by {norm.source})")
  return ImageFolderData(image_size, names, tuple(train), tuple(val), norm, channels, skipped,
                         source, augment, tuple(crop_scale))
