"""The optimizer step applied layer by layer in the backward pass of a layer stack.

A train step built from ``jax.grad`` holds every layer's weight gradient at
once: the backward scan writes them into one ``[N, ...]`` buffer per parameter
that XLA allocates before the loop, while the stacked activations saved for
backward are freed only after it. That buffer is the size of the stack's
parameters (a float32 ViT-B/16: 328 MiB). :func:`fused_update` instead runs the
stack's backward as its own reverse loop and, as each layer's gradient is
ready, applies the optimizer to that layer's parameters and optimizer state in
place, so at most one layer's gradient exists at a time. Under a segmented
policy the backward loop reruns each segment from its saved input and then
runs that segment's layers backward the same way.

Semantics. ``tx`` is applied to each layer as if that layer's parameters were
the whole model, and once more to the parameters outside the stack. For
elementwise transformations (``optax.adamw``, ``adam``, ``sgd`` with momentum,
``lion``, weight decay, schedules) that is exactly the update of the ordinary
step. A transformation
that reads all gradients at once does not see them all:
``optax.clip_by_global_norm`` inside ``tx`` clips each layer's gradient by that
layer's own norm (and the outer parameters' by theirs), so the update differs
from a whole-model clip whenever a norm exceeds the threshold. The loss and
gradients are those of the ordinary step; only their use differs.

The parameter tree is the usual one: the stacked ``[N, ...]`` leaves of
:func:`remat.scan_layers` and the linen / NNX stacks, and the same
optimizer state as ``tx.init`` of them, so a checkpoint moves between this step
and an ordinary one. Policies: per-layer rules and segmentings (``sqrt``,
``seg:K`` with a shorter last segment); mixes are refused.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.extend
import jax.numpy as jnp
import optax

from remat.layout import lean_saveable
from remat.policies import Policy, PolicyError, get_policy
from remat.unrolled_parts import zero_after

_IN_BACKWARD = contextvars.ContextVar('remat_fused_backward', default=False)


def read_after(x, value):
  """``x``, read only once ``value`` exists, inside :func:`fused_update`'s backward pass.

  For derivative rules: ``q = read_after(q, dO)`` in a custom VJP's backward makes
  every use of ``q`` wait for ``dO`` (``x`` plus a zero made from ``value[0]``, 0 for
  NaN and inf too; one add XLA fuses into the reader). XLA's CPU schedule otherwise
  prepares a layer's backward pass from its residuals as soon as they are read,
  holding those copies through the rest of the layer's backward pass. Elsewhere (an
  ordinary step) it returns ``x`` unchanged: there the hint was measured to help some
  plans and hurt others (GPT-2 small's H200 plan of ``dots_no_batch``: +174 MiB).
  """
  if not _IN_BACKWARD.get():
    return x
  zero = _zero_after(value)
  return jax.tree_util.tree_map(lambda a: a + zero.astype(a.dtype), x)


def _zero_after(*trees):
  """A float32 zero computed from every leaf of ``trees``, so it exists only after all of them.

  Built from :func:`remat.unrolled_parts.zero_after` (a clamp of one element's bits),
  it is 0 for NaN and inf too: ``0 * value[0]`` made every tied value NaN when the
  first element of ``value`` was not finite.
  """
  leaves = jax.tree_util.tree_leaves(trees)
  return sum(zero_after(a) for a in leaves).astype(jnp.float32)


@contextlib.contextmanager
def _in_backward():
  token = _IN_BACKWARD.set(True)
  try:
    yield
  finally:
    _IN_BACKWARD.reset(token)


class FusedUpdateError(ValueError):
  """Parameters, optimizer state or a policy that the fused step cannot use; one line."""


class FusedUpdate(NamedTuple):
  """``init(outer, stacked) -> opt_state`` and the fused train step.

  ``step(outer, stacked, opt_state, *batch) -> (outer, stacked, opt_state, loss)``:
  one forward pass, the loss, and a backward pass that updates the stack's
  parameters as it goes (module docstring). Jit it donating the first three
  arguments so the updates are written in place.
  """
  init: Callable[[Any, Any], Any]
  step: Callable[..., tuple]


def _runs(num_layers: int, policy: Policy) -> list[tuple[int, int, int]]:
  """(first layer, segments, layers per segment) runs; unsegmented: one run of N one-layer parts."""
  size = policy.segment_size(num_layers)
  if size is None:
    return [(0, num_layers, 1)]
  full, rest = divmod(num_layers, size)
  runs = [(0, full, size)]
  if rest:
    runs.append((full * size, 1, rest))
  return runs


def _slice(tree, start, size: int | None):
  """Layer ``start`` (``size`` None: the leading axis dropped) or layers ``start:start+size``."""
  if size is None:
    return jax.tree_util.tree_map(lambda a: jax.lax.dynamic_index_in_dim(a, start, 0, False), tree)
  return jax.tree_util.tree_map(lambda a: jax.lax.dynamic_slice_in_dim(a, start, size), tree)


def _split_state(opt_state, num_layers: int):
  """Optimizer-state leaves, their treedef, and which are per layer ([N, ...]) vs shared scalars."""
  leaves, treedef = jax.tree_util.tree_flatten(opt_state)
  for leaf in leaves:
    shape = jnp.shape(leaf)
    if shape and shape[0] != num_layers:
      raise FusedUpdateError(
          f'fused_update: an optimizer-state leaf of shape {tuple(shape)} is neither per layer '
          f'([{num_layers}, ...], like the stacked parameters) nor a scalar; use an elementwise '
          'optax transformation (adamw, adam, sgd, lion)')
  return leaves, treedef, [bool(jnp.shape(leaf)) for leaf in leaves]


def _merge_state(treedef, per_layer, layered, shared):
  """The optimizer state from its per-layer and shared leaves (the inverse of the split)."""
  it_l, it_s = iter(layered), iter(shared)
  return jax.tree_util.tree_unflatten(treedef,
                                      [next(it_l) if p else next(it_s) for p in per_layer])


def fused_update(pre_fn: Callable, layer_fn: Callable, post_fn: Callable,
                 tx: optax.GradientTransformation, *, policy: str | Policy = 'none') -> FusedUpdate:
  """A train step that applies ``tx`` to each layer of a stack during the backward pass.

  The model is ``pre_fn -> N x layer_fn -> post_fn``::

      x = pre_fn(outer, *batch)              # e.g. embeddings
      x = layer_fn(stacked[i], x)            # i = 0 .. N-1, stacked leaves [N, ...]
      loss = post_fn(outer, x, *batch)       # e.g. final norm, head and loss

  ``outer`` holds every parameter outside the stack (``pre_fn`` and ``post_fn``
  may share some, such as tied embeddings: their gradients are summed).

  Args:
    pre_fn: ``pre_fn(outer, *batch) -> x``.
    layer_fn: ``layer_fn(layer_params, x) -> x`` (the :func:`remat.scan_layers`
      convention; close over constants).
    post_fn: ``post_fn(outer, x, *batch) -> scalar loss``.
    tx: the optimizer; see the module docstring for what a per-layer update means.
    policy: a spec or :class:`Policy` for the stack (not a mix).

  Returns:
    A :class:`FusedUpdate`.

  Raises:
    PolicyError: an unknown spec, or a mix.
    FusedUpdateError: (when the step is traced) an optimizer-state leaf that is
      not per layer, or stacked parameters with different layer counts.
  """
  policy = get_policy(policy)
  if policy.mixed:
    raise PolicyError(f"fused_update takes one rule for the whole stack; '{policy.spec}' is a mix")

  def init(outer, stacked):
    return tx.init(outer), tx.init(stacked)

  def step(outer, stacked, opt_state, *batch):
    outer_state, stack_state = opt_state
    num_layers = _num_layers(stacked)
    leaves, treedef, per_layer = _split_state(stack_state, num_layers)
    shared = [leaf for leaf, p in zip(leaves, per_layer) if not p]
    layered = [leaf for leaf, p in zip(leaves, per_layer) if p]

    def unit_state(layered_part):
      return _merge_state(treedef, per_layer, layered_part, shared)

    rule = policy._layer_policy() or lean_saveable   # `none` is the stack's lean none
    one = jax.checkpoint(layer_fn, policy=rule, prevent_cse=False)  # inside scans only
    x, pre_vjp = jax.vjp(lambda o: pre_fn(o, *batch), outer)
    update = _Update(tx, unit_state, per_layer, _state_owner(stack_state, stacked, per_layer),
                     _backward_order(layer_fn, stacked, x))
    runs = _runs(num_layers, policy)
    saved = []
    for first, count, size in runs:
      if policy.segmented:   # keep each segment's input; the backward pass reruns the segment
        x, inputs = _segments_forward(layer_fn, stacked, x, first, count, size)
        saved.append((inputs, None))
      else:
        x, residuals, layout = _layers_forward(one, stacked, x, first, count)
        saved.append((residuals, layout))
    loss, post_vjp = jax.vjp(lambda o, y: post_fn(o, y, *batch), outer, x)
    d_outer, dx = post_vjp(jnp.ones_like(loss))
    carry = (dx, stacked, layered, list(shared))
    for (first, count, size), (kept, layout) in reversed(list(zip(runs, saved))):
      if policy.segmented:
        carry = _segments_backward(one, update, carry, kept, first, count, size)
      else:
        carry = _layers_backward(update, carry, kept, layout, first, count)
    dx, stacked, layered, new_shared = carry
    (d_pre,) = _after(pre_vjp, dx, outer)(dx)
    d_outer = jax.tree_util.tree_map(jnp.add, d_outer, d_pre)
    updates, outer_state = tx.update(d_outer, outer_state, outer)
    outer = optax.apply_updates(outer, updates)
    stack_state = _merge_state(treedef, per_layer, layered, new_shared)
    return outer, stacked, (outer_state, stack_state), loss

  return FusedUpdate(init, step)


def _after(vjp_fn, value, params):
  """``vjp_fn`` whose residuals (other than ``params``) are tied to ``value``: read only after it.

  XLA may prepare a backward pass as soon as its residuals exist: ViT-B/16's patch embedding
  had a transposed copy of the images made in the forward pass and held through the whole
  stack's backward (4.59 MiB). Adding a zero made from ``value`` (the stack's input gradient;
  :func:`_zero_after`) makes each such residual depend on it, at the cost of one add XLA fuses
  into its reader.
  """
  own = {id(p) for p in jax.tree_util.tree_leaves(params)}
  zero = _zero_after(value)
  leaves, treedef = jax.tree_util.tree_flatten(vjp_fn)
  tied = [leaf + zero.astype(leaf.dtype)
          if id(leaf) not in own and jnp.issubdtype(jnp.result_type(leaf), jnp.floating) else leaf
          for leaf in leaves]
  return jax.tree_util.tree_unflatten(treedef, tied)


def _num_layers(stacked) -> int:
  sizes = {jnp.shape(a)[0] if jnp.ndim(a) else None for a in jax.tree_util.tree_leaves(stacked)}
  if len(sizes) != 1 or None in sizes:
    raise FusedUpdateError('fused_update: every stacked parameter needs the same leading layer '
                           f'axis, got leading sizes {sorted(map(str, sizes))}')
  return sizes.pop()


class _Update:
  """``tx`` on one layer: its gradient, parameters and optimizer-state slice, written in place."""

  def __init__(self, tx, unit_state, per_layer, state_owner, order):
    self.tx, self.unit_state, self.per_layer = tx, unit_state, per_layer
    self.state_owner, self.order = state_owner, order

  def __call__(self, grads, params_all, layered_all, index):
    """Returns ``(params_all, layered_all, new shared scalars)`` with layer ``index`` updated."""
    def new_values(p_all, l_all):
      params = _slice(p_all, index, None)
      state = self.unit_state(_slice(l_all, index, None))
      updates, new_state = self.tx.update(grads, state, params)
      new_params = optax.apply_updates(params, updates)
      return jax.tree_util.tree_leaves(new_params) + jax.tree_util.tree_leaves(new_state)

    n_params = len(jax.tree_util.tree_leaves(params_all))
    shapes = jax.eval_shape(new_values, params_all, layered_all)
    layered_at = {}   # output position -> position in layered_all
    for pos, p in enumerate(self.per_layer):
      if p:
        layered_at[n_params + pos] = len(layered_at)
    shared_at = [n_params + pos for pos, p in enumerate(self.per_layer) if not p]
    # Each group is one loop; its outputs are written before the next group's loop starts.
    # A one-iteration loop, so a leaf's new values exist before any stacked buffer is
    # written: fused into the writes, they read slices of buffers that other writes change,
    # and XLA then copies whole [N, ...] buffers each iteration (measured on CPU: +523 MiB for
    # ViT-B/16). A loop per large parameter (with its optimizer-state leaves) holds one
    # parameter's new values at a time rather than the whole layer's (ViT-B/16: 27 MiB
    # rather than 54 at the peak of `dots`). The loop's buffers start as zeros that depend on
    # every leaf of the gradient and on the previous group's result, so XLA allocates them
    # only when they are needed (a constant start was allocated at the top of the layer's
    # backward: +54 to +80 MiB at ViT-B/16's peak). The CPU options keep such loops;
    # elsewhere XLA inlines them, and the H200 plan was measured the same with and without.
    groups = _groups(shapes, n_params, self.state_owner, self.order)
    zero = _zero_after(grads)
    p_leaves, p_def = jax.tree_util.tree_flatten(params_all)
    l_leaves = list(layered_all)
    shared = [None] * len(shared_at)
    for group in groups:
      start = [jnp.full(shapes[i].shape, zero, shapes[i].dtype) for i in group]

      def body(c, _, group=group):
        p_tree, l_all, _ = c
        out = new_values(p_tree, l_all)
        return (p_tree, l_all, [out[i] for i in group]), None
      (params_tree, l_leaves, outs), _ = jax.lax.scan(
          body, (jax.tree_util.tree_unflatten(p_def, p_leaves), l_leaves, start), None, length=1)
      p_leaves = jax.tree_util.tree_leaves(params_tree)
      for i, value in zip(group, outs):
        if i < n_params:
          p_leaves[i] = jax.lax.dynamic_update_index_in_dim(p_leaves[i], value, index, 0)
        elif i in layered_at:
          j = layered_at[i]
          l_leaves[j] = jax.lax.dynamic_update_index_in_dim(l_leaves[j], value, index, 0)
        else:
          shared[shared_at.index(i)] = value
      zero = zero + _zero_after(outs[0])
    return jax.tree_util.tree_unflatten(p_def, p_leaves), l_leaves, shared


def _state_owner(state, params, per_layer) -> list[int | None] | None:
  """For each optimizer-state leaf, the parameter leaf it belongs to (None: a shared scalar).

  Optax states hold parameter-shaped subtrees (Adam's ``mu`` and ``nu``); their leaves belong
  to the parameter leaf at the same position. Returns None when a per-layer leaf lies outside
  such a subtree (its owner is unknown, so the layer is updated as one group).
  """
  p_def = jax.tree_util.tree_structure(params)
  is_params = lambda node: jax.tree_util.tree_structure(node) == p_def
  owner = []
  for node in jax.tree_util.tree_leaves(state, is_leaf=is_params):
    if is_params(node) and jax.tree_util.tree_leaves(node):
      owner.extend(range(len(jax.tree_util.tree_leaves(node))))
    else:
      owner.append(None)
  if len(owner) != len(per_layer) or any(o is None and p for o, p in zip(owner, per_layer)):
    return None
  return owner


def _backward_order(layer_fn, stacked, x) -> list[int]:
  """Parameter leaves in the order the backward pass makes their gradients: last used first."""
  params = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), stacked)
  x = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), x)
  jaxpr = jax.make_jaxpr(layer_fn)(params, x).jaxpr
  n = len(jax.tree_util.tree_leaves(params))
  first = {}
  for pos, eqn in enumerate(jaxpr.eqns):
    for v in eqn.invars:
      if not isinstance(v, jax.extend.core.Literal):
        first.setdefault(v, pos)
  use = [first.get(v, -1) for v in jaxpr.invars[:n]]
  return sorted(range(n), key=lambda i: -use[i])


def _groups(shapes, n_params: int, owner, order) -> list[list[int]]:
  """Output positions in update groups: each large parameter with its state leaves, then the rest.

  ``owner[k]`` is the parameter index that state leaf ``k`` belongs to (None: shared or unknown);
  with any per-layer state leaf of unknown owner, everything is one group. Large parameters come
  in ``order`` (the order their gradients are made), so each group can run as soon as its
  gradient exists.
  """
  size = lambda i: math.prod(shapes[i].shape) * shapes[i].dtype.itemsize
  if owner is None:
    return [list(range(len(shapes)))]
  largest = max(size(i) for i in range(n_params))
  big = [i for i in order if size(i) * 4 >= largest]
  rest = [i for i in range(n_params) if i not in big]
  groups = []
  for i in big + [None]:
    members = rest if i is None else [i]
    group = list(members) + [n_params + k for k, o in enumerate(owner) if o in members]
    if i is None:   # the shared scalars (step counts) with the last group
      group += [n_params + k for k, o in enumerate(owner) if o is None]
    if group:
      groups.append(group)
  return groups


def _layers_forward(one, stacked, x, first, count: int):
  """Runs layers ``first .. first+count-1``; returns ``(x, stacked residuals, layout)``.

  A layer's VJP is a pytree whose leaves are its residuals. Leaves that are the
  layer's own parameters are not stacked again (the backward pass reads them
  from the parameters); ``layout`` records where each leaf comes from.
  """
  layout = {}

  def body(h, i):
    params = _slice(stacked, first + i, None)
    y, vjp_fn = jax.vjp(one, params, h)
    leaves, layout['treedef'] = jax.tree_util.tree_flatten(vjp_fn)
    own = {id(p): j for j, p in enumerate(jax.tree_util.tree_leaves(params))}
    kept, where = [], []
    for leaf in leaves:
      if id(leaf) in own:
        where.append((True, own[id(leaf)]))
      else:
        where.append((False, len(kept)))
        kept.append(leaf)
    layout['where'] = where
    return y, kept

  x, residuals = jax.lax.scan(body, x, jnp.arange(count))
  return x, residuals, layout


def _layers_backward(update, carry, residuals, layout, first, count: int):
  """Reverse loop over layers ``first+count-1 .. first``: VJP, then the update of the layer."""

  def body(carry, inp):
    dy, params_all, layered_all, _ = carry
    i, kept = inp
    index = first + i
    params = _slice(params_all, index, None)
    own = jax.tree_util.tree_leaves(params)
    leaves = [own[j] if is_param else kept[j] for is_param, j in layout['where']]
    with _in_backward():
      grads, dx = jax.tree_util.tree_unflatten(layout['treedef'], leaves)(dy)
    params_all, layered_all, new_shared = update(grads, params_all, layered_all, index)
    return (dx, params_all, layered_all, new_shared), None

  carry, _ = jax.lax.scan(body, carry, (jnp.arange(count), residuals), reverse=True)
  return carry


def _segments_forward(layer_fn, stacked, x, first: int, count: int, size: int):
  """Runs ``count`` segments of ``size`` layers, keeping only each segment's input."""

  def segment(h, s):
    params = _slice(stacked, first + s * size, size)
    return jax.lax.scan(lambda c, p: (layer_fn(p, c), None), h, params)[0], h

  return jax.lax.scan(segment, x, jnp.arange(count))


def _segments_backward(one, update, carry, inputs, first: int, count: int, size: int):
  """Reverse loop over segments: rerun a segment from its input, then its layers' backward."""

  def body(carry, inp):
    s, x = inp
    start = first + s * size
    _, residuals, layout = _layers_forward(one, carry[1], x, start, size)
    return _layers_backward(update, carry, residuals, layout, start, size), None

  carry, _ = jax.lax.scan(body, carry, (jnp.arange(count), inputs), reverse=True)
  return carry
