"""training/data/image_folder.py: layouts, the deterministic split, augmentation, errors, Grain."""

import json

import numpy as np
import pytest
from PIL import Image, ImageDraw

from training.data import DataError
from training.data.image_folder import (DEFAULT_NORMALISATION, Normalisation, class_names,
                                   load_image_folder, normalisation)

NORM = Normalisation((0.5, 0.5, 0.5), (0.5, 0.5, 0.5), 'test')


def draw(path, cls: str, size, rng):
  """A red disk or a blue square on a light background, at a random place (PNG or JPEG)."""
  w, h = (size, size) if isinstance(size, int) else size
  im = Image.new('RGB', (w, h), tuple(int(v) for v in rng.integers(180, 256, 3)))
  r = rng.uniform(0.3, 0.45) * min(w, h)
  cx, cy = rng.uniform(r, w - r), rng.uniform(r, h - r)
  box = [cx - r, cy - r, cx + r, cy + r]
  if cls == 'red_disk':
    ImageDraw.Draw(im).ellipse(box, fill=(220, 30, 30))
  else:
    ImageDraw.Draw(im).rectangle(box, fill=(30, 30, 220))
  im.save(path)


def write_folder(root, counts: dict, size=32, seed=0, suffix='.png'):
  """``counts``: {'train': n, 'val': m} (a train/val layout) or {'': n} (class folders only)."""
  rng = np.random.default_rng(seed)
  for split, n in counts.items():
    for cls in ('blue_square', 'red_disk'):
      d = root / split / cls if split else root / cls
      d.mkdir(parents=True, exist_ok=True)
      for i in range(n):
        draw(d / f'{i}{suffix}', cls, size, rng)
  return root


@pytest.fixture(scope='module')
def folder(tmp_path_factory):
  return write_folder(tmp_path_factory.mktemp('imgs'), {'train': 6, 'val': 3})


def test_train_val_layout_labels_and_shapes(folder):
  data = load_image_folder(str(folder), 16, NORM)
  assert data.classes == ('blue_square', 'red_disk')
  assert len(data.train) == 12 and len(data.val) == 6 and data.skipped == 0
  images, labels = data.batch(0, 5, seed=0)
  assert images.shape == (5, 16, 16, 3) and images.dtype == np.float32
  assert labels.dtype == np.int32 and set(labels) <= {0, 1}
  # Normalised by (x - 0.5) / 0.5: every pixel in [-1, 1].
  assert images.min() >= -1 and images.max() <= 1


def test_batches_are_pure_functions_of_seed_and_step(folder):
  data = load_image_folder(str(folder), 16, NORM)
  a, b = data.batch(3, 8, seed=1), data.batch(3, 8, seed=1)
  np.testing.assert_array_equal(a[0], b[0])
  np.testing.assert_array_equal(a[1], b[1])
  assert not np.array_equal(a[0], data.batch(4, 8, seed=1)[0])
  assert not np.array_equal(a[0], data.batch(3, 8, seed=2)[0])


def test_an_epoch_sees_every_training_image_once(folder):
  """12 images, batch 4: steps 0..2 are one permutation of the training set (labels 6 + 6)."""
  data = load_image_folder(str(folder), 16, NORM)
  labels = np.concatenate([data.batch(s, 4, seed=0)[1] for s in range(3)])
  assert sorted(labels.tolist()) == [0] * 6 + [1] * 6


def test_a_process_decodes_only_its_rows_and_they_equal_the_whole_batch(folder):
  data = load_image_folder(str(folder), 16, NORM)
  whole = data.batch(2, 6, seed=0)
  part = data.batch(2, 6, seed=0, rows=(3, 4, 5))
  np.testing.assert_array_equal(part[0][3:], whole[0][3:])
  np.testing.assert_array_equal(part[1][3:], whole[1][3:])
  assert not part[0][:3].any()  # rows of other processes are left empty


def test_validation_has_no_augmentation_and_matches_vit_image_processor(folder):
  """A square image: centre square (the whole image) resized bilinearly, as ViTImageProcessor
  (its Pillow backend)."""
  transformers = pytest.importorskip('transformers')
  data = load_image_folder(str(folder), 16, NORM)
  (images, labels), = data.val_batches(1, 6)
  # transformers 5 has a Pillow and a torchvision backend (picked when torchvision is
  # installed, with its own resize); ours decodes and resizes with Pillow, as the former does.
  pillow = getattr(transformers, 'ViTImageProcessorPil', transformers.ViTImageProcessor)
  proc = pillow(size={'height': 16, 'width': 16}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
  pil = [Image.open(p).convert('RGB') for p, _ in data.val]
  theirs = proc(pil, return_tensors='np')['pixel_values'].transpose(0, 2, 3, 1)
  # uint8 pixels scaled by 1/255 and normalised in float: equal to a few float32 ulps of 1.
  np.testing.assert_allclose(images, theirs, rtol=0, atol=1e-6)
  np.testing.assert_array_equal(labels, [l for _, l in data.val])


def test_training_crops_flip_and_vary(tmp_path):
  """One asymmetric image: training views differ from each other and from the validation view."""
  d = tmp_path / 'one'
  for cls in ('a', 'b'):
    (d / cls).mkdir(parents=True)
    y, x = np.mgrid[:40, :60]
    im = np.stack([x * 4, y * 6, np.where(x < 20, 255, 0)], -1).astype(np.uint8)
    # Red grows to the right, green downwards (so every crop differs); blue only on the left,
    # where a flip moves it to the right.
    for i in range(2):
      Image.fromarray(im).save(d / cls / f'{i}.png')
  data = load_image_folder(str(d), 16, NORM)
  views = np.stack([data.batch(s, 2, seed=0)[0] for s in range(20)]).reshape(-1, 16, 16, 3)
  left, right = views[:, :, :8, 2].mean((1, 2)), views[:, :, 8:, 2].mean((1, 2))
  assert (left > right).any() and (right > left).any()  # some views flipped, some not
  assert len({v.tobytes() for v in views}) == len(views)  # every crop differs


def test_held_out_split_is_by_file_name_and_per_class(tmp_path):
  root = write_folder(tmp_path / 'flat', {'': 10})
  data = load_image_folder(str(root), 16, NORM)
  assert len(data.val) == 2 and len(data.train) == 18       # 10% of each class: one each
  assert sorted(l for _, l in data.val) == [0, 1]
  again = load_image_folder(str(root), 16, NORM)
  assert again.val == data.val                               # the same split every time


def test_unreadable_files_are_skipped_and_counted(tmp_path):
  root = write_folder(tmp_path / 'bad', {'train': 3, 'val': 1}, suffix='.jpg')
  (root / 'train' / 'red_disk' / 'broken.png').write_bytes(b'not an image')
  (root / 'val' / 'blue_square' / 'empty.jpeg').write_bytes(b'')
  (root / 'train' / 'red_disk' / 'notes.txt').write_text('ignored: not an image suffix')
  data = load_image_folder(str(root), 16, NORM)
  assert data.skipped == 2 and len(data.train) == 6 and len(data.val) == 2
  assert '2 unreadable files skipped' in data.source


@pytest.mark.parametrize('make,needle', [
    (lambda r: (r / 'a').mkdir(), "holds no images (.png, .jpg, .jpeg) in its class folders"),
    (lambda r: [(r / c).mkdir() for c in 'ab'] and Image.new('RGB', (4, 4)).save(r / 'a' / 'x.png'),
     "class folder 'b' holds no images"),
    (lambda r: (r / 'x.png').write_bytes(b''), 'has no class folders'),
    (lambda r: (r / 'train' / 'a').mkdir(parents=True) or Image.new('RGB', (4, 4)).save(
        r / 'train' / 'a' / 'x.png'), 'has train/ but no val/'),
])
def test_bad_folders_are_one_line_errors(tmp_path, make, needle):
  root = tmp_path / 'data'
  root.mkdir()
  make(root)
  with pytest.raises(DataError) as e:
    class_names(str(root))
  assert needle in str(e.value) and '\n' not in str(e.value)


def test_normalisation_from_the_checkpoint_folder_or_the_default(tmp_path):
  assert normalisation('vit', None, 3).mean == DEFAULT_NORMALISATION['vit'][0]
  assert normalisation('resnet', str(tmp_path), 3).std == DEFAULT_NORMALISATION['resnet'][1]
  (tmp_path / 'preprocessor_config.json').write_text(json.dumps(
      {'image_mean': [0.1, 0.2, 0.3], 'image_std': [0.4, 0.5, 0.6]}))
  got = normalisation('vit', str(tmp_path), 3)
  assert got.mean == (0.1, 0.2, 0.3) and got.std == (0.4, 0.5, 0.6)
  with pytest.raises(DataError, match='do not fit a 1-channel model'):
    normalisation('vit', str(tmp_path), 1)


def test_grain_stream_gives_the_batches_of_batch(folder):
  data = load_image_folder(str(folder), 16, NORM)
  stream = data.stream(5, 4, seed=0, workers=0)
  for step in (5, 6, 7):
    images, labels, failures = next(stream)
    assert failures == ()
    want = data.batch(step, 4, seed=0)
    np.testing.assert_array_equal(np.asarray(images), want[0])
    np.testing.assert_array_equal(np.asarray(labels), want[1])


@pytest.mark.slow
def test_grain_worker_processes_give_the_same_batches(folder):
  """Two Grain worker processes (spawned: several seconds to start) decode ahead, in order."""
  data = load_image_folder(str(folder), 16, NORM)
  stream = data.stream(0, 4, seed=0, workers=2)
  for step in range(4):
    images, labels, _ = next(stream)
    np.testing.assert_array_equal(np.asarray(images), data.batch(step, 4, seed=0)[0])
    np.testing.assert_array_equal(np.asarray(labels), data.batch(step, 4, seed=0)[1])
