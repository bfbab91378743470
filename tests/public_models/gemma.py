"""A Gemma-style decoder in Flax NNX, as in Flax's Gemma example.

Follows google/flax ``examples/gemma/modules.py``, ``layers.py``, ``positional_embeddings.py``
and ``transformer.py`` (Copyright The Flax Authors, Apache License 2.0): an
``Embedder`` scaled by sqrt(D) whose table also decodes, ``RMSNorm`` with a
``1 + scale`` weight, ``Attention`` with multi-query/grouped key-values
(``q_einsum``, ``kv_einsum``, ``attn_vec_einsum``), rotary embeddings and query
scaling by ``head_dim ** -0.5``, a gated GELU ``FeedForward`` (``gating_einsum``
``[2, D, F]``, ``linear``) and ``Block`` with pre- and post-norms (Gemma 2), the
blocks held in a list and applied in a Python loop. Left out: the KV cache,
sliding windows and logit soft-capping.
"""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

import remat


@dataclasses.dataclass(frozen=True)
class Config:
  num_embed: int = 64
  embed_dim: int = 64
  hidden_dim: int = 256
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 16
  num_layers: int = 6
  seq_len: int = 64


class RMSNorm(nnx.Module):
  def __init__(self, dim, *, rngs):
    self.scale = nnx.Param(jnp.zeros((dim,)))

  def __call__(self, x):
    var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(var + 1e-6) * (1 + self.scale[...])


def apply_rope(x, positions, max_wavelength=10_000):
  half = x.shape[-1] // 2
  timescale = max_wavelength ** (2 * jnp.arange(half) / x.shape[-1])
  sinusoid = positions[..., None] / timescale[None, None, :]
  sin, cos = jnp.sin(sinusoid)[:, :, None], jnp.cos(sinusoid)[:, :, None]
  first, second = jnp.split(x, 2, axis=-1)
  return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


class Attention(nnx.Module):
  def __init__(self, cfg: Config, *, rngs):
    init = nnx.initializers.normal(0.02)
    self.q_einsum = nnx.Param(init(rngs.params(), (cfg.num_heads, cfg.embed_dim, cfg.head_dim)))
    self.kv_einsum = nnx.Param(init(rngs.params(),
                                    (2, cfg.num_kv_heads, cfg.embed_dim, cfg.head_dim)))
    self.attn_vec_einsum = nnx.Param(init(rngs.params(),
                                          (cfg.num_heads, cfg.head_dim, cfg.embed_dim)))
    self.cfg = cfg

  def __call__(self, x, positions, mask):
    cfg = self.cfg
    q = jnp.einsum('BTD,NDH->BTNH', x, self.q_einsum[...])
    k, v = jnp.einsum('BSD,CKDH->CBSKH', x, self.kv_einsum[...])
    q = apply_rope(q, positions) * cfg.head_dim ** -0.5
    k = apply_rope(k, positions)
    groups = cfg.num_heads // cfg.num_kv_heads
    q = q.reshape(q.shape[:2] + (cfg.num_kv_heads, groups, cfg.head_dim))
    logits = jnp.einsum('BTKGH,BSKH->BTKGS', q, k)
    logits = jnp.where(mask[:, :, None, None, :], logits, -2.3819763e38)
    probs = jax.nn.softmax(logits, axis=-1).astype(k.dtype)
    enc = jnp.einsum('BTKGS,BSKH->BTKGH', probs, v).reshape(q.shape[:2] + (cfg.num_heads,
                                                                          cfg.head_dim))
    return jnp.einsum('BTNH,NHD->BTD', enc, self.attn_vec_einsum[...])


class FeedForward(nnx.Module):
  def __init__(self, cfg: Config, *, rngs):
    init = nnx.initializers.normal(0.02)
    self.gating_einsum = nnx.Param(init(rngs.params(), (2, cfg.embed_dim, cfg.hidden_dim)))
    self.linear = nnx.Param(init(rngs.params(), (cfg.hidden_dim, cfg.embed_dim)))

  def __call__(self, x):
    ff_gate = jnp.dot(x, self.gating_einsum[0])
    gate_value = jax.nn.gelu(ff_gate)
    ff1 = jnp.dot(x, self.gating_einsum[1])
    return jnp.dot(gate_value * ff1, self.linear[...])


class Block(nnx.Module):
  def __init__(self, cfg: Config, *, rngs):
    self.pre_attention_norm = RMSNorm(cfg.embed_dim, rngs=rngs)
    self.attn = Attention(cfg, rngs=rngs)
    self.post_attention_norm = RMSNorm(cfg.embed_dim, rngs=rngs)
    self.pre_ffw_norm = RMSNorm(cfg.embed_dim, rngs=rngs)
    self.mlp = FeedForward(cfg, rngs=rngs)
    self.post_ffw_norm = RMSNorm(cfg.embed_dim, rngs=rngs)

  def __call__(self, x, positions, mask):
    attn_output = self.post_attention_norm(self.attn(self.pre_attention_norm(x), positions, mask))
    attn_output += x
    outputs = self.post_ffw_norm(self.mlp(self.pre_ffw_norm(attn_output)))
    return outputs + attn_output


class Transformer(nnx.Module):
  """``policy`` None: the untouched model (a list of blocks); else an :class:`remat.NNXStack`."""

  def __init__(self, cfg: Config, policy: str | None = None, *, rngs, remat_policy=None):
    self.cfg = cfg
    self.remat_policy = remat_policy   # per-block nnx.remat of the untouched blocks
    self.input_embedding = nnx.Param(nnx.initializers.normal(1.0)(
        rngs.params(), (cfg.num_embed, cfg.embed_dim)))
    if policy is None:
      self.layers = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
    else:
      self.layers = remat.NNXStack(lambda r: Block(cfg, rngs=r), cfg.num_layers, policy,
                                   rngs=rngs)
    self.final_norm = RMSNorm(cfg.embed_dim, rngs=rngs)

  def __call__(self, tokens):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    mask = jnp.tril(jnp.ones((tokens.shape[1],) * 2, bool))[None]
    x = self.input_embedding[...][tokens] * jnp.sqrt(self.cfg.embed_dim).astype(jnp.float32)
    if isinstance(self.layers, remat.NNXStack):
      x = self.layers(x, positions, mask)
    else:
      call = lambda layer, x, positions, mask: layer(x, positions, mask)
      if self.remat_policy is not None:
        call = nnx.remat(call, policy=self.remat_policy)
      for layer in self.layers:
        x = call(layer, x, positions, mask)
    x = self.final_norm(x)
    return x @ self.input_embedding[...].T


def case(cfg: Config = Config(), batch: int = 8, seed: int = 0):
  from tests.public_models import Case, block_policy
  tokens = jax.random.randint(jax.random.PRNGKey(seed + 1), (batch, cfg.seq_len), 0,
                              cfg.num_embed)
  untouched = Transformer(cfg, rngs=nnx.Rngs(seed))
  graphdef, params = nnx.split(untouched, nnx.Param)

  def loss_of(graph):
    def loss(p, t):
      logits = nnx.merge(graph, p)(t)
      logp = jax.nn.log_softmax(logits[:, :-1])
      return -jnp.mean(jnp.take_along_axis(logp, t[:, 1:, None], -1))
    return loss

  stacked_models = {}

  def stacked_model(spec):
    if spec not in stacked_models:
      model = nnx.eval_shape(lambda: Transformer(cfg, spec, rngs=nnx.Rngs(seed)))
      stacked_models[spec] = nnx.split(model, nnx.Param)
    return stacked_models[spec]

  def stack(p):
    p = nnx.to_pure_dict(p)
    layers = [p['layers'][i] for i in range(cfg.num_layers)]
    out = {k: v for k, v in p.items() if k != 'layers'}
    out['layers'] = {'layers': jax.tree_util.tree_map(lambda *a: jnp.stack(a), *layers)}
    state = jax.tree_util.tree_map(lambda a: a, stacked_model('none')[1])  # a fresh State
    nnx.replace_by_pure_dict(state, out)
    return state

  def per_block(rule):
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(seed),
                                               remat_policy=block_policy(rule)))
    return loss_of(nnx.split(model, nnx.Param)[0])

  return Case('gemma', loss_of(graphdef), lambda spec: loss_of(stacked_model(spec)[0]), params,
              tokens, stack, cfg.num_layers, per_block)
