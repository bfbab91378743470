"""Hugging Face config fields and state-dict names -> our configs and parameter paths.

Models: GPT-2, Llama, ViT, ResNet.

Pure numpy, no torch or transformers: :mod:`models.hf.load` reads the files and
checks the result against our models; this module only maps names and
layouts. Each ``*_variables`` function reads a :class:`StateDict` and fills
its flat ``out`` dict, ``{('params' | 'batch_stats', *path): (array, hf_name)}``,
with layer stacks stacked on a new leading axis and counted from the keys.

Layouts: torch ``Linear`` weights are ``[out, in]`` (transposed to a Dense
kernel's ``[in, out]``); GPT-2's ``Conv1D`` weights are already ``[in, out]``;
torch ``Conv2d`` weights are OIHW (to HWIO); BatchNorm ``weight``/``bias`` are
``scale``/``bias`` params, ``running_mean``/``running_var`` the
``batch_stats`` ``mean``/``var``.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import numpy as np

from models.gpt import GPTConfig
from models.llama import LlamaConfig, RopeScaling
from models.resnet import ResNetConfig
from models.vit import ViTConfig

# HF model_type -> (our arch, base-model prefix of the body's keys).
MODEL_TYPES = {'gpt2': ('gpt', 'transformer.'), 'llama': ('llama', 'model.'),
               'vit': ('vit', 'vit.'), 'resnet': ('resnet', 'resnet.')}


class HFImportError(ValueError):
  """A Hugging Face checkpoint that cannot be imported; the message is one line."""


def _check(ok: bool, msg: str):
  if not ok:
    raise HFImportError(msg)


def _few(names, n: int = 4) -> str:
  names = sorted(names)
  more = f' (and {len(names) - n} more)' if len(names) > n else ''
  return ', '.join(names[:n]) + more


def _square(hf: dict, field: str, default: int) -> int:
  v = hf.get(field, default)
  if isinstance(v, (list, tuple)):
    _check(len(v) == 2 and v[0] == v[1], f'ViT with non-square {field} {v} is not supported')
    v = v[0]
  return int(v)


def _num_labels(hf: dict) -> int:
  return len(hf['id2label']) if hf.get('id2label') else int(hf.get('num_labels', 2))


def gpt_config(hf: dict) -> GPTConfig:
  """GPT2Config fields -> GPTConfig; rejects variants our GPT does not compute."""
  d = int(hf.get('n_embd', 768))
  act = hf.get('activation_function', 'gelu_new')
  _check(act in ('gelu_new', 'gelu_pytorch_tanh'),
         f"GPT-2 with activation_function '{act}' is not supported (only gelu_new)")
  for flag in ('scale_attn_by_inverse_layer_idx', 'reorder_and_upcast_attn', 'add_cross_attention'):
    _check(not hf.get(flag, False), f'GPT-2 with {flag}=true is not supported')
  _check(hf.get('scale_attn_weights', True), 'GPT-2 with scale_attn_weights=false is not supported')
  _check(hf.get('tie_word_embeddings', True),
         'GPT-2 with untied output embeddings (tie_word_embeddings=false) is not supported')
  _check(hf.get('n_inner') in (None, 4 * d),
         f"GPT-2 with n_inner {hf.get('n_inner')} is not supported (only 4 * n_embd = {4 * d})")
  rates = {k: float(hf.get(k, 0.1)) for k in ('resid_pdrop', 'embd_pdrop', 'attn_pdrop')}
  _check(len(set(rates.values())) == 1,
         f'GPT-2 with different dropout rates {rates} is not supported (our GPT has one rate)')
  return GPTConfig(vocab_size=int(hf.get('vocab_size', 50257)),
                   max_len=int(hf.get('n_positions', 1024)), num_layers=int(hf.get('n_layer', 12)),
                   num_heads=int(hf.get('n_head', 12)), d_model=d, dropout=rates['resid_pdrop'],
                   layer_norm_eps=float(hf.get('layer_norm_epsilon', 1e-5)))


def _llama_rope(hf: dict) -> tuple[float, RopeScaling | None]:
  """(rope_theta, rope_scaling): transformers 4's two fields or 5's ``rope_parameters``."""
  params = hf.get('rope_parameters') or {}
  theta = float(params.get('rope_theta', hf.get('rope_theta', 10000.0)))
  scaling = hf.get('rope_scaling') or params
  kind = scaling.get('rope_type', scaling.get('type', 'default'))
  if kind == 'default':
    return theta, None
  _check(kind == 'llama3', f"Llama with rope_type '{kind}' is not supported (only default and "
         'llama3)')
  fields = ('factor', 'low_freq_factor', 'high_freq_factor', 'original_max_position_embeddings')
  missing = [f for f in fields if f not in scaling]
  _check(not missing, f"Llama rope_scaling llama3 lacks {', '.join(missing)}")
  _check(scaling.get('attention_factor') in (None, 1.0),
         'Llama rope_scaling with attention_factor != 1 is not supported')
  return theta, RopeScaling(float(scaling['factor']), float(scaling['low_freq_factor']),
                            float(scaling['high_freq_factor']),
                            int(scaling['original_max_position_embeddings']))


def llama_config(hf: dict) -> LlamaConfig:
  """LlamaConfig fields (transformers 4 or 5) -> our LlamaConfig (dtype float32, as read)."""
  act = hf.get('hidden_act', 'silu')
  _check(act == 'silu', f"Llama with hidden_act '{act}' is not supported (only silu)")
  for flag in ('attention_bias', 'mlp_bias'):
    _check(not hf.get(flag, False), f'Llama with {flag}=true is not supported (our Llama has no '
           'biases)')
  d, heads = int(hf.get('hidden_size', 4096)), int(hf.get('num_attention_heads', 32))
  head_dim = hf.get('head_dim')
  _check(head_dim is None or heads * int(head_dim) == d,
         f'Llama with head_dim {head_dim} != hidden_size / num_attention_heads is not supported')
  theta, scaling = _llama_rope(hf)
  kv = hf.get('num_key_value_heads')
  return LlamaConfig(vocab_size=int(hf.get('vocab_size', 32000)), d_model=d,
                     num_layers=int(hf.get('num_hidden_layers', 32)), num_heads=heads,
                     num_kv_heads=heads if kv is None else int(kv),
                     mlp_dim=int(hf.get('intermediate_size', 11008)),
                     max_len=int(hf.get('max_position_embeddings', 2048)),
                     rms_norm_eps=float(hf.get('rms_norm_eps', 1e-6)), rope_theta=theta,
                     rope_scaling=scaling,
                     tie_embeddings=bool(hf.get('tie_word_embeddings', False)))


def vit_config(hf: dict) -> ViTConfig:
  """ViTConfig fields -> our ViTConfig; rejects variants our ViT does not compute."""
  act = hf.get('hidden_act', 'gelu')
  _check(act == 'gelu', f"ViT with hidden_act '{act}' is not supported (only exact gelu)")
  _check(hf.get('qkv_bias', True), 'ViT with qkv_bias=false is not supported')
  return ViTConfig(image_size=_square(hf, 'image_size', 224),
                   patch_size=_square(hf, 'patch_size', 16),
                   channels=int(hf.get('num_channels', 3)), num_classes=_num_labels(hf),
                   num_layers=int(hf.get('num_hidden_layers', 12)),
                   num_heads=int(hf.get('num_attention_heads', 12)),
                   d_model=int(hf.get('hidden_size', 768)),
                   mlp_dim=int(hf.get('intermediate_size', 3072)),
                   dropout=float(hf.get('hidden_dropout_prob', 0.0)),
                   attention_dropout=float(hf.get('attention_probs_dropout_prob', 0.0)),
                   layer_norm_eps=float(hf.get('layer_norm_eps', 1e-12)))


def resnet_config(hf: dict) -> ResNetConfig:
  """ResNetConfig fields -> our ResNetConfig (image_size keeps our default)."""
  act = hf.get('hidden_act', 'relu')
  _check(act == 'relu', f"ResNet with hidden_act '{act}' is not supported (only relu)")
  for flag in ('downsample_in_first_stage', 'downsample_in_bottleneck'):
    _check(not hf.get(flag, False), f'ResNet with {flag}=true is not supported')
  return ResNetConfig(embedding_size=int(hf.get('embedding_size', 64)),
                      hidden_sizes=tuple(hf.get('hidden_sizes', (256, 512, 1024, 2048))),
                      depths=tuple(hf.get('depths', (3, 4, 6, 3))),
                      layer_type=hf.get('layer_type', 'bottleneck'),
                      num_classes=_num_labels(hf), channels=int(hf.get('num_channels', 3)))


CONFIGS = {'gpt': gpt_config, 'llama': llama_config, 'vit': vit_config, 'resnet': resnet_config}


class Stacked:
  """The layers of one stacked leaf, kept as they are read (memory-mapped views) until used.

  ``np.asarray`` stacks them; a loader that converts layer by layer (a LoRA
  run's base, cast or quantized as it is read: ``models.hf.load.from_state_dict``'s
  ``convert``) never holds more than one layer of the checkpoint in memory.
  """

  def __init__(self, layers: list):
    self.layers = layers

  @property
  def shape(self) -> tuple[int, ...]:
    return (len(self.layers), *np.shape(self.layers[0]))

  @property
  def dtype(self):
    return np.asarray(self.layers[0]).dtype

  def __array__(self, dtype=None, copy=None):
    del copy
    return np.stack([np.asarray(a, dtype) for a in self.layers])


class StateDict:
  """A checkpoint's tensors, with the base-model prefix optional and every key use recorded.

  Attributes:
    tensors: HF name -> numpy array.
    prefix: the base-model prefix (``transformer.``, ...) when the keys carry it, else ''.
    config: our config the result is for (a layout may depend on it: Llama's tied head), or None.
  """

  def __init__(self, tensors: dict[str, np.ndarray], base_prefix: str, where: str, config=None):
    self.config = config
    self.tensors = tensors
    self.where = where
    self.prefix = base_prefix if any(k.startswith(base_prefix) for k in tensors) else ''
    self.used: set[str] = set()
    self.out: dict[tuple[str, ...], tuple[np.ndarray, str]] = {}

  def name(self, key: str, head: bool = False) -> str:
    return key if head else self.prefix + key

  def has(self, key: str, head: bool = False) -> bool:
    return self.name(key, head) in self.tensors

  def take(self, key: str, head: bool = False, hint: str = '') -> np.ndarray:
    """The tensor ``key`` (under the base prefix unless ``head``), marked used."""
    name = self.name(key, head)
    _check(name in self.tensors, f'{self.where} lacks {name}{hint}')
    self.used.add(name)
    return self.tensors[name]

  def ignore(self, pattern: str):
    """Marks keys matching the regex ``pattern`` (after the prefix) as used."""
    self.used.update(k for k in self.tensors if re.fullmatch(re.escape(self.prefix) + pattern, k))

  def count(self, pattern: str) -> int:
    """1 + the largest index captured by ``pattern`` (a regex with one group), or 0."""
    regex = re.compile(re.escape(self.prefix) + pattern)
    idx = [int(m.group(1)) for k in self.tensors if (m := regex.match(k))]
    return max(idx) + 1 if idx else 0

  def put(self, path: str, array, source: str):
    self.out[tuple(path.split('/'))] = (array if isinstance(array, Stacked) else np.asarray(array),
                                        source)

  def stack(self, path: str, template: str, n: int, fn: Callable = lambda a: a, offset: int = 0):
    """Puts ``fn`` of layers ``offset..offset+n-1`` of ``template`` (with ``{i}``), stacked
    (:class:`Stacked`: read when used)."""
    arrays = [fn(self.take(template.format(i=offset + i))) for i in range(n)]
    self.put(path, Stacked(arrays), self.name(template.format(i='*')))

  def leftovers(self) -> list[str]:
    return [k for k in self.tensors if k not in self.used]


def _t(a):  # torch Linear [out, in] -> Dense kernel [in, out]
  return np.swapaxes(a, -1, -2)


def _hwio(a):  # torch Conv2d OIHW -> Flax HWIO
  return np.transpose(a, (2, 3, 1, 0))


def _index_regex(template: str) -> str:
  """'h.{i}.' -> a regex capturing the index."""
  return re.escape(template).replace(r'\{i\}', r'(\d+)')


def _layers(sd: StateDict, template: str) -> int:
  """How many layers ``template`` (with ``{i}``) has; at least one."""
  n = sd.count(_index_regex(template))
  _check(n > 0, f'{sd.where} has no keys like {sd.name(template)}*')
  return n


def gpt_variables(sd: StateDict):
  """GPT2LMHeadModel / GPT2Model keys -> our GPT params (lm_head tied to wte)."""
  n = _layers(sd, 'h.{i}.')
  wte = sd.take('wte.weight')
  sd.put('params/wte/embedding', wte, sd.name('wte.weight'))
  sd.put('params/wpe/embedding', sd.take('wpe.weight'), sd.name('wpe.weight'))
  blk = 'params/h/block'
  for ln in ('ln_1', 'ln_2'):
    sd.stack(f'{blk}/{ln}/scale', f'h.{{i}}.{ln}.weight', n)
    sd.stack(f'{blk}/{ln}/bias', f'h.{{i}}.{ln}.bias', n)
  for leaf, hf in (('kernel', 'weight'), ('bias', 'bias')):
    fused = np.stack([sd.take(f'h.{i}.attn.c_attn.{hf}') for i in range(n)])
    _check(fused.shape[-1] % 3 == 0, f'{sd.name(f"h.0.attn.c_attn.{hf}")} has shape '
           f'{fused.shape[1:]}, whose last axis is not 3 * n_embd')
    for part, arr in zip(('query', 'key', 'value'), np.split(fused, 3, axis=-1)):
      sd.put(f'{blk}/attn/{part}/{leaf}', arr, sd.name(f'h.*.attn.c_attn.{hf}') + f' ({part})')
    # Conv1D weights are already [in, out].
    sd.stack(f'{blk}/attn/c_proj/{leaf}', f'h.{{i}}.attn.c_proj.{hf}', n)
    sd.stack(f'{blk}/mlp/c_fc/{leaf}', f'h.{{i}}.mlp.c_fc.{hf}', n)
    sd.stack(f'{blk}/mlp/c_proj/{leaf}', f'h.{{i}}.mlp.c_proj.{hf}', n)
  sd.put('params/ln_f/scale', sd.take('ln_f.weight'), sd.name('ln_f.weight'))
  sd.put('params/ln_f/bias', sd.take('ln_f.bias'), sd.name('ln_f.bias'))
  sd.ignore(r'h\.\d+\.attn\.(bias|masked_bias)')  # causal-mask buffers of older checkpoints
  if sd.has('lm_head.weight', head=True):
    _check(np.array_equal(sd.take('lm_head.weight', head=True), wte),
           f'{sd.where}: lm_head.weight differs from {sd.name("wte.weight")}; untied output '
           'embeddings are not supported')


_LLAMA_LINEAR = {'self_attn/q_proj': 'self_attn.q_proj', 'self_attn/k_proj': 'self_attn.k_proj',
                 'self_attn/v_proj': 'self_attn.v_proj', 'self_attn/o_proj': 'self_attn.o_proj',
                 'mlp/gate_proj': 'mlp.gate_proj', 'mlp/up_proj': 'mlp.up_proj',
                 'mlp/down_proj': 'mlp.down_proj'}


def llama_variables(sd: StateDict):
  """LlamaForCausalLM / LlamaModel keys -> our Llama params (``lm_head`` for an untied config)."""
  n = _layers(sd, 'layers.{i}.')
  emb = sd.take('embed_tokens.weight')
  sd.put('params/embed_tokens/embedding', emb, sd.name('embed_tokens.weight'))
  blk = 'params/layers/block'
  for ours, hf in _LLAMA_LINEAR.items():
    sd.stack(f'{blk}/{ours}/kernel', f'layers.{{i}}.{hf}.weight', n, _t)
  for ln in ('input_layernorm', 'post_attention_layernorm'):
    sd.stack(f'{blk}/{ln}/scale', f'layers.{{i}}.{ln}.weight', n)
  sd.put('params/norm/scale', sd.take('norm.weight'), sd.name('norm.weight'))
  sd.ignore(r'layers\.\d+\.self_attn\.rotary_emb\.inv_freq')  # a buffer in older checkpoints
  tied = sd.config is None or sd.config.tie_embeddings
  if tied:
    if sd.has('lm_head.weight', head=True):
      _check(np.array_equal(sd.take('lm_head.weight', head=True), emb),
             f'{sd.where}: lm_head.weight differs from {sd.name("embed_tokens.weight")}, but the '
             'config ties the embeddings (tie_embeddings)')
  else:
    head = sd.take('lm_head.weight', head=True,
                   hint=' (a base LlamaModel, or a tied checkpoint for an untied config?)')
    sd.put('params/lm_head/kernel', _t(head), 'lm_head.weight')


# ViT layer names: as written to model.safetensors (transformers 4.x and 5.x), and as
# transformers >= 5 names its modules in memory (its state_dict()).
_VIT_FILE = {'attention/query': 'attention.attention.query',
             'attention/key': 'attention.attention.key',
             'attention/value': 'attention.attention.value',
             'attention/output': 'attention.output.dense', 'intermediate': 'intermediate.dense',
             'output': 'output.dense'}
_VIT_MODULES = {'attention/query': 'attention.q_proj', 'attention/key': 'attention.k_proj',
                'attention/value': 'attention.v_proj', 'attention/output': 'attention.o_proj',
                'intermediate': 'mlp.fc1', 'output': 'mlp.fc2'}


def vit_variables(sd: StateDict):
  """ViTForImageClassification keys (file or in-memory names) -> our ViT params."""
  layer, dense = 'encoder.layer.{i}.', _VIT_FILE
  if not sd.count(_index_regex(layer)) and sd.count(_index_regex('layers.{i}.')):
    layer, dense = 'layers.{i}.', _VIT_MODULES
  n = _layers(sd, layer)
  emb = 'embeddings.'
  for ours in ('cls_token', 'position_embeddings'):
    sd.put(f'params/embeddings/{ours}', sd.take(emb + ours), sd.name(emb + ours))
  proj = emb + 'patch_embeddings.projection.'
  sd.put('params/embeddings/patch/kernel', _hwio(sd.take(proj + 'weight')),
         sd.name(proj + 'weight'))
  sd.put('params/embeddings/patch/bias', sd.take(proj + 'bias'), sd.name(proj + 'bias'))
  blk = 'params/encoder/block'
  for ours, hf in dense.items():
    sd.stack(f'{blk}/{ours}/kernel', f'{layer}{hf}.weight', n, _t)
    sd.stack(f'{blk}/{ours}/bias', f'{layer}{hf}.bias', n)
  for ln in ('layernorm_before', 'layernorm_after'):
    sd.stack(f'{blk}/{ln}/scale', f'{layer}{ln}.weight', n)
    sd.stack(f'{blk}/{ln}/bias', f'{layer}{ln}.bias', n)
  sd.put('params/layernorm/scale', sd.take('layernorm.weight'), sd.name('layernorm.weight'))
  sd.put('params/layernorm/bias', sd.take('layernorm.bias'), sd.name('layernorm.bias'))
  sd.ignore(r'pooler\..*')  # ViTModel's pooler; the classifier reads the class token
  hint = ' (a base ViTModel without the classification head?)'
  sd.put('params/classifier/kernel', _t(sd.take('classifier.weight', True, hint)),
         'classifier.weight')
  sd.put('params/classifier/bias', sd.take('classifier.bias', True, hint), 'classifier.bias')


def _conv_layer(sd: StateDict, ours: str, template: str, n: int, offset: int = 0):
  """A ResNetConvLayer (conv + BatchNorm) of ``n`` stacked layers (``n=0``: not stacked)."""
  def one(path, key, fn=lambda a: a):
    if n:
      sd.stack(path, template + key, n, fn, offset)
    else:
      sd.put(path, fn(sd.take(template + key)), sd.name(template + key))
  one(f'params/{ours}/convolution/kernel', '.convolution.weight', _hwio)
  for col, leaf, hf in (('params', 'scale', 'weight'), ('params', 'bias', 'bias'),
                        ('batch_stats', 'mean', 'running_mean'),
                        ('batch_stats', 'var', 'running_var')):
    one(f'{col}/{ours}/normalization/{leaf}', f'.normalization.{hf}')


def resnet_variables(sd: StateDict):
  """ResNetForImageClassification keys -> our ResNet params and batch_stats."""
  _conv_layer(sd, 'embedder', 'embedder.embedder', 0)
  for s in range(_layers(sd, 'encoder.stages.{i}.')):
    stage = f'encoder.stages.{s}.layers.'
    depth = sd.count(_index_regex(stage + '{i}.'))
    convs = sd.count(_index_regex(stage + '0.layer.{i}.'))
    if sd.has(stage + '0.shortcut.convolution.weight'):
      _conv_layer(sd, f'stages_{s}_first/block/shortcut', stage + '{i}.shortcut', 1)
    for k in range(convs):
      _conv_layer(sd, f'stages_{s}_first/block/layer_{k}', stage + f'{{i}}.layer.{k}', 1)
      if depth > 1:
        _conv_layer(sd, f'stages_{s}_layers/block/layer_{k}', stage + f'{{i}}.layer.{k}',
                    depth - 1, offset=1)
  sd.ignore(r'.*\.num_batches_tracked')
  hint = ' (a base ResNetModel without the classification head?)'
  sd.put('params/classifier/kernel', _t(sd.take('classifier.1.weight', True, hint)),
         'classifier.1.weight')
  sd.put('params/classifier/bias', sd.take('classifier.1.bias', True, hint), 'classifier.1.bias')


VARIABLES: dict[str, Callable[[StateDict], Any]] = {
    'gpt': gpt_variables, 'llama': llama_variables, 'vit': vit_variables,
    'resnet': resnet_variables}
