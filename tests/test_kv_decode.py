"""Greedy generation with a KV cache (models/kv_decode.py) against the full model, token for token.

The reference reruns the training model over the whole sequence for every new
token and takes the argmax of the last position: what generation means. The
weights are scaled up so the logits are far apart (a random model's are
nearly tied, and an argmax between near-ties would test rounding, not the
cache); the cached step must then pick the same token at every position.
"""

import jax
import jax.numpy as jnp
import pytest

from models.gpt import GPT, GPTConfig
from models.kv_decode import greedy_generate
from models.llama import Llama, LlamaConfig

MODELS = {
    'llama': Llama(LlamaConfig(vocab_size=50, d_model=32, num_layers=2, num_heads=4,
                               num_kv_heads=2, mlp_dim=64, tie_embeddings=False, max_len=32)),
    'llama-tied-mha': Llama(LlamaConfig(vocab_size=50, d_model=32, num_layers=3, num_heads=2,
                                        num_kv_heads=2, mlp_dim=48, max_len=32)),
    'gpt': GPT(GPTConfig(vocab_size=50, d_model=32, num_layers=2, num_heads=4, max_len=32)),
}


def _reference(model, params, prompt, n):
  # One compiled shape: the sequence right-padded to max_len (causal: padding after a position
  # changes nothing at it).
  logits = jax.jit(lambda toks: model.apply({'params': params}, toks)[0])
  ids = list(prompt)
  for _ in range(n):
    toks = jnp.zeros((1, model.config.max_len), jnp.int32).at[0, :len(ids)].set(jnp.asarray(ids))
    ids.append(int(jnp.argmax(logits(toks)[len(ids) - 1])))
  return ids[len(prompt):]


@pytest.mark.parametrize('name', sorted(MODELS))
def test_cached_greedy_equals_rerunning_the_model(name):
  model = MODELS[name]
  params = model.init(jax.random.PRNGKey(1), jnp.zeros((1, 8), jnp.int32))['params']
  params = jax.tree_util.tree_map(lambda a: a * 8 if a.ndim >= 2 else a, params)
  prompts = [[1, 2, 3], [5], [7, 8, 9, 10, 11, 12]]   # rows of different lengths, one batch
  got = greedy_generate('gpt' if name == 'gpt' else 'llama', model.config, params, prompts, 10,
                        None)
  assert got == [_reference(model, params, p, 10) for p in prompts]
  # Cut before the end-of-text id: take one the first row generates.
  eot = got[0][4]
  cut = greedy_generate('gpt' if name == 'gpt' else 'llama', model.config, params, prompts[:1],
                        10, eot)
  assert cut == [got[0][:got[0].index(eot)]]


def test_the_context_bounds_generation():
  model = MODELS['gpt']
  params = model.init(jax.random.PRNGKey(1), jnp.zeros((1, 8), jnp.int32))['params']
  got = greedy_generate('gpt', model.config, params, [[1] * 30], 10, None)
  assert len(got[0]) == 2   # 30 prompt tokens + 2 = max_len 32
  with pytest.raises(ValueError, match='prompts need 1 to 32'):
    greedy_generate('gpt', model.config, params, [[1] * 33], 1, None)


def test_a_lora_models_greedy_generation_includes_its_adapters():
  """--eval-generate and training.sample decode a LoRA run: its adapters must count, token for
  token as the LoRA model itself computes."""
  import dataclasses
  from models.lora.spec import LoraSpec
  base = MODELS['llama']
  model = Llama(dataclasses.replace(base.config, lora=LoraSpec(rank=4)))
  params = model.init(jax.random.PRNGKey(1), jnp.zeros((1, 8), jnp.int32))['params']
  keys = iter(jax.random.split(jax.random.PRNGKey(3), 64))

  def scaled(path, a):
    name = path[-1].key if hasattr(path[-1], 'key') else ''
    if name == 'lora_b':   # zero at init: nonzero here, so the adapters change the argmax
      return jax.random.normal(next(keys), a.shape, a.dtype)
    return a * 8 if a.ndim >= 2 and jnp.issubdtype(a.dtype, jnp.floating) else a
  params = jax.tree_util.tree_map_with_path(scaled, params)
  prompts = [[1, 2, 3], [7, 8, 9, 10]]
  got = greedy_generate('llama', model.config, params, prompts, 8, None)
  assert got == [_reference(model, params, p, 8) for p in prompts]
  # Without the adapters the continuation differs: the test would catch them being dropped.
  assert got != greedy_generate('llama', base.config, _without_adapters(params), prompts, 8, None)


def _without_adapters(tree):
  if isinstance(tree, dict):
    return {k: _without_adapters(v) for k, v in tree.items() if k not in ('lora_a', 'lora_b')}
  return tree
