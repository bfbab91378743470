"""Our variables -> Hugging Face state dicts and configs: the inverse of :mod:`models.hf.layout`.

The contract every family's writer keeps (:data:`WRITERS`, one entry per arch)::

    writer(variables, config) -> (state_dict, hf_config)

* ``variables``: ``{'params': ..., **model_state}`` as our model's ``init``
  makes them (layer stacks stacked on a leading axis), numpy or JAX arrays.
* ``config``: our config dataclass (GPTConfig, LlamaConfig, ...).
* ``state_dict``: ``{hf_name: np.ndarray}`` in the layout ``transformers``'
  ``*ForCausalLM`` / ``*ForImageClassification`` expects (torch ``Linear``
  weights ``[out, in]``), float32; the caller casts to the export dtype.
  Tied weights are written once (as ``save_pretrained`` does).
* ``hf_config``: the ``config.json`` object (``model_type``,
  ``architectures`` and every shape field), without dtype or token ids,
  which the caller adds.

A family whose folder needs files besides ``config.json``, the weights and
the tokenizer (a vision model's ``preprocessor_config.json``) registers a
function in :data:`EXTRA_FILES`: ``extra(config) -> {file_name: json_object}``.
Vision writers (ViT, ResNet) live in ``models/hf/export_vision.py`` with this
same signature and are registered here.

Each writer is checked by :func:`models.hf.load.from_state_dict` reading its
output back to the same variables, and by ``transformers`` giving our logits
(tests/test_export.py).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from models.gpt import GPTConfig
from models.llama import LlamaConfig

StateDict = dict[str, np.ndarray]
Writer = Callable[[dict, Any], tuple[StateDict, dict]]


def _np(tree) -> Any:
  if isinstance(tree, dict):
    return {k: _np(v) for k, v in tree.items()}
  return np.asarray(tree, np.float32)


def _t(a: np.ndarray) -> np.ndarray:  # Dense kernel [in, out] -> torch Linear [out, in]
  return np.ascontiguousarray(np.swapaxes(a, -1, -2))


def _layers(sd: StateDict, template: str, stacked: np.ndarray, fn=lambda a: a):
  """``template`` (with ``{i}``) of every layer of a stacked leaf."""
  for i in range(stacked.shape[0]):
    sd[template.format(i=i)] = np.ascontiguousarray(fn(stacked[i]))


def gpt_writer(variables: dict, config: GPTConfig) -> tuple[StateDict, dict]:
  """Our GPT -> ``GPT2LMHeadModel`` (``lm_head`` tied to ``wte``, so not written)."""
  p = _np(variables['params'])
  sd: StateDict = {'transformer.wte.weight': p['wte']['embedding'],
                   'transformer.wpe.weight': p['wpe']['embedding']}
  blk = p['h']['block']
  pre = 'transformer.h.{i}.'
  for ln in ('ln_1', 'ln_2'):
    _layers(sd, pre + f'{ln}.weight', blk[ln]['scale'])
    _layers(sd, pre + f'{ln}.bias', blk[ln]['bias'])
  attn = blk['attn']
  for leaf, hf in (('kernel', 'weight'), ('bias', 'bias')):
    # GPT-2's Conv1D weights are [in, out], like our kernels; c_attn is q, k, v side by side.
    fused = np.concatenate([attn[part][leaf] for part in ('query', 'key', 'value')], axis=-1)
    _layers(sd, pre + f'attn.c_attn.{hf}', fused)
    _layers(sd, pre + f'attn.c_proj.{hf}', attn['c_proj'][leaf])
    _layers(sd, pre + f'mlp.c_fc.{hf}', blk['mlp']['c_fc'][leaf])
    _layers(sd, pre + f'mlp.c_proj.{hf}', blk['mlp']['c_proj'][leaf])
  sd['transformer.ln_f.weight'] = p['ln_f']['scale']
  sd['transformer.ln_f.bias'] = p['ln_f']['bias']
  hf = {'model_type': 'gpt2', 'architectures': ['GPT2LMHeadModel'],
        'vocab_size': config.vocab_size, 'n_positions': config.max_len,
        'n_embd': config.d_model, 'n_layer': config.num_layers, 'n_head': config.num_heads,
        'n_inner': None, 'activation_function': 'gelu_new',
        'resid_pdrop': config.dropout, 'embd_pdrop': config.dropout,
        'attn_pdrop': config.dropout, 'layer_norm_epsilon': config.layer_norm_eps,
        'scale_attn_weights': True, 'tie_word_embeddings': True}
  return sd, hf


_LLAMA_LINEAR = {'self_attn/q_proj': 'self_attn.q_proj', 'self_attn/k_proj': 'self_attn.k_proj',
                 'self_attn/v_proj': 'self_attn.v_proj', 'self_attn/o_proj': 'self_attn.o_proj',
                 'mlp/gate_proj': 'mlp.gate_proj', 'mlp/up_proj': 'mlp.up_proj',
                 'mlp/down_proj': 'mlp.down_proj'}


def llama_writer(variables: dict, config: LlamaConfig) -> tuple[StateDict, dict]:
  """Our Llama -> ``LlamaForCausalLM`` (``lm_head.weight`` only when untied)."""
  p = _np(variables['params'])
  sd: StateDict = {'model.embed_tokens.weight': p['embed_tokens']['embedding']}
  blk = p['layers']['block']
  for ours, hf in _LLAMA_LINEAR.items():
    module, proj = ours.split('/')
    _layers(sd, f'model.layers.{{i}}.{hf}.weight', blk[module][proj]['kernel'], _t)
  for ln in ('input_layernorm', 'post_attention_layernorm'):
    _layers(sd, f'model.layers.{{i}}.{ln}.weight', blk[ln]['scale'])
  sd['model.norm.weight'] = p['norm']['scale']
  if not config.tie_embeddings:
    sd['lm_head.weight'] = _t(p['lm_head']['kernel'])
  scaling = config.rope_scaling
  hf = {'model_type': 'llama', 'architectures': ['LlamaForCausalLM'],
        'vocab_size': config.vocab_size, 'hidden_size': config.d_model,
        'intermediate_size': config.mlp_dim, 'num_hidden_layers': config.num_layers,
        'num_attention_heads': config.num_heads, 'num_key_value_heads': config.num_kv_heads,
        'head_dim': config.head_dim, 'max_position_embeddings': config.max_len,
        'rms_norm_eps': config.rms_norm_eps, 'rope_theta': config.rope_theta,
        'rope_scaling': None if scaling is None else {
            'rope_type': 'llama3', 'factor': scaling.factor,
            'low_freq_factor': scaling.low_freq_factor,
            'high_freq_factor': scaling.high_freq_factor,
            'original_max_position_embeddings': scaling.original_max_position_embeddings},
        'hidden_act': 'silu', 'attention_bias': False, 'mlp_bias': False,
        'tie_word_embeddings': config.tie_embeddings}
  return sd, hf


WRITERS: dict[str, Writer] = {'gpt': gpt_writer, 'llama': llama_writer}
EXTRA_FILES: dict[str, Callable[[Any], dict[str, dict]]] = {}
