"""The one implementation of a policy over a stack of layers, in plain JAX.

Every front door (:func:`scan_layers` here, :class:`remat.LayerStack` for
linen, :class:`remat.NNXStack` for NNX) reduces its stack to
:func:`segmented_scan`: a ``lax.scan`` over layers whose per-layer slices
(parameters, dropout keys, mutable state) are stacked ``[N, ...]``. The
policy decides the loop nest:

* per layer: one scan of N layers, each in ``jax.checkpoint`` with the rule;
  ``none`` keeps every value an expensive operation produced and rebuilds the
  cheap elementwise ones in the backward pass (:func:`remat.layout.lean_saveable`),
  as XLA's fusion does in an unrolled model, where a plain scan would
  materialise all of them as ``[N, ...]`` loop outputs;
* segmented (``sqrt``, ``seg:K``, ``stage``): a scan over N // K segments,
  each in ``jax.checkpoint(policy=nothing_saveable)`` so only its input is
  saved, the per-layer rule (for ``none`` the lean one) applied inside it,
  then one remainder segment of N % K layers.

``prevent_cse=False`` only inside a loop of length > 1; a loop of one
iteration (a one-layer stack, a remainder, a ``stage`` segment) is still a
length-1 scan with ``prevent_cse=True``. XLA's while-loop simplifier inlines
such loops, after which the CPU backend drops their checkpoints unless the
step is compiled with :data:`remat.targets.CPU_COMPILER_OPTIONS`
(docs/own-model.md has the measurements); GPU pipelines keep them.

The front doors also check the stack against the policy when it is traced:
segment sizes outside 1..N and ``names:``/``offload:`` tags that one layer
does not emit fail with the one-line :class:`~remat.policies.PolicyError`.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import jax
import jax.numpy as jnp

from remat.layout import lean_saveable, run_unrolled, unrolled_active
from remat.policies import Policy, PolicyError, get_policy
from remat.tags import iter_eqns

_nothing = jax.checkpoint_policies.nothing_saveable


class StackSignatureError(TypeError):
  """A layer whose signature or result does not fit the stack helper; the message is one line."""


def _first(tree):
  return jax.tree_util.tree_map(lambda a: a[0], tree)


def _add_axis(tree):
  return jax.tree_util.tree_map(lambda a: a[None], tree)


def _layer(step: Callable, rule, prevent_cse: bool) -> Callable:
  return step if rule is None else jax.checkpoint(step, policy=rule, prevent_cse=prevent_cse)


def _run_layers(step: Callable, x, xs, length: int, rule):
  """``lax.scan(step, x, xs)`` over ``length`` layers, each under ``rule``."""
  # prevent_cse=False is safe only inside a loop that stays a loop; XLA inlines length-1 ones.
  return jax.lax.scan(_layer(step, rule, prevent_cse=length == 1), x, xs)


def _run_one(body: Callable, x, xs):
  """One layer as a length-1 scan over x itself (not a carry), so it may change x's shape."""
  _, (y, ys) = jax.lax.scan(lambda c, inp: (c, body(*inp)), None, (_add_axis(x), xs))
  return _first(y), ys


def _split_stacked(tree, num_layers: int, size: int):
  """[N, ...] leaves -> ([N//K, K, ...], [N%K, ...]) leaves."""
  full = num_layers // size
  cut = full * size
  main = jax.tree_util.tree_map(lambda a: a[:cut].reshape((full, size) + a.shape[1:]), tree)
  tail = jax.tree_util.tree_map(lambda a: a[cut:], tree)
  return main, tail


def segmented_scan(step: Callable, x, xs, num_layers: int, policy: Policy):
  """Runs ``step(x, xs_i) -> (x, ys_i)`` over N layers as ``policy`` says.

  Args:
    step: one layer; ``xs_i`` is layer i's slice of ``xs``.
    x: the carry (the activations). With N == 1 the layer may change its shape.
    xs: a pytree of per-layer inputs stacked ``[N, ...]`` (may be empty).
    num_layers: N.
    policy: the policy; a segment larger than N is one segment of N (the
      front doors check the size first unless told not to).

  Returns:
    ``(x, ys)`` as from ``lax.scan``: ``ys`` stacked ``[N, ...]``.
  """
  if unrolled_active():  # the measuring reference: the user's loop, no checkpoint
    return run_unrolled(step, x, xs, num_layers)
  if policy.mixed:
    return _mixed_scan(step, x, xs, num_layers, policy)
  # `none` keeps what no fusion could rebuild cheaply: see remat/layout.py for why and the bytes.
  rule = policy._layer_policy() or lean_saveable
  size = policy.segment_size(num_layers)
  if num_layers == 1:
    body = _layer(step, rule, prevent_cse=True)
    if size is not None:  # one segment of one layer: saves only its input
      body = jax.checkpoint(body, policy=_nothing, prevent_cse=True)
    return _run_one(body, x, xs)
  if size is None:
    return _run_layers(step, x, xs, num_layers, rule)
  full, rest = divmod(num_layers, size)
  main, tail = _split_stacked(xs, num_layers, size)

  def segment(length: int, prevent_cse: bool) -> Callable:
    run = lambda x, seg_xs: _run_layers(step, x, seg_xs, length, rule)
    return jax.checkpoint(run, policy=_nothing, prevent_cse=prevent_cse)

  # Segments are a loop even when there is one (a `stage`), so that with
  # CPU_COMPILER_OPTIONS the CPU backend keeps its checkpoint too.
  x, ys = jax.lax.scan(segment(size, prevent_cse=full == 1), x, main)
  ys = jax.tree_util.tree_map(lambda a: a.reshape((full * size,) + a.shape[2:]), ys)
  if rest:
    x, ys_rest = jax.lax.scan(segment(rest, prevent_cse=True), x, _add_axis(tail))
    ys = jax.tree_util.tree_map(lambda a, b: jnp.concatenate([a, b[0]]), ys, ys_rest)
  return x, ys


def _mixed_scan(step: Callable, x, xs, num_layers: int, policy: Policy):
  """A mix: consecutive runs of layers, each a :func:`segmented_scan` under its own part.

  Each run reads its slice of the stacked ``xs``, so the parameter tree is the
  same as under any other policy; the price is that XLA assembles the stack's
  gradient from the runs' pieces, a copy the size of the stack's parameters
  (as for a remainder segment), which the compiled plan shows.
  """
  start, outs = 0, []
  for count, part in policy.layer_split(num_layers):
    run_xs = jax.tree_util.tree_map(lambda a, s=start, c=count: a[s:s + c], xs)
    x, ys = segmented_scan(step, x, run_xs, count, part)
    outs.append(ys)
    start += count
  if len(outs) == 1:
    return x, outs[0]
  return x, jax.tree_util.tree_map(lambda *a: jnp.concatenate(a), *outs)


# --- the checks every front door makes when its stack is traced ------------------------------


def check_signature(fn: Callable, args: tuple, kwargs: dict, expects: str) -> None:
  """Raises :class:`StackSignatureError` if ``fn`` cannot be called with these arguments."""
  try:
    sig = inspect.signature(fn)
  except (TypeError, ValueError):
    return  # a builtin or C function: let the call itself speak
  try:
    sig.bind(*args, **kwargs)
  except TypeError as e:
    raise StackSignatureError(f'{expects}; {_name(fn)}{sig} does not fit: {e}') from None


def takes_rng(fn: Callable) -> bool:
  """True if ``fn`` has a parameter named ``rng`` (or **kwargs): the stack passes it the layer's key."""
  try:
    params = inspect.signature(fn).parameters.values()
  except (TypeError, ValueError):
    return False
  return any(p.name == 'rng' for p in params)


def _name(fn) -> str:
  return getattr(fn, '__qualname__', None) or type(fn).__name__


def split_output(out, x, expects: str, *, same_shape: bool):
  """A layer's result as ``(y, aux)``: ``y`` alone if it is shaped like ``x``, else ``(y, aux)``."""
  x_def = jax.tree_util.tree_structure(x)
  if jax.tree_util.tree_structure(out) == x_def:
    y, aux = out, None
  elif isinstance(out, tuple) and len(out) == 2 and jax.tree_util.tree_structure(out[0]) == x_def:
    y, aux = out
  else:
    raise StackSignatureError(f'{expects}; the layer returned {_describe(out)} for x of '
                              f'{_describe(x)}')
  if same_shape:
    got, want = _describe(y), _describe(x)
    if got != want:
      raise StackSignatureError(f'{expects}; the layer returned y of {got} for x of {want} '
                                '(only a one-layer stack may change the shape)')
  return y, aux


def _describe(tree) -> str:
  leaves = jax.tree_util.tree_leaves(tree, is_leaf=lambda a: a is None)
  parts = ['None' if a is None else f'{getattr(a, "dtype", type(a).__name__)}'
           f'{list(getattr(a, "shape", ()))}' for a in leaves]
  return parts[0] if len(parts) == 1 else f'({", ".join(parts)})'


def _is_array(a) -> bool:
  return isinstance(a, (jax.Array, jax.ShapeDtypeStruct)) or hasattr(a, '__array__')


def trace_layer(step: Callable, x, xs_0, static: Any = None):
  """Traces one layer abstractly: returns (output shapes, emitted checkpoint names).

  Non-array leaves of ``x``/``xs_0`` (Python flags) stay static. Nothing runs.
  """
  def abstract(tree):
    return jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)) if _is_array(a) else a,
        tree)
  leaves, treedef = jax.tree_util.tree_flatten(abstract((x, xs_0)))
  where = [i for i, a in enumerate(leaves) if isinstance(a, jax.ShapeDtypeStruct)]

  def fn(*arrays):
    full = list(leaves)
    for i, a in zip(where, arrays):
      full[i] = a
    return step(*jax.tree_util.tree_unflatten(treedef, full))

  closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*[leaves[i] for i in where])
  tags = {e.params['name'] for e in iter_eqns(closed.jaxpr) if e.primitive.name == 'name'}
  return shapes, tags


def check_policy(policy, num_layers: int | None, tags: set[str] | None = None) -> Policy:
  """The policy, parsed if a spec, checked against the stack (segment size, emitted tags)."""
  if num_layers is not None and num_layers < 1:
    raise PolicyError(f'a layer stack needs num_layers >= 1, got {num_layers}')
  return get_policy(policy, num_layers=num_layers, tags=tags)


def num_stacked(tree, what: str) -> int:
  """N, the common leading axis of the stacked leaves of ``tree``."""
  sizes = {jnp.shape(a)[0] if jnp.ndim(a) else None for a in jax.tree_util.tree_leaves(tree)}
  if len(sizes) != 1 or None in sizes:
    raise StackSignatureError(f'{what} must be stacked [N, ...] on every leaf with one N; '
                              f'leading sizes found: {sorted(sizes, key=str)}')
  return sizes.pop()


# --- plain JAX -------------------------------------------------------------------------------

_EXPECTS = ('scan_layers calls layer_fn(params, x, *args[, rng=key]) -> y or (y, aux), with '
            'params one slice of stacked_params')


def scan_layers(layer_fn: Callable, stacked_params, x, *args, policy: Policy | str = 'none',
                rng: jax.Array | None = None, num_layers: int | None = None,
                strict: bool = True):
  """Applies N layers that share one function and have stacked parameters, under ``policy``.

  Args:
    layer_fn: ``layer_fn(params, x, *args) -> y`` or ``-> (y, aux)``, where
      ``params`` is one layer's slice of ``stacked_params`` and ``y`` is shaped
      like ``x`` (any shape when N is 1). If it has a parameter named ``rng``,
      it gets ``rng=`` layer i's key (None without ``rng``).
    stacked_params: a pytree whose leaves are stacked ``[N, ...]``.
    x: the input (an array or a pytree), carried from layer to layer.
    *args: inputs every layer gets unchanged (a mask, positions, a flag).
    policy: a :class:`~remat.policies.Policy` or a spec such as ``'full@sqrt'``.
    rng: one key; layer i gets the i-th of ``jax.random.split(rng, N)``,
      whatever the segmenting.
    num_layers: N, if ``stacked_params`` is empty.
    strict: check the policy against this stack alone (segment size within
      1..N, tags the layer emits); False for a model whose stacks differ in
      depth or tags, see :class:`remat.LayerStack`.

  Returns:
    ``y``, or ``(y, aux)`` with every layer's ``aux`` stacked ``[N, ...]``
    when the layer returns one that is not None.

  Raises:
    PolicyError: a segment size outside 1..N, or a ``names:``/``offload:`` tag
      that the layer does not emit.
    StackSignatureError: a layer that cannot be called as above.
  """
  n = num_layers if num_layers is not None else num_stacked(stacked_params, 'stacked_params')
  policy = check_policy(policy, n if strict else None)
  with_rng = takes_rng(layer_fn)
  rng_kw = {'rng': None} if with_rng else {}
  check_signature(layer_fn, (None, x) + args, rng_kw, _EXPECTS)
  keys = None if rng is None else jax.random.split(rng, n)

  def step(x, sliced):
    params, key = sliced
    out = layer_fn(params, x, *args, **({'rng': key} if with_rng else {}))
    return split_output(out, x, _EXPECTS, same_shape=n > 1)

  xs = (stacked_params, keys)
  (_, aux), tags = trace_layer(step, x, _first(xs))
  tag_rule = strict and policy.uses_tags
  if tag_rule:
    policy.validate(tags=tags)
  y, auxs = segmented_scan(step, x, xs, n, policy)
  return y if aux is None else (y, auxs)
