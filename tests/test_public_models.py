"""Public models, untouched and on the library: equal gradients, and the stack never plans more.

The models (tests/public_models/) are re-implementations of the Flax lm1b example's
Transformer LM, an NNX Gemma, a big_vision ViT, the Equinox BERT example, a Gemma 3
decoder (5 local + 1 global layers on ``pattern=``) and diffusers' Flax U-Net (skips
returned by the down stacks, taken by the up stacks as ``xs=``). For each, the loss
gradient is compiled (``remat.measuring.step_memory``: parameters are arguments,
gradients outputs, so ``temp`` is the activation memory) and compared with the
untouched model's: ``none`` at most 1.05x its temp (the stack costs nothing
for stacking), ``full`` at most 0.4x and ``sqrt`` at most 0.7x. docs/own-model.md has
the figures.

Our own GPT, ViT and Llama (tests/public_models/ours.py) are held to the same bounds
against their unrolled form (``remat.layout.unrolled_reference``), on both plans too.
"""

import jax
import pytest

from remat.measuring import step_memory
from remat.targets import get_target, gpu_plugin_available
from tests.numerics import assert_trees_close
from tests.public_models import bert, gemma, gemma3, lm1b, ours, unet, vit

CASES = {'bert': bert.case, 'gemma': gemma.case, 'gemma3': gemma3.case, 'lm1b': lm1b.case,
         'unet': unet.case, 'vit': vit.case}
# (spec, the largest temp allowed as a fraction of the untouched model's), issue 23.
BOUNDS = (('none', 1.05), ('full', 0.4), ('sqrt', 0.7))
# Where a model does not meet its bound yet, the ratio measured (issue 37), held so that it does not
# grow; docs/own-model.md says why. The U-Net's full keeps every skip, the up path's inputs and a
# reversed copy of the skips that `xs=skips[::-1]` makes (43.38 vs 88.58 MiB, 0.4897x at 0157867;
# held at 0.59 from 32f0939 until then; 44.39 MiB, 0.5011x, since 2722ce3 writes each gradient row
# as soon as it is computed: remat.explain's live peak 49.46 -> 49.52 MiB, XLA's packing loss
# 0.15 -> 1.10 MiB, as in docs/own-model.md's 8-layer U-Net). (Gemma 3's none on the H200 plan, held at 1.075 until
# issue 34's layouts, now plans 0.70x: `auto` lays a pattern's layers out as `loops` on a GPU plan.)
MEASURED_ABOVE = {('unet', 'h200', 'full'): 0.51}

_cases = {}


def _case(name):
  if name not in _cases:
    _cases[name] = CASES[name]()
  return _cases[name]


def temps(name, target):
  c = _case(name)
  t = get_target(target)
  out = {'untouched': step_memory(c.untouched, c.params, c.batch, target=t).temp}
  for spec, _ in BOUNDS:
    out[spec] = step_memory(c.stacked(spec), c.stack(c.params), c.batch, target=t).temp
  return out


# One model's gradients in the default suite (~6 s each on 2 cores); the others are slow.
@pytest.mark.parametrize('name', [n if n == 'vit' else pytest.param(n, marks=pytest.mark.slow)
                                  for n in sorted(CASES)])
def test_gradients_equal_untouched(name):
  c = _case(name)
  want = c.stack(jax.jit(jax.grad(c.untouched))(c.params, c.batch))
  for spec in ('none', 'sqrt', 'full'):
    got = jax.jit(jax.grad(c.stacked(spec)))(c.stack(c.params), c.batch)
    assert_trees_close(got, want, err_msg=f'{name} {spec}: ')


def _check(name, target):
  t = temps(name, target)
  assert _case(name).num_layers >= 6
  for spec, bound in BOUNDS:
    bound = MEASURED_ABOVE.get((name, target, spec), bound)
    assert t[spec] <= bound * t['untouched'], (name, target, spec, t)


# The two heaviest compiles (18 s each) run with -m extended, as CI does.
@pytest.mark.parametrize('name', [pytest.param(n, marks=pytest.mark.extended)
                                  if n in ('gemma3', 'unet') else n for n in sorted(CASES)])
def test_stack_plans_no_more_than_untouched_cpu(name):
  _check(name, 'cpu')


@pytest.mark.gpu_plan
@pytest.mark.slow
@pytest.mark.skipif(not gpu_plugin_available(), reason='needs the gpu-plan extra')
@pytest.mark.parametrize('name', sorted(CASES))
def test_stack_plans_no_more_than_untouched_h200(name):
  _check(name, 'h200')


# Our own models against their unrolled form (remat.layout.unrolled_reference: the stack as a
# Python loop, no checkpoint), at the default configs' shapes with >= 6 layers (tests/public_models/
# ours.py); slow (four compiles of each). The same bounds: the unrolled form is what a user would
# have written without the library.
def _check_ours(config, target):
  from bench.zoo import grad_memory
  from remat.layout import unrolled_reference
  cfg, (batch, size) = ours.model_config(config), ours.ZOO[config]
  assert cfg.num_layers >= ours.MIN_LAYERS
  t = get_target(target)
  with unrolled_reference():
    ref = grad_memory(cfg, 'none', batch, size, t).temp
  for spec, bound in BOUNDS:
    temp = grad_memory(cfg, spec, batch, size, t).temp
    assert temp <= bound * ref, (config, target, spec, temp, ref)


@pytest.mark.slow
@pytest.mark.parametrize('config', sorted(ours.ZOO))
def test_our_models_plan_no_more_than_unrolled_cpu(config):
  _check_ours(config, 'cpu')


@pytest.mark.gpu_plan
@pytest.mark.slow
@pytest.mark.skipif(not gpu_plugin_available(), reason='needs the gpu-plan extra')
@pytest.mark.parametrize('config', sorted(ours.ZOO))
def test_our_models_plan_no_more_than_unrolled_h200(config):
  _check_ours(config, 'h200')
