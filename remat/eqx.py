"""Equinox modules in a stack: ``remat.eqx.scan_module(stacked_module, x, policy=...)``.

An Equinox model stacks its layers the Equinox way, by creating them under
``eqx.filter_vmap`` (every array leaf gets a leading ``[N, ...]`` axis). Such a
module also holds leaves that are not arrays (its activation function, sizes),
which a scan cannot carry, so the stack helpers need the arrays partitioned
from the rest: :func:`scan_module` does it with ``eqx.partition(module,
eqx.is_array)`` and rebuilds layer i with ``eqx.combine`` inside the scan, then
runs the one implementation behind every front door
(:func:`remat.scan_layers`). Gradients with ``eqx.filter_grad`` flow to the
stacked module's arrays.

Equinox is optional: this module imports it when called, and ``import remat``
never does (``pip install equinox``).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Hashable, Mapping, Sequence

import jax

from remat.policies import Policy
from remat.jax_stack import scan_layers
from remat.stack_checks import StackSignatureError, check_keywords

_EXPECTS = ('remat.eqx.scan_module calls layer(x[, xs_i], *args[, key=key]) -> y or (y, aux), '
            'with layer one slice of the stacked module')


def _equinox():
  try:
    import equinox
  except ImportError:
    raise ImportError('remat.eqx needs Equinox: pip install equinox') from None
  return equinox


def stack_modules(make_layer: Callable[[jax.Array], Any], num_layers: int, key: jax.Array):
  """N layers made by ``make_layer(key)``, one key each, as one module stacked ``[N, ...]``.

  The Equinox idiom ``eqx.filter_vmap(make_layer)(jax.random.split(key, N))``.
  """
  eqx = _equinox()
  return eqx.filter_vmap(make_layer)(jax.random.split(key, num_layers))


def scan_module(stacked, x, *args, policy: Policy | str = 'none', xs=None,
                key: jax.Array | None = None, strict: bool = True,
                pattern: Sequence[Hashable] | None = None, xs_kwargs=None,
                layout: str = 'auto'):
  """Applies the N layers of a stacked Equinox module in order, under ``policy``.

  Args:
    stacked: an Equinox module whose array leaves are stacked ``[N, ...]``
      (:func:`stack_modules`); layer i is called ``layer(x, *args)`` (with
      ``xs``: ``layer(x, xs_i, *args)``) and returns ``y`` or ``(y, aux)``.
      With a ``pattern``: a mapping kind -> such a module holding that kind's
      layers, stacked ``[n_kind, ...]`` in order (a Swin stage's regular and
      shifted-window blocks).
    x: the input, carried from layer to layer.
    *args: inputs every layer gets unchanged.
    policy: a :class:`~remat.policies.Policy` or a spec such as ``'full@sqrt'``.
    xs: per-layer inputs stacked ``[N, ...]`` (with a pattern, a mapping kind ->
      ``[n_kind, ...]``).
    key: one PRNG key; layer i gets the i-th of ``jax.random.split(key, N)`` as
      ``key=`` (Equinox's dropout convention), whatever the segmenting.
    strict: as for :func:`remat.scan_layers`.
    pattern: layer i is of kind ``pattern[i % len(pattern)]``; segmentings and
      mix counts count repeats of the pattern (:mod:`remat.patterns`).
    xs_kwargs: per-layer inputs passed by keyword, as for :func:`remat.scan_layers`.
    layout: as for :func:`remat.scan_layers`.

  Returns:
    ``y``, or ``(y, aux)`` with every layer's ``aux`` stacked ``[N, ...]``
    (with a pattern, a mapping kind -> ``[n_kind, ...]``).

  Raises:
    StackSignatureError: ``key`` given to layers whose ``__call__`` takes no
      ``key``, or arrays not stacked ``[N, ...]`` (one line).
  """
  eqx = _equinox()
  if pattern is None:
    params, layer_fn = _split(eqx, stacked, key, 'stacked', xs_kwargs)
  else:
    if not isinstance(stacked, Mapping):
      raise StackSignatureError('remat.eqx.scan_module with a pattern takes stacked as a mapping '
                                f'kind -> stacked Equinox module, got {type(stacked).__name__}')
    split = {k: _split(eqx, m, key, f'stacked[{k!r}]',
                       None if not isinstance(xs_kwargs, Mapping) else xs_kwargs.get(k))
             for k, m in stacked.items()}
    params = {k: p for k, (p, _) in split.items()}
    layer_fn = {k: f for k, (_, f) in split.items()}
  return scan_layers(layer_fn, params, x, *args, xs=xs, policy=policy, rng=key, strict=strict,
                     pattern=pattern, xs_kwargs=xs_kwargs, layout=layout)


def _split(eqx, stacked, key, what: str, names=None):
  """(the module's arrays, a layer function of them) for :func:`remat.scan_layers`."""
  if not isinstance(stacked, eqx.Module):
    raise StackSignatureError(f'remat.eqx.scan_module takes an Equinox module stacked [N, ...] '
                              f'as {what}, got {type(stacked).__name__}')
  params, static = eqx.partition(stacked, eqx.is_array)
  try:
    takes_key = 'key' in inspect.signature(type(stacked).__call__).parameters
  except (TypeError, ValueError):
    takes_key = False
  if key is not None and not takes_key:
    raise StackSignatureError(f'key= was given but {type(stacked).__name__}.__call__ has no '
                              'parameter named key')
  if names is not None:
    check_keywords(type(stacked).__call__, names, _EXPECTS, reserved=('rng', 'rngs', 'key'))

  def layer_fn(p, x, *rest, rng=None, **named):
    layer = eqx.combine(p, static)
    return layer(x, *rest, **named, **({'key': rng} if takes_key else {}))
  return params, layer_fn
