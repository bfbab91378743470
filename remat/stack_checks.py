"""The checks every stack front door makes when its stack is traced, with one-line errors.

A layer whose signature or result does not fit the stack, parameters not
stacked ``[N, ...]``, a segment size outside 1..N or a ``names:`` tag the layer
does not emit: each is caught here, before anything compiles, as a one-line
:class:`StackSignatureError` or :class:`~remat.policies.PolicyError`. The
linen, NNX, plain-JAX and Equinox front doors share them.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from remat.policies import Policy, PolicyError, get_policy
from remat.tags import iter_eqns


class StackSignatureError(TypeError):
  """A layer whose signature or result does not fit the stack helper; the message is one line."""



def check_signature(fn: Callable, args: tuple, kwargs: dict, expects: str) -> None:
  """Raises :class:`StackSignatureError` if ``fn`` cannot be called with these arguments."""
  try:
    sig = inspect.signature(fn)
  except (TypeError, ValueError):
    return  # a builtin or C function: let the call itself speak
  try:
    sig.bind(*args, **kwargs)
  except TypeError as e:
    raise StackSignatureError(f'{expects}; {_name(fn)}{sig} does not fit: {e}; '
                              f'{adapter_hint(fn, expects)}') from None


def adapter_hint(fn: Callable, expects: str) -> str:
  """How to fit a layer of another signature: a wrapper in the stack's order, one line."""
  call = expects.split(' calls ', 1)[-1].split(' ->', 1)[0]   # e.g. 'layer_fn(params, x[, xs_i], ...)'
  order = call[call.index('(') + 1:call.rindex(')')] if '(' in call else '...'
  return (f'adapt it with a wrapper that takes the stack\'s order ({order}) and calls '
          f'{_name(fn)} in its own, returning (y, aux) with y shaped like x; a per-layer input '
          'that the layer takes by keyword goes in xs_kwargs={name: stacked}')


def per_layer_scalars(tree):
  """Per-layer Python numbers as arrays: ``[0.0, 0.05, 0.1]`` (a stochastic-depth ramp) -> ``[N]``.

  A list or tuple of N Python numbers cannot be sliced per layer as it is (it
  is N leaves, not one stacked one), so it becomes one float32 (or int32)
  array; every other leaf is left as it is.
  """
  def numbers(a):
    return (isinstance(a, (list, tuple)) and len(a) > 0
            and all(isinstance(v, (bool, int, float)) for v in a))
  return jax.tree_util.tree_map(lambda a: jnp.asarray(a) if numbers(a) else a, tree,
                                is_leaf=numbers)


def check_keywords(fn: Callable, names, expects: str, reserved=('rng', 'rngs')) -> None:
  """Raises :class:`StackSignatureError` unless ``fn`` takes each of ``names`` by keyword.

  The names are those of ``xs_kwargs``: per-layer inputs a layer receives as
  keyword arguments (a U-Net block's ``enc=`` skip).
  """
  if not isinstance(names, Mapping):
    raise StackSignatureError(f'{expects}; xs_kwargs must be a mapping name -> inputs stacked '
                              f'[N, ...], got {type(names).__name__}')
  bad = [n for n in names if not isinstance(n, str) or n in reserved]
  if bad:
    raise StackSignatureError(f'{expects}; xs_kwargs names {bad[0]!r}, which is not a usable '
                              f'keyword ({", ".join(reserved)} are the stack\'s own)')
  try:
    params = inspect.signature(fn).parameters
  except (TypeError, ValueError):
    return
  if any(p.kind is p.VAR_KEYWORD for p in params.values()):
    return
  by_keyword = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
  missing = [n for n in names if n not in by_keyword]
  if missing:
    raise StackSignatureError(
        f'{expects}; xs_kwargs names {missing[0]!r}, which {_name(fn)} does not take by keyword '
        f'(its keyword parameters: {", ".join(by_keyword) or "none"})')


def note_layer_call(error: Exception, door: str, fn: Callable, has_xs: bool, names) -> None:
  """Adds to an error raised inside a layer how the stack called it, so it names the stack.

  A per-layer input bound to the wrong parameter (a skip meant for the keyword
  ``enc=`` landing on the next positional one) fails deep inside the layer,
  with a message about shapes that never says a stack is involved.
  """
  if not hasattr(error, 'add_note'):  # Python < 3.11
    return
  more = ', xs_i' if has_xs else ''
  kw = ''.join(f', {n}=<slice i>' for n in (names or ()))
  error.add_note(f'remat: raised in layer 0 of {door}, called as {_name(fn)}(..., x{more}, *args'
                 f'{kw}); a per-layer input the layer takes by keyword goes in '
                 'xs_kwargs={name: stacked}, not xs')


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
                              f'{_describe(x)}{_swap_hint(out, x)}')
  if same_shape:
    got, want = _describe(y), _describe(x)
    if got != want:
      raise StackSignatureError(f'{expects}; the layer returned y of {got} for x of {want} '
                                f'(only a one-layer stack may change the shape){_swap_hint(out, x)}')
  return y, aux


def _swap_hint(out, x) -> str:
  """A hint when the layer returns (aux, y): its second value, not its first, is shaped like x."""
  if isinstance(out, tuple) and len(out) == 2 and _describe(out[1]) == _describe(x) \
      and _describe(out[0]) != _describe(x):
    return ('; its second value is shaped like x: it returns (aux, y), and the stack wants '
            '(y, aux), e.g. a wrapper returning block(...)[::-1]')
  return ''


def _describe(tree) -> str:
  leaves = jax.tree_util.tree_leaves(tree, is_leaf=lambda a: a is None)
  parts = ['None' if a is None else f'{getattr(a, "dtype", type(a).__name__)}'
           f'{list(getattr(a, "shape", ()))}' for a in leaves]
  return parts[0] if len(parts) == 1 else f'({", ".join(parts)})'


def first_layer(tree):
  """Layer 0's slice of a tree stacked ``[N, ...]`` (what the checks trace the layer on)."""
  return jax.tree_util.tree_map(lambda a: a[0], tree)


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
