"""Named model configs, one JSON file each in this folder.

A file holds ``{"arch": "gpt"|"llama"|"vit"|"resnet", "description": ..., "model": {...},
"train": {...}}``:
``model`` fills the architecture's frozen config dataclass, ``train`` gives
default training settings that command-line flags override.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from models.gpt import GPTConfig
from models.llama import LlamaConfig
from models.layers import DTYPES
from models.resnet import ResNetConfig
from models.vit import ViTConfig

CONFIG_DIR = Path(__file__).parent
ARCHS = {'gpt': GPTConfig, 'llama': LlamaConfig, 'vit': ViTConfig, 'resnet': ResNetConfig}
# The config a model family uses when none is named.
DEFAULT_CONFIG = {'gpt': 'tiny', 'llama': 'llama-tiny', 'vit': 'vit-tiny', 'resnet': 'resnet-tiny'}


@dataclasses.dataclass(frozen=True)
class NamedConfig:
  """A config file, parsed."""
  name: str
  arch: str
  description: str
  model: Any
  train: dict[str, Any]


def config_names(arch: str | None = None) -> list[str]:
  """Names of the shipped configs (of one arch if given), sorted."""
  names = sorted(p.stem for p in CONFIG_DIR.glob('*.json'))
  if arch is None:
    return names
  return [n for n in names if json.loads((CONFIG_DIR / f'{n}.json').read_text()).get('arch') == arch]


def load_config(name: str) -> NamedConfig:
  """Loads ``configs/<name>.json``.

  Raises:
    ValueError: one line naming the valid configs or the bad field.
  """
  path = CONFIG_DIR / f'{name}.json'
  if not path.is_file():
    raise ValueError(f"unknown config '{name}'; valid: {', '.join(config_names())}")
  raw = json.loads(path.read_text())
  arch = raw.get('arch')
  if arch not in ARCHS:
    raise ValueError(f"config '{name}': unknown arch '{arch}'; valid: {', '.join(ARCHS)}")
  cls = ARCHS[arch]
  fields = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(raw.get('model', {})) - fields)
  if unknown:
    raise ValueError(f"config '{name}': unknown model field(s) {', '.join(unknown)}; "
                     f"valid: {', '.join(sorted(fields))}")
  try:
    model = cls(**raw.get('model', {}))
  except ValueError as e:
    raise ValueError(f"config '{name}': {e}") from None
  return NamedConfig(name, arch, raw.get('description', ''), model, dict(raw.get('train', {})))


def with_dtype(named: NamedConfig, dtype: str | None) -> NamedConfig:
  """``named`` with its model config's compute dtype set to ``dtype`` (None: unchanged).

  What ``--dtype`` does in ``train.py`` and ``bench.report``.

  Raises:
    ValueError: one line, for a dtype other than float32 or bfloat16.
  """
  if dtype is None:
    return named
  if dtype not in DTYPES:
    raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got '{dtype}'")
  return dataclasses.replace(named, model=dataclasses.replace(named.model, dtype=dtype))
