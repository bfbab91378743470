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
from typing import Any, Callable, Hashable, Mapping, Sequence

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
    if size is not None:  # one segment of one layer: saves only its input
      body = jax.checkpoint(_layer(step, policy._layer_policy(), prevent_cse=True),
                            policy=_nothing, prevent_cse=True)
    else:
      body = _layer(step, rule, prevent_cse=True)
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
  shapes = _leaf_shapes(tree, what)
  if not shapes:
    raise StackSignatureError(f'{what} has no arrays, so it does not say how many layers there '
                              'are; pass num_layers')
  sizes = {s[0] if s else None for _, s in shapes}
  if len(sizes) != 1 or None in sizes:
    path, shape = next((p, s) for p, s in shapes if (s[0] if s else None) != _most(shapes))
    raise StackSignatureError(
        f'{what} must be stacked [N, ...] on every leaf with one N, but {what}{path} has shape '
        f'{_shape(shape)} and the others [{_most(shapes)}, ...] (per-layer trees: '
        'remat.stack_layers)')
  return sizes.pop()


def check_stacked(tree, num_layers: int, what: str) -> None:
  """Raises :class:`StackSignatureError` unless every leaf of ``tree`` is stacked ``[N, ...]``.

  Catches a ``num_layers`` that disagrees with the stacked leaves (which would
  otherwise run as many layers as the segmenting happens to read) and a
  per-layer (unstacked) tree handed to a stack.
  """
  shapes = _leaf_shapes(tree, what)
  if all(s[:1] == (num_layers,) for _, s in shapes):
    return
  sizes = {s[0] if s else None for _, s in shapes}
  if len(sizes) == 1 and None not in sizes:
    m = sizes.pop()
    raise StackSignatureError(
        f'the stack has num_layers={num_layers} but every leaf of {what} has leading axis {m}; '
        f'a {num_layers}-layer stack needs every leaf stacked [{num_layers}, ...] (num_layers={m} '
        'if it holds that many layers; a per-layer tree is stacked by remat.stack_layers)')
  path, shape = next((p, s) for p, s in shapes if s[:1] != (num_layers,))
  raise StackSignatureError(
      f'{what}{path} has shape {_shape(shape)}; every leaf of a {num_layers}-layer stack is '
      f'stacked [{num_layers}, ...] (per-layer trees: remat.stack_layers)')


def _leaf_shapes(tree, what: str = '') -> list[tuple[str, tuple]]:
  out = []
  for p, a in jax.tree_util.tree_leaves_with_path(tree):
    if not _is_array(a) and not isinstance(a, (bool, int, float, complex)):
      raise StackSignatureError(
          f'{what}{jax.tree_util.keystr(p)} is {type(a).__name__} {a!r:.40}, not an array; a '
          "stack's per-layer trees hold arrays (an Equinox module: remat.eqx.scan_module, or "
          'eqx.partition(module, eqx.is_array))')
    out.append((jax.tree_util.keystr(p), tuple(jnp.shape(a))))
  return out


def _most(shapes) -> int | None:
  counts = {}
  for _, s in shapes:
    counts[s[0] if s else None] = counts.get(s[0] if s else None, 0) + 1
  return max(counts, key=counts.get)


def _shape(shape) -> str:
  return f'[{", ".join(map(str, shape))}]'


def check_swapped(fn: Callable, trace: Callable, expects: str) -> None:
  """After ``trace()`` of a layer failed: one-line error if ``fn`` takes (x, params) instead.

  ``trace`` traces the layer with its first two arguments swapped and returns
  its output shapes; if that works the user wrote ``layer_fn(x, params)``.
  """
  try:
    trace()
  except Exception:  # noqa: BLE001 -- any failure: the swap is not the explanation
    return
  try:
    sig = f'{_name(fn)}{inspect.signature(fn)}'
  except (TypeError, ValueError):
    sig = _name(fn)
  raise StackSignatureError(
      f'{expects}; {sig} fails when called so and runs with its first two arguments swapped: '
      'it takes x before params, swap its parameters') from None


# --- plain JAX -------------------------------------------------------------------------------

_EXPECTS = ('scan_layers calls layer_fn(params, x[, xs_i], *args[, rng=key]) -> y or (y, aux), '
            'with params one slice of stacked_params (and xs_i one of xs)')


def scan_layers(layer_fn: Callable | Mapping[Hashable, Callable], stacked_params, x, *args,
                xs=None, policy: Policy | str = 'none', rng: jax.Array | None = None,
                num_layers: int | None = None, strict: bool = True,
                pattern: Sequence[Hashable] | None = None):
  """Applies N layers that share one function and have stacked parameters, under ``policy``.

  Args:
    layer_fn: ``layer_fn(params, x, *args) -> y`` or ``-> (y, aux)``, where
      ``params`` is one layer's slice of ``stacked_params`` and ``y`` is shaped
      like ``x`` (any shape when N is 1). With ``xs``, ``layer_fn(params, x,
      xs_i, *args)``. If it has a parameter named ``rng``, it gets ``rng=``
      layer i's key (None without ``rng``). With a ``pattern``: a mapping
      kind -> such a function.
    stacked_params: a pytree whose leaves are stacked ``[N, ...]``; with a
      ``pattern``, a mapping kind -> a pytree stacked ``[n_kind, ...]`` (the
      layers of that kind, in order).
    x: the input (an array or a pytree), carried from layer to layer.
    *args: inputs every layer gets unchanged (a mask, positions, a flag).
    xs: per-layer inputs, a pytree stacked ``[N, ...]`` (a KV cache, per-layer
      state); layer i gets its slice after ``x``. With a ``pattern``, a mapping
      kind -> ``[n_kind, ...]``. A layer returning ``(y, ys_i)`` gives ``ys``
      stacked the same way.
    policy: a :class:`~remat.policies.Policy` or a spec such as ``'full@sqrt'``.
    rng: one key; layer i gets the i-th of ``jax.random.split(rng, N)``,
      whatever the segmenting.
    num_layers: N; checked against the stacked leaves (required only when
      ``stacked_params`` and ``xs`` are empty).
    strict: check the policy against this stack alone (segment size within
      1..N, tags the layer emits); False for a model whose stacks differ in
      depth or tags, see :class:`remat.LayerStack`.
    pattern: layer i is of kind ``pattern[i % len(pattern)]``, e.g.
      ``('local',) * 5 + ('global',)``; segmentings and mix counts then count
      repeats of the pattern (:mod:`remat.patterns`).

  Returns:
    ``y``, or ``(y, aux)`` with every layer's ``aux`` stacked ``[N, ...]``
    (with a pattern: a mapping kind -> ``[n_kind, ...]``) when the layer
    returns one that is not None.

  Raises:
    PolicyError: a segment size outside 1..N, or a ``names:``/``offload:`` tag
      that the layer does not emit.
    StackSignatureError: a layer that cannot be called as above (swapped
      arguments included), or a ``num_layers``, ``xs`` or pattern that
      disagrees with the stacked leaves.
  """
  from remat import patterns  # builds on segmented_scan above
  if pattern is None:
    fns, params, per_layer = {None: layer_fn}, {None: stacked_params}, {None: xs}
    n = _stack_depth(stacked_params, xs, num_layers)
  else:
    if not (isinstance(layer_fn, Mapping) and isinstance(stacked_params, Mapping)):
      raise StackSignatureError('scan_layers with a pattern takes layer_fn and stacked_params as '
                                'mappings kind -> function and kind -> stacked params')
    pattern = patterns.check_pattern(pattern, list(layer_fn), 'scan_layers')
    patterns.check_pattern(pattern, list(stacked_params), 'scan_layers stacked_params')
    if xs is not None and not (isinstance(xs, Mapping) and set(xs) <= set(layer_fn)):
      raise StackSignatureError('scan_layers with a pattern takes xs as a mapping kind -> '
                                'inputs stacked [n_kind, ...]')
    fns, params = dict(layer_fn), dict(stacked_params)
    per_layer = {k: None if xs is None else xs.get(k) for k in fns}
    counts = {k: num_stacked(params[k], f"stacked_params[{k!r}]") for k in fns}
    n = patterns.layers_for(counts, pattern)
    if num_layers is not None and num_layers != n:
      raise StackSignatureError(f'the stack has num_layers={num_layers} but stacked_params holds '
                                f'{n} layers of the pattern; pass num_layers={n}')
  units = patterns.num_units(pattern, n)
  policy = check_policy(policy, units if strict else None)
  counts = {None: n} if pattern is None else patterns.kind_counts(pattern, n)
  keys = None if rng is None else jax.random.split(rng, n)
  index = None if pattern is None else patterns.kind_indices(pattern, n)
  steps, stacked, aux, tags = {}, {}, None, set()
  for kind, fn in fns.items():
    what = 'stacked_params' if kind is None else f'stacked_params[{kind!r}]'
    check_stacked(params[kind], counts[kind], what)
    if per_layer[kind] is not None:
      check_stacked(per_layer[kind], counts[kind], what.replace('stacked_params', 'xs'))
    kind_keys = None if keys is None or kind is None else keys[index[kind]]
    step, layer_xs = _plain_step(fn, x, args, per_layer[kind] is not None, n > 1)
    stacked[kind] = (params[kind], keys if kind is None else kind_keys, per_layer[kind])
    steps[kind] = step
    try:
      (_, kind_aux), kind_tags = trace_layer(step, x, _first(stacked[kind]))
    except Exception as e:
      check_swapped(fn, lambda: trace_layer(layer_xs, x, _first(stacked[kind])), _EXPECTS)
      if isinstance(e, StackSignatureError) and num_layers is None:
        raise StackSignatureError(
            f'{e} (N={n} was read from the leading axis of {what}; is every leaf stacked '
            '[N, ...]? a per-layer tree is stacked by remat.stack_layers)') from None
      raise
    aux = kind_aux if aux is None else aux
    tags |= kind_tags
  if strict and policy.uses_tags:
    policy.validate(tags=tags)
  if pattern is None:
    y, auxs = patterns.run_stack(steps[None], x, stacked[None], n, policy)
  else:
    y, auxs = patterns.run_stack(steps, x, stacked, n, policy, pattern)
  return y if aux is None else (y, auxs)


def _stack_depth(stacked_params, xs, num_layers: int | None) -> int:
  """N: ``num_layers``, else the leading axis of the stacked parameters (or of ``xs``)."""
  if num_layers is not None:
    return num_layers
  if jax.tree_util.tree_leaves(stacked_params):
    return num_stacked(stacked_params, 'stacked_params')
  if jax.tree_util.tree_leaves(xs):
    return num_stacked(xs, 'xs')
  raise StackSignatureError('scan_layers needs num_layers when stacked_params and xs are empty')


def _plain_step(layer_fn: Callable, x, args: tuple, has_xs: bool, many: bool):
  """(the scan step of ``layer_fn``, the same step with params and x swapped, for diagnosis)."""
  with_rng = takes_rng(layer_fn)
  rng_kw = {'rng': None} if with_rng else {}
  check_signature(layer_fn, (None, x) + ((None,) if has_xs else ()) + args, rng_kw, _EXPECTS)

  def call(first, second, sliced):
    _, key, xs_i = sliced
    more = (xs_i,) if has_xs else ()
    return layer_fn(first, second, *more, *args, **({'rng': key} if with_rng else {}))

  def step(x, sliced):
    out = call(sliced[0], x, sliced)
    return split_output(out, x, _EXPECTS, same_shape=many)

  def swapped(x, sliced):
    return split_output(call(x, sliced[0], sliced), x, _EXPECTS, same_shape=many)
  return step, swapped
