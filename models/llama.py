"""Llama-family decoder (Llama 2/3, SmolLM2) in Flax linen, on :class:`remat.LayerStack`.

Pre-RMSNorm blocks, rotary position embeddings (with Llama 3's frequency
scaling), grouped-query attention, a SwiGLU MLP, no biases, tied or untied
output embeddings, as Hugging Face's ``LlamaForCausalLM`` computes them.

Parameter names follow Hugging Face's so an import is a mechanical mapping
(``layers.{i}`` is index ``i`` of the stacked leaves under ``layers/block``;
torch ``Linear`` weights ``[out, in]`` are our kernels ``[in, out]``)::

    embed_tokens/embedding                          model.embed_tokens.weight
    layers/block/input_layernorm/scale              model.layers.{i}.input_layernorm.weight
    layers/block/self_attn/{q,k,v,o}_proj/kernel    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight
    layers/block/post_attention_layernorm/scale     model.layers.{i}.post_attention_layernorm.weight
    layers/block/mlp/{gate,up,down}_proj/kernel     model.layers.{i}.mlp.{gate,up,down}_proj.weight
    norm/scale                                      model.norm.weight
    lm_head/kernel (untied only)                    lm_head.weight

Mixed precision (``LlamaConfig.dtype``): parameters are created and stored in
float32 (master weights; the optimizer state follows them), cast to ``dtype``
where they are used; activations are in ``dtype``. RMSNorm statistics, the
softmax and the output layer with its cross-entropy run in float32, then cast
back. Parameter gradients are float32 (the transpose of a cast is a cast).

Activations are tagged with ``checkpoint_name`` where they are created, with
MaxText's decoder names (see :data:`TAGS`), so ``names:...`` policies and the
MaxText presets select them as MaxText users know them.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from models.attention import IMPLEMENTATIONS as ATTENTION_IMPLEMENTATIONS
from models.attention import attention
from models.layers import DTYPES
from models.lora.dense import AdaptedDense, adapter_key
from models.lora.spec import PROJECTIONS, LoraSpec, as_spec, projection_tag
from models.rope import (  # noqa: F401  (RoPE and SwiGLU re-exported: the model's names)
    RopeScaling, apply_rotary, rope_frequencies, rotary_tables)
from models.swiglu import swiglu_down, swiglu_mlp  # noqa: F401
from remat.policies import Policy, get_policy
from remat.stack import LayerStack

# Every checkpoint name the Llama block emits (tests check the traced model agrees).
# H: query heads, K: key/value heads, Dh: head width, F: MLP width.
TAGS = {
    'query_proj': 'query projection before rotary embedding, [B, T, H, Dh]',
    'key_proj': 'key projection before rotary embedding, [B, T, K, Dh]',
    'value_proj': 'value projection, [B, T, K, Dh]',
    'context': 'attention output before the output projection, [B, T, H, Dh]',
    'out_proj': 'attention output projection, [B, T, D]',
    'mlpwi_0': 'MLP gate projection, before SiLU, [B, T, F]',
    'mlpwi_1': 'MLP up projection, [B, T, F]',
    'mlpwo': 'MLP down projection, [B, T, D]',
}

_INIT_STD = 0.02   # HF LlamaConfig.initializer_range


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Shape and numerics of a Llama-family model (names of HF ``LlamaConfig`` in brackets).

  Attributes:
    vocab_size: tokens (256 for byte-level text) [vocab_size].
    d_model: width [hidden_size].
    num_layers: decoder blocks [num_hidden_layers].
    num_heads: query heads [num_attention_heads]; the head width is d_model / num_heads.
    num_kv_heads: key/value heads, dividing num_heads (grouped-query attention;
      equal to num_heads for multi-head attention) [num_key_value_heads].
    mlp_dim: SwiGLU width [intermediate_size].
    max_len: longest sequence the model accepts [max_position_embeddings];
      no parameter depends on it.
    rms_norm_eps: RMSNorm epsilon [rms_norm_eps].
    rope_theta: rotary base [rope_theta].
    rope_scaling: None, or Llama 3's frequency scaling (a :class:`RopeScaling`
      or a dict of its fields, as a JSON config gives it) [rope_scaling].
    tie_embeddings: the output layer reuses the input embedding [tie_word_embeddings].
    loss_chunk: tokens per chunk of the training loss's output layer, as
      ``GPTConfig.loss_chunk`` (:func:`models.chunked_loss.chunked_cross_entropy`):
      None picks chunks of <= 64 MiB of float32 logits, 0 the plain loss.
    dtype: 'float32' or 'bfloat16': activations and matmuls (parameters stay float32).
    attention: attention implementation, as ``GPTConfig.attention``
      (:func:`models.attention.attention`). Changes memory and time, not values.
    lora: None (every parameter trained), or the LoRA adapters of a run whose
      base is frozen (:mod:`models.lora`; a dict of its fields in JSON).
  """
  vocab_size: int = 256
  d_model: int = 128
  num_layers: int = 4
  num_heads: int = 4
  num_kv_heads: int = 2
  mlp_dim: int = 384
  max_len: int = 256
  rms_norm_eps: float = 1e-5
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  tie_embeddings: bool = True
  loss_chunk: int | None = None
  dtype: str = 'float32'
  attention: str = 'auto'
  lora: LoraSpec | None = None

  def __post_init__(self):
    object.__setattr__(self, 'lora', as_spec(self.lora))
    for f in ('vocab_size', 'd_model', 'num_layers', 'num_heads', 'num_kv_heads', 'mlp_dim',
              'max_len'):
      if getattr(self, f) < 1:
        raise ValueError(f'LlamaConfig.{f} must be >= 1, got {getattr(self, f)}')
    if self.d_model % self.num_heads:
      raise ValueError(f'LlamaConfig.d_model ({self.d_model}) must be divisible by num_heads '
                       f'({self.num_heads})')
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f'LlamaConfig.num_kv_heads ({self.num_kv_heads}) must divide num_heads '
                       f'({self.num_heads})')
    if self.head_dim % 2:
      raise ValueError(f'LlamaConfig head width d_model / num_heads = {self.head_dim} must be '
                       'even for rotary embeddings')
    if not self.rms_norm_eps > 0:
      raise ValueError(f'LlamaConfig.rms_norm_eps must be > 0, got {self.rms_norm_eps}')
    if not self.rope_theta > 1:
      raise ValueError(f'LlamaConfig.rope_theta must be > 1, got {self.rope_theta}')
    if isinstance(self.rope_scaling, dict):   # from a JSON config (or dataclasses.asdict)
      fields = {f.name for f in dataclasses.fields(RopeScaling)}
      unknown = sorted(set(self.rope_scaling) - fields)
      if unknown:
        raise ValueError(f"LlamaConfig.rope_scaling: unknown field(s) {', '.join(unknown)}; "
                         f"valid: {', '.join(sorted(fields))}")
      object.__setattr__(self, 'rope_scaling', RopeScaling(**self.rope_scaling))
    if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
      raise ValueError(f'LlamaConfig.rope_scaling must be None, a RopeScaling or a dict, got '
                       f'{self.rope_scaling!r:.60}')
    if self.loss_chunk is not None and self.loss_chunk < 0:
      raise ValueError(f'LlamaConfig.loss_chunk must be >= 0 or None, got {self.loss_chunk}')
    if self.attention not in ATTENTION_IMPLEMENTATIONS:
      raise ValueError(f"LlamaConfig.attention must be one of "
                       f"{', '.join(ATTENTION_IMPLEMENTATIONS)}, got '{self.attention}'")
    if self.dtype not in DTYPES:
      raise ValueError(f"LlamaConfig.dtype must be one of {', '.join(DTYPES)}, got '{self.dtype}'")

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads


class Dense(nn.Module):
  """A bias-free ``x @ kernel``: the kernel stored float32, used in ``dtype``."""
  features: int
  dtype: str = 'float32'

  def _kernel(self, in_features: int):
    """The ``[in_features, features]`` kernel, created float32 and cast to ``dtype``."""
    kernel = self.param('kernel', nn.initializers.normal(_INIT_STD), (in_features, self.features),
                        jnp.float32)
    return kernel.astype(self.dtype)

  @nn.compact
  def __call__(self, x):
    return jnp.dot(x.astype(self.dtype), self._kernel(x.shape[-1]))


class RMSNorm(nn.Module):
  """``x / rms(x) * scale``: statistics in float32, result and scaling in ``dtype`` (as HF)."""
  epsilon: float
  dtype: str = 'float32'

  @nn.compact
  def __call__(self, x):
    scale = self.param('scale', nn.initializers.ones, (x.shape[-1],), jnp.float32)
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.epsilon)
    return normed.astype(self.dtype) * scale.astype(self.dtype)


def _projection(module: nn.Module, cfg: LlamaConfig, features: int, path: str, x, rng):
  """``x`` through the block's projection ``path`` ('self_attn/q_proj'): a :class:`Dense`, or in
  a LoRA run a frozen :class:`~models.lora.dense.AdaptedDense` (``rng``: its adapter's dropout)."""
  name = path.rsplit('/', 1)[-1]
  if cfg.lora is None:
    return Dense(features, cfg.dtype, name=name, parent=module)(x)
  index = [p for p, _ in PROJECTIONS['llama']].index(path)
  return AdaptedDense(features, cfg.lora, path, projection_tag('llama', path), cfg.dtype,
                      name=name, parent=module)(x, adapter_key(rng, index))


class Attention(nn.Module):
  """Grouped-query causal self-attention with rotary embeddings."""
  config: LlamaConfig

  @nn.compact
  def __call__(self, x, cos, sin, segment_ids=None, rng=None):
    cfg = self.config
    b, t, _ = x.shape
    proj = lambda heads, name: _projection(self, cfg, heads * cfg.head_dim, f'self_attn/{name}',
                                           x, rng).reshape(b, t, heads, cfg.head_dim)
    q = checkpoint_name(proj(cfg.num_heads, 'q_proj'), 'query_proj')
    k = checkpoint_name(proj(cfg.num_kv_heads, 'k_proj'), 'key_proj')
    v = checkpoint_name(proj(cfg.num_kv_heads, 'v_proj'), 'value_proj')
    # Grouped-query heads go in as they are: attention() never repeats k and v.
    ctx = attention(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v, causal=True,
                    dropout_rate=0.0, deterministic=True, rng=None,
                    implementation=cfg.attention, segment_ids=segment_ids)
    out = _projection(self, cfg, cfg.d_model, 'self_attn/o_proj', ctx.reshape(b, t, cfg.d_model),
                      rng)
    return checkpoint_name(out, 'out_proj')


class SwiGLUDown(Dense):
  """``Dense(features)(silu(gate) * up)``: the same ``kernel`` and values, a leaner derivative.

  The backward pass keeps ``gate`` and ``up`` alone (:func:`swiglu_down`).
  """

  @nn.compact
  def __call__(self, gate, up):
    return swiglu_down(gate, up, self._kernel(gate.shape[-1]))


class DenseKernel(Dense):
  """A ``Dense`` layer's ``kernel`` alone, for a rule that applies it itself (same variable)."""

  @nn.compact
  def __call__(self, in_features: int):
    return self._kernel(in_features)


class MLP(nn.Module):
  """SwiGLU: ``down(silu(gate(x)) * up(x))``; the backward pass keeps ``x``, ``gate`` and ``up``.

  The kernels are ``gate_proj``, ``up_proj`` and ``down_proj`` as in a stack of ``Dense``
  layers; :func:`swiglu_mlp` applies them.
  """
  config: LlamaConfig

  @nn.compact
  def __call__(self, x, rng=None):
    cfg = self.config
    if cfg.lora is not None:
      return self._adapted(x, rng)
    d = x.shape[-1]
    wg = DenseKernel(cfg.mlp_dim, cfg.dtype, name='gate_proj')(d)
    wu = DenseKernel(cfg.mlp_dim, cfg.dtype, name='up_proj')(d)
    wd = DenseKernel(cfg.d_model, cfg.dtype, name='down_proj')(cfg.mlp_dim)
    return checkpoint_name(swiglu_mlp(x.astype(cfg.dtype), wg, wu, wd), 'mlpwo')

  def _adapted(self, x, rng):
    """The LoRA run's MLP: frozen projections with adapters, written plainly.

    The chunked rule of :func:`swiglu_mlp` computes the three kernels' gradients,
    which a frozen base does not need; here ``gate`` and ``up`` are the tagged
    products (what every policy keeps or recomputes, as before) and the SiLU
    product is rebuilt from them elementwise.
    """
    cfg = self.config
    x = x.astype(cfg.dtype)
    gate = checkpoint_name(_projection(self, cfg, cfg.mlp_dim, 'mlp/gate_proj', x, rng), 'mlpwi_0')
    up = checkpoint_name(_projection(self, cfg, cfg.mlp_dim, 'mlp/up_proj', x, rng), 'mlpwi_1')
    hidden = gate * jax.nn.sigmoid(gate) * up   # nn.silu(gate) * up, as models.swiglu computes it
    return checkpoint_name(_projection(self, cfg, cfg.d_model, 'mlp/down_proj', hidden, rng),
                           'mlpwo')


class Block(nn.Module):
  """Pre-norm decoder block, in the layer-stack convention ``(x, cos, sin[, segment_ids]) -> x``.

  ``rng`` is the layer's dropout key: only a LoRA run with adapter dropout
  draws one (Llama itself has no dropout); None otherwise.
  """
  config: LlamaConfig

  @nn.compact
  def __call__(self, x, cos, sin, segment_ids=None, *, rng=None):
    cfg = self.config
    h = RMSNorm(cfg.rms_norm_eps, cfg.dtype, name='input_layernorm')(x)
    x = x + Attention(cfg, name='self_attn')(h, cos, sin, segment_ids, rng)
    h = RMSNorm(cfg.rms_norm_eps, cfg.dtype, name='post_attention_layernorm')(x)
    return x + MLP(cfg, name='mlp')(h, rng)


class Embed(nn.Module):
  """The token embedding ``[vocab, D]``, float32; the caller casts only the looked-up rows."""
  vocab_size: int
  features: int

  def setup(self):
    self.embedding = self.param('embedding', nn.initializers.normal(_INIT_STD),
                                (self.vocab_size, self.features), jnp.float32)

  def __call__(self, tokens):
    return jnp.take(self.embedding, tokens, axis=0)


class LMHead(nn.Module):
  """The untied output layer: float32 ``x @ kernel``, kernel ``[D, vocab]``."""
  vocab_size: int

  @nn.compact
  def __call__(self, x):
    kernel = self.param('kernel', nn.initializers.normal(_INIT_STD),
                        (x.shape[-1], self.vocab_size), jnp.float32)
    return jnp.dot(x.astype(jnp.float32), kernel)


def output_embedding(params, config: LlamaConfig):
  """The output layer as ``[vocab, D]`` (what :func:`models.chunked_loss.chunked_cross_entropy` takes)."""
  if config.tie_embeddings:
    return params['embed_tokens']['embedding']
  return params['lm_head']['kernel'].T


class Llama(nn.Module):
  """Llama language model returning float32 next-token logits [B, T, vocab].

  ``return_hidden=True`` (or :meth:`hidden`) returns the final hidden states
  [B, T, d_model] in ``dtype`` instead; the training loss applies the output
  layer (:func:`output_embedding`) to them in chunks, so a 128k-word
  vocabulary's logits never exist whole. Llama has no dropout:
  ``deterministic=False`` draws keys only for a LoRA run's adapter dropout.

  A window packed from several documents passes ``segment_ids`` (int [B, T]:
  attention stays within a document) and ``positions`` (int [B, T]: the
  rotary positions, restarting at 0 in each document).

  Attributes:
    config: model shape and dtype.
    policy: remat policy (a :class:`~remat.policies.Policy` or a spec string).
  """
  config: LlamaConfig
  policy: Policy | str = 'none'
  layout: str = 'auto'   # how the stack becomes a program (remat.layout.LAYOUTS)

  @nn.compact
  def __call__(self, tokens, *, deterministic: bool = True, return_hidden: bool = False,
               segment_ids=None, positions=None):
    cfg = self.config
    policy = get_policy(self.policy, num_layers=cfg.num_layers)
    t = tokens.shape[1]
    if t > cfg.max_len:
      raise ValueError(f'sequence length {t} exceeds the model max_len {cfg.max_len}')
    embed = Embed(cfg.vocab_size, cfg.d_model, name='embed_tokens')
    x = embed(tokens).astype(cfg.dtype)
    cos, sin = rotary_tables(cfg, t, positions)
    segs = () if segment_ids is None else (segment_ids,)
    # Keys are drawn only where something uses them: the unadapted model stays as it was.
    drop = not deterministic and cfg.lora is not None and cfg.lora.dropout > 0
    x = LayerStack(Block, cfg.num_layers, policy, block_kwargs={'config': cfg},
                   name='layers', layout=self.layout)(x, cos, sin, *segs,
                                                      deterministic=not drop)
    x = RMSNorm(cfg.rms_norm_eps, cfg.dtype, name='norm')(x)
    if return_hidden:
      return x
    # The output layer in float32: its logits feed a float32 softmax cross-entropy, and the
    # chunked training loss (float32 too) then gives the same values.
    if cfg.tie_embeddings:
      return jnp.dot(x.astype(jnp.float32), embed.embedding.T)
    return LMHead(cfg.vocab_size, name='lm_head')(x)

  def hidden(self, tokens, *, deterministic: bool = True):
    """Final hidden states [B, T, d_model] (after ``norm``), in ``dtype``."""
    return self(tokens, deterministic=deterministic, return_hidden=True)
