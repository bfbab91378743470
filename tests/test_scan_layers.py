"""The plain-JAX front door: per-call inputs, aux outputs, dropout keys, one-line errors."""

import jax
import jax.numpy as jnp
import pytest

from numerics import assert_trees_close
from own_model import DEPTH, TAG, inputs, mlp, no_remat_loss, stacked_params
from remat import PolicyError, StackSignatureError, get_policy, scan_layers


def _one_line(excinfo, needle):
  msg = str(excinfo.value)
  assert needle in msg and '\n' not in msg, msg


def test_per_call_inputs_and_aux():
  p, x = stacked_params(), inputs()
  def layer(p, x, scale):
    y = mlp(p, x, scale)
    return y, jnp.mean(y)
  y, aux = scan_layers(layer, p, x, 0.5, policy='full@sqrt')
  want = x
  for i in range(DEPTH):
    want = mlp(jax.tree_util.tree_map(lambda a: a[i], p), want, 0.5)
  assert_trees_close(y, want)
  assert aux.shape == (DEPTH,)


def test_one_dropout_stream_under_every_segmenting():
  p, x = stacked_params(), inputs()
  def layer(p, x, rng):
    keep = jax.random.bernoulli(rng, 0.9, x.shape)
    return jnp.where(keep, mlp(p, x), 0.0) / 0.9
  key = jax.random.PRNGKey(3)
  grads = {s: jax.grad(lambda p: jnp.sum(scan_layers(layer, p, x, policy=s, rng=key) ** 2))(p)
           for s in ('none', 'full', 'sqrt', 'seg:3')}
  for s in grads:
    assert_trees_close(grads[s], grads['none'], err_msg=f'{s}: ')


def test_one_layer_may_change_the_shape():
  p = {'w': jnp.ones((1, 4, 6))}
  for spec in ('none', 'full', 'stage', 'seg:1'):
    y = scan_layers(lambda p, x: x @ p['w'], p, jnp.ones((2, 4)), policy=spec)
    assert y.shape == (2, 6)


@pytest.mark.parametrize('spec,needle', [
    ('names:fc_1', f'unknown tag(s) fc_1; this model emits: {TAG}'),
    ('offload:nope', f'unknown tag(s) nope; this model emits: {TAG}'),
    ('seg:20', 'valid sizes for this 16-layer stack are 1..16'),
])
def test_policy_checked_against_the_stack(spec, needle):
  with pytest.raises(PolicyError) as e:
    scan_layers(mlp, stacked_params(), inputs(), policy=spec)
  _one_line(e, needle)


def test_names_of_an_untagged_layer():
  with pytest.raises(PolicyError) as e:
    scan_layers(lambda p, x: x @ p['w'], {'w': jnp.ones((3, 4, 4))}, jnp.ones(4), policy='names:a')
  _one_line(e, 'this model emits: no tags')


@pytest.mark.parametrize('layer,args,needle', [
    (lambda p, x, mask: x, (), "missing a required argument: 'mask'"),
    (lambda p, x: x, (1.0,), 'too many positional arguments'),
    (lambda p, x: x[:, :2], (), 'the layer returned y of float32[128, 2] for x of float32[128, 128]'),
    (lambda p, x: (x, x, x), (), 'the layer returned (float32'),
])
def test_wrong_signatures_fail_in_one_line(layer, args, needle):
  with pytest.raises(StackSignatureError) as e:
    scan_layers(layer, stacked_params(), inputs(), *args, policy='full')
  _one_line(e, needle)
  assert 'scan_layers calls layer_fn(params, x[, xs_i], *args' in str(e.value)


@pytest.mark.parametrize('bad', [None, 7, jax.checkpoint_policies.nothing_saveable])
def test_policy_type_checked(bad):
  with pytest.raises(PolicyError) as e:
    scan_layers(mlp, stacked_params(), inputs(), policy=bad)
  _one_line(e, 'a remat policy is a spec string or a Policy')


def test_jax_policy_misuse_cannot_be_silent():
  # The README's old snippet: jax.checkpoint(f, policy=get_policy(spec).jax_policy) meant full
  # remat for none and every segmenting. Now it raises; Policy.checkpoint does what none says.
  for spec in ('none', 'sqrt', 'seg:4', 'stage', 'full@sqrt'):
    with pytest.raises(PolicyError):
      jax.checkpoint(mlp, policy=get_policy(spec).jax_policy)
  assert get_policy('none').checkpoint(mlp) is mlp


def test_accepts_a_policy_object_and_no_remat_matches_by_hand():
  p, x = stacked_params(), inputs()
  got = jax.grad(lambda p: jnp.sum(scan_layers(mlp, p, x, policy=get_policy('none')) ** 2))(p)
  assert_trees_close(got, jax.grad(no_remat_loss)(p, x))


def test_strict_off_for_models_whose_stacks_differ():
  p, x = stacked_params(), inputs()
  assert scan_layers(mlp, p, x, policy='names:shortcut', strict=False).shape == x.shape
  got = jax.grad(lambda p: jnp.sum(scan_layers(mlp, p, x, policy='seg:20', strict=False) ** 2))(p)
  assert_trees_close(got, jax.grad(no_remat_loss)(p, x))


@pytest.mark.parametrize('spec', ['4xfull+none', '3xnone+full', '8xfull@seg:4+sqrt',
                                  f'2xnames:{TAG}+5xdots+full', '15xfull+none'])
def test_mix_gives_the_gradients_of_none(spec):
  """A mix (runs of layers under different specs) changes memory only: same loss and gradients."""
  p, x = stacked_params(), inputs()
  def loss(p, spec):
    return jnp.sum(scan_layers(mlp, p, x, policy=spec) ** 2)
  want = jax.value_and_grad(no_remat_loss)(p, x)
  got = jax.jit(jax.value_and_grad(loss), static_argnums=1)(p, spec)
  assert_trees_close(got, want, err_msg=f'{spec}: ')


def test_mix_really_remats_only_its_runs():
  """4xfull+names:fc1 keeps the tagged value for 12 layers, not 16."""
  from remat.residuals import by_tag, saved_residuals
  p, x = stacked_params(), inputs()
  def kept(spec):
    res = saved_residuals(lambda p, x: jnp.sum(scan_layers(mlp, p, x, policy=spec)), p, x)
    return by_tag(res).get(TAG, 0)
  per_layer = kept(f'names:{TAG}') // DEPTH
  assert per_layer > 0
  assert kept(f'4xfull+names:{TAG}') == (DEPTH - 4) * per_layer
  assert kept(f'4xnames:{TAG}+full') == 4 * per_layer
  assert kept('full') == 0
