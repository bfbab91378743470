"""Greedy generation with a KV cache for the zoo's language models (GPT-2 and Llama).

The training models run whole windows; generating from them token by token
would rerun the window for every token. Here one compiled loop
(:func:`jax.lax.scan` over positions, and over the stacked layers inside each
step) feeds one token per row per step and keeps each layer's keys and values
in a cache ``[layers, B, L, kv heads, Dh]``, so a step costs one token's
matmuls and one row of attention.

Rows of a batch have prompts of different lengths, all starting at position 0:
at step ``t`` a row still inside its prompt reads its prompt's next token, a
row past it reads the token it generated. No padding is ever attended to, so
each row's result is what it would be alone.

The step reads the training model's parameter tree (stacked ``[layers, ...]``
by :class:`remat.LayerStack`) and computes what :mod:`models.llama` and
:mod:`models.gpt` compute for one position, in float32 (``tests/test_kv_decode.py``
checks it against the full model and against ``transformers``' ``generate``).
"""

from __future__ import annotations

import dataclasses

import functools

import jax
import jax.numpy as jnp
import numpy as np

from models.layers import layer_norm
from models.llama import apply_rotary, rope_frequencies


def _rms(x, scale, eps):
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _attend(q, ck, cv, t):
  """One query row per batch row against the cache up to position ``t``.

  ``q`` [B, H, Dh]; ``ck``, ``cv`` [B, L, Hkv, Dh]; query head ``h`` reads kv head ``h // G``.
  """
  b, h, d = q.shape
  hkv = ck.shape[2]
  q = q.reshape(b, hkv, h // hkv, d)
  scores = jnp.einsum('bngd,blnd->bngl', q, ck) / np.sqrt(d)
  visible = jnp.arange(ck.shape[1]) <= t
  scores = jnp.where(visible, scores, -jnp.inf)
  ctx = jnp.einsum('bngl,blnd->bngd', jax.nn.softmax(scores, axis=-1), cv)
  return ctx.reshape(b, h * d)


def _llama_step(cfg, params, tokens, t, cache):
  """Logits [B, V] of position ``t`` of a Llama; ``cache`` (k, v) updated at ``t``."""
  p = params
  x = p['embed_tokens']['embedding'][tokens]
  inv_freq = jnp.asarray(rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
  angles = jnp.concatenate([t * inv_freq, t * inv_freq])[None, :]   # [1, Dh]
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  b, dh = x.shape[0], cfg.head_dim

  def layer(x, xs):
    lp, ck, cv = xs
    a = lp['self_attn']
    h = _rms(x, lp['input_layernorm']['scale'], cfg.rms_norm_eps)
    proj = lambda name, heads: (h @ a[name]['kernel']).reshape(b, 1, heads, dh)
    q = apply_rotary(proj('q_proj', cfg.num_heads), cos, sin)[:, 0]
    k = apply_rotary(proj('k_proj', cfg.num_kv_heads), cos, sin)[:, 0]
    ck, cv = ck.at[:, t].set(k), cv.at[:, t].set(proj('v_proj', cfg.num_kv_heads)[:, 0])
    x = x + _attend(q, ck, cv, t) @ a['o_proj']['kernel']
    h = _rms(x, lp['post_attention_layernorm']['scale'], cfg.rms_norm_eps)
    m = lp['mlp']
    x = x + (jax.nn.silu(h @ m['gate_proj']['kernel']) * (h @ m['up_proj']['kernel'])
             ) @ m['down_proj']['kernel']
    return x, (ck, cv)

  x, cache = jax.lax.scan(layer, x, (p['layers']['block'], *cache))
  x = _rms(x, p['norm']['scale'], cfg.rms_norm_eps)
  head = (p['embed_tokens']['embedding'].T if cfg.tie_embeddings else p['lm_head']['kernel'])
  return x @ head, cache


def _gpt_step(cfg, params, tokens, t, cache):
  """Logits [B, V] of position ``t`` of a GPT-2; ``cache`` (k, v) updated at ``t``."""
  p = params
  x = p['wte']['embedding'][tokens] + p['wpe']['embedding'][t]
  b, dh, eps = x.shape[0], cfg.head_dim, cfg.layer_norm_eps
  dense = lambda d, y: y @ d['kernel'] + d['bias']
  norm = lambda n, y: layer_norm(y, n['scale'], n['bias'], eps)

  def layer(x, xs):
    lp, ck, cv = xs
    a = lp['attn']
    h = norm(lp['ln_1'], x)
    heads = lambda name: dense(a[name], h).reshape(b, cfg.num_heads, dh)
    ck, cv = ck.at[:, t].set(heads('key')), cv.at[:, t].set(heads('value'))
    x = x + dense(a['c_proj'], _attend(heads('query'), ck, cv, t))
    h = norm(lp['ln_2'], x)
    m = lp['mlp']
    x = x + dense(m['c_proj'], jax.nn.gelu(dense(m['c_fc'], h), approximate=True))
    return x, (ck, cv)

  x, cache = jax.lax.scan(layer, x, (p['h']['block'], *cache))
  return norm(p['ln_f'], x) @ p['wte']['embedding'].T, cache


def _decode(arch, cfg, length, params, buf, prompt_len):
  """Fills ``buf`` [B, length] past each row's prompt with greedy tokens."""
  step = _llama_step if arch == 'llama' else _gpt_step
  heads = cfg.num_kv_heads if arch == 'llama' else cfg.num_heads
  b = buf.shape[0]
  zeros = jnp.zeros((cfg.num_layers, b, length, heads, cfg.head_dim), jnp.float32)
  params = jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), params)

  def position(carry, t):
    buf, cache = carry
    logits, cache = step(cfg, params, buf[:, t], t, cache)
    nxt = jnp.argmax(logits, axis=-1).astype(buf.dtype)
    keep = t + 1 < prompt_len   # still inside the prompt: its own token stays
    buf = buf.at[:, t + 1].set(jnp.where(keep, buf[:, t + 1], nxt))
    return (buf, cache), None

  (buf, _), _ = jax.lax.scan(position, (buf, (zeros, zeros)), jnp.arange(length - 1))
  return buf


_COMPILED: dict = {}


def _compiled(arch: str, cfg, length: int):
  """The jitted :func:`_decode` for one model shape and length (configs may hold dicts, which
  ``jax.jit`` cannot hash as static arguments; their repr is the key)."""
  key = (arch, repr(cfg), length)
  if key not in _COMPILED:
    _COMPILED[key] = jax.jit(functools.partial(_decode, arch, cfg, length))
  return _COMPILED[key]


def greedy_generate(arch: str, cfg, params, prompts: list[list[int]], max_new_tokens: int,
                    eot_id: int | None) -> list[list[int]]:
  """The greedy continuation of each prompt, ``max_new_tokens`` at most, cut before ``eot_id``.

  Args:
    arch: 'llama' or 'gpt'.
    cfg: its LlamaConfig or GPTConfig.
    params: the model's parameter tree (``variables['params']``).
    prompts: token ids per row, each non-empty; a prompt and its continuation are kept within
      ``cfg.max_len`` (a row that reaches it stops there).

  Raises:
    ValueError: a prompt empty or longer than ``cfg.max_len``.
  """
  if not prompts:
    return []
  if getattr(cfg, 'lora', None) is not None:
    # The decoder computes the plain model: a LoRA run's adapters are folded into their base
    # (a QLoRA base dequantized), as its merged export is.
    from models.lora import params as lora_params
    params = lora_params.merged(params, cfg.lora, arch)
    cfg = dataclasses.replace(cfg, lora=None)
  lens = [len(p) for p in prompts]
  if min(lens) < 1 or max(lens) > cfg.max_len:
    raise ValueError(f'a prompt has {min(lens) if min(lens) < 1 else max(lens)} tokens; '
                     f'prompts need 1 to {cfg.max_len} (the model context)')
  # Lengths rounded up to a multiple of 16: batches of similar prompts share one compile.
  length = min(cfg.max_len, -(-(max(lens) + max_new_tokens) // 16) * 16)
  buf = np.zeros((len(prompts), length), np.int32)
  for i, p in enumerate(prompts):
    buf[i, :len(p)] = p
  out = np.asarray(_compiled(arch, cfg, length)(params, jnp.asarray(buf),
                                                 jnp.asarray(lens, jnp.int32)))
  result = []
  for i, n in enumerate(lens):
    new = out[i, n:n + max_new_tokens].tolist()
    if eot_id is not None and eot_id in new:
      new = new[:new.index(eot_id)]
    result.append(new)
  return result
