"""models/llama.py: shapes, tags, grouped-query attention, rotary scaling, config checks, and the
gradients of every remat policy against ``none`` in float32 and bfloat16."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import config_names, load_config
from models.llama import (TAGS, Llama, LlamaConfig, RopeScaling, SwiGLUDown, apply_rotary,
                          output_embedding, rope_frequencies, rotary_tables)
from models.tasks import Task
from numerics import assert_trees_close
from remat.policies import registered_specs

# Small enough to compile in about a second: 2 query heads per key/value head, an odd depth so
# sqrt and seg:2 leave a remainder segment.
CFG = LlamaConfig(vocab_size=64, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2, mlp_dim=48,
                  max_len=16, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64), tie_embeddings=False)
T = 12

# bfloat16 keeps 8 significant bits (relative step 2**-8 = 0.0039). A policy recomputes a layer
# with the same operations, so on XLA CPU (jax 0.10.2) every policy below gives none's bf16
# gradients bit for bit (measured: worst error 0). A backend may fuse, and so round, a
# recomputation differently from the forward pass: a recomputed activation may then differ by
# an ulp, and the gradients built on it by a few ulps of their terms. 2e-2 of the tree's largest
# gradient is five bf16 ulps of headroom for that; a wrong gradient (a dropped term, a stale
# residual) is off by O(1) of the affected leaf.
BF16_RTOL = 2e-2


def _windows(cfg=CFG, b=2, t=T, seed=1):
  return jnp.asarray(np.random.default_rng(seed).integers(0, cfg.vocab_size, size=(b, t + 1)),
                     jnp.int32)


@functools.lru_cache(maxsize=None)
def _params(cfg=CFG):
  return Task(cfg).model('none').init(jax.random.PRNGKey(0), _windows(cfg)[:, :-1])['params']


@functools.lru_cache(maxsize=None)
@functools.lru_cache(maxsize=None)  # each test's `none` reference is computed once per config
def _loss_and_grads(cfg, policy):
  task = Task(cfg)
  model = task.model(policy)
  fn = jax.jit(jax.value_and_grad(lambda p: task.loss(model, p, {}, _windows(cfg))[0]))
  return fn(_params(cfg))


def test_shapes_and_parameter_tree():
  params = _params()
  tokens = _windows()[:, :-1]
  model = Llama(CFG)
  logits = model.apply({'params': params}, tokens)
  hidden = model.apply({'params': params}, tokens, return_hidden=True)
  assert logits.shape == (2, T, CFG.vocab_size) and logits.dtype == jnp.float32
  assert hidden.shape == (2, T, CFG.d_model)
  blk = params['layers']['block']
  dh = CFG.head_dim
  assert blk['self_attn']['q_proj']['kernel'].shape == (3, 32, 4 * dh)
  assert blk['self_attn']['k_proj']['kernel'].shape == (3, 32, 2 * dh)
  assert blk['mlp']['down_proj']['kernel'].shape == (3, 48, 32)
  assert params['lm_head']['kernel'].shape == (32, 64)
  np.testing.assert_allclose(logits, hidden @ params['lm_head']['kernel'], rtol=1e-5, atol=1e-6)
  tied = _params(dataclasses.replace(CFG, tie_embeddings=True))
  assert 'lm_head' not in tied
  assert output_embedding(tied, dataclasses.replace(CFG, tie_embeddings=True)) is (
      tied['embed_tokens']['embedding'])
  assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(params))


def test_swiglu_down_rule():
  """SwiGLUDown is Dense(silu(gate) * up): same kernel and values, gradients within rounding,
  and the backward pass keeps gate and up alone where the plain ops keep six [.., F] arrays."""
  import flax.linen as nn
  from remat.residuals import saved_residuals
  rng = np.random.default_rng(0)
  gate, up = (jnp.asarray(rng.normal(size=(3, 5, 16)) * 2.0, jnp.float32) for _ in range(2))
  ours = SwiGLUDown(8)
  variables = ours.init(jax.random.PRNGKey(0), gate, up)
  assert variables['params']['kernel'].shape == (16, 8)
  plain = lambda v, g, u: jnp.dot(nn.silu(g) * u, v['params']['kernel'])
  np.testing.assert_array_equal(ours.apply(variables, gate, up), plain(variables, gate, up))
  loss = lambda f: lambda v, g, u: jnp.sum(jnp.sin(f(v, g, u)))
  assert_trees_close(jax.grad(loss(ours.apply), argnums=(0, 1, 2))(variables, gate, up),
                     jax.grad(loss(plain), argnums=(0, 1, 2))(variables, gate, up))
  # A linear loss keeps only what the layer itself needs; gate and up depend on a parameter.
  linear = lambda f: lambda p, g, u: jnp.sum(f(p['v'], g * p['a'], u * p['a']))
  params = {'v': variables, 'a': jnp.float32(1.5)}
  wide = lambda f: [r for r in saved_residuals(linear(f), params, gate, up)
                    if r.shape == gate.shape]
  assert len(wide(ours.apply)) == 2 and len(wide(plain)) == 6, (wide(ours.apply), wide(plain))


def test_swiglu_mlp_rule():
  """The MLP's custom VJP (a backward pass over chunks of 128 rows; 4 x 96 = 384 rows here,
  three chunks): the Dense layers' kernels, their values, gradients within rounding, and the
  backward pass keeps gate and up alone of the [.., F] arrays."""
  from models.llama import MLP, LlamaConfig
  from remat.residuals import saved_residuals
  cfg = LlamaConfig(d_model=16, num_heads=2, num_kv_heads=1, mlp_dim=24)
  x = jnp.asarray(np.random.default_rng(1).normal(size=(4, 96, 16)), jnp.float32)
  ours = MLP(cfg)
  variables = ours.init(jax.random.PRNGKey(0), x)
  shapes = jax.tree_util.tree_map(jnp.shape, variables['params'])
  assert shapes == {'gate_proj': {'kernel': (16, 24)}, 'up_proj': {'kernel': (16, 24)},
                    'down_proj': {'kernel': (24, 16)}}
  variables = jax.tree_util.tree_map(lambda p: p * 20.0, variables)   # unit-scale activations
  def plain(v, x):
    p = v['params']
    gate, up = x @ p['gate_proj']['kernel'], x @ p['up_proj']['kernel']
    return (jax.nn.silu(gate) * up) @ p['down_proj']['kernel']
  np.testing.assert_allclose(ours.apply(variables, x), plain(variables, x), rtol=1e-6, atol=1e-6)
  loss = lambda f: lambda v, x: jnp.sum(jnp.sin(f(v, x)))
  assert_trees_close(jax.grad(loss(ours.apply), argnums=(0, 1))(variables, x),
                     jax.grad(loss(plain), argnums=(0, 1))(variables, x))
  wide = [r for r in saved_residuals(loss(ours.apply), variables, x) if r.shape[-1] == 24]
  assert len(wide) == 2, wide


def test_no_remat_keeps_only_gate_and_up_in_the_mlp():
  """In the whole model, without remat: two [B, T, F] arrays per layer, the tagged gate and up."""
  from remat.residuals import saved_residuals
  task = Task(CFG)
  loss = lambda p, w: task.loss(task.model('none'), p, {}, w)[0]
  wide = [r for r in saved_residuals(loss, _params(), _windows()) if r.shape[-1] == CFG.mlp_dim]
  assert len(wide) == 2, wide


def test_too_long_a_sequence_is_one_line():
  with pytest.raises(ValueError, match='sequence length 17 exceeds the model max_len 16'):
    Llama(CFG).apply({'params': _params()}, jnp.zeros((1, 17), jnp.int32))


def test_emits_exactly_its_tags():
  assert Task(CFG).emitted_tags(T) == set(TAGS)


@pytest.mark.parametrize('preset', ['minimal', 'minimal_with_context'])
def test_maxtext_minimal_saves_the_gated_mlp_inputs(preset):
  """MaxText's minimal names the MLP input; on a gated MLP that is mlpwi_0 and mlpwi_1."""
  from remat.policies import PRESETS, get_policy, preset_tags
  from remat.residuals import by_tag, saved_residuals
  tags = Task(CFG).emitted_tags(T)
  assert get_policy(preset, num_layers=CFG.num_layers, tags=tags).spec == preset
  explicit = 'names:' + ','.join(preset_tags(preset, tags))
  assert 'mlpwi_0,mlpwi_1' in explicit and 'mlpwi,' not in explicit
  task = Task(CFG)

  def saved(spec):
    loss = lambda p, w: task.loss(task.model(spec), p, {}, w)[0]
    return by_tag(saved_residuals(loss, _params(), _windows()))
  got = saved(preset)
  # The gate and up projections are kept: SiLU's and the product's backward read them.
  b, f = _windows().shape[0] * T, CFG.mlp_dim
  assert got['mlpwi_0'] == got['mlpwi_1'] == CFG.num_layers * b * f * 4
  assert set(got) - {'(untagged)'} <= set(PRESETS[preset][1])
  assert got == saved(explicit)   # the preset is exactly its tags on this model
  assert ('context' in got) == (preset == 'minimal_with_context')


def test_names_typos_still_fail_closed():
  """Only presets read the MLP-input group; a names: list must name emitted tags."""
  from remat.policies import PolicyError, get_policy
  with pytest.raises(PolicyError, match="'names:mlpwi': unknown tag.*mlpwi; this model emits") as e:
    get_policy('names:mlpwi', num_layers=CFG.num_layers, tags=Task(CFG).emitted_tags(T))
  assert '\n' not in str(e.value)


def test_gqa_equals_multi_head_with_repeated_key_value_heads():
  """K key/value heads serve H / K query heads each: the same as H heads with k/v copied."""
  mha = dataclasses.replace(CFG, num_kv_heads=CFG.num_heads)
  params = jax.tree_util.tree_map(np.asarray, _params())
  attn = params['layers']['block']['self_attn']
  groups, dh = CFG.num_heads // CFG.num_kv_heads, CFG.head_dim
  for name in ('k_proj', 'v_proj'):
    w = attn[name]['kernel']   # [N, D, K * Dh]: head j is columns j*Dh..(j+1)*Dh
    heads = w.reshape(*w.shape[:2], CFG.num_kv_heads, dh)
    attn[name]['kernel'] = np.repeat(heads, groups, axis=2).reshape(*w.shape[:2], -1)
  tokens = _windows()[:, :-1]
  ours = Llama(CFG).apply({'params': _params()}, tokens)
  ref = Llama(mha).apply({'params': params}, tokens)
  assert_trees_close(np.asarray(ours), np.asarray(ref))


def _llama3_direct(inv_freq: float, s: RopeScaling) -> float:
  """Llama 3's rule for one frequency, as Meta's reference code writes it."""
  wavelen = 2 * math.pi / inv_freq
  if wavelen < s.original_max_position_embeddings / s.high_freq_factor:
    return inv_freq
  if wavelen > s.original_max_position_embeddings / s.low_freq_factor:
    return inv_freq / s.factor
  smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
      s.high_freq_factor - s.low_freq_factor)
  return (1 - smooth) * inv_freq / s.factor + smooth * inv_freq


@pytest.mark.parametrize('head_dim,theta,scaling', [
    (64, 500000.0, RopeScaling(32.0, 1.0, 4.0, 8192)),   # Llama 3.2
    (128, 500000.0, RopeScaling(8.0, 1.0, 4.0, 8192)),   # Llama 3.1
    (8, 10000.0, RopeScaling(8.0, 1.0, 4.0, 64)),         # CFG: all three regimes in 4 frequencies
    (16, 10000.0, None),
])
def test_rope_frequencies_match_the_direct_formula(head_dim, theta, scaling):
  got = rope_frequencies(head_dim, theta, scaling)
  plain = [1.0 / theta ** (2 * i / head_dim) for i in range(head_dim // 2)]
  want = plain if scaling is None else [_llama3_direct(f, scaling) for f in plain]
  np.testing.assert_allclose(got, np.float32(want), rtol=1e-7)
  if scaling is not None:  # every regime is exercised: some kept, some divided, some between
    ratio = np.asarray(want) / np.asarray(plain)
    assert ratio.max() == 1.0 and np.isclose(ratio.min(), 1 / scaling.factor)
    if head_dim == 8:
      assert ((ratio < 1) & (ratio > 1 / scaling.factor)).any()


def test_rotary_is_a_rotation_by_position():
  """Each (i, i + Dh/2) pair turns by angle position * inv_freq[i]; norms are kept."""
  cos, sin = rotary_tables(CFG, T)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(1, T, 1, CFG.head_dim)), jnp.float32)
  y = apply_rotary(x, cos, sin)
  half = CFG.head_dim // 2
  inv = rope_frequencies(CFG.head_dim, CFG.rope_theta, CFG.rope_scaling)
  z = np.asarray(x[0, :, 0, :half]) + 1j * np.asarray(x[0, :, 0, half:])
  want = z * np.exp(1j * np.arange(T)[:, None] * inv[None, :])
  np.testing.assert_allclose(y[0, :, 0, :half], want.real, atol=1e-5)
  np.testing.assert_allclose(y[0, :, 0, half:], want.imag, atol=1e-5)


@pytest.mark.parametrize('field,value,needle', [
    ('num_kv_heads', 3, r'num_kv_heads \(3\) must divide num_heads \(4\)'),
    ('d_model', 30, r'd_model \(30\) must be divisible by num_heads \(4\)'),
    ('num_layers', 0, 'num_layers must be >= 1, got 0'),
    ('dtype', 'float16', "dtype must be one of float32, bfloat16, got 'float16'"),
    ('rope_scaling', {'factor': 8.0, 'typo': 1}, r'rope_scaling: unknown field\(s\) typo'),
    ('rope_scaling', RopeScaling, 'rope_scaling must be None, a RopeScaling or a dict'),
    ('loss_chunk', -1, 'loss_chunk must be >= 0 or None'),
    ('rms_norm_eps', 0.0, 'rms_norm_eps must be > 0'),
])
def test_config_errors_are_one_line(field, value, needle):
  with pytest.raises(ValueError, match=needle) as info:
    dataclasses.replace(CFG, **{field: value})
  assert '\n' not in str(info.value)


def test_rope_scaling_errors_are_one_line():
  with pytest.raises(ValueError, match='0 < low_freq_factor < high_freq_factor') as info:
    RopeScaling(8.0, 4.0, 1.0, 8192)
  assert '\n' not in str(info.value)


def test_shipped_configs_load():
  names = config_names('llama')
  assert {'llama-tiny', 'smollm2-135m', 'smollm2-360m', 'llama-3.2-1b', 'llama-3.2-3b',
          'llama-3.1-8b'} <= set(names)
  one_b = load_config('llama-3.2-1b').model
  assert one_b.rope_scaling == RopeScaling(32.0, 1.0, 4.0, 8192) and one_b.tie_embeddings
  assert not load_config('llama-3.1-8b').model.tie_embeddings


# One of each kind in the default suite (per-layer rule, tags, segmenting, both); the rest
# with -m slow.
_DEFAULT_SPECS = {'full', 'dots', 'names:context,mlpwi_1', 'sqrt', 'dots@seg:2'}


def _policies():
  specs = registered_specs(('query_proj', 'mlpwi_0'), model_tags=TAGS) + [
      'names:context,mlpwi_1', 'sqrt', 'seg:2', 'full@sqrt', 'dots@seg:2']
  return [s if s in _DEFAULT_SPECS else pytest.param(s, marks=pytest.mark.slow)
          for s in specs if s != 'none']


@pytest.mark.parametrize('policy', _policies())
def test_every_policy_gives_the_gradients_of_none(policy):
  loss, grads = _loss_and_grads(CFG, policy)
  ref_loss, ref_grads = _loss_and_grads(CFG, 'none')
  assert_trees_close(loss, ref_loss)
  assert_trees_close(grads, ref_grads)


@pytest.mark.slow
def test_chunked_loss_equals_the_plain_loss():
  """The output layer in chunks (the 128k-vocab path) gives the plain loss and gradients."""
  for tied in (False, True):
    cfg = dataclasses.replace(CFG, tie_embeddings=tied, loss_chunk=0)
    chunked = dataclasses.replace(cfg, loss_chunk=5)   # 24 tokens: 5 chunks, the last padded
    assert_trees_close(_loss_and_grads(chunked, 'none'), _loss_and_grads(cfg, 'none'))


BF16 = dataclasses.replace(CFG, dtype='bfloat16')


@pytest.mark.slow   # two compiles of a bf16 train loss: over a minute on the shared 2-core VM
def test_chunked_loss_in_bfloat16_equals_the_plain_loss():
  """The 128k-vocab path in bfloat16: a float32 cotangent once reached the bf16 final norm."""
  plain = _loss_and_grads(dataclasses.replace(BF16, loss_chunk=0), 'none')
  loss, grads = _loss_and_grads(dataclasses.replace(BF16, loss_chunk=5), 'none')
  assert all(g.dtype == jnp.float32 for g in jax.tree_util.tree_leaves(grads))
  assert_trees_close(loss, plain[0])
  # As test_precision's GPT case: the chunked dL/dh is rounded to bfloat16 where the plain
  # path's is, in another summation order; a bfloat16 ulp (2^-8 of the value) on some elements.
  assert_trees_close(grads, plain[1], rtol=2 ** -7)


def test_bfloat16_runs_with_float32_weights_and_gradients():
  params = _params(BF16)
  assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(params))
  hidden = Llama(BF16).apply({'params': params}, _windows()[:, :-1], return_hidden=True)
  assert hidden.dtype == jnp.bfloat16
  loss, grads = _loss_and_grads(BF16, 'none')
  assert loss.dtype == jnp.float32 and np.isfinite(float(loss))
  assert all(g.dtype == jnp.float32 for g in jax.tree_util.tree_leaves(grads))
  # The same model in float32: bf16 rounding moves the loss by well under 1%.
  f32_loss, _ = _loss_and_grads(CFG, 'none')
  assert abs(float(loss) - float(f32_loss)) < 1e-2 * float(f32_loss)


@pytest.mark.parametrize('policy', ['full', 'full@sqrt'] + [
    pytest.param(s, marks=pytest.mark.slow)
    for s in ('dots', 'save_qkv_proj', 'names:context,mlpwi_1', 'sqrt')])
def test_bfloat16_every_policy_close_to_none(policy):
  loss, grads = _loss_and_grads(BF16, policy)
  ref_loss, ref_grads = _loss_and_grads(BF16, 'none')
  assert_trees_close(loss, ref_loss, rtol=BF16_RTOL)
  assert_trees_close(grads, ref_grads, rtol=BF16_RTOL)
