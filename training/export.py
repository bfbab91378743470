"""``python -m training.export RUN_DIR OUT_DIR``: a run's latest weights as a Hugging Face folder.

Writes what ``save_pretrained`` writes, so ``transformers``' ``from_pretrained``
(or any tool that reads that layout) loads it:

* ``config.json``: the trained model's shape (its vocabulary, its image size),
  from the family's writer in :data:`models.hf.export.WRITERS`;
* ``model.safetensors``, or above ``--max-shard-size`` (5 GB, as
  ``save_pretrained``) shards ``model-0000K-of-0000N.safetensors`` with
  ``model.safetensors.index.json``; float32, or ``--dtype bfloat16``;
* the tokenizer the run trained with (``tokenizer.json`` and its companions,
  copied from the run folder; a byte-level run has none) and any files the
  family registers in :data:`models.hf.export.EXTRA_FILES`.

A LoRA run (``train.py --lora``) exports merged by default: its adapters
folded into the base it trained on (``W + alpha / r * A @ B``; a QLoRA base
dequantized first), a full model like any other. ``--adapter`` writes the
adapters alone as a PEFT folder instead (``adapter_config.json``,
``adapter_model.safetensors``: :mod:`models.hf.export_adapter`), for
``peft.PeftModel.from_pretrained(base, OUT_DIR)`` on the base checkpoint.

The folder is written under a temporary name beside ``OUT_DIR`` and renamed
when complete: a failure leaves nothing behind. Errors are one line on stderr
with exit status 2: a missing or damaged run, an existing non-empty
``OUT_DIR``, a family without a writer.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np

from training.arguments import OneLineParser

DTYPES = {'float32': np.float32, 'bfloat16': ml_dtypes.bfloat16}
DEFAULT_SHARD_BYTES = 5 * 10**9   # save_pretrained's max_shard_size default, "5GB"
MAX_SHARD_BYTES = 10**15          # 1 PB: more than any model's weights


class ExportError(ValueError):
  """An export that cannot be done; the message is one line."""


def shard(state_dict: dict[str, np.ndarray], max_bytes: int) -> list[dict[str, np.ndarray]]:
  """Groups tensors, in name order, into shards of at most ``max_bytes`` (a larger tensor alone)."""
  shards, current, size = [], {}, 0
  for name in sorted(state_dict):
    n = state_dict[name].nbytes
    if current and size + n > max_bytes:
      shards.append(current)
      current, size = {}, 0
    current[name] = state_dict[name]
    size += n
  if current or not shards:
    shards.append(current)
  return shards


def write_weights(folder: Path, state_dict: dict[str, np.ndarray], max_bytes: int) -> list[str]:
  """Writes ``model.safetensors`` or shards and an index; returns the file names written."""
  from safetensors.numpy import save_file
  metadata = {'format': 'pt'}   # transformers reads the file as torch weights
  parts = shard(state_dict, max_bytes)
  if len(parts) == 1:
    save_file(parts[0], str(folder / 'model.safetensors'), metadata=metadata)
    return ['model.safetensors']
  names, weight_map = [], {}
  for i, part in enumerate(parts, 1):
    name = f'model-{i:05d}-of-{len(parts):05d}.safetensors'
    save_file(part, str(folder / name), metadata=metadata)
    names.append(name)
    weight_map.update({k: name for k in part})
  index = {'metadata': {'total_size': int(sum(a.nbytes for a in state_dict.values()))},
           'weight_map': dict(sorted(weight_map.items()))}
  (folder / 'model.safetensors.index.json').write_text(json.dumps(index, indent=2) + '\n')
  return names + ['model.safetensors.index.json']


def export(run_dir, out_dir, dtype: str = 'float32', max_shard_bytes: int = DEFAULT_SHARD_BYTES,
           log=print, warn=lambda m: print(f'training.export: warning: {m}', file=sys.stderr),
           which: str | None = None, adapter: bool = False, base_from=None) -> Path:
  """Writes the Hugging Face folder of ``run_dir``'s best step (``--keep-best``) or latest
  checkpoint (``which``: :func:`training.run.saved_run.load_run`) to ``out_dir``.

  Args:
    adapter: write a LoRA run's adapters as a PEFT folder (module docstring).
    base_from: a LoRA run's base folder, if it moved since training.

  Raises:
    ExportError, RunReadError: one line.
  """
  from models.hf import export_vision as vision
  from models.hf.export import EXTRA_FILES, WRITERS
  from models.lora import params as lora_params
  from models.tasks import Task
  from training.data.text_source import RUN_TOKENIZER_DIR
  from training.data.tokenizer import TOKENIZER_FILE, load_tokenizer
  from training.run.saved_run import load_run
  if dtype not in DTYPES:
    raise ExportError(f"--dtype {dtype}: valid: {', '.join(DTYPES)}")
  if max_shard_bytes < 1:
    raise ExportError(f'--max-shard-size must be >= 1 byte, got {max_shard_bytes}')
  out = Path(out_dir)
  if out.exists() and (not out.is_dir() or any(out.iterdir())):
    raise ExportError(f"'{out}' already exists and is not an empty folder; give a new OUT_DIR")
  _check_writable(out)   # before the checkpoint is read: a wrong OUT_DIR costs nothing
  if adapter:
    return _export_adapter(run_dir, out, dtype, log, warn, which)
  run = load_run(run_dir, warn, which, base_from=base_from, log=log)
  merged = f' with its {run.lora.describe()} merged' if run.lora is not None else ''
  if run.lora is not None:   # the adapters folded into the base: the model as it was trained
    run = dataclasses.replace(run, task=Task(dataclasses.replace(run.task.config, lora=None)),
                              variables={**run.variables, 'params': lora_params.merged(
                                  run.variables['params'], run.lora, run.task.arch)})
  arch = run.task.arch
  data = run.meta.get('data') or {}
  extra = EXTRA_FILES.get(arch, lambda _: {})(run.task.config)
  if arch in vision.WRITERS:
    # A vision run records its class names and normalisation; the folder's image processor
    # repeats the run's validation transform.
    state_dict, hf_config = vision.WRITERS[arch](run.variables, run.task.config,
                                                 data.get('classes'))
    if 'image_size' in data:
      extra = {**extra, 'preprocessor_config.json': vision.image_processor_config(
          data['image_size'], data['image_mean'], data['image_std'])}
  elif arch in WRITERS:
    state_dict, hf_config = WRITERS[arch](run.variables, run.task.config)
  else:
    raise ExportError(f"'{run_dir}' is a {arch} run; export writes "
                      f"{', '.join(sorted({**WRITERS, **vision.WRITERS}))}")
  state_dict = {k: np.ascontiguousarray(v, DTYPES[dtype]) for k, v in state_dict.items()}
  hf_config = {**hf_config, 'torch_dtype': dtype}
  tok_dir = Path(run_dir) / RUN_TOKENIZER_DIR
  tok = None
  if (tok_dir / TOKENIZER_FILE).is_file():
    tok = load_tokenizer(tok_dir / TOKENIZER_FILE)
    hf_config.update({'eos_token_id': tok.eot_id, 'bos_token_id': _bos(tok_dir, tok)})

  def weights(tmp: Path) -> list[str]:
    (tmp / 'config.json').write_text(json.dumps(hf_config, indent=2) + '\n')
    return ['config.json'] + write_weights(tmp, state_dict, max_shard_bytes)
  files = _write_folder(out, run_dir, weights, extra)
  size = sum(a.nbytes for a in state_dict.values())
  log(f'exported {run.described} of {run_dir} ({arch}{merged}, {size / 2**20:.1f} MiB of {dtype} '
      f"weights) to {out}: {', '.join(files)}")
  return out


def _export_adapter(run_dir, out: Path, dtype: str, log, warn, which=None) -> Path:
  """Writes a LoRA run's adapters as a PEFT folder (module docstring)."""
  from models.hf.export_adapter import AdapterExportError, peft_adapter
  from safetensors.numpy import save_file
  from training.run.saved_run import load_run
  run = load_run(run_dir, warn, which, base=False)   # the adapters alone: no base needed
  if run.lora is None:
    raise ExportError(f"'{run_dir}' was trained without --lora, so it has no adapters; export "
                      'the whole model without --adapter')
  cfg = run.task.config
  try:
    state_dict, adapter_config = peft_adapter(run.variables['params'], run.lora, run.task.arch,
                                              cfg.num_layers,
                                              (run.meta.get('base') or {}).get('init_from'))
  except AdapterExportError as e:
    raise ExportError(str(e)) from None
  state_dict = {k: np.ascontiguousarray(v, DTYPES[dtype]) for k, v in state_dict.items()}

  def weights(tmp: Path) -> list[str]:
    (tmp / 'adapter_config.json').write_text(json.dumps(adapter_config, indent=2) + '\n')
    save_file(state_dict, str(tmp / 'adapter_model.safetensors'), metadata={'format': 'pt'})
    return ['adapter_config.json', 'adapter_model.safetensors']
  files = _write_folder(out, run_dir, weights, {})
  size = sum(a.nbytes for a in state_dict.values())
  log(f'exported the LoRA adapters of {run.described} of {run_dir} ({run.lora.describe()}; '
      f'{size / 2**20:.1f} MiB of {dtype}) as a PEFT folder to {out}: {", ".join(files)}')
  return out


def _check_writable(out: Path):
  """``out`` can be created: its nearest existing ancestor is a folder this user may write."""
  parent = out.absolute().parent
  while not parent.exists() and not parent.is_symlink():
    parent = parent.parent
  if not parent.is_dir():
    raise ExportError(f"'{out}' cannot be created: '{parent}' is a file; give another OUT_DIR")
  if not os.access(parent, os.W_OK | os.X_OK):
    raise ExportError(f"'{out}' cannot be created: '{parent}' is not writable (permissions, or a "
                      'read-only file system); give another OUT_DIR')


def _write_folder(out: Path, run_dir, weights, extra: dict) -> list[str]:
  """Writes ``weights(tmp)``'s files, the run's tokenizer and ``extra`` JSON files into a
  temporary folder beside ``out``, renamed to ``out`` when complete; returns the file names."""
  from training.data.text_source import RUN_TOKENIZER_DIR
  from training.data.tokenizer import COMPANION_FILES, TOKENIZER_FILE, load_tokenizer
  tok_dir = Path(run_dir) / RUN_TOKENIZER_DIR
  out.parent.mkdir(parents=True, exist_ok=True)
  tmp = Path(tempfile.mkdtemp(prefix=f'.{out.name}.', dir=out.parent))
  try:
    _permissions(tmp, 0o777)   # mkdtemp makes it private; the folder is for sharing
    files = weights(tmp)
    for name in (TOKENIZER_FILE,) + COMPANION_FILES:
      if (tok_dir / name).is_file():
        shutil.copyfile(tok_dir / name, tmp / name)
        files.append(name)
    if (tok_dir / TOKENIZER_FILE).is_file() and not (tok_dir / 'tokenizer_config.json').is_file():
      # A bare tokenizer.json: name its end-of-text token, so AutoTokenizer knows the eos_token.
      tok = load_tokenizer(tok_dir / TOKENIZER_FILE)
      (tmp / 'tokenizer_config.json').write_text(json.dumps({'eos_token': tok.eot_token}) + '\n')
      files.append('tokenizer_config.json')
    for name, obj in extra.items():
      (tmp / name).write_text(json.dumps(obj, indent=2) + '\n')
      files.append(name)
    for f in tmp.iterdir():   # safetensors writes its files owner-only
      _permissions(f, 0o666)
    if out.exists():
      out.rmdir()   # empty (checked above)
    tmp.rename(out)
  except BaseException as e:
    shutil.rmtree(tmp, ignore_errors=True)
    _explain_write_error(e, out)
    raise
  return files


def _explain_write_error(e: BaseException, out: Path):
  """Raises a one-line ExportError for a full disk or a file system that refuses the write."""
  # safetensors raises its own type for a full disk; an OSError carries the errno.
  if 'No space left on device' in str(e) or getattr(e, 'errno', None) in (errno.ENOSPC,
                                                                           errno.EDQUOT):
    raise ExportError(f"no space left on device writing {out}; nothing was exported: free "
                      'space there, or give an OUT_DIR elsewhere') from None
  if isinstance(e, OSError):
    raise ExportError(f"cannot write '{e.filename or out}': {e.strerror or e}; nothing was "
                      'exported') from None


def _permissions(path: Path, mode: int):
  """``chmod`` to ``mode`` less the umask, as a plain ``open``/``mkdir`` would have made it."""
  umask = os.umask(0)
  os.umask(umask)
  path.chmod(mode & ~umask)


def _bos(tok_dir: Path, tok) -> int | None:
  """The tokenizer's beginning-of-text id (tokenizer_config.json's bos_token), or None."""
  config = tok_dir / 'tokenizer_config.json'
  if not config.is_file():
    return None
  try:
    bos = json.loads(config.read_text()).get('bos_token')
  except (OSError, ValueError, AttributeError):
    return None
  bos = bos.get('content') if isinstance(bos, dict) else bos
  return tok._tok.token_to_id(bos) if isinstance(bos, str) else None


def parse_size(text: str) -> int:
  """'5GB', '200MB', '64KiB', '1000' -> bytes (decimal units as save_pretrained; binary with i)."""
  units = {'': 1, 'B': 1, 'KB': 10**3, 'MB': 10**6, 'GB': 10**9, 'KIB': 2**10, 'MIB': 2**20,
           'GIB': 2**30}
  t = text.strip().upper()
  number = t.rstrip('KMGIB')
  unit = t[len(number):]
  try:
    value = float(number)
  except ValueError:
    raise argparse.ArgumentTypeError(f"'{text}' is not a size like 5GB, 200MB or 1000") from None
  if unit not in units:
    raise argparse.ArgumentTypeError(f"'{text}': unknown unit {unit}; use B, KB, MB, GB, KiB, "
                                     'MiB or GiB')
  if not (math.isfinite(value) and 1 <= value * units[unit] <= MAX_SHARD_BYTES):
    raise argparse.ArgumentTypeError(f"'{text}' is not a size from 1 byte to 1 PB")
  return int(value * units[unit])


def main(argv=None, prog: str = 'python -m training.export') -> int:
  """The command line; ``prog``: the command's name in the usage line and at the start of every
  message (without ``python -m``); the script ``export.py`` passes its own, as train.py does."""
  name = prog.removeprefix('python -m ')
  p = OneLineParser(prog=prog,
                    description="Write a run's latest checkpoint as a Hugging Face "
                                'save_pretrained folder.')
  p.add_argument('run_dir', metavar='RUN_DIR', help="a train.py run's --out folder")
  p.add_argument('out_dir', metavar='OUT_DIR', help='the folder to write (new or empty)')
  p.add_argument('--dtype', default='float32', choices=sorted(DTYPES),
                 help='weight dtype in model.safetensors (default: float32)')
  p.add_argument('--adapter', action='store_true',
                 help="a LoRA run's adapters alone, as a PEFT folder (adapter_config.json, "
                      'adapter_model.safetensors) for peft.PeftModel.from_pretrained(base, OUT_DIR); '
                      'without it a LoRA run is written merged into its base')
  p.add_argument('--base', default=None, metavar='HF_FOLDER',
                 help="a LoRA run's base checkpoint, if it moved since training (checked against "
                      "the run's record)")
  p.add_argument('--max-shard-size', type=parse_size, default=DEFAULT_SHARD_BYTES, metavar='SIZE',
                 help='largest safetensors file before the weights are sharded with an index '
                      '(default: 5GB, as save_pretrained)')
  p.add_argument('--checkpoint', choices=('best', 'last'), default=None,
                 help="the run's best step (kept by --keep-best) or its last (default: best "
                      'when the run kept one)')
  args = p.parse_args(argv)
  try:
    from remat.targets import prefer_cpu_without_gpu
    prefer_cpu_without_gpu()
    from training.run.saved_run import RunReadError
    export(args.run_dir, args.out_dir, args.dtype, args.max_shard_size, which=args.checkpoint,
           adapter=args.adapter, base_from=args.base,
           warn=lambda m: print(f'{name}: warning: {m}', file=sys.stderr))
  except (ExportError, RunReadError, ValueError) as e:
    print(f'{name}: error: {e}', file=sys.stderr)
    return 2
  except KeyboardInterrupt:   # the folder is written under a temporary name: nothing is left
    print(f'{name}: interrupted; nothing was exported', file=sys.stderr)
    return 130
  return 0


if __name__ == '__main__':
  sys.exit(main())
