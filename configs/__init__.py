"""Named model configs, one JSON file each in this folder.

A file holds ``{"arch": "gpt", "description": ..., "model": {...}, "train": {...}}``:
``model`` fills the architecture's frozen config dataclass, ``train`` gives
default training settings that command-line flags override.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from models.gpt import GPTConfig

CONFIG_DIR = Path(__file__).parent
ARCHS = {'gpt': GPTConfig}


@dataclasses.dataclass(frozen=True)
class NamedConfig:
  """A config file, parsed."""
  name: str
  arch: str
  description: str
  model: Any
  train: dict[str, Any]


def config_names() -> list[str]:
  """Names of the shipped configs, sorted."""
  return sorted(p.stem for p in CONFIG_DIR.glob('*.json'))


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
  return NamedConfig(name, arch, raw.get('description', ''), cls(**raw.get('model', {})),
                     dict(raw.get('train', {})))
