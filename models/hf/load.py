"""Import Hugging Face GPT-2, Llama, ViT and ResNet checkpoints into our Flax models.

A checkpoint is a local ``save_pretrained`` folder: ``config.json`` (read with
:mod:`json`) and ``model.safetensors`` or a sharded
``model.safetensors.index.json`` (read by :func:`read_safetensors`: the
format's JSON header and raw little-endian arrays, bfloat16 included, memory
mapped; float32, float16 and bfloat16 weights become float32). Neither torch
nor transformers is imported, and pickles (``pytorch_model.bin``) are
never loaded. The name and layout mapping is in :mod:`models.hf.layout`; the
result is checked leaf by leaf against the variables our model's ``init``
produces (traced with :func:`jax.eval_shape`, nothing allocated).

Example::

    arch, config, variables = load_hf('path/to/gpt2', expect_arch='gpt')
    logits = Task(config).model('none').apply(variables, tokens)

Every failure is an :class:`HFImportError` (a ``ValueError``) with a one-line
message: a missing folder or file, another architecture, an unsupported
variant, missing or unknown keys, or a shape that does not fit the config.
"""

from __future__ import annotations

import functools
import json
import pathlib
from typing import Any

import jax
import ml_dtypes
import numpy as np

from models.hf.layout import CONFIGS, MODEL_TYPES, VARIABLES, HFImportError, StateDict, _few
from models.tasks import ARCH_OF, Task

__all__ = ['HFImportError', 'load_hf', 'load_hf_config', 'from_state_dict', 'read_safetensors',
           'weight_files']

_NAMES = {'gpt': 'GPT-2', 'llama': 'Llama', 'vit': 'ViT', 'resnet': 'ResNet'}
_PREFIX = {arch: prefix for arch, prefix in MODEL_TYPES.values()}


def _folder(path) -> pathlib.Path:
  p = pathlib.Path(path)
  if not p.exists():
    raise HFImportError(f'no Hugging Face checkpoint folder at {p}')
  if not p.is_dir():
    raise HFImportError(f'{p} is not a folder; expected a save_pretrained folder')
  return p


def _read_json(file: pathlib.Path) -> dict:
  try:
    data = json.loads(file.read_text())
  except (OSError, ValueError) as e:
    raise HFImportError(f'cannot read {file}: {str(e).splitlines()[0]}') from None
  if not isinstance(data, dict):
    raise HFImportError(f'{file} does not hold a JSON object')
  return data


def _hf_config(p: pathlib.Path) -> tuple[str, dict]:
  file = p / 'config.json'
  if not file.is_file():
    raise HFImportError(f'{p} has no config.json; expected a folder written by save_pretrained')
  hf = _read_json(file)
  model_type = hf.get('model_type')
  if model_type not in MODEL_TYPES:
    supported = ', '.join(f'{t} ({_NAMES[a]})' for t, (a, _) in MODEL_TYPES.items())
    raise HFImportError(f"{file}: model_type '{model_type}' is not supported; supported: "
                        f'{supported}')
  return model_type, hf


def load_hf_config(path) -> tuple[str, Any]:
  """Reads a checkpoint folder's ``config.json``.

  Args:
    path: a ``save_pretrained`` folder.

  Returns:
    ``(arch, config)``: 'gpt', 'llama', 'vit' or 'resnet' and our config dataclass.

  Raises:
    HFImportError: one line, for a missing folder or config, another
      model_type, or a variant our model does not compute.
  """
  p = _folder(path)
  model_type, hf = _hf_config(p)
  arch = MODEL_TYPES[model_type][0]
  try:
    return arch, CONFIGS[arch](hf)
  except HFImportError as e:
    raise HFImportError(f'{p / "config.json"}: {e}') from None
  except (ValueError, TypeError, KeyError) as e:
    msg = str(e).splitlines()[0] if str(e) else type(e).__name__
    raise HFImportError(f'{p / "config.json"}: {msg}') from None


def weight_files(path) -> list[pathlib.Path]:
  """The safetensors files of a ``save_pretrained`` folder (one, or the shards its index names).

  Raises:
    HFImportError: one line: no folder, no weights, only a pickle, or missing shards.
  """
  return _weight_files(_folder(path))[0]


def _weight_files(p: pathlib.Path) -> tuple[list[pathlib.Path], str]:
  single, index = p / 'model.safetensors', p / 'model.safetensors.index.json'
  if single.is_file():
    files = [single]
  elif index.is_file():
    weight_map = _read_json(index).get('weight_map') or {}
    files = sorted({p / f for f in weight_map.values()})
    if not files:
      raise HFImportError(f'{index} lists no weight files')
  elif any((p / f).is_file() for f in ('pytorch_model.bin', 'pytorch_model.bin.index.json')):
    raise HFImportError(f'{p} holds only pytorch_model.bin (a pickle, never loaded here); '
                        're-save it with save_pretrained(..., safe_serialization=True) for '
                        'model.safetensors')
  else:
    raise HFImportError(f'{p} has no model.safetensors')
  missing = [f.name for f in files if not f.is_file()]
  if missing:
    raise HFImportError(f'{index} names weight files that are missing: {_few(missing, 2)}')
  return files, files[0].name if len(files) == 1 else index.name


def _read_tensors(p: pathlib.Path) -> tuple[dict[str, np.ndarray], str]:
  files, name = _weight_files(p)
  tensors = {}
  for f in files:
    tensors.update(read_safetensors(f))
  return tensors, name


# safetensors dtype names -> numpy dtypes (bfloat16 from ml_dtypes, which JAX depends on).
_SAFETENSORS_DTYPES = {'F64': np.float64, 'F32': np.float32, 'F16': np.float16,
                       'BF16': ml_dtypes.bfloat16, 'I64': np.int64, 'I32': np.int32,
                       'I16': np.int16, 'I8': np.int8, 'U8': np.uint8, 'BOOL': np.bool_}


def read_safetensors(file) -> dict[str, np.ndarray]:
  """The tensors of one ``.safetensors`` file, as read-only numpy arrays over a memory map.

  The format is an 8-byte little-endian header length, a JSON header (name ->
  dtype, shape, byte range) and the raw arrays. Read here rather than with
  ``safetensors.numpy``, whose numpy has no bfloat16 (the dtype Llama
  checkpoints are published in); nothing is executed or unpickled.

  Raises:
    HFImportError: one line, for an unreadable or damaged file or an unsupported dtype.
  """
  file = pathlib.Path(file)
  bad = lambda why: HFImportError(f'cannot read {file}: {why}')
  try:
    data = np.memmap(file, dtype=np.uint8, mode='r')
  except (OSError, ValueError) as e:
    raise bad(str(e).splitlines()[0] if str(e) else 'empty file') from None
  if data.size < 8:
    raise bad('too short for a safetensors header')
  n = int(np.frombuffer(data[:8].tobytes(), '<u8')[0])
  if n > data.size - 8:
    raise bad(f'header length {n} exceeds the file')
  try:
    header = json.loads(data[8:8 + n].tobytes())
  except ValueError as e:
    raise bad(f'header is not JSON ({str(e).splitlines()[0]})') from None
  if not isinstance(header, dict):
    raise bad('header is not a JSON object')
  body = data[8 + n:]
  out = {}
  for name, info in header.items():
    if name == '__metadata__':
      continue
    try:
      dtype, shape, (begin, end) = info['dtype'], tuple(info['shape']), info['data_offsets']
    except (TypeError, KeyError, ValueError):
      raise bad(f'malformed header entry for {name}') from None
    if dtype not in _SAFETENSORS_DTYPES:
      raise bad(f'{name} has dtype {dtype}, not one of {", ".join(_SAFETENSORS_DTYPES)}')
    np_dtype = np.dtype(_SAFETENSORS_DTYPES[dtype]).newbyteorder('<')
    if not (0 <= begin <= end <= body.size
            and end - begin == np_dtype.itemsize * int(np.prod(shape, dtype=np.int64))):
      raise bad(f'{name}: byte range {begin}..{end} does not hold a {dtype} array of shape '
                f'{list(shape)} within the file')
    out[name] = np.frombuffer(body, np_dtype, count=(end - begin) // np_dtype.itemsize,
                              offset=begin).reshape(shape)
  return out


@functools.lru_cache(maxsize=16)
def _expected(config) -> dict[tuple[str, ...], jax.ShapeDtypeStruct]:
  """Path -> shape and dtype of every variable our model's init produces for ``config``."""
  task = Task(config)
  model = task.model('none')
  shapes = jax.eval_shape(
      lambda: model.init(jax.random.PRNGKey(0), task.init_input(task.default_size)))
  flat = jax.tree_util.tree_flatten_with_path(shapes)[0]
  return {tuple(k.key for k in path): leaf for path, leaf in flat}


def from_state_dict(arch: str, tensors: dict[str, np.ndarray], config, where: str = 'state dict',
                    convert=None):
  """Maps HF-named arrays onto our variable tree for ``config``.

  The mapping is linear (transposes, splits, stacks), so it also maps
  gradients given in HF's layout to ours.

  Args:
    arch: 'gpt', 'llama', 'vit' or 'resnet'.
    tensors: HF state-dict name -> array (numpy or anything ``np.asarray`` takes).
    config: our config dataclass the result must fit.
    where: how messages name the source.
    convert: None, or ``convert(path, array, want)`` called for each leaf (``array``
      may be a :class:`models.hf.layout.Stacked` of layers, ``want`` the model's
      ShapeDtypeStruct), returning the leaf to keep, or None for the default
      (a float32 copy): a LoRA run stores its base cast or quantized as it reads it.

  Returns:
    ``{'params': ..., 'batch_stats': ...}`` (the latter for ResNet) of float32
    numpy arrays (bfloat16 and float16 checkpoints are widened exactly), with exactly our
    model's tree and shapes.

  Raises:
    HFImportError: one line, for missing or unknown keys or the first
      parameter whose shape does not fit ``config``.
  """
  sd = StateDict({k: np.asarray(v) for k, v in tensors.items()}, _PREFIX[arch], where, config)
  VARIABLES[arch](sd)
  extra = sd.leftovers()
  if extra:
    raise HFImportError(f'{where} has keys a {_NAMES[arch]} model does not use: {_few(extra)}')
  expected = _expected(config)
  out: dict[str, Any] = {}
  # Parameters before batch_stats, so the first mismatch named is a parameter's.
  for path, want in sorted(expected.items(), key=lambda item: item[0][0] != 'params'):
    name = '/'.join(path[1:])
    if path not in sd.out:
      raise HFImportError(f'{where} has nothing for {path[0]} {name} (shape {want.shape}) that '
                          'the config needs')
    array, source = sd.out[path]
    if array.shape != want.shape:
      raise HFImportError(f'shape mismatch at {name} ({source}): checkpoint {array.shape}, '
                          f'config {want.shape}')
    node = out
    for key in path[:-1]:
      node = node.setdefault(key, {})
    got = convert(path, array, want) if convert is not None else None
    node[path[-1]] = np.ascontiguousarray(array, dtype=want.dtype) if got is None else got
  unplaced = [f'{s} ({"/".join(p[1:])})' for p, (_, s) in sd.out.items() if p not in expected]
  if unplaced:
    raise HFImportError(f'{where} has parameters the config has no place for: {_few(unplaced, 2)}')
  return out


def load_hf(path, expect_arch: str | None = None, config=None,
            convert=None) -> tuple[str, Any, dict]:
  """Loads a Hugging Face checkpoint folder into our variables.

  Args:
    path: a ``save_pretrained`` folder (GPT2LMHeadModel / GPT2Model,
      ViTForImageClassification, ResNetForImageClassification).
    expect_arch: if given ('gpt', 'llama', 'vit' or 'resnet'), the checkpoint must be of it.
    config: if given (our config dataclass), the checkpoint's shapes must fit
      it, and it is returned instead of the one read from ``config.json``.
    convert: see :func:`from_state_dict`.

  Returns:
    ``(arch, config, variables)``; ``variables`` is ``{'params': ...}`` plus
    ``'batch_stats'`` for ResNet, float32 numpy arrays with the tree and
    shapes of ``Task(config).model(...).init``.

  Raises:
    HFImportError: one line (see :func:`load_hf_config`, :func:`from_state_dict`).
  """
  if expect_arch is not None and expect_arch not in _NAMES:
    raise HFImportError(f"unknown expected architecture '{expect_arch}'; valid: "
                        f'{", ".join(_NAMES)}')
  arch, hf_config = load_hf_config(path)
  p = pathlib.Path(path)
  if expect_arch is not None and arch != expect_arch:
    raise HFImportError(f'{p} holds a {_NAMES[arch]} checkpoint, not the expected '
                        f'{_NAMES[expect_arch]}')
  if config is None:
    config = hf_config
  elif ARCH_OF.get(type(config)) != arch:
    raise HFImportError(f'{p} holds a {_NAMES[arch]} checkpoint, which does not fit a '
                        f'{type(config).__name__}')
  tensors, file = _read_tensors(p)
  return arch, config, from_state_dict(arch, tensors, config, where=str(p / file), convert=convert)
