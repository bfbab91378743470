"""Where the memory goes: ``remat.explain(build, *example_args, policy=...)``.

Compiles one policy's program as :func:`remat.measure` does and reads XLA's
own buffer assignment and schedule of it (:mod:`remat.buffers`), then gives:

* **the timeline**: live bytes at each position of XLA's schedule (the
  module-scoped, flattened sequence: a loop's body appears once and stands for
  every iteration, whose buffers it reuses), with the forward pass, the
  backward pass, the optimizer update and each scanned loop marked;
* **the peak's contents** in categories (:data:`CATEGORIES`), the values
  saved for the backward pass by ``checkpoint_name`` tag, and the largest
  buffers with shape, dtype, size, source line and loop;
* **the packing loss**: the plan's bytes (``argument + output - alias +
  temp``, :mod:`remat.memory`) minus the live peak.

Definitions (docs/measuring.md):

* *live bytes at position t*: the bytes of the plan's parameter, output and
  temp allocations that hold an ``HloValue`` live at t, by XLA's live ranges
  (``HloLiveRange``) and XLA's offsets; two values in the same bytes at once
  (an in-place update at the instant it happens, a loop's carried value and its
  body parameter) count once. Host-memory values (offload) are a separate curve.
* *live peak*: the maximum of that curve. XLA's dump also names a "peak"
  moment, chosen with a loop-carried value sized as its while loop's tuple
  (a few bytes), so its moment can miss the maximum; it is reported beside ours
  as ``xla_listed_peak``.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any, Callable

import jax

from remat.buffers import PlanError, compile_with_plan
from remat.layout import compiling_for
from remat.explain_analysis import (BACKWARD, CATEGORIES, GRADS, INPUTS, OPT, OTHER, PARAMS,
                                    SAVED, Buffer, Explanation, Span, analyse)
from remat.memory import compiled_memory
from remat.policies import Policy, PolicyError, get_policy
from remat.targets import Target, get_target, with_shardings

__all__ = ['explain', 'explain_all', 'write', 'run_cli', 'Explanation', 'Buffer', 'Span',
           'ExplainError', 'CATEGORIES', 'PARAMS', 'OPT', 'INPUTS', 'GRADS', 'SAVED', 'BACKWARD',
           'OTHER']


class ExplainError(ValueError):
  """A program that cannot be explained (does not trace or compile); the message is one line."""


def _leaf_roles(program, args, kind: str) -> list[tuple[str, str]]:
  """(category, path) of every flattened leaf of ``args``, in jit's parameter order."""
  from remat.measuring import TrainStep
  flat, _ = jax.tree_util.tree_flatten_with_path(args)
  roles = [(INPUTS, jax.tree_util.keystr(p)) for p, _ in flat]
  n0 = len(jax.tree_util.tree_leaves(args[0])) if args else 0
  if kind == 'loss':
    roles[:n0] = [(PARAMS, p) for _, p in roles[:n0]]
  elif isinstance(program, TrainStep):
    roles[:n0] = [(OPT, p) for _, p in roles[:n0]]
    try:   # which state leaves the loss differentiates: trace loss_args on leaf numbers
      numbered = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(args[0]), range(n0))
      picked = jax.tree_util.tree_leaves(program.loss_args(numbered, *args[1:])[0])
      for i in picked:
        if isinstance(i, int) and 0 <= i < n0:
          roles[i] = (PARAMS, roles[i][1])
    except Exception:  # a loss_args that computes: the state stays 'optimizer state'
      pass
  return roles


def _devices(shardings) -> list:
  """The devices named by a pytree of shardings (a mesh's, for a sharded explanation)."""
  out = []
  for s in jax.tree_util.tree_leaves(shardings, is_leaf=lambda v: hasattr(v, 'device_set')):
    if hasattr(s, 'device_set'):
      out += list(s.device_set)
  return out


def _compile(program, args, target: Target, kw: dict):
  """``kw``: jit's ``in_shardings``/``out_shardings`` when given (a mesh), else nothing."""
  from remat.measuring import TrainStep, _abstract, _parts
  fn, donate, _ = _parts(program, args)
  # Given shardings name the devices (a mesh of CPU or abstract GPU devices) themselves.
  placed = (target.place(_abstract(args)) if 'in_shardings' not in kw
            else with_shardings(_abstract(args), kw['in_shardings']))
  # keep_unused: HLO parameter i is then flattened leaf i, so each buffer maps to its argument.
  platform = 'gpu' if target.sharding is not None or kw.get('in_shardings') is not None and any(
      d.platform == 'gpu' for d in _devices(kw['in_shardings'])) else jax.default_backend()
  with compiling_for(platform):   # stacks with layout='auto' choose for the target
    lowered = jax.jit(fn, donate_argnums=donate, keep_unused=True, **kw).lower(*placed)
  options = dict(target.compiler_options)
  if target.sharding is None and jax.default_backend() == 'cpu':
    # LLVM's optimisation of the CPU code is much of a compile and changes no buffer (the
    # plan is read, never run): the tiny GPT's plan is byte for byte the same without it.
    options['xla_backend_optimization_level'] = 0
  compiled, plan = compile_with_plan(lowered, options)
  return compiled, plan, ('step' if isinstance(program, TrainStep) else 'loss')


def explain(build: Callable[[Policy], Any], *example_args, policy: str | Policy = 'none',
            target: Target | str = 'cpu', shardings=None, out_shardings=None) -> Explanation:
  """Compiles ``build(policy)`` and explains XLA's memory plan of it (module docstring).

  Args:
    build: ``build(policy) -> program``, as for :func:`remat.measure`: a loss
      (explained as its ``value_and_grad`` w.r.t. the first argument) or a
      :class:`remat.TrainStep` (first argument donated).
    *example_args: arrays or ``jax.ShapeDtypeStruct``; compiled abstractly.
    policy: a spec or :class:`remat.Policy`.
    target: 'cpu', 'h100', 'h200' or a Target.
    shardings: ``in_shardings`` for ``jax.jit`` (a pytree prefix of the
      arguments): the per-device program on a mesh is explained, and the
      explanation's ``mesh`` names the mesh's axis sizes.
    out_shardings: ``out_shardings`` for ``jax.jit`` (with ``shardings``),
      to explain the very program a training loop compiles with them
      (default: XLA's sharding propagation picks the outputs').

  Raises:
    PolicyError: an unknown spec, or a tag the program does not emit.
    TargetError: an unknown target, or a GPU target without the plugin.
    ExplainError: ``build`` fails to trace or compile under the policy, or
      ``out_shardings`` without ``shardings``.
  """
  return explain_all(build, *example_args, policies=[policy], target=target,
                     shardings=shardings, out_shardings=out_shardings)[0]


def explain_all(build: Callable[[Policy], Any], *example_args, policies, target='cpu',
                shardings=None, out_shardings=None, num_layers: int | None = None,
                log: Callable[[str], None] | None = None) -> list[Explanation]:
  """:func:`explain` for several policies; every spec is checked before anything compiles."""
  from remat.measuring import program_tags
  if out_shardings is not None and shardings is None:
    raise ExplainError('out_shardings= needs shardings= (the mesh the inputs are on)')
  target = get_target(target) if isinstance(target, str) else target
  try:
    tags = program_tags(build, *example_args)
  except Exception as e:  # the user's function does not even trace under none
    raise ExplainError(f"build('none') does not trace: {_one_line(e)}") from None
  resolved = [get_policy(p, num_layers=num_layers, tags=tags) for p in policies]
  jit_kw = {k: v for k, v in (('in_shardings', shardings), ('out_shardings', out_shardings))
            if v is not None}
  out = []
  for pol in resolved:
    if log:
      log(f'explaining {pol.spec} on {target.name} ...')
    out.append(_explain_policy(build, example_args, pol, target, jit_kw))
  return out


def _explain_policy(build, example_args, pol: Policy, target: Target, jit_kw) -> Explanation:
  from remat.measuring import step_residuals
  try:
    program = build(pol)
    compiled, plan, kind = _compile(program, example_args, target, jit_kw)
    residuals = step_residuals(program, *example_args)
  except PolicyError as e:   # e.g. a segmenting build() cannot apply
    raise PolicyError(str(e).strip().splitlines()[0]) from None
  except PlanError as e:
    raise ExplainError(str(e)) from None
  except Exception as e:  # a user function that fails to trace, lower or compile
    raise ExplainError(f"build('{pol.spec}') does not compile for {target.name}: "
                       f'{_one_line(e)}') from None
  memory = compiled_memory(compiled, target.name)
  roles = _leaf_roles(program, example_args, kind)
  return dataclasses.replace(analyse(plan, memory, pol.spec, target.name, roles, residuals),
                             mesh=_mesh_of(jit_kw.get('in_shardings')))


def _mesh_of(shardings) -> dict[str, int] | None:
  """The axis sizes of the mesh ``shardings`` place on (``{'devices': n}`` for an unnamed set).

  None when every leaf is on one device: the program explained is then the whole one.
  """
  leaves = jax.tree_util.tree_leaves(shardings)
  named = next((s for s in leaves if isinstance(s, jax.sharding.NamedSharding)), None)
  if named is not None and named.mesh.size > 1:
    return dict(named.mesh.shape)
  devices = max((len(s.device_set) for s in leaves if hasattr(s, 'device_set')), default=1)
  return {'devices': devices} if devices > 1 else None


def write(explanations: list[Explanation], path: str, environment: dict,
          title: str = '') -> list[str]:
  """Writes the JSON, PNG and SVG of ``explanations``; returns the paths written.

  One explanation: ``path`` is a file (``X.json``, ``X.png``, ``X.svg`` from its
  stem) unless it is a directory or ends with '/'. Several: ``path`` is a
  directory (created) holding one ``SPEC.json/.png/.svg`` per policy and
  ``overlay.png/.svg`` with every policy on one plot.
  """
  from remat.explain_plot import plot
  from remat.table import write_json
  p = Path(path)
  as_dir = len(explanations) > 1 or p.is_dir() or str(path).endswith(('/', os.sep))
  if as_dir:
    p.mkdir(parents=True, exist_ok=True)
  elif p.parent and not p.parent.exists():
    raise ExplainError(f'--explain {path}: directory {p.parent} does not exist')
  written = []
  for e in explanations:
    stem = p / _file_name(e.spec) if as_dir else p.with_suffix('')
    write_json(str(stem.with_suffix('.json')), environment, {'explain': e.to_json()})
    written.append(str(stem.with_suffix('.json')))
    written += [str(x) for x in plot([e], stem, f'{title} {e.spec}'.strip())]
  if len(explanations) > 1:
    written += [str(x) for x in plot(explanations, p / 'overlay', title)]
  return written


def run_cli(build, example_args, specs: list[str], target: Target, path: str, environment: dict,
            title: str, num_layers: int | None = None, shardings=None,
            out_shardings=None) -> int:
  """``--explain`` of the reports: prints each policy's summary and writes the files (:func:`write`).

  ``shardings``, ``out_shardings`` as for :func:`explain` (the caller's mesh: a
  per-device plan).
  Raises the one-line errors of :func:`explain_all` for the report to print.
  """
  import sys
  exps = explain_all(build, *example_args, policies=specs, target=target, shardings=shardings,
                     out_shardings=out_shardings, num_layers=num_layers,
                     log=lambda s: print(s, file=sys.stderr, flush=True))
  for e in exps:
    print(e.summary())
  for written in write(exps, path, environment, title):
    print(f'wrote {written}')
  return 0


def _file_name(spec: str) -> str:
  return re.sub(r'[^\w.@+-]', '_', spec)


def _one_line(e: Exception) -> str:
  text = str(e).strip().splitlines()
  return f'{type(e).__name__}: {text[0] if text else ""}'.rstrip(': ')
