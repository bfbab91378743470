"""Procedural shape images: determinism, shapes, balance, splits, scale, errors, learnability."""

import numpy as np
import pytest

from training.data import DataError
from training.data.shapes import CLASSES, ShapesData, load_images


def spectra(images):
  """Translation- and contrast-sign-invariant features: the normalised log power spectrum."""
  centred = images - images.mean(axis=(1, 2), keepdims=True)
  power = (np.abs(np.fft.rfft2(centred, axes=(1, 2))) ** 2).sum(-1).reshape(len(images), -1)
  return np.log1p(power / power.mean(1, keepdims=True))


def stack(batches):
  return np.concatenate([b[0] for b in batches]), np.concatenate([b[1] for b in batches])


@pytest.fixture(scope='module')
def shapes32():
  """2000 training and 500 held-out 32x32 colour images."""
  data = load_images(32)
  return stack([data.batch(step, 100, seed=0) for step in range(20)]), stack(data.val_batches(5, 100))


def test_deterministic_by_seed_and_step():
  data = load_images(32)
  x, y = data.batch(3, 16, seed=7)
  x2, y2 = load_images(32).batch(3, 16, seed=7)
  np.testing.assert_array_equal(x, x2)
  np.testing.assert_array_equal(y, y2)
  assert not np.array_equal(x, data.batch(4, 16, seed=7)[0])
  assert not np.array_equal(x, data.batch(3, 16, seed=8)[0])
  for (a, la), (b, lb) in zip(data.val_batches(2, 8, seed=1), data.val_batches(2, 8, seed=1)):
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(la, lb)


@pytest.mark.parametrize('size,batch,channels', [(16, 4, 3), (32, 64, 3), (37, 5, 1), (512, 2, 3)])
def test_shapes_and_dtypes(size, batch, channels):
  x, y = load_images(size, channels=channels).batch(0, batch, seed=0)
  assert x.shape == (batch, size, size, channels) and x.dtype == np.float32
  assert y.shape == (batch,) and y.dtype == np.int32
  assert np.isfinite(x).all()


def test_standardised():
  x, _ = load_images(32).batch(0, 256, seed=0)
  assert abs(x.mean()) < 0.1 and 0.8 < x.std() < 1.2


@pytest.mark.parametrize('num_classes,batch', [(10, 64), (10, 20), (4, 30), (2, 7)])
def test_labels_in_range_and_balanced(num_classes, batch):
  data = load_images(32, num_classes=num_classes)
  for step in range(3):
    _, y = data.batch(step, batch, seed=0)
    assert y.min() >= 0 and y.max() < num_classes
    counts = np.bincount(y, minlength=num_classes)
    assert counts.max() - counts.min() <= 1


def test_train_and_val_streams_differ():
  data = load_images(32)
  train = data.batch(0, 32, seed=0)[0]
  val = data.val_batches(3, 32, seed=0)
  assert len(val) == 3 and all(v[0].shape == (32, 32, 32, 3) for v in val)
  assert not any(np.array_equal(train, v[0]) for v in val)
  assert not np.array_equal(val[0][0], val[1][0])  # the held-out batches differ from each other too


def test_same_task_at_every_resolution():
  """The same (seed, step) draws the same classes, positions, sizes and colours at any side."""
  small, y_small = load_images(32).batch(0, 16, seed=0)
  large, y_large = load_images(128).batch(0, 16, seed=0)
  np.testing.assert_array_equal(y_small, y_large)
  pooled = large.reshape(16, 32, 4, 32, 4, 3).mean(axis=(2, 4))
  other = load_images(32).batch(1, 16, seed=0)[0]
  assert np.abs(pooled - small).mean() < 0.25 * np.abs(other - small).mean()


def test_classes_differ_more_than_noise(shapes32):
  """Per-class mean spectra from two disjoint sets agree within a class and differ across classes."""
  (x, y), (xv, yv) = shapes32
  a = np.stack([spectra(x[y == k]).mean(0) for k in range(10)])
  b = np.stack([spectra(xv[yv == k]).mean(0) for k in range(10)])
  dist = np.linalg.norm(a[:, None] - b[None], axis=-1)
  same, across = np.diag(dist), dist[~np.eye(10, dtype=bool)]
  assert same.max() < across.min()


def test_learnable_by_nearest_class_mean(shapes32):
  """A nearest-class-mean classifier on power spectra far beats chance on held-out images;
  on raw pixels it does not (random positions and colours), so the task is not template matching."""
  (x, y), (xv, yv) = shapes32

  def accuracy(f, fv):
    means = np.stack([f[y == k].mean(0) for k in range(10)])
    d2 = (fv ** 2).sum(1)[:, None] - 2 * fv @ means.T + (means ** 2).sum(1)[None]
    return (d2.argmin(1) == yv).mean()

  assert accuracy(spectra(x), spectra(xv)) > 0.6  # chance is 0.1; about 0.99 here
  assert accuracy(x.reshape(len(x), -1), xv.reshape(len(xv), -1)) < 0.2


def test_greyscale_and_source():
  data = load_images(24, num_classes=4, channels=1)
  assert isinstance(data, ShapesData)
  assert data.source == 'procedural shapes (4 classes, 24x24, 1 channel)'
  assert load_images(32).source == 'procedural shapes (10 classes, 32x32, 3 channels)'
  assert len(CLASSES) == 10


@pytest.mark.parametrize('kwargs,expect', [
    (dict(image_size=15), '>= 16'), (dict(image_size=32.0), '>= 16'),
    (dict(image_size=32, num_classes=1), '2 to 10'), (dict(image_size=32, num_classes=11), '2 to 10'),
    (dict(image_size=32, channels=2), '1 (greyscale) or 3 (colour)'),
])
def test_errors_are_one_line_and_name_the_valid_range(kwargs, expect):
  with pytest.raises(DataError) as info:
    load_images(**kwargs)
  message = str(info.value)
  assert '\n' not in message and expect in message
  assert isinstance(info.value, ValueError)


def test_batch_size_must_be_positive():
  with pytest.raises(DataError, match='at least 1'):
    load_images(32).batch(0, 0, seed=0)
