"""Measure any function under a list of policies: ``remat.measure(build, *example_args, ...)``.

``build(policy) -> program`` is the user's code for one policy, and the
example arguments (arrays or ``jax.ShapeDtypeStruct``) are shared by every
policy. The program is one of:

* a **loss** ``loss(*args) -> scalar``: measured as ``jax.value_and_grad(loss)``
  with respect to the first argument, jitted, nothing donated. ``temp`` is then
  the activation memory (residuals, recompute working sets, transients) without
  any optimizer.
* a :class:`TrainStep`: a whole step (forward, backward, optimizer update) that
  donates its first argument (the train state); its loss is given too, since the
  residuals are read from the loss's VJP. The model-zoo report measures this.

Everything except time is compile only on abstract inputs, so shapes far larger
than the machine can be planned, for the local backend or for an H100/H200
target (:mod:`remat.targets`). Figures: :mod:`remat.memory`,
:mod:`remat.residuals`, :mod:`remat.flops`; the table: :mod:`remat.table`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import sys
import time as _time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from remat.flops import FlopCount, count_flops
from remat.layout import compiling_for, per_block_reference, unrolled_reference
from remat.memory import MemoryStats, compiled_memory
from remat.policies import Policy, PolicyError, get_policy
from remat.residuals import Residual, saved_residuals
from remat.table import PER_BLOCK, rows as table_rows, format_table, pareto_front
from remat.tags import emitted_tags
from remat.targets import Target, get_target

# For a function we know nothing about: the per-layer rules that need no tags or stack.
DEFAULT_POLICIES = ('none', 'full', 'dots', 'dots_no_batch')


def _default_loss_args(state, *rest):
  return (state.params, *rest)


@dataclasses.dataclass(frozen=True)
class TrainStep:
  """A whole train step to measure instead of the gradient of a loss.

  Attributes:
    step: ``step(state, *rest) -> (new_state, ...)``; compiled with ``state``
      donated and FLOP-counted as is. Timing feeds ``new_state`` back in.
    loss: ``loss(params, *more) -> scalar``, the loss the step differentiates;
      the residuals are those of its VJP with respect to ``params``.
    loss_args: maps the step's arguments to the loss's, e.g.
      ``lambda state, batch: (state.params, batch)`` (the default).
  """
  step: Callable
  loss: Callable
  loss_args: Callable = _default_loss_args


@dataclasses.dataclass(frozen=True)
class Measurement:
  """What one policy's program costs (definitions in remat.memory / flops / residuals)."""
  spec: str
  memory: MemoryStats
  flops: FlopCount
  residuals: tuple[Residual, ...]
  step_seconds: float | None = None

  @property
  def residual_bytes(self) -> int:
    return sum(r.nbytes for r in self.residuals)


@dataclasses.dataclass(frozen=True)
class Report:
  """Measurements of every policy, the reference (if any) then ``none`` first.

  Attributes:
    results: spec (or the reference's label) -> :class:`Measurement`, in the
      order measured.
    target: the :class:`remat.targets.Target` compiled for.
    baseline: the row every ratio is to: ``none``, or the label of the user's
      untouched function when ``measure(..., reference=fn)`` measured one.
    reference_own_args: True when the reference was measured on its own
      arguments (``reference_args``: its own parameter tree), False when on the
      policies' example arguments.
  """
  results: dict[str, Measurement]
  target: Target
  baseline: str = 'none'
  reference_own_args: bool = False

  @property
  def timed(self) -> bool:
    return all(m.step_seconds is not None for m in self.results.values())

  @property
  def front(self) -> set[str]:
    """Specs on the Pareto front of (temp, recompute FLOPs)."""
    return pareto_front({s: (m.memory.temp, m.flops.flops) for s, m in self.results.items()})

  def rows(self) -> list[dict]:
    """One JSON-ready row per policy (:func:`remat.table.rows`)."""
    out = table_rows(self.results, self.baseline)
    for r in out:
      r['arguments'] = ('reference_args' if r['policy'] == self.baseline and
                        self.reference_own_args else 'example_args')
    return out

  def table(self, header: str | None = None) -> str:
    """The text table the reports print (:func:`remat.table.format_table`)."""
    header = header or f'# target {self.target.name} ({self.target.description})'
    if self.baseline != 'none':
      where = ('its own arguments (reference_args)' if self.reference_own_args
               else 'the example arguments')
      header += f"\n# '{self.baseline}' measured on {where}; the policies on the example arguments"
    return format_table(self.rows(), header, self.timed)


def _abstract(tree):
  """ShapeDtypeStructs of every array leaf (other leaves, e.g. Python scalars, as they are)."""
  return jax.tree_util.tree_map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype) if hasattr(a, 'shape') and hasattr(
          a, 'dtype') else a, tree)


def _concrete(tree, copy: bool):
  """Arrays for running: zeros for abstract leaves; copies of arrays that will be donated."""
  def leaf(a):
    if isinstance(a, jax.ShapeDtypeStruct):
      return jnp.zeros(a.shape, a.dtype)
    return jnp.array(a, copy=True) if copy and hasattr(a, 'shape') else a
  return jax.tree_util.tree_map(leaf, tree)


def _parts(program, args):
  """(compiled function, donate_argnums, residual (loss, *loss_args)) of a loss or TrainStep."""
  if isinstance(program, TrainStep):
    return program.step, (0,), (program.loss, *program.loss_args(*args))
  if not callable(program):
    raise TypeError(f'build(policy) must return a loss function or a TrainStep, got '
                    f'{type(program).__name__}')
  return jax.value_and_grad(program), (), (program, *args)


def compile_step(program, *example_args, target: Target | str = 'cpu'):
  """AOT-compiles ``program`` (a loss's value_and_grad, or a TrainStep) for ``target``."""
  target = get_target(target) if isinstance(target, str) else target
  fn, donate, _ = _parts(program, example_args)
  args = target.place(_abstract(example_args))
  with compiling_for(target.platform):   # stacks with layout='auto' choose for the target
    lowered = jax.jit(fn, donate_argnums=donate).lower(*args)
  return lowered.compile(compiler_options=target.compiler_options or None)


def step_memory(program, *example_args, target: Target | str = 'cpu') -> MemoryStats:
  """Compiled memory of ``program`` alone (no FLOP or residual walk)."""
  target = get_target(target) if isinstance(target, str) else target
  return compiled_memory(compile_step(program, *example_args, target=target), target.name)


def step_flops(program, *example_args) -> FlopCount:
  """Matmul/conv FLOPs of ``program``, recompute included (jaxpr walk, nothing compiled)."""
  fn, _, _ = _parts(program, example_args)
  return count_flops(fn, *_abstract(example_args))


def step_residuals(program, *example_args) -> tuple[Residual, ...]:
  """Arrays the loss's VJP keeps for the backward pass (:func:`remat.residuals.saved_residuals`)."""
  _, _, (loss, params, *rest) = _parts(program, _abstract(example_args))
  return tuple(saved_residuals(loss, params, *rest))


def time_step(compiled, args: Sequence[Any], donated: bool, steps: int = 5,
              warmup: int = 2) -> float:
  """Median seconds of ``steps`` calls of ``compiled(*args)`` after ``warmup`` calls.

  With ``donated``, the first argument is donated and replaced by the first output.
  """
  args, times = list(args), []
  for i in range(warmup + steps):
    t = _time.perf_counter()
    out = compiled(*args)
    jax.block_until_ready(out)
    if i >= warmup:
      times.append(_time.perf_counter() - t)
    if donated:
      args[0] = out[0]
  return statistics.median(times)


def measure_policy(program, *example_args, spec: str, target: Target | str = 'cpu',
                   time: bool = False, time_steps: int = 5,
                   time_args: Sequence[Any] | None = None) -> Measurement:
  """Measures one already-built program; ``spec`` only labels the result.

  ``time_args``: arrays to time on, consumed as they are (a TrainStep donates
  the first); by default zeros of the example shapes, and copies of example
  arrays that would be donated.
  """
  target = get_target(target) if isinstance(target, str) else target
  compiled = compile_step(program, *example_args, target=target)
  seconds = None
  if time:
    if target.sharding is not None:
      raise ValueError(f'--time runs the step, which needs an attached {target.name}; '
                       'time on the local backend (--target cpu) instead')
    donated = isinstance(program, TrainStep)
    args = time_args if time_args is not None else [
        _concrete(a, copy=donated and i == 0) for i, a in enumerate(example_args)]
    seconds = time_step(compiled, args, donated, time_steps)
  with compiling_for(target.platform):   # FLOPs and residuals of the program that was compiled
    flops, residuals = step_flops(program, *example_args), step_residuals(program, *example_args)
  return Measurement(spec, compiled_memory(compiled, target.name), flops, residuals, seconds)


def program_tags(build: Callable, *example_args) -> set[str]:
  """The ``checkpoint_name`` tags the program of ``build('none')`` emits (traced, nothing run)."""
  fn, _, _ = _parts(build(get_policy('none')), example_args)
  return emitted_tags(fn, *_abstract(example_args))


def resolve_policies(specs: Sequence[str | Policy], tags: set[str] | None = None,
                     num_layers: int | None = None) -> list[Policy]:
  """Policies for ``specs`` with ``none`` first; one-line :class:`PolicyError` before any compile."""
  policies = [get_policy(s, num_layers=num_layers, tags=tags) for s in specs]
  rest = [p for p in policies if p.spec != 'none']
  return [get_policy('none')] + list({p.spec: p for p in rest}.values())


def measure(build: Callable[[Policy], Any], *example_args,
            policies: Sequence[str | Policy] = DEFAULT_POLICIES,
            target: Target | str = 'cpu', time: bool = False, time_steps: int = 5,
            num_layers: int | None = None, progress: bool = False, reference: Any = None,
            reference_label: str = 'reference',
            reference_args: Sequence[Any] | None = None,
            per_block: Sequence[str] = ()) -> Report:
  """Compiles and measures ``build(policy)`` for every policy; ``none`` is always measured first.

  With ``reference`` (your model as it was, before any stack or policy), that
  is measured first, as its own row, and every ratio is to it: what a policy
  saves or costs against the model you had, not against the stack's ``none``.
  With ``per_block``, the other yardstick too: the same model with each layer
  in ``jax.checkpoint`` under a rule in a Python loop (the one-line ``nn.remat``
  habit), one row per rule, each stack row beside the per-block row of its rule.

  Args:
    build: ``build(policy) -> program``: a loss ``loss(*args) -> scalar``
      (measured as its ``value_and_grad`` w.r.t. the first argument) or a
      :class:`TrainStep`. ``policy`` is a :class:`remat.Policy`: apply it with
      ``policy.checkpoint(fn)`` or a stack helper (``LayerStack``, ``NNXStack``,
      ``scan_layers``).
    *example_args: the program's arguments, arrays or ``jax.ShapeDtypeStruct``;
      compiled abstractly, and zero-filled where ``time`` needs values.
    policies: specs or :class:`remat.Policy` objects (``none`` is added).
    target: 'cpu' (the local backend), 'h100' or 'h200', or a Target.
    time: also run each program (median of ``time_steps`` after 2 warm-up
      calls; local backend only).
    time_steps: timed calls per policy.
    num_layers: if given, ``seg:K`` specs are checked against it.
    progress: a tqdm progress bar on stderr.
    reference: the untouched program, a loss or :class:`TrainStep`; its row
      comes first and every ratio (temp, peak, FLOPs, time) is to it. It takes
      ``example_args`` unless ``reference_args`` says otherwise. ``'unrolled'``:
      ``build``'s own program traced inside
      :func:`remat.layout.unrolled_reference` (every stack a Python loop, no
      checkpoint), for a model written on the stack from the start.
    reference_label: the reference's row label.
    reference_args: the reference's own arguments (arrays or
      ``jax.ShapeDtypeStruct``), when they differ from the stacked model's: your
      untouched model on its own, per-layer parameter tree, exactly as you
      wrote it (no adapter that stacks or unstacks, which would change its
      plan). The report says which arguments each row used.
    per_block: per-layer rules (``'full'``, ``'dots'``, ...): a row
      ``per-block:RULE`` each, ``build``'s program traced inside
      :func:`remat.layout.per_block_reference` (each layer in
      ``jax.checkpoint(policy=RULE)`` in a Python loop), measured after the
      reference. Rows of a stack under the same rule then show
      ``temp/pb`` (``Report.rows()``: ``per_block_ratio``).

  Returns:
    A :class:`Report`: ``results`` per spec, ``front``, ``rows()``, ``table()``.

  Raises:
    PolicyError: an unknown spec, or a ``names:``/``offload:`` tag the program
      does not emit (one line; checked before anything compiles).
    TargetError: an unknown target, or a GPU target without the plugin.
  """
  target = get_target(target) if isinstance(target, str) else target
  if reference is not None and not (callable(reference) or isinstance(reference, TrainStep)
                                    or reference == 'unrolled'):
    raise TypeError(f"reference must be the untouched loss function, a TrainStep or 'unrolled', "
                    f'got {type(reference).__name__}')
  tags = program_tags(build, *example_args)
  todo = resolve_policies(policies, tags, num_layers)
  blocks = [get_policy(r, tags=tags) for r in per_block]   # one-line errors before any compile
  for p in blocks:
    if p.segmented or p.mixed or not p.remat_layers:
      raise PolicyError(f"per_block takes per-layer rules that checkpoint ('full', 'dots', ...), "
                        f"got '{p.spec}'")
  if reference is not None and reference_label in {p.spec for p in todo}:
    raise ValueError(f"reference_label '{reference_label}' is also a policy's spec; choose another")
  if reference_args is not None and (reference is None or isinstance(reference, str)):
    raise ValueError('reference_args were given without a reference function to measure on them')
  if reference_args is not None and not isinstance(reference_args, (tuple, list)):
    raise TypeError(f'reference_args must be a tuple of the reference\'s arguments, got '
                    f'{type(reference_args).__name__}')
  todo = ([(reference_label, reference)] if reference is not None else []) + [
      (PER_BLOCK + p.spec, p) for p in blocks] + [(p.spec, p) for p in todo]
  if progress:
    from tqdm import tqdm
    todo = tqdm(todo, desc='compiling', unit='program', file=sys.stderr)
  results = {}
  for label, policy in todo:
    is_ref = label == reference_label and reference is not None
    context = contextlib.nullcontext()
    if is_ref and reference == 'unrolled':
      program, context = build(get_policy('none')), unrolled_reference()
    elif label.startswith(PER_BLOCK):
      program, context = build(get_policy('none')), per_block_reference(policy)
    else:
      program = policy if is_ref else build(policy)
    args = tuple(reference_args) if is_ref and reference_args is not None else example_args
    with context:   # the yardsticks are traced (compiled, FLOP-counted, residuals read) inside
      results[label] = measure_policy(program, *args, spec=label, target=target,
                                      time=time, time_steps=time_steps)
  return Report(results, target, reference_label if reference is not None else 'none',
                reference_args is not None)
