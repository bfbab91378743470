"""SwiGLU with lean derivatives: the down projection's and the whole MLP's backward rules.

:func:`swiglu_down` keeps ``gate`` and ``up`` alone for the backward pass;
:func:`swiglu_mlp` runs the MLP's backward pass over chunks of rows. Both give
the values of the ops written out; :mod:`models.llama` applies them.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from models.chunking import row_chunks, zeros_after


@jax.custom_jvp
def swiglu_down(gate, up, kernel):
  """SwiGLU's down projection ``(silu(gate) * up) @ kernel``, keeping only ``gate`` and ``up``.

  Same values as the ops written out. Differentiated as written, the backward
  pass would keep six ``[.., F]`` arrays per layer (``gate``, ``up``,
  ``sigmoid(gate)``, its slope, ``silu(gate)`` and the product, the matmul's
  input for its weight gradient), where PyTorch keeps four (``gate``,
  ``silu(gate)``, ``up``, the product). This rule keeps ``gate`` and ``up``
  alone: its tangent is a ``jax.checkpoint`` that rebuilds the rest from them,
  elementwise, in the backward pass; no matmul is recomputed. The forward
  matmul stays a plain ``dot_general``, so ``dots`` policies still see (and
  may save) its output.
  """
  return _swiglu_down_apply(gate, up, kernel)


def _swiglu_down_apply(gate, up, kernel):
  return jnp.dot(gate * jax.nn.sigmoid(gate) * up, kernel)   # nn.silu(gate) * up, as HF


@functools.partial(jax.checkpoint, prevent_cse=False)
def _swiglu_down_tangent(gate, up, kernel, d_gate, d_up, d_kernel):
  # A checkpoint saves its inputs alone. prevent_cse=False: the forward's silu(gate) lives in
  # another loop (or the same recompute), so XLA's CSE cannot stretch its lifetime.
  sig = jax.nn.sigmoid(gate)
  silu = gate * sig
  # silu'(g) = s + g s (1 - s) = s (1 + g (1 - s))
  d_hidden = sig * (1 + gate * (1 - sig)) * d_gate * up + silu * d_up
  return jnp.dot(d_hidden, kernel) + jnp.dot(silu * up, d_kernel)


@swiglu_down.defjvp
def _swiglu_down_jvp(primals, tangents):
  gate, up, kernel = primals
  return _swiglu_down_apply(gate, up, kernel), _swiglu_down_tangent(gate, up, kernel, *tangents)


def _mlp_forward(x, wg, wu, wd):
  gate = checkpoint_name(jnp.dot(x, wg), 'mlpwi_0')
  up = checkpoint_name(jnp.dot(x, wu), 'mlpwi_1')
  return _swiglu_down_apply(gate, up, wd), gate, up


@jax.custom_vjp
def swiglu_mlp(x, wg, wu, wd):
  """SwiGLU ``(silu(x @ wg) * (x @ wu)) @ wd``, with a backward pass over chunks of rows.

  Same values as the ops written out, and the same matmuls in both passes.
  The backward pass keeps ``x``, ``gate`` and ``up`` (tagged ``mlpwi_0``,
  ``mlpwi_1``: the matmul outputs a policy may save or recompute, as
  before) and runs over :data:`models.chunking.BACKWARD_ROWS` rows at a time: each
  chunk rebuilds ``silu(gate)`` and its slope elementwise, computes its
  rows of every ``[.., F]`` derivative and of ``dx``, and adds its share to
  the three weight gradients. Differentiated whole, XLA's CPU plan of one
  layer's backward pass held nine ``[B*T, F]`` buffers at once (the
  elementwise values, ``d_gate``, ``d_up`` and a transposed copy of each
  for the weight-gradient matmuls); per chunk they are a few
  ``[models.chunking.BACKWARD_ROWS, F]`` ones. No matmul is added: the weight gradients
  are the same products summed over chunks.
  """
  return _mlp_forward(x, wg, wu, wd)[0]


def _swiglu_mlp_fwd(x, wg, wu, wd):
  out, gate, up = _mlp_forward(x, wg, wu, wd)
  return out, (x, wg, wu, wd, gate, up)


def _swiglu_mlp_bwd(res, g):
  x, wg, wu, wd, gate, up = res
  rows = math.prod(x.shape[:-1])
  n = row_chunks(rows)
  split = lambda a: a.reshape(n, rows // n, a.shape[-1])
  contract_rows = (((0,), (0,)), ((), ()))

  def step(carry, chunk):
    dxs, acc = carry
    i, xc, gc, uc, gg = chunk
    sig = jax.nn.sigmoid(gc)
    silu = gc * sig
    d_wd = jax.lax.dot_general(silu * uc, gg, contract_rows, preferred_element_type=jnp.float32)
    dh = jnp.dot(gg, wd.T)
    d_up = dh * silu
    # silu'(g) = s + g s (1 - s) = s (1 + g (1 - s))
    d_gate = dh * uc * (sig * (1 + gc * (1 - sig)))
    dx = jnp.dot(d_gate, wg.T) + jnp.dot(d_up, wu.T)
    d_wg = jax.lax.dot_general(xc, d_gate, contract_rows, preferred_element_type=jnp.float32)
    d_wu = jax.lax.dot_general(xc, d_up, contract_rows, preferred_element_type=jnp.float32)
    sums = tuple(a + d for a, d in zip(acc, (d_wg, d_wu, d_wd)))
    return (jax.lax.dynamic_update_index_in_dim(dxs, dx.astype(dxs.dtype), i, 0), sums), None

  # zeros_after, not constant zeros, nor dx as a scan output (which JAX starts as constant
  # zeros): see models.chunking.zeros_after.
  init = (zeros_after(split(x).shape, x.dtype, g),
          tuple(zeros_after(w.shape, jnp.float32, g) for w in (wg, wu, wd)))
  (dx, (d_wg, d_wu, d_wd)), _ = jax.lax.scan(
      step, init, (jnp.arange(n), split(x), split(gate), split(up), split(g)))
  return (dx.reshape(x.shape), d_wg.astype(wg.dtype), d_wu.astype(wu.dtype),
          d_wd.astype(wd.dtype))


swiglu_mlp.defvjp(_swiglu_mlp_fwd, _swiglu_mlp_bwd)
