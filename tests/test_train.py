"""Configs, the training run (loss falls, resume is exact, checkpoints cross policies), CLI errors."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import config_names, load_config
from models.gpt import GPT
from numerics import RTOL, assert_trees_close
from training import cli
from training.trainer import TrainConfig, train

ROOT = Path(__file__).resolve().parents[1]
# Hugging Face parameter counts (tied embeddings): gpt2 124M ... gpt2-xl 1.5B.
HF_PARAMS = {'gpt2-small': 124_439_808, 'gpt2-medium': 354_823_168,
             'gpt2-large': 774_030_080, 'gpt2-xl': 1_557_611_200}


@pytest.mark.parametrize('name', config_names('gpt'))
def test_every_config_loads(name):
  named = load_config(name)
  assert named.arch == 'gpt' and named.description
  shapes = jax.eval_shape(lambda: GPT(named.model).init(
      jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32)))
  count = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(shapes))
  if name in HF_PARAMS:
    assert count == HF_PARAMS[name]


def test_shipped_configs():
  assert {'tiny', 'gpt2-small', 'gpt2-medium', 'gpt2-large', 'gpt2-xl'} <= set(config_names())


def _cfg(tmp_path, text_file, **kw):
  base = dict(config='tiny', remat='sqrt', steps=8, batch_size=4, seq_len=32, lr=3e-3,
              warmup_steps=2, data=str(text_file), out=str(tmp_path / 'run'), eval_every=4,
              eval_batches=2, save_every=4, memory_report=False)
  base.update(kw)
  return TrainConfig(**base)


def _rows(out):
  return [json.loads(l) for l in (Path(out) / 'metrics.jsonl').read_text().splitlines()]


@pytest.fixture(scope='module')
def uninterrupted(tmp_path_factory):
  tmp = tmp_path_factory.mktemp('full')
  text = tmp / 'corpus.txt'
  text.write_text(''.join(f'def f{i}(x):\n    return x * {i} + {i % 7}\n' for i in range(400)))
  cfg = _cfg(tmp, text)
  train(cfg, log=lambda *_: None)
  return cfg, _rows(cfg.out)


def test_training_lowers_the_loss(uninterrupted):
  _, rows = uninterrupted
  assert [r['step'] for r in rows] == list(range(1, 9))
  assert rows[0]['loss'] > 5.0  # ~ln 256 at the start
  assert rows[-1]['val_loss'] < rows[0]['loss'] - 1.0
  assert {'step', 'loss', 'tokens_per_s', 'policy'} <= set(rows[0])
  assert rows[3]['val_loss'] > rows[-1]['val_loss']


def _interrupt_and_resume(uninterrupted, tmp_path, remat):
  cfg, _ = uninterrupted
  out = tmp_path / 'run'
  shutil.copytree(cfg.out, out)
  shutil.rmtree(out / 'checkpoints' / '8')  # as if the run had died after step 4's checkpoint
  resumed = TrainConfig(**{**cfg.__dict__, 'out': str(out), 'resume': True, 'remat': remat})
  train(resumed, log=lambda *_: None)
  return _rows(out)


def test_resume_equals_uninterrupted(uninterrupted, tmp_path, capsys):
  cfg, ref = uninterrupted
  out = tmp_path / 'run'
  shutil.copytree(cfg.out, out)
  shutil.rmtree(out / 'checkpoints' / '8')
  # Only --resume and --out: every other setting comes from what the checkpoint recorded.
  assert cli.main(['--resume', f'--out={out}', '--no-memory-report']) == 0
  assert 'resumed step 4 (saved under policy sqrt)' in capsys.readouterr().out
  rows = _rows(out)
  assert [r['step'] for r in rows] == list(range(1, 9))
  # The same program on the same inputs from a bit-exact checkpoint: the same numbers.
  assert [r['loss'] for r in rows] == [r['loss'] for r in ref]
  assert rows[-1]['val_loss'] == ref[-1]['val_loss']


def test_checkpoint_restores_under_another_policy(uninterrupted, tmp_path):
  rows = _interrupt_and_resume(uninterrupted, tmp_path, 'full@seg:2')
  ref = uninterrupted[1]
  assert rows[-1]['policy'] == 'full@seg:2' and ref[-1]['policy'] == 'sqrt'
  # Another policy rounds each gradient differently (within RTOL of the gradients' scale), and
  # four AdamW steps amplify that: Adam divides by sqrt(v), so noise-sized gradient elements
  # take steps of the learning rate's size. Losses stay within ten times the gradient tolerance.
  assert_trees_close(np.array([r['loss'] for r in rows]), np.array([r['loss'] for r in ref]),
                     rtol=10 * RTOL)


def _cli(argv, capsys):
  code = cli.main(argv)
  return code, capsys.readouterr()


@pytest.mark.parametrize('argv,needle', [
    (['--remat=bogus'], "unknown remat policy 'bogus'"),
    (['--remat=names:nope'], 'unknown tag(s) nope; this model emits: context'),
    (['--remat=names:'], "empty tag in 'names:'"),
    (['--remat=seg:7'], 'segment size 7 is out of range; valid sizes for this 6-layer stack are 1..6'),
    (['--config=gpt3'], "unknown config 'gpt3'; valid: gpt2-large"),
    (['--seq-len=4096'], '--seq-len 4096 exceeds config tiny max_len 128'),
    (['--steps=0'], '--steps must be >= 1'),
    (['--data=/no/such/place'], "--data '/no/such/place' does not exist"),
    (['--data=/dev/null'], "--data '/dev/null' is not a regular file or a folder"),
    (['--lr=nan'], '--lr must be a finite number > 0, got nan'),
    (['--remat=seg:\uff12'], 'segment size must be an integer >= 1'),
    (['--model=bert'], "unknown --model 'bert'; valid: gpt, llama, vit, resnet"),
    (['--model=vit', '--config=tiny'], '--model vit does not match config tiny (a gpt model)'),
    (['--model=vit', '--image-size=30'], 'a ViT takes a multiple of its patch size 4'),
    (['--model=vit', '--data=/dev/null'], "--data '/dev/null' is not a folder; for a ViT or ResNet"),
    (['--model=resnet', '--image-size=16'], '--image-size must be >= 32 for a ResNet'),
    (['--image-size=64'], '--image-size applies to vit and resnet configs'),
    (['--model=resnet', '--remat=minimal'], 'unknown tag(s) query_proj'),
    (['--model=resnet', '--remat=seg:3'], 'valid sizes for this 2-layer stack are 1..2'),
    (['--dtype=float16'], "--dtype must be one of float32, bfloat16, got 'float16'"),
])
def test_cli_errors_are_one_line_exit_2(argv, needle, capsys, tmp_path):
  out = tmp_path / 'never'
  code, cap = _cli(argv + [f'--out={out}'], capsys)
  assert code == 2
  lines = cap.err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith('train.py: error: ') and needle in lines[0]
  assert not out.exists()  # nothing half-written


def test_existing_run_needs_resume(uninterrupted, capsys):
  cfg, _ = uninterrupted
  code, cap = _cli([f'--out={cfg.out}', f'--data={cfg.data}'], capsys)
  assert code == 2 and 'pass --resume' in cap.err


@pytest.mark.gpu_plan
def test_train_py_runs_clean_with_gpu_plugin_installed(text_file, tmp_path):
  # No JAX_PLATFORMS: train.py itself must keep an installed jax-cuda12 plugin from
  # printing a CUDA traceback on a machine without a GPU.
  env = {k: v for k, v in os.environ.items() if k != 'JAX_PLATFORMS'}
  run = subprocess.run([sys.executable, 'train.py', '--steps=1', '--batch-size=2', '--seq-len=16',
                        f'--data={text_file}', f'--out={tmp_path / "run"}', '--no-memory-report'],
                       cwd=ROOT, capture_output=True, text=True, env=env)
  assert run.returncode == 0, run.stderr[-2000:]
  assert 'Traceback' not in run.stderr and 'Unable to load CUDA' not in run.stderr
  assert 'done: step 1' in run.stdout


def test_list_policies(capsys):
  code, cap = _cli(['--remat=list'], capsys)
  assert code == 0
  for spec in ('none', 'full', 'dots_no_batch', 'sqrt', 'seg:K', 'minimal_offloaded'):
    assert any(line.startswith(spec + ' ') for line in cap.out.splitlines()), spec


def _plugin_notice(line: str) -> bool:
  return line.startswith('WARNING: All log messages before absl::InitializeLog()') or (
      'cudart_stub.cc' in line and 'Could not find cuda drivers' in line)


def test_train_py_end_to_end_error_and_help():
  bad = subprocess.run([sys.executable, 'train.py', '--remat=nope'], cwd=ROOT,
                       capture_output=True, text=True)
  # The jax-cuda12 plugin (gpu-plan extra), when installed on a machine without a GPU, logs
  # "Could not find cuda drivers" notices from C++ at start-up; ours is the only other line.
  ours = [l for l in bad.stderr.splitlines() if not _plugin_notice(l)]
  assert bad.returncode == 2 and len(ours) == 1 and ours[0].startswith('train.py: error:')
  helptext = subprocess.run([sys.executable, 'train.py', '--help'], cwd=ROOT,
                            capture_output=True, text=True).stdout
  for flag in ('--remat', '--config', '--steps', '--batch-size', '--seq-len', '--lr', '--seed',
               '--data', '--out', '--resume'):
    assert flag in helptext
