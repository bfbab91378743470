"""train.py --init-from: fine-tuning starts from a Hugging Face folder; bad folders fail in one line."""

import numpy as np
import pytest

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

from configs import load_config  # noqa: E402
from models.hf.load import load_hf  # noqa: E402
from models.tasks import Task  # noqa: E402
from numerics import assert_trees_close  # noqa: E402
from training import cli  # noqa: E402
from training.run.checkpoints import restore  # noqa: E402
from training.step import train_step as st  # noqa: E402


@pytest.fixture(scope='module')
def hf_resnet(tmp_path_factory):
  """A random HF ResNet with the shape of our resnet-tiny config, saved as safetensors."""
  cfg = load_config('resnet-tiny').model
  torch.manual_seed(0)
  model = transformers.ResNetForImageClassification(transformers.ResNetConfig(
      embedding_size=cfg.embedding_size, hidden_sizes=list(cfg.hidden_sizes),
      depths=list(cfg.depths), layer_type=cfg.layer_type, num_labels=cfg.num_classes))
  with torch.no_grad():  # non-trivial running statistics, so a lost batch_stats would show
    for m in model.modules():
      if isinstance(m, torch.nn.BatchNorm2d):
        m.running_mean.normal_()
        m.running_var.uniform_(0.5, 2.0)
  path = tmp_path_factory.mktemp('hf') / 'resnet'
  model.save_pretrained(path)
  return path


def test_init_from_finds_the_config_and_starts_from_the_weights(hf_resnet, tmp_path, capsys):
  out = tmp_path / 'run'
  # A learning rate of ~0 keeps the weights where they started, so the checkpoint shows them.
  assert cli.main([f'--init-from={hf_resnet}', '--steps=1', '--batch-size=4', '--lr=1e-12',
                   '--eval-every=1', f'--out={out}', '--no-memory-report']) == 0
  text = capsys.readouterr().out
  assert 'model: resnet-tiny' in text and 'initialised from the Hugging Face checkpoint' in text
  _, _, variables = load_hf(hf_resnet)
  task = Task(load_config('resnet-tiny').model)
  model = task.model('sqrt')
  tx = st.make_optimizer(1e-12, 1, 20, 1e-4, 1.0)
  state, _ = st.abstract_inputs(model, tx, 4, 32)
  restored, meta = restore(out, state, warn=pytest.fail)
  assert meta['config'] == 'resnet-tiny'
  # One AdamW step at lr 1e-12 moves a weight by ~1e-12: the imported weights, to rounding.
  assert_trees_close(restored.params, variables['params'])
  # Running averages moved by one training step (momentum 0.9) from the imported ones, not
  # from a fresh initialisation's zeros and ones.
  mean = lambda v: v['batch_stats']['embedder']['normalization']['mean']
  imported, trained = mean(variables), mean(restored.model_state)
  assert np.abs(trained - 0.9 * imported).max() < 0.2 * np.abs(imported).max()


@pytest.mark.parametrize('args,needle', [
    (['--init-from=/no/such/folder'], 'no Hugging Face checkpoint folder at /no/such/folder'),
    (['--config=resnet-18', '--init-from={hf}'], 'shape mismatch'),
    (['--config=tiny', '--init-from={hf}'], 'holds a ResNet checkpoint, not the expected GPT-2'),
])
def test_init_from_errors_are_one_line(args, needle, hf_resnet, tmp_path, capsys):
  out = tmp_path / 'never'
  code = cli.main([a.format(hf=hf_resnet) for a in args] + [f'--out={out}', '--steps=1'])
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and len(err) == 1 and err[0].startswith('train.py: error: ')
  assert needle in err[0], err[0]
  assert not out.exists()
