"""Equinox modules through remat.eqx: partitioned for the user, gradients of the loop by hand."""

import ast
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from numerics import assert_trees_close
import remat
from remat import StackSignatureError

eqx = pytest.importorskip('equinox')
D, N = 8, 4


class Block(eqx.Module):
  """A residual MLP with dropout: eqx.nn.MLP holds a non-array leaf (its activation)."""
  mlp: eqx.nn.MLP
  drop: eqx.nn.Dropout

  def __init__(self, key):
    self.mlp = eqx.nn.MLP(D, D, 2 * D, 1, activation=jax.nn.gelu, key=key)
    self.drop = eqx.nn.Dropout(0.5)

  def __call__(self, x, key=None):
    return x + self.drop(self.mlp(x), key=key, inference=key is None)


def _by_hand(stacked, x, key=None):
  params, static = eqx.partition(stacked, eqx.is_array)
  keys = None if key is None else jax.random.split(key, N)
  for i in range(N):
    layer = eqx.combine(jax.tree_util.tree_map(lambda a: a[i], params), static)
    x = layer(x, key=None if keys is None else keys[i])
  return x


@pytest.mark.parametrize('key,specs', [
    (jax.random.PRNGKey(3), ('none', 'full@sqrt')),
    pytest.param(None, ('none', 'full', 'sqrt', 'full@sqrt'), marks=pytest.mark.slow),
    pytest.param(jax.random.PRNGKey(3), ('full', 'sqrt'), marks=pytest.mark.slow)])
def test_scan_module_gives_the_loop_by_hand(key, specs):
  stacked = remat.eqx.stack_modules(Block, N, jax.random.PRNGKey(0))
  assert stacked.mlp.layers[0].weight.shape == (N, 2 * D, D)
  x = jnp.linspace(-1.0, 1.0, D)
  loss = lambda m, f: jnp.sum(f(m) ** 2)
  want = eqx.filter_grad(loss)(stacked, lambda m: _by_hand(m, x, key))
  for spec in specs:
    got = eqx.filter_grad(loss)(
        stacked, lambda m: remat.eqx.scan_module(m, x, policy=spec, key=key))
    assert_trees_close(eqx.filter(got, eqx.is_array), eqx.filter(want, eqx.is_array),
                       err_msg=f'{spec}: ')


def test_a_module_handed_to_scan_layers_is_one_line():
  stacked = remat.eqx.stack_modules(Block, N, jax.random.PRNGKey(0))
  with pytest.raises(StackSignatureError) as e:
    remat.scan_layers(lambda m, x: m(x), stacked, jnp.ones(D), policy='full')
  msg = str(e.value)
  assert 'not an array' in msg and 'remat.eqx.scan_module' in msg and '\n' not in msg


def test_remat_never_imports_equinox_at_module_level():
  # Equinox is optional: no module of the library imports it at top level (remat.eqx does
  # inside its functions). Checked on the source, since this test process imports Equinox.
  for path in Path(remat.__file__).parent.glob('*.py'):
    for node in ast.parse(path.read_text()).body:
      names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
          [node.module or ''] if isinstance(node, ast.ImportFrom) else [])
      assert not any(n.split('.')[0] == 'equinox' for n in names), path
