"""Command line of ``train.py``: flags -> :class:`TrainConfig` -> :func:`train`."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from configs import DEFAULT_CONFIG, config_names
from remat.auto_budget import is_auto
from remat.layout import LAYOUTS
from remat.policies import PolicyError, list_policies
from remat.targets import prefer_cpu_without_gpu
from training.arguments import DefaultsHelpFormatter, OneLineParser, add_lora_flags
from training.data import DataError
from training.data.text_source import load_named
from training.run import bounds
from training.step import mesh as meshlib
from training.trainer import (DivergedError, RunError, TrainConfig, default_config,
                              matching_config, read_meta, train)

_FLAGS = {  # flag -> (type, help); defaults come from the named config, then TrainConfig
    'steps': (int, 'optimizer steps'),
    'batch_size': (int, 'sequences or images per step'),
    'grad_accum': (int, 'gradient accumulation: the batch in K microbatches of batch-size / K, '
                        'one update from their float32 gradient sums (activations sized by the '
                        'microbatch; docs/training.md); under --remat=auto:BUDGET, unset: chosen '
                        'with the policy (docs/making-a-run-fit.md)'),
    'seq_len': (int, 'gpt/llama: tokens per sequence (bytes for byte-level text), at most the '
                     'config max_len'),
    'image_size': (int, 'vit/resnet: image side in pixels (a ViT: a multiple of its patch size; '
                        'positions from --init-from are resampled to it)'),
    'lr': (float, 'peak AdamW learning rate (linear warmup, cosine decay to 10%%)'),
    'warmup_steps': (int, 'linear warmup steps'),
    'weight_decay': (float, 'AdamW weight decay'),
    'grad_clip': (float, 'global gradient-norm clip'),
    'seed': (int, 'seed of initialisation, batches and dropout'),
    'eval_every': (int, 'validation loss every N steps (and at the end)'),
    'eval_batches': (int, 'validation batches per evaluation'),
    'save_every': (int, 'orbax checkpoint every N steps (and at the end)'),
    'data_workers': (int, 'image folders: Grain worker processes decoding ahead; 0 decodes in '
                          'this process; unset: 0 on <= 2 cores, else cores - 2, at most 8'),
    'skip_nonfinite': (int, 'skip up to N steps in a row whose loss or gradients are not finite '
                            '(their update is dropped); the next one stops the run (exit 3). '
                            '0: stop at the first'),
    'spike_factor': (float, 'loss guard (docs/training-safety.md): a loss above both this factor '
                            'times and --spike-margin nats over the median of the last 20 healthy '
                            'steps is a spike (default 2; inf: off)'),
    'spike_margin': (float, 'loss guard: see --spike-factor (default 1)'),
    'spike_patience': (int, 'loss guard: this many spikes in a row stop the run (exit 3) before '
                            'the blown-up state is saved (default 3)'),
}


def crop_scale(text: str) -> tuple[float, float]:
  """``MIN,MAX``: two numbers (their range is checked with the other settings)."""
  parts = text.split(',')
  try:
    low, high = (float(x) for x in parts)
  except ValueError:
    raise argparse.ArgumentTypeError(f'{text!r} is not MIN,MAX (two numbers, e.g. 0.5,1)') from None
  return low, high


def build_parser() -> argparse.ArgumentParser:
  p = OneLineParser(
      prog='train.py',
      description='Train a GPT-2-style byte-level model, or a ViT / ResNet on procedural images, '
                  'with a named remat policy.',
      formatter_class=DefaultsHelpFormatter)
  p.add_argument('--remat', default=None, metavar='SPEC',
                 help="remat policy spec, e.g. none, full, dots, names:query_proj,out_proj, sqrt, "
                      "seg:4, full@sqrt, 4xfull+none; or a memory budget, auto:SIZE (auto:8GiB), "
                      "auto:Fx (auto:0.6x of none's plan) or auto (a GPU's pool), resolved to the "
                      "policy of least recompute that fits (docs/auto.md); 'list' prints them all "
                      "(default: sqrt, or the resumed run's)")
  p.add_argument('--layout', default=None, metavar='LAYOUT',
                 help=f"how the layer stack becomes a program: {', '.join(LAYOUTS)} (auto: the "
                      'scan on CPU, chosen per policy on a GPU; the parameters are the same under '
                      "every layout; docs/own-model.md) (default: auto, or the resumed run's)")
  p.add_argument('--model', default=None, metavar='MODEL',
                 help=f"model family: {', '.join(DEFAULT_CONFIG)}; picks its default config "
                      f"({', '.join(f'{k}: {v}' for k, v in DEFAULT_CONFIG.items())})")
  p.add_argument('--config', default=None,
                 help=f"named config: {', '.join(config_names())}, or hf:PATH (a Hugging Face "
                      f"folder's config.json) (default: the model's default, "
                      "or the resumed run's)")
  for name, (typ, help_) in _FLAGS.items():
    p.add_argument('--' + name.replace('_', '-'), type=typ, default=None,
                   help=help_ + ' (default: from the config)')
  p.add_argument('--dtype', default=None, metavar='DTYPE',
                 help='compute dtype: float32 or bfloat16 (parameters and optimizer state stay '
                      "float32; docs/precision.md) (default: the config's, or the resumed run's)")
  p.add_argument('--data', default=None, metavar='PATH',
                 help="gpt/llama: text file, .jsonl file (rows {\"text\"}, {\"prompt\", "
                      "\"completion\"}: loss on the completion only, or {\"messages\"}: the "
                      "tokenizer's chat template, loss on assistant turns) or a folder of either "
                      "(default: this Python's stdlib source); vit/resnet: an image folder, "
                      "DIR/<class>/*.png|jpg|jpeg or DIR/train/<class>/... and DIR/val/<class>/... "
                      "(default: procedural shapes)")
  p.add_argument('--eval-data', default=None, action='append', metavar='PATH',
                 help='a held-out set evaluated whole beside --data\'s own held-out split '
                      '(metrics eval_<its stem>_loss, ...; may be given several times): '
                      'gpt/llama: a .jsonl or text file (or a folder) of rows; vit/resnet: a '
                      "folder of class folders, DIR/<class>/*.png|jpg|jpeg, of the run's classes "
                      '(no augmentation; eval_<stem>_accuracy too)')
  p.add_argument('--eval-generate', type=int, default=None, metavar='N',
                 help='gpt/llama: at each evaluation, greedy generation (a KV cache) on the '
                      'first N prompt/completion rows of each held-out set: exact match and '
                      'token accuracy beside the loss, each row in OUT/generations.jsonl '
                      '(default: 0, none)')
  p.add_argument('--keep-best', default=None, metavar='METRIC',
                 help='keep the step with the best value of this held-out metric (val_loss, '
                      'val_accuracy, val_exact_match, eval_<name>_loss, ...; lower is better for '
                      '*_loss) in OUT/best, apart from the rotation; training.export and '
                      'training.sample take it by default')
  p.add_argument('--early-stop', type=int, default=None, metavar='PATIENCE',
                 help='with --keep-best: stop after PATIENCE evaluations in a row without a '
                      'better value, saving the last state')
  p.add_argument('--augment', default=None, choices=('none', 'flip', 'crop', 'crop+flip'),
                 help='vit/resnet image folders: the training images\' augmentation, a random '
                      'resized crop, a horizontal flip (wrong where orientation is the label), '
                      'both or none (default: crop+flip)')
  p.add_argument('--crop-scale', default=None, type=crop_scale, metavar='MIN,MAX',
                 help="vit/resnet image folders: the random crop's share of the image area "
                      '(default: 0.08,1, torchvision\'s)')
  p.add_argument('--tokenizer', default=None, metavar='PATH',
                 help="gpt/llama: a tokenizer.json or a folder holding one, or 'bytes' "
                      "(default: the --init-from folder's tokenizer, else bytes)")
  p.add_argument('--out', default=None, metavar='DIR',
                 help='output folder for metrics.jsonl and checkpoints (default: runs/CONFIG-SPEC)')
  again = p.add_mutually_exclusive_group()
  again.add_argument('--resume', action='store_true',
                     help='continue from the latest checkpoint in --out')
  again.add_argument('--restart', action='store_true',
                     help="start the run in --out over from step 0, with its recorded settings "
                          "(flags override them); its previous files move to --out/previous/N/")
  p.add_argument('--allow-changed', default=None, metavar='NAME,...',
                 help='with --resume: accept these changed settings (e.g. batch_size,lr) and '
                      "record the change in the run's history; a resume refuses any other "
                      'change to a setting that enters the computation')
  p.add_argument('--init-from', default=None, metavar='HF_FOLDER',
                 help='start from the weights of a Hugging Face save_pretrained folder (GPT-2, '
                      'Llama, ViT, ResNet; safetensors); without --config, the shipped config of '
                      'its shape, else one built from its config.json (--config hf:PATH)')
  p.add_argument('--offload-optimizer', action='store_true', default=None,
                 help="keep the optimizer state (AdamW's moments) in pinned host memory between "
                      'steps, streamed to the device a layer at a time for the update (a GPU; a '
                      'no-op on the CPU backend; docs/training.md)')
  add_lora_flags(p)
  meshlib.add_flags(p)
  p.add_argument('--tensorboard', action='store_true', default=None,
                 help='also write the metric rows (learning rate included) as TensorBoard scalars '
                      'to OUT/tensorboard (needs tensorboardX: pip install -e ".[tensorboard]")')
  p.add_argument('--no-memory-report', dest='memory_report', action='store_false',
                 help='skip compiling the no-remat step for the start-up memory line')
  return p


def config_from_args(args: argparse.Namespace) -> TrainConfig:
  """Settings, later ones winning: TrainConfig defaults, the named config's train section,
  the resumed run's recorded settings (with --resume), explicit flags."""
  valid = {f.name for f in dataclasses.fields(TrainConfig)}
  flags = {k: v for k, v in vars(args).items() if v is not None and k in valid}
  if 'eval_data' in flags:
    flags['eval_data'] = tuple(flags['eval_data'])
  recorded = {}
  if args.resume or args.restart:
    known = {k: v for k, v in flags.items() if k in ('config', 'remat', 'out', 'dtype')}
    known.setdefault('config', default_config(args.model))
    meta = read_meta(TrainConfig(**known).out_dir) or {}
    # The mesh belongs to the machine, not the run: a resume takes --mesh from its flags only.
    recorded = {k: v for k, v in meta.get('train', {}).items()
                if k in valid and k not in ('out', 'mesh')}
  if 'config' not in flags and args.init_from and not args.resume:
    flags['config'] = matching_config(args.init_from)
  name = flags.get('config', recorded.get('config', default_config(args.model)))
  named = load_named(name)
  bounds.check_applicable(named.arch, name, flags)   # a flag of another model is an error
  values = {k: v for k, v in named.train.items() if k in valid}
  values['config'] = name
  values.update(recorded)
  values.update(flags)
  # Under --remat=auto:BUDGET the microbatches are a lever the search chooses, unless given.
  values['grad_accum_search'] = is_auto(values.get('remat') or '') and 'grad_accum' not in flags
  return TrainConfig(**values)


def main(argv=None) -> int:
  prefer_cpu_without_gpu()
  args = build_parser().parse_args(argv)
  if args.remat == 'list':
    rows = list_policies()
    width = max(len(s) for s, _ in rows)
    for spec, desc in rows:
      print(f'{spec:<{width}}  {desc}')
    return 0
  try:
    meshlib.start_processes(args.coordinator, args.num_processes, args.process_id)
    train(config_from_args(args))
  except DivergedError as e:  # its own code: the settings were valid, the run was not
    print(f'train.py: error: {e}', file=sys.stderr)
    return 3
  except (PolicyError, DataError, RunError, ValueError) as e:   # TensorBoardError among them
    print(f'train.py: error: {e}', file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print('train.py: interrupted; rerun with --resume to continue from the last checkpoint',
          file=sys.stderr)
    return 130
  return 0
