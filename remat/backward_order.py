"""A unit's backward pass that writes each gradient row as soon as it is final.

Inside a loop body XLA's GPU scheduler orders the operations of one unit's
backward step as it likes, and the weight-gradient matmuls, whose results
only the row writes at the end of the step read, tend to run late: the
values they read (an MLP's input and its cotangent, ``[batch, seq, hidden]``
each) then stay live through the rest of the step, the attention's backward
included. The per-block model has the same operations in straight-line code
and frees them earlier. Measured on the public ViT (8 layers, loss gradient,
H100 plan, the stored scan of :mod:`remat.stored_scan`): under ``dots`` the
MLP's two ``[8, 64, 256]`` values were live at the peak, beside the attention's
backward.

:func:`write_when_final` evaluates the backward step's jaxpr (its checkpoints
and nested ``jit`` calls inlined, so that each gradient is a value of its
own) one equation at a time. As soon as a gradient leaf is computed it is
written into its row, and the written buffer and every value that the rest
of the backward step reads are passed through one ``optimization_barrier``:
XLA can then start no later work of the step until the row is written.

Only values that depend on the incoming cotangents (the backward work) or on
the buffer just written are held by the barrier; cheap elementwise values
among them (:data:`remat.layout.CHEAP_PRIMITIVES`) are computed again after
it from the held values rather than held themselves, so the barrier does not
make XLA materialise what it would have fused. A saved value read out of the
rows about to be written is held as it was read, so the write does not
overwrite it while a later fusion still reads it (XLA would copy the whole
accumulator).
"""

from __future__ import annotations

import contextlib
from typing import Callable

import jax
import jax.extend.core as jcore

from remat.layout import CHEAP_PRIMITIVES

try:   # attribute each equation replayed here to the user's source line, as JAX's own eval does
  from jax._src import source_info_util as _source_info
except ImportError:   # pragma: no cover
  _source_info = None

# Call-like primitives whose body is inlined: a gradient computed inside one of them is otherwise a
# result of the whole call, known only when the call ends.
_INLINED = ('remat2', 'checkpoint', 'pjit', 'jit', 'closed_call', 'core_call')


def write_when_final(fn: Callable, args: list, rows: dict, write: Callable,
                     cotangents: set) -> tuple[list, dict]:
  """``fn(*args)``, each output in ``rows`` written into its buffer as soon as it is computed.

  Args:
    fn: a function of the flat ``args`` returning a flat list of arrays.
    args: its flat arguments.
    rows: ``{output index: argument index}``: the output is written into that
      argument (a buffer) by ``write``.
    write: ``write(buffer, value) -> buffer``.
    cotangents: indices of the arguments whose dependants are the backward
      work that waits for each write.

  Returns:
    ``(outputs, buffers)``: every output of ``fn`` (as computed), and
    ``{argument index: buffer written}`` for the outputs written here (an
    output that is one of the arguments or a constant is not written: the
    caller writes it).
  """
  closed = jax.make_jaxpr(fn)(*args)
  flat = jax.make_jaxpr(lambda *a: _inline(closed.jaxpr, closed.consts, a))(*args)
  jaxpr = flat.jaxpr
  defined = {o: p for p, e in enumerate(jaxpr.eqns) for o in e.outvars}
  last_use = {}
  for p, e in enumerate(jaxpr.eqns):
    for v in _vars(e.invars):
      last_use[v] = p
  for v in _vars(jaxpr.outvars):
    last_use[v] = len(jaxpr.eqns)
  cheap = {o for e in jaxpr.eqns if e.primitive.name in CHEAP_PRIMITIVES for o in e.outvars}
  writes = {}
  for out, arg in rows.items():
    var = jaxpr.outvars[out]
    if isinstance(var, jcore.Var) and var in defined:
      writes.setdefault(defined[var], []).append((var, arg))
  backward = _dependants(jaxpr, [jaxpr.invars[i] for i in cotangents])
  reads = {arg: _dependants(jaxpr, [jaxpr.invars[arg]]) for arg in set(rows.values())}

  env = dict(zip(jaxpr.constvars, flat.consts))
  env.update(zip(jaxpr.invars, args))
  buffers = {}
  for p, eqn in enumerate(jaxpr.eqns):
    _bind(eqn, env)
    if p not in writes:
      continue
    done = {var for var, _ in writes[p]}
    for var, arg in writes[p]:
      buffers[arg] = write(buffers.get(arg, env[jaxpr.invars[arg]]), env[var])
    args_written = [arg for _, arg in writes[p]]
    done |= {jaxpr.invars[a] for a in args_written}
    waiting = backward.union(*(reads[a] for a in args_written))
    live = [v for v in env if v in waiting and last_use.get(v, -1) > p and v not in done]
    held, again = _roots(jaxpr, live, waiting, cheap, defined)
    held = [v for v in held if hasattr(env[v], 'dtype')]
    out_buffers, out_held = jax.lax.optimization_barrier(
        ([buffers[a] for a in args_written], [env[v] for v in held]))
    buffers.update(zip(args_written, out_buffers))
    env.update(zip(held, out_held))
    for q in sorted(again):
      _bind(jaxpr.eqns[q], env)
  return _read(env, jaxpr.outvars), buffers


def _vars(atoms) -> list:
  return [a for a in atoms if isinstance(a, jcore.Var)]


def _dependants(jaxpr, sources: list) -> set:
  """The variables computed from any of ``sources`` (and ``sources``)."""
  out = set(sources)
  for e in jaxpr.eqns:
    if any(v in out for v in _vars(e.invars)):
      out.update(e.outvars)
  return out


def _roots(jaxpr, live: list, waiting: set, cheap: set, defined: dict) -> tuple[list, set]:
  """The values to hold at a barrier for ``live``, and the cheap equations to compute again after it.

  A live cheap value is computed again from its inputs; those of its inputs
  that wait on the barrier too are traced back the same way, down to values
  an expensive operation produced (or arguments), which are held.
  """
  held, again, seen, todo = [], set(), set(), list(live)
  while todo:
    v = todo.pop()
    if v in seen:
      continue
    seen.add(v)
    if v in cheap:
      again.add(defined[v])
      todo.extend(u for u in _vars(jaxpr.eqns[defined[v]].invars) if u in waiting)
    else:
      held.append(v)
  return held, again


def _read(env: dict, atoms) -> list:
  """The values of ``atoms`` (variables in ``env``, or literals)."""
  return [a.val if isinstance(a, jcore.Literal) else env[a] for a in atoms]


def _assign(env: dict, outvars, values) -> None:
  for var, value in zip(outvars, values):
    if not isinstance(var, jcore.DropVar):
      env[var] = value


def _bind(eqn, env: dict) -> None:
  """Evaluates one equation into ``env``, under its own source location and name."""
  with _context(eqn):
    out = eqn.primitive.bind(*_read(env, eqn.invars), **eqn.primitive.get_bind_params(eqn.params))
  _assign(env, eqn.outvars, out if eqn.primitive.multiple_results else [out])


def _inline(jaxpr, consts, args) -> list:
  """Evaluates ``jaxpr`` with the bodies of its checkpoints and ``jit`` calls inlined (recursively)."""
  env = dict(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  for eqn in jaxpr.eqns:
    if eqn.primitive.name not in _INLINED:
      _bind(eqn, env)
      continue
    body = eqn.params.get('jaxpr', eqn.params.get('call_jaxpr'))
    inner, inner_consts = (body.jaxpr, body.consts) if hasattr(body, 'consts') else (body, ())
    with _context(eqn):
      _assign(env, eqn.outvars, _inline(inner, inner_consts, _read(env, eqn.invars)))
  return _read(env, jaxpr.outvars)


def _context(eqn):
  """The equation's traceback and name stack, for the operations bound from it."""
  stack = contextlib.ExitStack()
  if _source_info is not None:
    stack.enter_context(_source_info.user_context(
        eqn.source_info.traceback,
        name_stack=_source_info.current_name_stack() + eqn.source_info.name_stack))
  stack.enter_context(eqn.ctx.manager)
  return stack
