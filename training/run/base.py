"""The frozen base of a LoRA run: where it comes from, its digest, and the check on resume.

A LoRA run's checkpoints hold what trains (the adapters, their optimizer
state), never the base, which can be a hundred times larger. The run's record
(every checkpoint's ``meta`` and ``run.json``) holds ``base``: the Hugging Face
folder it was loaded from (``--init-from``) and the SHA-256 of that folder's
weight files, or, for a base initialised from the seed, the seed. A resume, an
export and a sample load the base again and check it against that digest:
adapters trained on one base are not resumed on another (one line, before the
run writes anything).
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from models.hf.layout import Stacked
from models.lora import params as lora_params
from models.lora import quantize as q
from models.lora.spec import STACKS
from remat.memory import format_bytes
from training.run.settings import RunError

_CHUNK = 1 << 24


def checkpoint_digest(folder) -> str:
  """SHA-256 over a ``save_pretrained`` folder's weight files: each file's name, then its bytes."""
  from models.hf.load import weight_files
  h = hashlib.sha256()
  for f in weight_files(folder):
    h.update(f.name.encode() + b'\0')
    with open(f, 'rb') as stream:
      while chunk := stream.read(_CHUNK):
        h.update(chunk)
  return h.hexdigest()


def record(init_from: str | None, seed: int) -> dict:
  """What a run records of its base: the folder and its digest, or the seed of a random one."""
  if init_from:
    return {'init_from': str(init_from), 'sha256': checkpoint_digest(init_from)}
  return {'init_from': None, 'seed': seed}


def _named(rec: dict) -> str:
  if rec.get('init_from'):
    return f"{rec['init_from']} (weights sha256 {rec['sha256'][:12]})"
  return f"a random base from --seed {rec.get('seed')}"


def check(was: dict | None, now: dict, where: str, what: str = '--resume') -> None:
  """Raises a one-line RunError unless the base ``now`` is the one recorded as ``was``.

  Args:
    was: the run's ``base`` record (None: the record has none).
    now: :func:`record` of the base at hand.
    where: the run folder, for the message.
    what: the caller, for the message.
  """
  if was is None:
    raise RunError(f'{what}: {where} records no LoRA base (its record predates adapters or was '
                   'damaged); it cannot be continued as a LoRA run')
  same = (was.get('sha256') == now.get('sha256') if was.get('init_from') or now.get('init_from')
          else was.get('seed') == now.get('seed'))
  if not same:
    fix = (f"pass --init-from {was['init_from']}" if was.get('init_from') else
           f"drop --init-from (and pass --seed {was.get('seed')})")
    raise RunError(f'{what}: {where} was trained on the base {_named(was)}, not on '
                   f'{_named(now)}: its adapters belong to that base; {fix}, or another --out for '
                   'a new run')


def freeze(base: dict, spec, arch: str, dtype) -> dict:
  """:func:`models.lora.params.freeze`: the base on the device as the run keeps it."""
  return lora_params.freeze(base, spec, arch, dtype)


def reader(spec, arch: str, dtype, num_layers: int, log=print):
  """``convert`` for :func:`models.hf.finetune.load_pretrained`: the block stack's leaves stored
  as the run keeps them while they are read, one layer at a time (cast to ``dtype``; kernels
  quantized under QLoRA, with a progress bar), so the checkpoint is never held whole in float32.
  Other leaves (embeddings, norms, a head) are left to the loader's float32 and
  :func:`freeze`."""
  stack = ('params',) + STACKS[arch]
  kernels = {('params',) + k for k in lora_params.kernel_paths(arch)} if spec.quantize else set()
  quant = jax.jit(lambda w: q.quantize(w, spec.quantize))
  total = lora_params.quantized_layers(spec, arch, num_layers)
  if total:
    log(f'quantizing the base to {spec.quantize} as it is read (blocks of up to 64 weights, '
        'scales bfloat16)')
  bar = tqdm(total=total, desc=f'quantize {spec.quantize}', unit='layer', file=sys.stderr,
             dynamic_ncols=True, mininterval=0.5, disable=not total)
  store = np.dtype(jnp.dtype(dtype))

  def convert(path, array, want):
    del want
    if path[:len(stack)] != stack:
      return None
    layers = array.layers if isinstance(array, Stacked) else list(array)
    if path in kernels:
      done = []
      for layer in layers:
        done.append(jax.device_get(quant(np.asarray(layer, np.float32))))
        bar.update(1)
      if bar.n >= total:
        bar.close()
      return {k: np.stack([d[k] for d in done]) for k in ('codes', 'scale')}
    return np.stack([np.asarray(layer, store) for layer in layers])
  return convert


def describe(state, spec) -> str:
  """The start-up line of a LoRA run: what trains, and the frozen base as it is stored."""
  trained = lora_params.count(state.params)
  frozen = lora_params.count(state.frozen)
  stored = lora_params.nbytes(state.frozen)
  share = trained / max(1, trained + frozen)
  base = f'{spec.quantize}' if spec.quantize else str(jax.tree_util.tree_leaves(
      state.frozen)[0].dtype)
  return (f'lora: {spec.describe()}: {trained:,} parameters train ({share:.2%} of '
          f'{trained + frozen:,}); the base is frozen, stored {base} in {format_bytes(stored)} '
          'and never in a checkpoint')


def folder_of(rec: dict | None) -> Path | None:
  """The base folder a record names (None: a random base)."""
  return Path(rec['init_from']) if rec and rec.get('init_from') else None
