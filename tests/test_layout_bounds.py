"""Issue 34's second yardstick on the H100 and H200 plans: the stack (``layout='auto'``) against the per-block habit.

The per-block habit is the untouched model with each block in ``nn.remat``
(``nnx.remat``) under a rule's ``jax.checkpoint`` policy, as its users write it
(tests/public_models/: ``Case.per_block``). On a GPU plan, where a checkpoint
in straight-line code is kept, the stack should plan no more than that habit
under the same rule, and no more than the untouched model under ``none``.
docs/own-model.md has the figures for every public model and ours; the
diffusers U-Net aside (its stacks are two or three layers deep), the public
models and ours (their yardsticks traced with :mod:`remat.layout`'s
references) are checked here, at >= 8 layers (slow: six compiles each; the public
models on both plans). So is a plain Transformer block written here, tagged with
the names the MaxText presets read, under those presets too (H100 plan). Where the
stack does not meet a bound yet, the ratio measured is held so that it does not
grow (docs/own-model.md says which buffers make the difference).
"""

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name

from remat import scan_layers
from remat.layout import per_block_reference
from remat.measuring import step_memory
from remat.targets import get_target, gpu_plugin_available
from tests.public_models import deep_case

# (stack spec, the yardstick it is held to): the per-block habit under the same rule, or untouched.
BOUNDS = (('full', 'per-block:full'), ('dots', 'per-block:dots'), ('none', 'untouched'))
# Where the stack does not meet a bound yet, the ratio measured on the H100 and H200 plans (jax
# 0.10.2) at the commit that set it, held so that it does not grow: the larger of the two, rounded
# up in its second decimal, nothing more. These plans came out the same in every run (not every
# XLA plan does: a scanned BERT's dots planned 18.64 or 18.89 MiB in two runs of one command).
# Gemma 3-style full: a pattern, laid out as one-iteration loops ('loops'); the stack keeps what
# its layers save in gradient rows written later (remat.kept_in_gradients), as the per-block model
# keeps its saved values in the gradient buffers of layers whose backward has not run; what is
# left is the backward working set (docs/own-model.md): 1.0533 (H200 1.09999). Gemma-style dots:
# the scan, auto's layout there since it writes each gradient row as soon as it is computed
# (remat.backward_order), 1.0152 on both plans (0.98 unrolled, which compiled 2.1x as slowly);
# its full, held at 1.03 until then, is 0.89x.
MEASURED_ABOVE = {('gemma', 'dots'): 1.02, ('gemma3', 'full'): 1.10}
PUBLIC = ('vit', 'lm1b', 'gemma', 'bert', 'gemma3')


def temps(name: str, target: str) -> dict:
  c, t = deep_case(name), get_target(target)
  out = {'untouched': step_memory(c.untouched, c.params, c.batch, target=t).temp}
  for rule in ('full', 'dots'):
    out[f'per-block:{rule}'] = step_memory(c.per_block(rule), c.params, c.batch, target=t).temp
  stacked = c.stack(c.params)
  for spec, _ in BOUNDS:
    out[spec] = step_memory(c.stacked(spec), stacked, c.batch, target=t).temp
  return out


def our_temps(config: str, target: str) -> dict:
  """The same for our zoo model ``config`` at the tests' shape with 8 layers, its yardsticks traced."""
  from bench.zoo import grad_memory
  from remat.layout import unrolled_reference
  from tests.public_models import ours
  cfg, (batch, size), t = ours.model_config(config, ours.DEEP), ours.ZOO[config], get_target(target)
  out = {}
  for label, context in (('untouched', unrolled_reference()),
                         ('per-block:full', per_block_reference('full')),
                         ('per-block:dots', per_block_reference('dots'))):
    with context:
      out[label] = grad_memory(cfg, 'none', batch, size, t).temp
  for spec, _ in BOUNDS:
    out[spec] = grad_memory(cfg, spec, batch, size, t).temp
  return out


@pytest.mark.gpu_plan
@pytest.mark.slow
@pytest.mark.skipif(not gpu_plugin_available(), reason='needs the gpu-plan extra')
@pytest.mark.parametrize('config', ('tiny', 'llama-tiny', 'vit-tiny'))
def test_our_models_meet_every_bound_h100(config):
  """Our GPT, Llama and ViT (8 layers each) meet all three, with no held ratio. Their layers loop (a
  chunked MLP backward), so under full and none 'auto' keeps the scan, which plans less than the
  per-block loop; under dots it is the per-block loop, its kept values in gradient rows. Llama's
  dots planned 1.003x its per-block habit until the chunked backward passes' carries stopped
  starting as constant zeros (models.chunking.zeros_after)."""
  t = our_temps(config, 'h100')
  for spec, yardstick in BOUNDS:
    assert t[spec] <= t[yardstick], (spec, yardstick, t[spec] / t[yardstick])


@pytest.mark.gpu_plan
@pytest.mark.slow
@pytest.mark.skipif(not gpu_plugin_available(), reason='needs the gpu-plan extra')
@pytest.mark.parametrize('target', ('h100', 'h200'))
@pytest.mark.parametrize('name', PUBLIC)
def test_stack_plans_no_more_than_the_per_block_habit(name, target):
  assert deep_case(name).num_layers >= 8
  t = temps(name, target)
  assert t['per-block:full'] < t['per-block:dots'] < t['untouched'], t   # the habit works here
  for spec, yardstick in BOUNDS:
    bound = MEASURED_ABOVE.get((name, spec), 1.0)
    assert t[spec] <= bound * t[yardstick], (name, spec, yardstick, t[spec] / t[yardstick])


# A plain Transformer block as users write it (pre-norm, dense causal attention, GELU MLP, no
# loop of its own), tagged with the names the MaxText presets read; 8 layers, H100 plan.
TAGGED_RULES = ('full', 'dots_no_batch', 'minimal', 'save_dot_except_mlp', 'save_qkv_proj',
                'save_out_proj')
# Held where auto plans above that habit: dots on the scan (auto's layout for dots where no layer
# loops), 1.056x (61.25 against 58.00 MiB: the [B, H, T, T] scores each layer keeps do not fit its
# gradient rows; unrolled 0.991x, which compiled 2.7x as slowly), and dots_no_batch and minimal
# (the same rule here) unrolled, 1.00001x (512 bytes over; the scan 0.934x). docs/own-model.md.
TAGGED_ABOVE = {'dots': 1.06, 'dots_no_batch': 1.01, 'minimal': 1.01}


def tagged_block(p, x):
  tag = checkpoint_name
  b, t, d = x.shape
  heads = 4
  norm = lambda v: (v - v.mean(-1, keepdims=True)) * jax.lax.rsqrt(v.var(-1, keepdims=True) + 1e-5)
  h = norm(x)
  q, k, v = (tag(h @ p[w], n).reshape(b, t, heads, d // heads)
             for w, n in (('wq', 'query_proj'), ('wk', 'key_proj'), ('wv', 'value_proj')))
  s = jnp.einsum('bqhd,bkhd->bhqk', q, k) / (d // heads) ** 0.5
  s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
  a = jnp.einsum('bhqk,bkhd->bqhd', jax.nn.softmax(s, -1), v).reshape(b, t, d)
  x = x + tag(tag(a, 'context') @ p['wo'], 'out_proj')
  return x + tag(jax.nn.gelu(tag(norm(x) @ p['w1'], 'mlpwi')) @ p['w2'], 'mlpwo')


@pytest.mark.gpu_plan
@pytest.mark.slow
@pytest.mark.skipif(not gpu_plugin_available(), reason='needs the gpu-plan extra')
def test_a_plain_tagged_transformer_against_the_per_block_habit_under_every_rule():
  n, d, f = 8, 128, 512
  keys = jax.random.split(jax.random.PRNGKey(0), 6)
  shapes = {'wq': (d, d), 'wk': (d, d), 'wv': (d, d), 'wo': (d, d), 'w1': (d, f), 'w2': (f, d)}
  params = {w: jax.random.normal(k, (n, *s)) * 0.05 for k, (w, s) in zip(keys, shapes.items())}
  x = jnp.ones((8, 128, d))
  t = get_target('h100')
  loss = lambda spec: lambda p, x: jnp.mean(scan_layers(tagged_block, p, x, policy=spec) ** 2)
  for rule in TAGGED_RULES + ('dots',):
    with per_block_reference(rule):
      per_block = step_memory(loss('none'), params, x, target=t).temp
    stack = step_memory(loss(rule), params, x, target=t).temp
    assert stack <= TAGGED_ABOVE.get(rule, 1.0) * per_block, (rule, stack / per_block)
