"""A ViT run read back from its latest checkpoint, for tests that score it by hand."""

from pathlib import Path

import pytest

from models.tasks import Task
from models.vit import ViTConfig
from training.run import checkpoints as ckpt
from training.step import train_step as st


def restore_vit_run(out):
  """(our config, params, the run record) of the run's latest checkpoint."""
  meta = ckpt.read_meta(out)[1]
  config = ViTConfig(**meta['model'])
  tx = st.make_optimizer(1e-3, 10, 1, 0.0, 1.0)  # the optimizer state's shapes only
  state, _ = st.abstract_inputs(Task(config).model('none'), tx, 1, config.image_size)
  restored, _ = ckpt.restore(Path(out), state, warn=pytest.fail)
  return config, restored.params, meta
