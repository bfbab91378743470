"""Spec grammar, registry contents and one-line errors of the policy module."""

import jax
import pytest

from models.gpt import TAGS
from models.resnet import TAGS as RESNET_TAGS
from remat import PRESETS, Policy, PolicyError, get_policy, list_policies
from remat.policies import conv_saveable, preset_tags, registered_specs

cp = jax.checkpoint_policies


@pytest.mark.parametrize('spec,rule,segment', [
    ('none', 'none', None), ('full', 'full', None), ('dots', 'dots', None),
    ('sqrt', 'none', 'sqrt'), ('seg:3', 'none', 3), ('full@sqrt', 'full', 'sqrt'),
    ('dots_no_batch@seg:2', 'dots_no_batch', 2), ('minimal', 'names', None),
    ('qkv_proj_offloaded', 'offload', None), ('names:out_proj,mlpwo', 'names', None),
    ('stage', 'none', 'stage'), ('full@stage', 'full', 'stage'), ('convs', 'convs', None),
    ('save_conv_narrow@sqrt', 'names', 'sqrt'),
    ('4xfull+none', 'mix', None), ('2xfull@seg:2+3xnames:context+dots', 'mix', None),
])
def test_parse(spec, rule, segment):
  p = get_policy(spec)
  assert (p.rule, p.segment) == (rule, segment)
  assert get_policy(p.spec) == p  # canonical spec round-trips


def test_canonical_forms():
  assert get_policy('none@sqrt').spec == 'sqrt'
  assert get_policy(' names: query_proj , key_proj ').spec == 'names:query_proj,key_proj'
  assert get_policy('save_qkv_proj@seg:2').spec == 'save_qkv_proj@seg:2'


def test_policy_is_immutable_and_hashable():
  p = get_policy('full')
  with pytest.raises(Exception):
    p.rule = 'none'
  assert hash(p) == hash(get_policy('full'))


def test_jax_policies():
  assert get_policy('full').jax_policy is cp.nothing_saveable
  assert get_policy('everything').jax_policy is cp.everything_saveable
  assert get_policy('dots').jax_policy is cp.dots_saveable
  assert get_policy('dots_no_batch').jax_policy is cp.dots_with_no_batch_dims_saveable
  assert callable(get_policy('names:context').jax_policy)
  assert callable(get_policy('offload:context').jax_policy)
  assert get_policy('convs').jax_policy is conv_saveable


def test_conv_saveable_saves_only_convolutions():
  import jax.numpy as jnp
  def f(w, x):
    y = jax.lax.conv_general_dilated(x, w, (1, 1), 'SAME')
    return jnp.sin(y).reshape(-1) @ jnp.ones(y.size)
  w, x = jnp.ones((2, 2, 3, 3)), jnp.ones((1, 2, 5, 5))  # OIHW kernel, NCHW input

  def saved(policy):  # shapes of the arrays the backward pass keeps, inputs excluded
    closed = jax.make_jaxpr(lambda w, x: jax.vjp(jax.checkpoint(f, policy=policy), w, x)[1])(w, x)
    inputs = set(closed.jaxpr.invars)
    return [v.aval.shape for v in closed.jaxpr.outvars if v not in inputs]

  assert saved(conv_saveable) == [(1, 2, 5, 5)]  # the conv output, not sin's input or the matmul
  assert saved(cp.nothing_saveable) == []


def test_segment_sizes_are_capped_per_stack():
  assert get_policy('stage').segment_size(7) == 7
  assert get_policy('seg:4').segment_size(2) == 2  # a shorter ResNet stage: one segment
  with pytest.raises(PolicyError, match='out of range'):
    get_policy('seg:4', num_layers=3)  # but the model's deepest stack must fit K


@pytest.mark.parametrize('n,k', [
    (1, 1), (2, 1), (3, 2), (5, 2), (7, 3), (13, 4),     # no divisor near sqrt(N): round(sqrt(N))
    (4, 2), (8, 2), (12, 3), (16, 4), (24, 4), (32, 4), (36, 6), (48, 6), (64, 8),  # divisors
])
def test_sqrt_segment_size(n, k):
  assert get_policy('sqrt').segment_size(n) == k


def test_presets_use_model_tags():
  from models.llama import TAGS as LLAMA_TAGS
  for name, (kind, tags, _) in PRESETS.items():
    assert kind in ('names', 'offload')
    assert any(preset_tags(name, t) is not None for t in (TAGS, RESNET_TAGS, LLAMA_TAGS)), name
  # The MLP input is GPT-2's mlpwi or a gated MLP's mlpwi_0 + mlpwi_1, whichever is emitted.
  for name in ('minimal', 'minimal_with_context', 'minimal_offloaded'):
    assert 'mlpwi' in preset_tags(name, TAGS) and 'mlpwi_0' not in preset_tags(name, TAGS)
    llama = preset_tags(name, LLAMA_TAGS)
    assert {'mlpwi_0', 'mlpwi_1'} <= set(llama) and 'mlpwi' not in llama
    assert preset_tags(name, set(LLAMA_TAGS) - {'mlpwi_1'}) is None   # half a group is none
    assert name in registered_specs(model_tags=LLAMA_TAGS)
  assert PRESETS['save_dot_except_mlp'][1] == ('query_proj', 'key_proj', 'value_proj', 'out_proj')
  assert 'save_conv_narrow' not in registered_specs(model_tags=TAGS)
  assert 'minimal' not in registered_specs(model_tags=RESNET_TAGS)


def test_listing_covers_registry():
  listed = {spec for spec, _ in list_policies()}
  for spec in registered_specs():
    if ':' not in spec:
      assert spec in listed
  assert {'sqrt', 'seg:K', 'stage', 'convs'} <= listed
  assert all(desc and '\n' not in desc for _, desc in list_policies())


@pytest.mark.parametrize('spec,kwargs,needle', [
    ('bogus', {}, "unknown remat policy 'bogus'; valid: none, full"),
    ('', {}, 'empty remat policy'),
    ('names:', {}, "empty tag in 'names:'"),
    ('names:query_proj,,key_proj', {}, "empty tag in 'names:'"),
    ('offload:', {}, "empty tag in 'offload:'"),
    ('names', {}, "'names' needs tags"),
    ('seg:0', {}, 'segment size must be an integer >= 1'),
    ('seg:x', {}, 'segment size must be an integer >= 1'),
    ('seg:\uff12', {}, "segment size must be an integer >= 1, got '\uff12'"),  # full-width 2
    ('seg:+2', {}, 'segment size must be an integer >= 1'),
    ('full@seg: 2', {}, 'segment size must be an integer >= 1'),
    ('full@cubic', {}, "unknown segmenting 'cubic'; valid: sqrt, seg:K, stage"),
    ('seg:6', {'num_layers': 5}, 'segment size 6 is out of range; valid sizes for this 5-layer stack are 1..5'),
    ('names:nope', {'tags': TAGS}, 'unknown tag(s) nope; this model emits: context, key_proj'),
    ('offload:query_proj,nope', {'tags': TAGS}, 'unknown tag(s) nope'),
    ('full+none', {}, "part 'full' needs a layer count, e.g. 4xfull+none"),
    ('4xfull', {}, 'a layer count starts a mix and needs a part after it, e.g. 4xfull+none'),
    ('0xfull+none', {}, "a part's layer count must be >= 1, got '0'"),
    ('4xfull++none', {}, 'empty part'),
    ('4xbogus+none', {}, "unknown remat policy '4xbogus+none'"),
    ('5xfull+none', {'num_layers': 5}, 'the counted parts cover 5 layers; this 5-layer stack '
     'needs fewer than 5'),
    ('2xfull+2xnone', {'num_layers': 5}, 'needs exactly 5'),
    ('2xfull@seg:3+none', {'num_layers': 5}, "segment size 3 is out of range; valid sizes for "
     "this 2-layer stack are 1..2 (in the mix '2xfull@seg:3+none')"),
    ('2xnames:nope+none', {'tags': TAGS}, 'unknown tag(s) nope'),
    ('auto:40GiB', {}, "'auto:40GiB' is a budget, not a policy"),
])
def test_errors_are_one_line(spec, kwargs, needle):
  with pytest.raises(PolicyError) as e:
    get_policy(spec, **kwargs)
  msg = str(e.value)
  assert needle in msg
  assert '\n' not in msg


def test_policy_instance_passes_through():
  p = get_policy('full@seg:2')
  assert get_policy(p, num_layers=4) is p
  with pytest.raises(PolicyError):
    get_policy(p, num_layers=1)
  assert isinstance(p, Policy)


@pytest.mark.parametrize('spec,needle', [
    ('none', 'means no remat'), ('sqrt', 'segments a stack'), ('seg:4', 'segments a stack'),
    ('stage', 'segments a stack'), ('full@sqrt', 'segments a stack'),
])
def test_jax_policy_cannot_be_misread(spec, needle):
  # jax.checkpoint / nn.remat / nnx.remat read policy=None as "save nothing": full remat.
  with pytest.raises(PolicyError) as e:
    get_policy(spec).jax_policy
  assert needle in str(e.value) and '\n' not in str(e.value)


def test_checkpoint_and_remat_entry_points():
  import flax.linen as nn
  f = lambda x: x * 2
  assert get_policy('none').checkpoint(f) is f
  assert get_policy('full').checkpoint(f) is not f
  assert get_policy('none').remat(nn.Dense) is nn.Dense
  assert get_policy('none').nnx_remat(f) is f
  for method in ('checkpoint', 'remat', 'nnx_remat'):
    with pytest.raises(PolicyError, match='remat.LayerStack .* remat.scan_layers'):
      getattr(get_policy('seg:2'), method)(f)


@pytest.mark.parametrize('bad', [None, 3, cp.nothing_saveable, ['full']])
def test_spec_type_is_checked(bad):
  with pytest.raises(PolicyError, match='a remat policy is a spec string or a Policy') as e:
    get_policy(bad)
  assert '\n' not in str(e.value)


def test_mix_parts_and_layer_split():
  p = get_policy(' 4x full + 2xdots@seg:2 + none ', num_layers=12)
  assert p.spec == '4xfull+2xdots@seg:2+none' and p.mixed and get_policy(p.spec) == p
  assert [(n, q.spec) for n, q in p.layer_split(12)] == [(4, 'full'), (2, 'dots@seg:2'),
                                                          (6, 'none')]
  # A shorter stack (a ResNet stage under a non-strict stack) runs the first parts only.
  assert [(n, q.spec) for n, q in p.layer_split(5)] == [(4, 'full'), (1, 'dots@seg:2')]
  assert get_policy('2xnone+qkv_proj_offloaded').offloads
  assert get_policy('2xnone+save_qkv_proj').uses_tags and not get_policy('2xnone+full').uses_tags
  with pytest.raises(PolicyError, match='mixes rules across a stack'):
    get_policy('4xfull+none').checkpoint(lambda x: x)
