"""Training ViT and ResNet on procedural images: loss falls, BatchNorm state survives --resume."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from numerics import RTOL, assert_trees_close
from training import cli
from training.trainer import TrainConfig, train


def _cfg(tmp_path, config, **kw):
  base = dict(config=config, remat='sqrt', steps=8, batch_size=8, lr=3e-3, warmup_steps=2,
              out=str(tmp_path / 'run'), eval_every=4, eval_batches=2, save_every=4,
              memory_report=False)
  base.update(kw)
  return TrainConfig(**base)


def _rows(out):
  return [json.loads(l) for l in (Path(out) / 'metrics.jsonl').read_text().splitlines()]


@pytest.fixture(scope='module')
def resnet_run(tmp_path_factory):
  cfg = _cfg(tmp_path_factory.mktemp('resnet'), 'resnet-tiny', image_size=32)
  train(cfg, log=lambda *_: None)
  return cfg, _rows(cfg.out)


# Both ResNet runs share one 8-step training (about a minute on 2 cores): -m slow; ViT's
# end-to-end training stays in the default suite.
@pytest.mark.slow
def test_resnet_trains_and_reports_accuracy(resnet_run):
  _, rows = resnet_run
  assert [r['step'] for r in rows] == list(range(1, 9))
  assert {'loss', 'images_per_s', 'val_loss', 'val_accuracy'} <= set(rows[-1])
  assert 0.0 <= rows[-1]['val_accuracy'] <= 1.0
  assert np.isfinite([r['loss'] for r in rows]).all()


@pytest.mark.slow
def test_resnet_resume_restores_batch_stats(resnet_run, tmp_path, capsys):
  cfg, ref = resnet_run
  out = tmp_path / 'run'
  shutil.copytree(cfg.out, out)
  shutil.rmtree(out / 'checkpoints' / '8')
  # Resume under another policy: the checkpoint (params, batch_stats, optimizer) is policy-free.
  assert cli.main(['--resume', f'--out={out}', '--remat=stage', '--config=resnet-tiny']) == 0
  assert 'resumed step 4' in capsys.readouterr().out
  rows = _rows(out)
  # The evaluation after resuming uses the restored running averages: it would differ if
  # batch_stats had been re-initialised.
  # Another policy: rounding amplified by four AdamW steps (tests/test_train.py says why).
  assert_trees_close(np.array([r['loss'] for r in rows] + [rows[-1]['val_loss']]),
                     np.array([r['loss'] for r in ref] + [ref[-1]['val_loss']]), rtol=10 * RTOL)


def test_vit_trains_with_dropout(tmp_path):
  cfg = _cfg(tmp_path, 'vit-tiny', remat='minimal@sqrt', steps=4, eval_every=2)
  rows = train(cfg, log=lambda *_: None)
  assert [r['step'] for r in rows] == [1, 2, 3, 4] and 'val_accuracy' in rows[-1]


@pytest.mark.slow
@pytest.mark.parametrize('model', ['vit', 'resnet'])
def test_default_run_loss_falls_clearly(model, tmp_path):
  # The README's default vision runs (python train.py --model vit|resnet), 2-4 minutes each.
  args = cli.build_parser().parse_args([f'--model={model}', f'--out={tmp_path / model}',
                                        '--no-memory-report'])
  rows = train(cli.config_from_args(args), log=lambda *_: None)
  assert rows[0]['loss'] > 0.95 * np.log(10)  # chance level at the start
  assert rows[-1]['val_loss'] < 0.8 * np.log(10)
  assert rows[-1]['val_accuracy'] > 0.3  # chance: 0.1
