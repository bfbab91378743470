"""ViT positions at another size, fine-tune loading, and the vision writers back to transformers."""

import dataclasses

import jax
import numpy as np
import pytest

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

from configs import load_config  # noqa: E402
from models.hf.export_vision import (ExportError, resnet_writer, vit_writer,  # noqa: E402
                                     write_folder)
from models.hf.finetune import load_pretrained  # noqa: E402
from models.hf.load import load_hf, read_safetensors  # noqa: E402
from models.resnet import ResNetConfig  # noqa: E402
from models.tasks import Task  # noqa: E402
from models.vit_positions import resize_positions  # noqa: E402
from numerics import assert_trees_close  # noqa: E402

TINY_VIT = dict(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2,
                num_attention_heads=2, intermediate_size=64, num_labels=3)


@pytest.fixture(scope='module')
def hf_vit(tmp_path_factory):
  torch.manual_seed(0)
  model = transformers.ViTForImageClassification(transformers.ViTConfig(**TINY_VIT)).eval()
  path = tmp_path_factory.mktemp('hf') / 'vit16'
  model.save_pretrained(path)
  return path, model


def _logits(model, images):
  with torch.no_grad():
    return model(torch.tensor(images).permute(0, 3, 1, 2)).logits.numpy()


@pytest.mark.parametrize('old,new', [(4, 8), (4, 6), (14, 24), (8, 3)])
def test_positions_resample_as_torch_bicubic(old, new):
  pos = np.random.default_rng(old * new).normal(size=(1, 1 + old * old, 5)).astype(np.float32)
  got = resize_positions(pos, new)
  grid = torch.tensor(pos[:, 1:]).reshape(1, old, old, 5).permute(0, 3, 1, 2)
  want = torch.nn.functional.interpolate(grid, size=(new, new), mode='bicubic',
                                         align_corners=False).permute(0, 2, 3, 1).reshape(1, -1, 5)
  assert got.shape == (1, 1 + new * new, 5)
  np.testing.assert_array_equal(got[:, 0], pos[:, 0])          # the class token's, kept
  assert_trees_close(got[:, 1:], want.numpy())


def test_a_checkpoint_at_16_px_runs_at_32_as_transformers_interpolates(hf_vit):
  """Our ViT at 32 px from a 16 px checkpoint = transformers' interpolate_pos_encoding=True."""
  path, model = hf_vit
  _, theirs = load_hf(path, expect_arch='vit')[:2]
  config = dataclasses.replace(theirs, image_size=32)
  variables, notes = load_pretrained(path, 'vit', config)
  assert len(notes) == 1 and '4x4 patch grid (16 px) to 8x8 (32 px)' in notes[0]
  # The tree is the model's own; only the position table changed shape.
  shapes = lambda v: {'/'.join(k.key for k in p): a.shape
                      for p, a in jax.tree_util.tree_flatten_with_path(v)[0]}
  before = shapes(load_hf(path)[2])
  after = shapes(variables)
  assert before.keys() == after.keys()
  assert {k for k in before if before[k] != after[k]} == {
      'params/embeddings/position_embeddings'}
  images = np.random.default_rng(0).normal(size=(2, 32, 32, 3)).astype(np.float32)
  ours = Task(config).model('none').apply(variables, images)
  with torch.no_grad():
    want = model(torch.tensor(images).permute(0, 3, 1, 2),
                 interpolate_pos_encoding=True).logits.numpy()
  assert_trees_close(np.asarray(ours), want)


def test_another_class_count_gets_a_zero_head_and_keeps_the_rest(hf_vit):
  path, _ = hf_vit
  _, theirs, original = load_hf(path)
  config = dataclasses.replace(theirs, num_classes=5)
  variables, notes = load_pretrained(path, 'vit', config)
  assert notes == ["classifier replaced: the checkpoint's 3 classes -> 5, zero-initialised"]
  head = variables['params']['classifier']
  assert head['kernel'].shape == (32, 5) and not head['kernel'].any() and not head['bias'].any()
  rest = lambda v: {k: x for k, x in v['params'].items() if k != 'classifier'}
  assert_trees_close(rest(variables), rest(original))


def test_vit_writer_inverts_the_import_exactly(hf_vit):
  path, _ = hf_vit
  _, config, variables = load_hf(path)
  state_dict, hf = vit_writer(variables, config, ['a', 'b', 'c'])
  saved = read_safetensors(path / 'model.safetensors')
  assert state_dict.keys() == saved.keys()
  for k in saved:
    np.testing.assert_array_equal(state_dict[k], saved[k], err_msg=k)
  assert hf['image_size'] == 16 and hf['id2label'] == {'0': 'a', '1': 'b', '2': 'c'}


def _tiny_resnet(tmp_path):
  """(config, our variables, the saved state dict) of a random HF ResNet.

  Small, but with both stacks of a stage (a first block with its shortcut, then more blocks).
  """
  cfg = ResNetConfig(embedding_size=8, hidden_sizes=(16, 32), depths=(3, 1),
                     layer_type='bottleneck', num_classes=4)
  torch.manual_seed(0)
  model = transformers.ResNetForImageClassification(transformers.ResNetConfig(
      embedding_size=cfg.embedding_size, hidden_sizes=list(cfg.hidden_sizes),
      depths=list(cfg.depths), layer_type=cfg.layer_type, num_labels=cfg.num_classes))
  with torch.no_grad():  # running statistics that a lost batch_stats leaf would show
    for m in model.modules():
      if isinstance(m, torch.nn.BatchNorm2d):
        m.running_mean.normal_()
        m.running_var.uniform_(0.5, 2.0)
  model.save_pretrained(tmp_path / 'in')
  _, _, variables = load_hf(tmp_path / 'in', config=cfg)
  return cfg, variables, read_safetensors(tmp_path / 'in' / 'model.safetensors')


def test_resnet_writer_inverts_the_import_exactly(tmp_path):
  cfg, variables, saved = _tiny_resnet(tmp_path)
  state_dict, _ = resnet_writer(variables, cfg)
  assert state_dict.keys() == saved.keys()
  for k in saved:
    np.testing.assert_array_equal(state_dict[k], saved[k], err_msg=k)


@pytest.mark.slow
def test_resnet_export_loads_in_transformers_with_our_logits(tmp_path):
  cfg, variables, _ = _tiny_resnet(tmp_path)
  out = write_folder(tmp_path / 'out', 'resnet', variables, cfg,
                     {'classes': None, 'image_size': 32, 'image_mean': [0.5] * 3,
                      'image_std': [0.5] * 3})
  back, info = transformers.ResNetForImageClassification.from_pretrained(
      out, output_loading_info=True)
  assert not info['missing_keys'] and not info['unexpected_keys'] and not info['mismatched_keys']
  images = np.random.default_rng(1).normal(size=(2, 32, 32, 3)).astype(np.float32)
  ours = Task(cfg).model('none').apply(variables, images)
  assert_trees_close(np.asarray(ours), _logits(back.eval(), images))


def test_write_folder_loads_in_transformers_with_our_logits_and_processor(hf_vit, tmp_path):
  path, _ = hf_vit
  _, config, variables = load_hf(path)
  data = {'classes': ['cat', 'dog', 'owl'], 'image_size': 16, 'image_mean': [0.1, 0.2, 0.3],
          'image_std': [0.4, 0.5, 0.6]}
  out = write_folder(tmp_path / 'export', 'vit', variables, config, data)
  assert sorted(p.name for p in out.iterdir()) == ['config.json', 'model.safetensors',
                                                    'preprocessor_config.json']
  model, info = transformers.ViTForImageClassification.from_pretrained(
      out, output_loading_info=True)
  assert not info['missing_keys'] and not info['unexpected_keys'] and not info['mismatched_keys']
  assert model.config.id2label == {0: 'cat', 1: 'dog', 2: 'owl'}
  images = np.random.default_rng(2).normal(size=(3, 16, 16, 3)).astype(np.float32)
  ours = Task(config).model('none').apply(variables, images)
  assert_trees_close(np.asarray(ours), _logits(model.eval(), images))
  proc = transformers.AutoImageProcessor.from_pretrained(out)
  assert type(proc).__name__.startswith('ViTImageProcessor')
  assert proc.size == {'height': 16, 'width': 16} and list(proc.image_mean) == [0.1, 0.2, 0.3]


def test_write_folder_refuses_a_non_empty_folder_and_leaves_nothing_on_error(hf_vit, tmp_path):
  path, _ = hf_vit
  _, config, variables = load_hf(path)
  busy = tmp_path / 'busy'
  busy.mkdir()
  (busy / 'keep.txt').write_text('x')
  with pytest.raises(ExportError, match='exists and is not an empty folder'):
    write_folder(busy, 'vit', variables, config, {})
  with pytest.raises(ExportError, match='2 class names for a classifier of 3 outputs'):
    write_folder(tmp_path / 'new', 'vit', variables, config, {'classes': ['a', 'b']})
  assert sorted(p.name for p in tmp_path.iterdir()) == ['busy']   # no partial folder
  resnet = load_config('resnet-tiny').model
  with pytest.raises(ExportError, match='BatchNorm epsilon 1e-5'):
    resnet_writer({}, dataclasses.replace(resnet, bn_eps=1e-3))
