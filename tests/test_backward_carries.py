"""The models' looped backward passes start their loop carries from the incoming cotangent.

A loop whose carry starts as constants (zeros) lets XLA make that carry at
any time: in an unrolled stack on a GPU its pipeline made every layer's at the
start of the backward pass and held them all (our tiny GPT's chunked MLP,
``dots``, H100 plan: seven zeroed ``[1024, 512]`` buffers at the peak; the
blockwise attention's ``dQ``, ``dK`` and ``dV`` sums, 29 MiB of llama-tiny's
plan at 2 x 2048 tokens: docs/attention.md). Each rule's carries are made from the
cotangent instead (``models.chunking.zeros_after``, or copies of it). Checked
on the jaxpr of each pullback: every loop in it takes initial carries that
are computed from the cotangent, so they cannot exist before it.
"""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from models.attention import attention, blockwise_attention
from models.layers import gelu_dense
from models.swiglu import swiglu_mlp
from remat.unrolled_parts import _body

NO_KEY = jnp.zeros((2,), jnp.uint32)


def _normal(*shape, seed=0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _loop_starts(jaxpr, from_g: list[bool], found: list[bool]) -> list[bool]:
  """Which of ``jaxpr``'s outputs depend on the cotangent; appends, for each loop inside (at any
  depth), whether all of its initial carries do."""
  dep = {v for v, d in zip(jaxpr.invars, from_g) if d}
  for eqn in jaxpr.eqns:
    ins = [not isinstance(v, jax.extend.core.Literal) and v in dep for v in eqn.invars]
    name = eqn.primitive.name
    if name in ('scan', 'while'):
      if name == 'scan':
        first, body = eqn.params['num_consts'], eqn.params['jaxpr'].jaxpr
        found.append(all(ins[first:first + eqn.params['num_carry']]))
      else:
        body = eqn.params['body_jaxpr'].jaxpr
        found.append(all(ins[eqn.params['cond_nconsts'] + eqn.params['body_nconsts']:]))
      _loop_starts(body, [True] * len(body.invars), found)   # loops nested in the body
      outs = [any(ins)] * len(eqn.outvars)
    else:   # jit, checkpoint, custom rules: followed inside
      inner = _body(eqn)
      outs = ([any(ins)] * len(eqn.outvars) if inner is None
              else _loop_starts(inner, ins, found))
    dep.update(v for v, d in zip(eqn.outvars, outs) if d)
  return [not isinstance(v, jax.extend.core.Literal) and v in dep for v in jaxpr.outvars]


def _loops_of_pullback(f, *args) -> list[bool]:
  out, pullback = jax.vjp(f, *args)
  jaxpr = jax.make_jaxpr(pullback)(jnp.ones_like(out)).jaxpr
  found = []
  _loop_starts(jaxpr, [True] * len(jaxpr.invars), found)
  return found


CASES = {
    # 512 rows in chunks of 128
    'gelu_dense': (lambda h, w, b: gelu_dense(h, w, b, False),
                   (_normal(2, 256, 64, seed=1), _normal(64, 32, seed=2), _normal(32, seed=3))),
    'swiglu_mlp': (swiglu_mlp, (_normal(2, 256, 32, seed=1), _normal(32, 64, seed=2),
                                _normal(32, 64, seed=3), _normal(64, 32, seed=4))),
    # 128 query rows in chunks of 64
    'dense attention': (lambda q, k, v: attention(q, k, v, causal=True, dropout_rate=0.0,
                                                  deterministic=True, rng=None,
                                                  implementation='dense'),
                        (_normal(2, 128, 4, 8, seed=1), _normal(2, 128, 2, 8, seed=2),
                         _normal(2, 128, 2, 8, seed=3))),
    'blockwise attention': (lambda q, k, v: blockwise_attention(q, k, v, NO_KEY, causal=True,
                                                                block_q=4, block_k=4),
                            (_normal(2, 16, 4, 8, seed=1), _normal(2, 16, 2, 8, seed=2),
                             _normal(2, 16, 2, 8, seed=3))),
}


@pytest.mark.parametrize('name', CASES)
def test_every_backward_loop_starts_from_the_cotangent(name):
  f, args = CASES[name]
  starts = _loops_of_pullback(f, *args)
  assert starts, f'{name}: its backward pass runs no loop'
  assert all(starts), f'{name}: a backward loop starts from constants: {starts}'


def test_the_check_sees_a_constant_start():
  """The check itself: a pullback whose loop starts from constant zeros fails it."""
  @jax.custom_vjp
  def f(x):
    return x * 2.0

  def bwd(_, g):
    total, _ = jax.lax.scan(lambda c, row: (c + 2.0 * row, None), jnp.zeros(g.shape[1:]), g)
    return (jnp.broadcast_to(total, g.shape),)
  f.defvjp(lambda x: (f(x), None), bwd)
  assert _loops_of_pullback(f, _normal(4, 3)) == [False]
