"""How a stack lays out its layers: the lean rule for "no recomputation", and the unrolled reference.

Under ``none`` (and inside the segments of ``sqrt``, ``seg:K``, ``stage``)
the user asked for no recomputation. In the user's own, unrolled model XLA
honours that for the expensive operations only: its fusion passes copy cheap
elementwise producers (a GELU, a LayerNorm's scale and shift, a softmax's
exponent) into the backward pass's fusions, so only their inputs stay live.
A ``lax.scan`` cannot do that: what JAX's partial evaluation decides to keep
becomes a stacked loop output, ``[N, ...]``, and is materialised whole, every
elementwise intermediate of every layer. Measured on a 6-layer pre-LN
Transformer (width 128, MLP 512, batch 8 x 128, ``jax.grad`` of the loss):
the untouched model plans 111.79 MiB of ``temp`` on the XLA CPU backend and
74.00 MiB on the H200 plan; the plain scan 147.07 MiB (1.32x) and 143.79 MiB
(1.94x).

:func:`lean_saveable` gives the scan what the fusion gives the unrolled
program: the layer keeps every value that an expensive operation produced
(a matmul, a convolution, a reduction, a gather, random bits, a custom call:
anything not listed in :data:`CHEAP_PRIMITIVES`) and rebuilds the cheap
elementwise and layout values from them in the backward pass. Nothing that
:mod:`remat.flops` counts is recomputed. The same model then plans 60.83 MiB
(0.54x the untouched model) on CPU and 52.81 MiB (0.71x) on H200.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable

import jax

from remat.policies import PolicyError, get_policy
from remat.unrolled_parts import zero_cotangent

# Primitives whose outputs are rebuilt rather than kept: elementwise arithmetic and
# comparisons, type conversions and pure layout changes. Their cost is one pass over
# memory that XLA fuses into the consumer; everything else (dot_general, conv, reduce_*,
# cumsum, sort, gather/scatter, random bits, custom calls, nested jit) is kept.
CHEAP_PRIMITIVES = frozenset({
    # arithmetic
    'add', 'sub', 'mul', 'div', 'neg', 'max', 'min', 'abs', 'sign', 'square', 'rem', 'pow',
    'integer_pow', 'clamp', 'floor', 'ceil', 'round', 'nextafter',
    # transcendental, one value in, one out
    'exp', 'exp2', 'log', 'log1p', 'expm1', 'tanh', 'logistic', 'sqrt', 'rsqrt', 'cbrt',
    'erf', 'erfc', 'sin', 'cos',
    # comparisons, logic and selection
    'eq', 'ne', 'lt', 'le', 'gt', 'ge', 'and', 'or', 'not', 'xor', 'select_n', 'is_finite',
    # bit arithmetic (a counter-based dropout mask is rebuilt from its key, not kept in float32)
    'shift_left', 'shift_right_logical', 'shift_right_arithmetic', 'bitcast_convert_type',
    'population_count', 'clz',
    # types and layout
    'convert_element_type', 'reduce_precision', 'broadcast_in_dim', 'reshape', 'transpose',
    'squeeze', 'expand_dims', 'slice', 'pad', 'concatenate', 'rev', 'iota', 'copy', 'copy_p',
    # markers that compute nothing
    'name', 'stop_gradient', 'optimization_barrier',
})


def lean_saveable(prim, *_, **__) -> bool:
  """A ``jax.checkpoint`` policy: keep what an expensive operation produced, rebuild the rest.

  The stack's rule for "no recomputation" (see the module docstring); it
  never recomputes a matmul, convolution, reduction or any primitive outside
  :data:`CHEAP_PRIMITIVES`.
  """
  return prim.name not in CHEAP_PRIMITIVES


# --- the yardsticks: the user's model as they would write it ----------------------------------

_REFERENCE = contextvars.ContextVar('remat_reference', default=None)


@contextlib.contextmanager
def unrolled_reference():
  """Stacks traced inside run as a plain Python loop over their layers, with no checkpoint.

  This is the model as its user would write it without the library (each layer
  applied in turn, XLA free to fuse across layers), for measuring the stack
  against it: ``with unrolled_reference(): compiled = jax.jit(loss).lower(...).compile()``.
  Only tracing inside the block is affected; the parameter tree is the same
  stacked one, and each layer's gradient is written into it in place
  (:mod:`remat.unrolled`), as a model with per-layer parameters writes its
  own. Every policy and layout is ignored here.
  """
  token = _REFERENCE.set(_policy('none'))
  try:
    yield
  finally:
    _REFERENCE.reset(token)


@contextlib.contextmanager
def per_block_reference(rule: str = 'full'):
  """Stacks traced inside run as a Python loop of ``jax.checkpoint(layer, policy=rule)``.

  The other yardstick: what a user gets by writing ``nn.remat(Block,
  policy=...)`` (or ``jax.checkpoint``) on each block of a Python loop, the
  one-line habit of Hugging Face, nanodo and most training code. Each layer is
  checkpointed with ``rule``'s ``jax.checkpoint`` policy and
  ``prevent_cse=True``, as ``nn.remat`` does; ``'none'`` is
  :func:`unrolled_reference`. The stack's own policy and layout are ignored.

  Args:
    rule: a per-layer rule spec (``'full'``, ``'dots'``, ``'names:fc1'``, a
      preset) or a :class:`remat.Policy` without segments.

  Raises:
    PolicyError: an unknown rule, or one with segments or a mix (a per-block
      ``nn.remat`` has neither).
  """
  policy = _policy(rule)
  if policy.segmented or policy.mixed:
    raise PolicyError(f"per_block_reference takes a per-layer rule such as 'full' or 'dots', "
                      f"not '{policy.spec}': a checkpoint on each block has no segments")
  token = _REFERENCE.set(policy)
  try:
    yield
  finally:
    _REFERENCE.reset(token)


def _policy(rule):
  return get_policy(rule)


def active_reference():
  """The policy of the yardstick being traced (``none`` or a rule), or None outside both."""
  return _REFERENCE.get()


def unrolled_active() -> bool:
  """True inside :func:`unrolled_reference`."""
  ref = _REFERENCE.get()
  return ref is not None and ref.spec == 'none'


# --- layouts: how a stack's units become a program ----------------------------------------------

# 'auto' picks one of the others per target and policy (choose_layout).
LAYOUTS = ('auto', 'scan', 'unrolled', 'loops', 'groups')
LAYOUT_HELP = {
    'auto': 'scan on CPU; on a GPU, in a stack of <= 8 units: the scan for none and full in a '
            'stack of one layer kind outside vmap or where a layer runs a loop of its own, and '
            'for dots in such a stack where none does; else unrolled for a per-layer rule and '
            'loops for none and patterns; deeper: scan (docs/own-model.md)',
    'scan': 'one lax.scan over the layers: compiled once, whatever N; on a GPU what the rule saves '
            'waits in the gradient rows the backward pass writes later',
    'unrolled': 'a Python loop, each layer in jax.checkpoint with the rule (the per-block habit; '
                'GPU), gradients written into the stacked parameters in place',
    'loops': 'as unrolled, each layer in a loop of one iteration (the XLA CPU backend keeps its '
             'checkpoint with remat.targets.CPU_COMPILER_OPTIONS)',
    'groups': 'scans of ~sqrt(N) layers (or of one segment each), joined by a Python loop',
}

_PLATFORM = contextvars.ContextVar('remat_platform', default=None)


@contextlib.contextmanager
def compiling_for(platform: str):
  """Stacks traced inside choose their ``'auto'`` layout for ``platform`` ('cpu' or 'gpu').

  For a program traced on one machine and compiled for another: the GPU plans
  of :mod:`remat.targets` (:func:`remat.measure`, :func:`remat.explain` and the
  reports set it). Elsewhere the platform is JAX's default backend.
  """
  token = _PLATFORM.set(platform)
  try:
    yield
  finally:
    _PLATFORM.reset(token)


def target_platform() -> str:
  """'cpu' or 'gpu' (or another JAX backend name): what an ``'auto'`` layout is chosen for."""
  return _PLATFORM.get() or jax.default_backend()


def check_layout(layout: str) -> str:
  """``layout`` if it is one of :data:`LAYOUTS`; a one-line :class:`PolicyError` otherwise."""
  if layout not in LAYOUTS:
    raise PolicyError(f"unknown layout {layout!r}; valid: {', '.join(LAYOUTS)}")
  return layout


# The deepest stack that 'auto' unrolls on a GPU: XLA compiles every unrolled layer (the train step
# of Llama-3.2-1B, 16 layers, compiled 2.9x as slowly unrolled as scanned, of Llama-3.1-8B, 32
# layers, 6.0x on the H100 plan: docs/own-model.md).
AUTO_UNROLL_MAX = 8


def choose_layout(policy, num_units: int,
                  platform: str | None = None, pattern: bool = False,
                  inner_loop: bool | Callable[[], bool] = False,
                  stored: bool | Callable[[], bool] = False) -> str:
  """The layout ``'auto'`` stands for (measured in docs/own-model.md).

  The scan on the CPU backend (which drops checkpoints in straight-line
  code), for segments and mixes, for a rule that offloads (XLA's GPU compiler
  moves a scan's stacked residuals to host memory, but few of the unrolled
  layers': llama-tiny, 6 layers, ``qkv_proj_offloaded``, H200 plan: 6.00 MiB on
  the host and 15.36 MiB of ``temp`` scanned, 1.25 and 27.73 unrolled), in a stack deeper than
  :data:`AUTO_UNROLL_MAX` (compile time), and under ``none`` or ``full`` for a layer
  that runs a loop of its own (``inner_loop``: a blockwise attention, a chunked
  backward pass), whose zero-initialised backward accumulators XLA's GPU
  pipeline merges across unrolled layers into one fusion that holds all of them
  at once (our tiny GPT, 8 layers, ``full``, H100 plan, when its loops started
  from constant zeros: 31.93 MiB unrolled, 15.22 MiB scanned; a loop that starts
  from zeros made from its input is not merged). Under a rule that keeps matmul
  outputs the kept values dominate and either layout can win on such a model
  (``dots``, then: our tiny GPT 51.79 MiB scanned against 59.92 unrolled, our
  llama-tiny 54.05 against 50.77), so there the layout does not depend on it:
  the per-block habit.

  Under ``none`` and ``full``, in a stack with one kind of layer, it is the scan
  too where the scan keeps its saved values in gradient rows (``stored``:
  :func:`remat.stored_scan.applies`; not inside ``jax.vmap``): there it plans
  below both yardsticks on the public models, compiled once where the unrolled
  layers compiled 2.1-2.7x as slowly (the issue-34 ViT, ``full``, H100 plan:
  3.15 MiB against 3.78 unrolled and 4.52 per-block; docs/own-model.md). So is
  ``dots``, for a layer without a loop of its own, since each unit's backward
  step writes its gradient rows as soon as they are computed
  (:mod:`remat.backward_order`): the ViT 14.80 MiB against 15.39 per-block,
  the Gemma-style decoder 19.32 against 19.03 (1.015x; 18.72 unrolled, which
  compiled 2.1x as slowly). On our models, whose MLP backward runs in chunks,
  the unrolled ``dots`` layers plan less (``vit-tiny`` 55.17 MiB against 58.28
  scanned), so there ``dots`` stays the per-block habit.

  Otherwise, on a GPU, the layers become :mod:`remat.unrolled`'s Python loop,
  which frees each layer's saved values after its backward step where the scan
  holds them as ``[N, ...]`` stacks until its backward loop ends:

  * a per-layer rule that recomputes or keeps matmul outputs (``full``,
    ``dots``, ``names:``, presets) where the scan above is not chosen:
    ``'unrolled'``, the per-block habit;
  * ``none``, and every rule in a pattern: ``'loops'``, each layer in a loop of
    one iteration. Under ``none`` its lean rule keeps less than either the scan
    or a plain loop without checkpoints (the lm1b model: 18.36 MiB against
    21.55 scanned and 21.26 untouched); for a pattern it also keeps XLA from
    rewriting one of the Gemma 3-style decoder's matmuls into a cuBLAS call
    with a 4 MiB workspace (``full`` at b4c4e97: 5.85 MiB against 9.34
    unrolled, 10.25 scanned).

  Args:
    policy: the resolved :class:`remat.Policy`.
    num_units: the stack's units (layers, or repeats of a pattern).
    platform: 'cpu' or 'gpu'; default :func:`target_platform`.
    pattern: the stack has a pattern of layer kinds.
    inner_loop: whether a layer runs a loop (or a function that says so, called
      only when the answer matters: it traces the layer).
    stored: whether the scan would keep its saved values in gradient rows (or a
      function that says so, called only when the answer matters).
  """
  platform = platform or target_platform()
  if (platform != 'gpu' or policy.mixed or policy.segmented or policy.offloads
      or num_units > AUTO_UNROLL_MAX):
    return 'scan'
  if policy.rule in ('none', 'full') and _answer(inner_loop):
    return 'scan'
  if (not pattern and policy.rule in ('none', 'full', 'dots')
      and (policy.rule != 'dots' or not _answer(inner_loop)) and _answer(stored)):
    return 'scan'
  if pattern or policy.rule == 'none':
    return 'loops'
  return 'unrolled'


def _answer(flag: bool | Callable[[], bool]) -> bool:
  """``flag``, called first where it is a function (asked only when the answer matters)."""
  return flag() if callable(flag) else flag


def has_loop(fn: Callable, *args) -> bool:
  """Whether ``fn(*args)`` or its derivative runs a ``scan`` or ``while`` loop (at any depth).

  The derivative is traced too: a layer's own ``jax.custom_vjp`` may loop in
  its backward pass only (our GPT's GELU + Dense, whose backward runs over rows
  in chunks).
  """
  from remat.tags import iter_eqns

  def forward_and_back(*args):
    out, pull = jax.vjp(fn, *args)
    return pull(jax.tree_util.tree_map(zero_cotangent, out))
  try:
    jaxpr = jax.make_jaxpr(forward_and_back)(*args).jaxpr
  except Exception:   # pylint: disable=broad-except
    # Not differentiable as called (integer outputs only, a framework that forbids the transform
    # here): the forward pass alone, which still shows a loop outside a custom derivative.
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
  return any(e.primitive.name in ('scan', 'while') for e in iter_eqns(jaxpr))


def resolve_layout(layout: str, policy, num_units: int,
                   pattern: bool = False, inner_loop: bool | Callable[[], bool] = False,
                   stored: bool | Callable[[], bool] = False) -> str:
  """``layout``, with ``'auto'`` replaced by :func:`choose_layout`'s choice."""
  check_layout(layout)
  if layout != 'auto':
    return layout
  return choose_layout(policy, num_units, pattern=pattern, inner_loop=inner_loop, stored=stored)
