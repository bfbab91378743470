"""A LoRA run's adapters as a PEFT folder: ``adapter_config.json`` and ``adapter_model.safetensors``.

What ``peft.PeftModel.from_pretrained(base, folder)`` loads onto the Hugging
Face model the run started from (and what peft's own ``save_pretrained``
writes): per adapted module ``base_model.model.<module>.lora_A.weight``
``[r, in]`` and ``lora_B.weight`` ``[out, r]`` (our ``lora_a`` ``[in, r]`` and
``lora_b`` ``[r, out]``, transposed), scaled by ``lora_alpha / r`` as ours.

* Llama: our projections are the Hugging Face modules of the same names.
* GPT-2: Hugging Face fuses query, key and value into ``attn.c_attn`` (a
  ``Conv1D``). Three adapters of rank r on them are one adapter of rank 3r on
  ``c_attn``, exactly: ``A = [A_q A_k A_v]``, ``B`` block-diagonal. The config
  says so with ``rank_pattern`` / ``alpha_pattern`` (``c_attn``: 3r and 3 alpha,
  the same scale), and ``fan_in_fan_out`` (Conv1D weights are ``[in, out]``).

ViT is not written: transformers renamed its modules between versions (4's
``attention.attention.query``, 5's ``attention.q_proj``), so a PEFT folder
would load under one of them only; export it merged instead.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from models.lora.spec import STACKS, LoraSpec

# Our projection -> the Hugging Face module of layer {i}.
MODULES = {
    'llama': {p: f'model.layers.{{i}}.{p.replace("/", ".")}' for p in (
        'self_attn/q_proj', 'self_attn/k_proj', 'self_attn/v_proj', 'self_attn/o_proj',
        'mlp/gate_proj', 'mlp/up_proj', 'mlp/down_proj')},
    'gpt': {'attn/c_proj': 'transformer.h.{i}.attn.c_proj', 'mlp/c_fc': 'transformer.h.{i}.mlp.c_fc',
            'mlp/c_proj': 'transformer.h.{i}.mlp.c_proj'},
}
_FUSED = {'gpt': ('transformer.h.{i}.attn.c_attn', ('attn/query', 'attn/key', 'attn/value'))}
TASK_TYPES = {'llama': 'CAUSAL_LM', 'gpt': 'CAUSAL_LM'}
PREFIX = 'base_model.model.'


class AdapterExportError(ValueError):
  """Adapters that cannot be written as a PEFT folder; the message is one line."""


def _block(trained: dict, arch: str) -> dict:
  node = trained
  for k in STACKS[arch]:
    node = node[k]
  return node


def _adapter(block: dict, projection: str):
  node = block
  for k in projection.split('/'):
    node = node.get(k) if isinstance(node, dict) else None
    if node is None:
      return None
  if 'lora_a' not in node:
    return None
  return np.asarray(node['lora_a'], np.float32), np.asarray(node['lora_b'], np.float32)


def _targets(modules: list[str], everything: list[str]) -> list[str] | str:
  """peft's ``target_modules``: the modules' last names when that picks exactly them, else a
  regular expression (peft matches a string whole against each module's name)."""
  last = lambda m: m.rsplit('.', 1)[-1]
  chosen = {last(m) for m in modules}
  if all(last(m) not in chosen or m in modules for m in everything):
    return sorted(chosen)
  inner = sorted({m.split('{i}.', 1)[1] for m in modules})
  return r'.*\.(' + '|'.join(re.escape(m) for m in inner) + ')'


def peft_adapter(trained: dict, spec: LoraSpec, arch: str, num_layers: int,
                 base_path: str | None) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
  """``(state_dict, adapter_config)`` of a LoRA run's trained parameters.

  Args:
    trained: the run's trained tree (``lora_a``/``lora_b`` under the block stack).
    spec: the run's adapters.
    arch: 'llama' or 'gpt'.
    num_layers: layers of the stack.
    base_path: the base's folder, recorded as ``base_model_name_or_path``.

  Raises:
    AdapterExportError: one line, for a family without a PEFT layout here.
  """
  if arch not in MODULES:
    raise AdapterExportError(f'--adapter writes PEFT folders for {", ".join(sorted(MODULES))} '
                             f'runs; export this {arch} run merged (without --adapter)')
  block = _block(trained, arch)
  sd: dict[str, np.ndarray] = {}
  modules, rank_pattern, alpha_pattern = [], {}, {}
  r = spec.rank
  for projection, module in MODULES[arch].items():
    got = _adapter(block, projection)
    if got is None:
      continue
    modules.append(module)
    a, b = got
    for i in range(num_layers):
      name = PREFIX + module.format(i=i)
      sd[f'{name}.lora_A.weight'] = np.ascontiguousarray(a[i].T)
      sd[f'{name}.lora_B.weight'] = np.ascontiguousarray(b[i].T)
  if arch in _FUSED:
    module, parts = _FUSED[arch]
    present = [(j, _adapter(block, p)) for j, p in enumerate(parts)]
    present = [(j, ab) for j, ab in present if ab is not None]
    if present:
      modules.append(module)
      k = len(present)
      width = present[0][1][1].shape[-1]   # each part's output width
      for i in range(num_layers):
        a = np.concatenate([ab[0][i] for _, ab in present], axis=-1)        # [in, k r]
        b = np.zeros((k * r, len(parts) * width), np.float32)             # block-diagonal
        for n, (j, ab) in enumerate(present):
          b[n * r:(n + 1) * r, j * width:(j + 1) * width] = ab[1][i]
        name = PREFIX + module.format(i=i)
        sd[f'{name}.lora_A.weight'] = np.ascontiguousarray(a.T)
        sd[f'{name}.lora_B.weight'] = np.ascontiguousarray(b.T)
      if k > 1:   # rank k r, alpha k alpha: the scale alpha / r is the parts'
        short = module.rsplit('.', 1)[-1]
        rank_pattern[short], alpha_pattern[short] = k * r, k * spec.alpha
  everything = list(MODULES[arch].values()) + ([_FUSED[arch][0]] if arch in _FUSED else [])
  config = {
      'peft_type': 'LORA', 'task_type': TASK_TYPES[arch], 'r': r, 'lora_alpha': spec.alpha,
      'lora_dropout': spec.dropout, 'target_modules': _targets(modules, everything),
      'rank_pattern': rank_pattern, 'alpha_pattern': alpha_pattern, 'bias': 'none',
      'fan_in_fan_out': arch == 'gpt', 'modules_to_save': None, 'init_lora_weights': True,
      'use_rslora': False, 'use_dora': False, 'inference_mode': True,
      'base_model_name_or_path': base_path,
  }
  return sd, config
