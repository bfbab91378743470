"""--augment and --crop-scale on an image folder (training/data/image_folder.py), on the batches.

The images are red on the left half and blue on the right, so a flip is seen
(the left column turns blue) and a crop's content is known. Every image is a
square, so the held-out transform (the centre square, resized) is the whole
image resized.
"""

import numpy as np
import pytest
from PIL import Image

from training.data.image_folder import Normalisation, load_image_folder

SIDE = 16
NORM = Normalisation((0.0, 0.0, 0.0), (1.0, 1.0, 1.0), 'none')


@pytest.fixture(scope='module')
def folder(tmp_path_factory):
  root = tmp_path_factory.mktemp('halves')
  for cls in ('a', 'b'):
    (root / cls).mkdir()
    for i in range(12):
      px = np.zeros((32, 32, 3), np.uint8)
      px[:, :16, 0] = 255           # left: red
      px[:, 16:, 2] = 255           # right: blue
      px[: 4 + i, :, 1] = 128       # a green band from the top, of another height per image
      Image.fromarray(px).save(root / cls / f'{i}.png')
  return root


def _images(folder, augment, scale=(0.08, 1.0), steps=6):
  data = load_image_folder(str(folder), SIDE, NORM, 3, augment, scale)
  return data, np.concatenate([data.batch(s, 8, seed=0)[0] for s in range(steps)])


def _flipped(x):   # the left column bluer than red: the image was mirrored
  return x[:, :, 0, 2] > x[:, :, 0, 0]


def _mirrored(x):   # per image: a row blue at its left end and red at its right
  return ((x[:, :, 0, 2] > x[:, :, 0, 0]) & (x[:, :, -1, 0] > x[:, :, -1, 2])).any(axis=1)


def test_none_is_the_held_out_transform(folder):
  data, x = _images(folder, 'none')
  val = np.concatenate([b[0] for b in data.val_batches(3, 8)])
  # The same images, decoded the same way: every training image is one of the held-out kind's.
  whole = {data._val_image(data._open(data.train, i, [])[0]).tobytes()
           for i in range(len(data.train))}
  assert all(img.tobytes() in whole for img in x)
  assert not _flipped(x).any() and not _flipped(val).any()


def test_flip_mirrors_about_half_and_never_crops(folder):
  data, x = _images(folder, 'flip')
  mirrored = _flipped(x).all(axis=1)
  assert 0.25 < mirrored.mean() < 0.75   # 48 draws of p = 1/2
  whole = {data._val_image(data._open(data.train, i, [])[0]).tobytes()
           for i in range(len(data.train))}
  unflipped = x[~mirrored]
  assert all(img.tobytes() in whole for img in unflipped)


def test_crop_without_flip_keeps_the_orientation(folder):
  _, x = _images(folder, 'crop', scale=(0.25, 0.5))
  # Crops of a quarter to half the area: never the whole image, never mirrored (blue on the
  # left of red). A crop may hold one colour only; many hold both.
  assert not _mirrored(x).any()
  assert ((x[:, :, 0, 0] > x[:, :, 0, 2]) & (x[:, :, -1, 2] > x[:, :, -1, 0])).any()
  data, whole = _images(folder, 'none')
  assert not any(img.tobytes() in {w.tobytes() for w in whole} for img in x)


def test_default_is_crop_and_flip(folder):
  _, x = _images(folder, 'crop+flip')
  assert _mirrored(x).any()   # some crop spans both halves, mirrored


@pytest.mark.parametrize('args,message', [
    (['--augment', 'flip', '--crop-scale', '0.5,1'], '--crop-scale applies to --augment crop'),
    (['--crop-scale', '1.5,2'], '--crop-scale MIN,MAX must have 0 < MIN <= MAX <= 1'),
    (['--crop-scale', 'nan,1'], '--crop-scale MIN,MAX must have 0 < MIN <= MAX <= 1'),
    (['--augment', 'flip'], '--augment applies to an image folder (--data DIR)'),
])
def test_bad_augmentation_is_one_line(tmp_path, capsys, args, message):
  from training import cli
  assert cli.main(['--model', 'vit', '--steps', '1', '--out', str(tmp_path / 'o'), *args]) == 2
  err = capsys.readouterr().err
  assert message in err and err.count('\n') == 1 and not (tmp_path / 'o').exists()
