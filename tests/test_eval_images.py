"""--eval-data DIR for a vision run (training/data/held_out_images.py): each folder named in the
metrics, every image counted once, scored against the run's classes, checked by hand."""

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import optax
import pytest
from PIL import Image

from models.tasks import Task
from vision_runs import restore_vit_run
from test_image_folder import draw, write_folder
from training import cli

SIDE = 16


def _images(root, drawn: dict, seed: int):
  """``drawn``: class folder -> what each of its images shows (a class of
  tests/test_image_folder.py's ``draw``; another class's picture is a wrong label)."""
  rng = np.random.default_rng(seed)
  for cls, kinds in drawn.items():
    (root / cls).mkdir(parents=True, exist_ok=True)
    for i, kind in enumerate(kinds):
      draw(root / cls / f'{i}.png', kind, 32, rng)
  return root


def _argv(tmp, out, *more):
  return ['--config=vit-tiny', f'--image-size={SIDE}', f'--data={tmp / "data"}',
          '--batch-size=4', '--augment=none', '--data-workers=0', '--no-memory-report',
          f'--out={out}', *more]


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  """Six steps on two classes (a blue square or a red disk: learnt in three steps); two eval
  folders: five images (a batch of 4, and one of 1 image and 3 filling rows), one of them a red
  disk filed as a blue square, so the accuracy is 4/5; and two images of the second class only."""
  tmp = tmp_path_factory.mktemp('evimg')
  write_folder(tmp / 'data', {'': 6})
  _images(tmp / 'heldout', {'blue_square': ['blue_square', 'red_disk', 'blue_square'],
                            'red_disk': ['red_disk', 'red_disk']}, seed=1)
  _images(tmp / 'reds', {'red_disk': ['red_disk', 'red_disk']}, seed=2)
  out = tmp / 'run'
  with contextlib.redirect_stdout(io.StringIO()) as said:
    code = cli.main(_argv(tmp, out, '--steps=6', '--eval-every=3', '--eval-batches=1',
                          '--lr=3e-3', f'--eval-data={tmp / "heldout"}',
                          f'--eval-data={tmp / "reds"}', '--keep-best=eval_reds_loss'))
  assert code == 0, said.getvalue()
  rows = [json.loads(l) for l in (out / 'metrics.jsonl').read_text().splitlines()]
  return tmp, out, rows, said.getvalue()


def _by_hand(folder: Path, config, params, meta):
  """(mean cross-entropy, accuracy) over every image of ``folder``, decoded here with Pillow:
  the whole (square) image resized to the run's side, normalised with the run's statistics,
  labelled by the class's index in the run's class list."""
  classes = meta['data']['classes']
  mean, std = (np.asarray(meta['data'][k], np.float32) for k in ('image_mean', 'image_std'))
  xs, ys = [], []
  for path in sorted(folder.glob('*/*.png')):
    im = Image.open(path).convert('RGB').resize((SIDE, SIDE), Image.Resampling.BILINEAR)
    xs.append((np.asarray(im, np.float32) / 255 - mean) / std)
    ys.append(classes.index(path.parent.name))
  logits = Task(config).model('none').apply({'params': params}, np.stack(xs), deterministic=True)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, np.asarray(ys))
  return float(ce.mean()), float(np.mean(np.argmax(logits, -1) == np.asarray(ys)))


def test_each_folder_is_named_and_scored_once_per_image(run, capsys):
  tmp, out, rows, said = run
  # The eval folders are not training data: the run trains on --data's 10 training images, and
  # each folder is evaluated whole, in its own metrics.
  assert '2 classes, 10 train / 2 val images' in said
  assert (f'eval data: {tmp / "heldout"}: 5 images of 2 classes, each evaluated once, centre '
          'square, no augmentation (metrics eval_heldout_loss, eval_heldout_accuracy)') in said
  assert f'eval data: {tmp / "reds"}: 2 images of 1 class,' in said
  evaluated = [r for r in rows if 'val_loss' in r]
  assert [r['step'] for r in evaluated] == [3, 6]
  for r in evaluated:
    assert {'eval_heldout_loss', 'eval_heldout_accuracy', 'eval_reds_loss',
            'eval_reds_accuracy'} <= set(r)
  config, params, meta = restore_vit_run(out)
  assert meta['data']['classes'] == ['blue_square', 'red_disk']
  assert (out / 'best').is_dir()   # an eval folder's metric is one --keep-best may name
  assert meta['train']['eval_data'] == [str(tmp / 'heldout'), str(tmp / 'reds')]
  # Every image once: the filling rows of the last batch count for nothing (counted with
  # weight 1 they gave 0.5 here), and the one-class folder is scored against the run's labels.
  assert [r['eval_heldout_accuracy'] for r in evaluated] == [0.8, 0.8]
  assert [r['eval_reds_accuracy'] for r in evaluated] == [1.0, 1.0]
  for name in ('heldout', 'reds'):
    loss, accuracy = _by_hand(tmp / name, config, params, meta)
    assert evaluated[-1][f'eval_{name}_accuracy'] == pytest.approx(accuracy, abs=1e-5)
    assert evaluated[-1][f'eval_{name}_loss'] == pytest.approx(loss, rel=1e-4, abs=2e-5)


@pytest.mark.parametrize('make,needle', [
    (lambda t: _images(t / 'ev', {'red_disk': ['red_disk'], 'green_star': ['red_disk']}, 3),
     "class folder 'green_star' is not a class of the run, whose classes are blue_square, "
     'red_disk'),
    (lambda t: (t / 'ev').write_text('{"text": "a"}\n'), "--eval-data '{ev}' is not a folder"),
    (lambda t: write_folder(t / 'ev', {'train': 1, 'val': 1}),
     "for a train/ and val/ layout, pass '{ev}/val'"),
])
def test_a_bad_eval_folder_is_one_line_and_writes_nothing(run, tmp_path, capsys, make, needle):
  tmp = run[0]
  make(tmp_path)
  out = tmp_path / 'never'
  code = cli.main(_argv(tmp, out, '--steps=1', f'--eval-data={tmp_path / "ev"}'))
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and len(err) == 1 and err[0].startswith('train.py: error: '), err
  assert needle.format(ev=tmp_path / 'ev') in err[0], err[0]
  assert not out.exists()


def test_training_images_in_an_eval_folder_are_named(run):
  """An eval folder that shares files with --data (here --data itself, a class-folder layout
  whose 90% are trained on) is evaluated, with a warning that its metrics are not held out."""
  from types import SimpleNamespace
  from training.data.held_out_images import eval_image_sets
  tmp = run[0]
  cfg = SimpleNamespace(eval_data=(str(tmp / 'data'),), data=str(tmp / 'data'), batch_size=4)
  task = SimpleNamespace(config=SimpleNamespace(channels=3))
  meta = {'classes': ['blue_square', 'red_disk'], 'image_mean': [0.5] * 3, 'image_std': [0.5] * 3}
  warned = []
  sets = eval_image_sets(cfg, task, SIDE, meta, lambda _: None, warned.append)
  assert [s.name for s in sets] == ['eval_data'] and len(sets[0].batches) == 3   # 12 images
  assert warned == [f"--eval-data '{tmp / 'data'}': 10 of its 12 images are also training "
                    f"images of --data {tmp / 'data'}: its metrics are not held-out ones"]


def test_a_text_run_refuses_an_image_folder(run, tmp_path, capsys):
  """A gpt run given an image folder says so, rather than reading the PNGs as text."""
  text = tmp_path / 't.txt'
  text.write_text('the quick brown fox jumps over the lazy dog. ' * 50)
  out = tmp_path / 'never'
  code = cli.main(['--model', 'gpt', '--data', str(text), '--seq-len', '16', '--steps', '1',
                   f'--eval-data={run[0] / "reds"}', f'--out={out}', '--no-memory-report'])
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and len(err) == 1, err
  assert f"--eval-data '{run[0] / 'reds'}' holds images (.png files); a gpt or llama run " in err[0]
  assert not out.exists()
