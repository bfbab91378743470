"""Images at their own bit depth, a size limit, failures named once, prefetch bounded (issue 36 (2), (4)).

Images are drawn here with Pillow; the memory test (slow) runs ``train.py`` in
subprocesses on an image folder and on procedural images and compares their
peak resident memory.
"""

import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from test_image_folder import write_folder
from training.data import DataError, image_decode
from training.data import image_folder
from training.data.image_folder import Normalisation, load_image_folder
from training.data.vision_source import _Prefetched

ROOT = Path(__file__).resolve().parents[1]
IDENTITY = Normalisation((0.0,) * 3, (1.0,) * 3, 'test')   # pixels / 255, as they are


def _gradient16(size=32) -> np.ndarray:
  """A 16-bit ramp over the whole range: 0 .. 65535."""
  return np.linspace(0, 65535, size * size).round().astype(np.uint16).reshape(size, size)


def test_a_16_bit_png_decodes_to_its_values(tmp_path):
  ramp = _gradient16()
  path = tmp_path / 'deep.png'
  Image.fromarray(ramp).save(path)   # a 16-bit greyscale PNG
  with Image.open(path) as im:
    assert im.mode in image_decode.SIXTEEN_BIT
  got = np.asarray(image_decode.decode(path, 3), np.float32)
  np.testing.assert_allclose(got, ramp / 65535 * 255, rtol=1e-6, atol=1e-3)
  # Through a whole folder: the validation batch holds the ramp on the 0..1 scale, in 3
  # channels; before, convert('RGB') clipped at 255 and 97% of its pixels were 1.0.
  for split in ('train', 'val'):
    for cls in ('a', 'b'):
      (tmp_path / 'f' / split / cls).mkdir(parents=True)
      Image.fromarray(ramp).save(tmp_path / 'f' / split / cls / '0.png')
  data = load_image_folder(str(tmp_path / 'f'), 32, IDENTITY)
  images, _ = data.val_batches(1, 1)[0]
  assert images.shape == (1, 32, 32, 3)
  np.testing.assert_allclose(images[0, ..., 0], ramp / 65535, atol=1e-5)
  np.testing.assert_array_equal(images[0, ..., 0], images[0, ..., 2])
  assert (images >= 0.999).mean() < 0.01
  train, _ = data.batch(0, 2, seed=0)
  assert 0.0 <= train.min() and train.max() <= 1.0 + 1e-6 and (train >= 0.999).mean() < 0.05


def test_an_8_bit_image_decodes_as_before(tmp_path):
  rgb = np.random.default_rng(0).integers(0, 256, (8, 8, 3)).astype(np.uint8)
  Image.fromarray(rgb).save(tmp_path / 'x.png')
  np.testing.assert_array_equal(np.asarray(image_decode.decode(tmp_path / 'x.png', 3)), rgb)
  grey = np.asarray(image_decode.decode(tmp_path / 'x.png', 1))
  assert grey.shape == (8, 8) and grey.dtype == np.uint8


@pytest.mark.parametrize('side', [9500, 13400])   # above the limit; above twice the limit
def test_an_image_above_the_size_limit_is_refused_in_one_line(tmp_path, side, capfd):
  root = write_folder(tmp_path / 'f', {'train': 2, 'val': 1})
  huge = root / 'train' / 'red_disk' / 'huge.png'
  Image.new('1', (side, side)).save(huge)   # 1 bit per pixel: a few kB on disk
  with pytest.raises(DataError) as e:
    load_image_folder(str(root), 16, IDENTITY)
  line = str(e.value)
  assert str(huge) in line and 'more than the limit of 89,478,485 pixels' in line
  assert '\n' not in line and capfd.readouterr().err == ''   # no Pillow warning either
  if side == 9500:
    assert '9500x9500 (90,250,000 pixels)' in line


def _truncated_folder(tmp_path) -> tuple[Path, Path]:
  root = write_folder(tmp_path / 'f', {'train': 3, 'val': 1}, size=64)
  bad = root / 'train' / 'red_disk' / 'cut.png'
  rng = np.random.default_rng(1)
  Image.fromarray(rng.integers(0, 256, (64, 64, 3)).astype(np.uint8)).save(bad)
  bad.write_bytes(bad.read_bytes()[:200])   # the header identifies; the pixels do not decode
  return root, bad


def test_a_truncated_image_is_named_once_with_a_count(tmp_path, capfd, monkeypatch):
  monkeypatch.setattr(image_decode, 'REPORT', image_decode.Reporter())   # a fresh process's
  root, bad = _truncated_folder(tmp_path)
  data = load_image_folder(str(root), 16, IDENTITY)
  assert str(bad) in {p for p, _ in data.train}   # it identifies; decoding fails later
  batch_at = _Prefetched(data, 4, seed=0, workers=0, rows=None)
  for step in range(12):   # 48 images of 7: the truncated one is met about 7 times
    batch_at(step)
  for step in range(12):
    data.batch(step, 4, seed=0)
  lines = capfd.readouterr().err.splitlines()
  assert len(lines) == 1, lines
  assert lines[0].startswith(f'image_folder: skipped unreadable image {bad} (OSError')
  assert '(1 unreadable so far, each named once)' in lines[0]


def test_decoding_runs_at_most_a_few_batches_ahead(tmp_path, monkeypatch):
  """Grain's defaults (16 threads, 500 elements) decoded up to 500 batches ahead in-process."""
  root = write_folder(tmp_path / 'f', {'train': 3, 'val': 1})
  data = load_image_folder(str(root), 16, IDENTITY)
  decoded, lock = [], threading.Lock()
  real = image_folder.ImageFolderData.batch_and_failures

  def counting(self, step, *args, **kwargs):
    with lock:
      decoded.append(step)
    return real(self, step, *args, **kwargs)
  monkeypatch.setattr(image_folder.ImageFolderData, 'batch_and_failures', counting)
  stream = data.stream(0, 2, seed=0, workers=0)
  for pulled in range(1, 6):
    next(stream)
    with lock:   # at every moment: the pulled batches plus the buffer, at most
      assert max(decoded) < pulled + image_folder.PREFETCH_BATCHES, decoded


def _peak_rss_kib(argv, cwd) -> int:
  """Peak resident memory (KiB) of ``python argv`` run in a child of a fresh wrapper."""
  wrapper = ('import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], '
             'capture_output=True, text=True); sys.stderr.write(r.stderr); '
             'print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)')
  out = subprocess.run([sys.executable, '-c', wrapper, sys.executable, *argv], cwd=cwd,
                       capture_output=True, text=True, timeout=900)
  code, kib = out.stdout.split()
  assert code == '0', out.stderr
  return int(kib)


@pytest.mark.slow   # two ViT runs at 128 px in subprocesses
def test_in_process_decoding_at_128_px_stays_near_the_procedural_peak(tmp_path):
  root = write_folder(tmp_path / 'imgs', {'train': 40, 'val': 4}, size=(320, 240),
                      suffix='.jpg')
  common = [str(ROOT / 'train.py'), '--model', 'vit', '--image-size', '128', '--steps', '6',
            '--batch-size', '16', '--eval-batches', '1', '--eval-every', '6',
            '--no-memory-report', '--remat', 'full']
  procedural = _peak_rss_kib(common + ['--out', str(tmp_path / 'a')], tmp_path)
  folder = _peak_rss_kib(common + ['--data', str(root), '--data-workers', '0',
                                   '--out', str(tmp_path / 'b')], tmp_path)
  print(f'peak RSS: procedural {procedural / 2**20:.2f} GiB, image folder {folder / 2**20:.2f} GiB')
  assert folder < 1.5 * procedural, (folder, procedural)
