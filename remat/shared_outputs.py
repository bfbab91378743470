"""Per-layer outputs that are the carry, kept once: a U-Net's skips without a second copy.

A layer that returns its output as its per-layer output (``return y, y``: a
U-Net's down path handing each block's output to the up path as a skip), or
its input (``return y, x``), asks the stack for a value it already keeps: the
backward pass needs every layer's input, which is the previous layer's
output. Under ``jax.grad`` of a plain ``lax.scan`` the two are two stacked
buffers, ``[N, ...]`` each, because JAX's partial evaluation of the scan makes
the saved inputs and the returned outputs separate loop outputs even where
they are the same value. A U-Net with skips at 8 x 256 x 128 (float32): one
MiB more under every policy, measured with :func:`remat.explain`.

:func:`scan` runs such a stack with its own derivative rule: the forward loop
keeps, per layer, what the layer's rule saves (``jax.vjp`` of the
checkpointed layer) *except* the values that are also the stack's outputs or
inputs (the carry, the layer's slice of ``xs``, values shared by every
layer), and the backward loop reads those back from the outputs. Everything
else (the rule, what is recomputed, the gradients) is that of the plain scan.
It is used only when a layer's per-layer output is its carry, so every other
stack keeps JAX's own derivative. Like any ``jax.custom_vjp``, such a stack
supports reverse-mode differentiation only (``jax.grad``, ``jax.vjp``), not
``jax.jvp``.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from remat.unrolled_parts import inexact, residual_origins, zero_cotangent


def shared_leaves(step: Callable, x, xs_0) -> dict[int, tuple[str, int]]:
  """Which per-layer output leaves of ``step`` are its carry: ys leaf -> ('in'|'out', carry leaf).

  Traced on the step without checkpoints (a checkpoint's outputs are new
  values even where the function returns the same one twice). 'out': the leaf
  is the layer's output carry leaf; 'in': it is the layer's input carry leaf.
  """
  n_carry = len(jax.tree_util.tree_leaves(x))
  jaxpr = jax.make_jaxpr(step)(x, xs_0).jaxpr
  carry_in = jaxpr.invars[:n_carry]
  carry_out, ys = jaxpr.outvars[:n_carry], jaxpr.outvars[n_carry:]
  out = {}
  for i, v in enumerate(ys):
    if isinstance(v, jax.extend.core.Literal):
      continue
    for j, c in enumerate(carry_out):
      if v is c and _same_aval(jaxpr, j):
        out[i] = ('out', j)
        break
    else:
      for j, c in enumerate(carry_in):
        if v is c:
          out[i] = ('in', j)
          break
  return out


def _same_aval(jaxpr, j: int) -> bool:
  # A one-layer stack may change the carry's shape; only equal input and output carries chain.
  return jaxpr.invars[j].aval.shape == jaxpr.outvars[j].aval.shape


def scan(step: Callable, x, xs, length: int, shares: dict[int, tuple[str, int]]):
  """``lax.scan(step, x, xs)`` whose per-layer outputs in ``shares`` are not kept twice.

  Args:
    step: one layer (checkpointed with its rule): ``step(x, xs_i) -> (x, ys_i)``.
    x: the carry.
    xs: per-layer inputs stacked ``[length, ...]``.
    length: the number of layers.
    shares: from :func:`shared_leaves`.

  Returns:
    ``(x, ys)`` as from ``lax.scan``.
  """
  converted, consts = jax.closure_convert(step, x, jax.tree_util.tree_map(lambda a: a[0], xs))
  # The carry leaves the backward loop can read back from the outputs, and from where.
  source = {j: (kind, i) for i, (kind, j) in shares.items()}
  layout = {}  # filled when the forward loop is traced: where each residual leaf comes from

  def run(x, xs, consts):
    return jax.lax.scan(lambda c, xs_i: converted(c, xs_i, *consts), x, xs)

  def forward(x, xs, consts):
    def body(c, xs_i):
      out, pull = jax.vjp(lambda c, xs_i, k: converted(c, xs_i, *k), c, xs_i, consts)
      leaves, layout['tree'] = jax.tree_util.tree_flatten(pull)
      known = ([(('c', j), a) for j, a in enumerate(jax.tree_util.tree_leaves(c)) if j in source]
               + [(('x', j), a) for j, a in enumerate(jax.tree_util.tree_leaves(xs_i))]
               + [(('k', j), a) for j, a in enumerate(jax.tree_util.tree_leaves(consts))])
      layout['where'], kept = residual_origins(leaves, known)
      return out[0], (out[1], kept)
    x_out, (ys, kept) = jax.lax.scan(body, x, xs)
    ys_leaves = jax.tree_util.tree_leaves(ys)
    outputs = {i: ys_leaves[i] for i in shares}
    return (x_out, ys), (x, xs, consts, outputs, kept)

  def backward(res, cts):
    x0, xs, consts, outputs, kept = res
    ct_x, ct_ys = cts
    x0_leaves = jax.tree_util.tree_leaves(x0)

    def carry_leaf(j, i):
      kind, y = source[j]
      if kind == 'in':
        return jax.lax.dynamic_index_in_dim(outputs[y], i, keepdims=False)
      prev = jax.lax.dynamic_index_in_dim(outputs[y], jnp.maximum(i - 1, 0), keepdims=False)
      return jnp.where(i == 0, x0_leaves[j], prev)

    k_leaves, k_def = jax.tree_util.tree_flatten(consts)
    xs_def = jax.tree_util.tree_structure(xs)
    xs_float = [inexact(a) for a in jax.tree_util.tree_leaves(xs)]
    k_float = [inexact(a) for a in k_leaves]

    def body(carry, inp):
      ct_c, ct_k = carry
      i, xs_i, kept_i, ct_ys_i = inp
      xs_leaves = jax.tree_util.tree_leaves(xs_i)
      leaves = []
      for kind, j in layout['where']:
        leaves.append({'r': lambda: kept_i[j], 'c': lambda: carry_leaf(j, i),
                       'x': lambda: xs_leaves[j], 'k': lambda: k_leaves[j]}[kind]())
      pull = jax.tree_util.tree_unflatten(layout['tree'], leaves)
      ct_c_in, ct_xs_i, ct_k_i = pull((ct_c, ct_ys_i))
      # Integer and key leaves get float0 cotangents, which a loop neither carries nor stacks.
      ct_k_i = [a for a, f in zip(jax.tree_util.tree_leaves(ct_k_i), k_float) if f]
      ct_k = [a + b for a, b in zip(ct_k, ct_k_i)]
      ct_xs_i = [a for a, f in zip(jax.tree_util.tree_leaves(ct_xs_i), xs_float) if f]
      return (ct_c_in, ct_k), ct_xs_i

    ct_k0 = [jnp.zeros_like(a) for a, f in zip(k_leaves, k_float) if f]
    (ct_x0, ct_k), ct_xs = jax.lax.scan(
        body, (ct_x, ct_k0), (jnp.arange(length), xs, kept, ct_ys), reverse=True)
    ct_k, ct_xs = iter(ct_k), iter(ct_xs)
    xs_leaves = jax.tree_util.tree_leaves(xs)
    ct_k = [next(ct_k) if f else zero_cotangent(a) for a, f in zip(k_leaves, k_float)]
    ct_xs = [next(ct_xs) if f else zero_cotangent(a) for a, f in zip(xs_leaves, xs_float)]
    return (ct_x0, jax.tree_util.tree_unflatten(xs_def, ct_xs),
            jax.tree_util.tree_unflatten(k_def, ct_k))

  fn = jax.custom_vjp(run)
  fn.defvjp(forward, backward)
  return fn(x, xs, consts)
