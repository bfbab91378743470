"""Optimizer state in host memory between steps, streamed to the device for the update.

``--offload-optimizer``: AdamW's moments (every optimizer state leaf shaped like
its parameter) live in pinned host memory (JAX memory kinds: ``pinned_host``
shardings, :data:`jax.memory.Space`) from one step to the next. The update
brings them to the device one slice at a time and sends the new values back:
a layer at a time for the layer stack's parameters (``[N, ...]`` leaves under
a :class:`remat.LayerStack`'s ``block``, in a :func:`jax.lax.fori_loop`), and
one parameter at a time for the others (embeddings, final norm, head; each
transfer ordered after the previous update by an optimization barrier). The
device then holds the parameters, the gradients and one slice of the moments,
instead of all the moments.

The update is the ordinary one (:func:`training.step.train_step.make_optimizer`):
the global-norm clip is computed once over all gradients, then the per-element
part of the optimizer (AdamW with its schedule, :func:`optimizer_parts`) runs on
each slice; AdamW is elementwise, so the results are the ordinary step's (the
tests check equality on the CPU backend, where the same streamed update runs
without transfers). The state keeps its tree, so checkpoints are unchanged.

State that is not per parameter and not a scalar (a factored second moment, a
preconditioner) cannot be streamed with its parameter: :func:`check_state`
refuses it in one line (:class:`OffloadError`).

On the CPU backend host and device memory are the same RAM: the trainer says so
in one line and compiles the ordinary step. GPU plans on this CPU machine
(``bench.report --target h100 --offload-optimizer``) compile the streamed step
with its host arguments (:func:`compile_for_target`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from jax import lax

from remat.layout import compiling_for

HOST, DEVICE = jax.memory.Space.Host, jax.memory.Space.Device


class OffloadError(ValueError):
  """An optimizer state that cannot be placed in host memory; the message is one line."""


@dataclasses.dataclass(frozen=True)
class Offload:
  """How the streamed update runs.

  Attributes:
    grad_clip: the global-norm clip applied before ``inner`` (the ordinary step's).
    inner: the per-element rest of the optimizer (AdamW with its schedule).
    num_layers: the layer stack's depth (its leaves' leading axis).
    transfer: move the state between host and device memory (False: the same
      streamed update in device memory, what the CPU backend runs in tests).
  """
  grad_clip: float
  inner: optax.GradientTransformation
  num_layers: int
  transfer: bool = True


def stacked_mask(params, num_layers: int):
  """True for a parameter leaf of the layer stack (under ``block``, leading axis ``num_layers``)."""
  def one(path, a):
    keys = [getattr(k, 'key', None) for k in path]
    return 'block' in keys and a.ndim >= 1 and a.shape[0] == num_layers
  return jax.tree_util.tree_map_with_path(one, params)


def owners(inner: optax.GradientTransformation, state, params) -> list[int]:
  """For each leaf of ``state`` (flattened), the index of its parameter leaf, or -1 (none).

  Raises:
    OffloadError: the state cannot be matched to the parameters.
  """
  ids = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params),
                                     list(range(len(jax.tree_util.tree_leaves(params)))))
  try:
    got = optax.tree_utils.tree_map_params(
        inner, lambda _, j: j, state, ids,
        transform_non_params=lambda v: jax.tree_util.tree_map(lambda _: -1, v))
  except Exception as e:   # an init that reads its parameters' values cannot be mapped
    raise OffloadError(f'--offload-optimizer: the optimizer state cannot be matched to the '
                       f'parameters ({type(e).__name__}: {str(e).splitlines()[0][:120]})') from None
  return jax.tree_util.tree_leaves(got)


def check_state(inner: optax.GradientTransformation, state, params) -> None:
  """Every state leaf is a scalar, or has its parameter's shape (what can be streamed with it).

  Raises:
    OffloadError: one line naming the first leaf that cannot be placed.
  """
  p_leaves = jax.tree_util.tree_leaves(params)
  for (path, leaf), j in zip(jax.tree_util.tree_flatten_with_path(state)[0],
                             owners(inner, state, params)):
    where = f'--offload-optimizer: the optimizer state leaf {jax.tree_util.keystr(path)}'
    if j < 0 and leaf.size > 1:
      raise OffloadError(f'{where} of shape {tuple(leaf.shape)} is not per parameter, so it '
                         "cannot be streamed with a parameter; only state shaped like its "
                         "parameter (AdamW's moments) and scalars can be placed in host memory")
    if j >= 0 and tuple(leaf.shape) != tuple(p_leaves[j].shape):
      raise OffloadError(f"{where} has shape {tuple(leaf.shape)}, not its parameter's "
                         f'{tuple(p_leaves[j].shape)}; only state shaped like its parameter can '
                         'be streamed with it')


def host_leaves(inner: optax.GradientTransformation, state, params):
  """The inner state's tree of bools: True for the leaves that live in host memory."""
  return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(state),
                                      [j >= 0 for j in owners(inner, state, params)])


def _empty(a):
  return jnp.zeros((0,), a.dtype)


def streamed_update(off: Offload, grads, opt_state, params, finite=None):
  """The ordinary update (clip, then ``off.inner``), a slice of the state at a time.

  Args:
    off: the :class:`Offload` settings.
    grads, params: the step's gradients and parameters (device).
    opt_state: ``(clip state, inner state)``, the ordinary optimizer's state;
      with ``off.transfer`` its per-parameter leaves are in host memory.
    finite: with the non-finite guard, a scalar bool: False keeps the old values.

  Returns:
    ``(new params, new opt_state)``, the state's leaves where they were.
  """
  clip_state, state = opt_state
  scale = jnp.minimum(1.0, off.grad_clip / optax.tree.norm(grads))   # clip_by_global_norm's
  p_leaves, p_def = jax.tree_util.tree_flatten(params)
  g_leaves = jax.tree_util.tree_leaves(grads)
  stacked = jax.tree_util.tree_leaves(stacked_mask(params, off.num_layers))
  s_leaves, s_def = jax.tree_util.tree_flatten(state)
  owner = owners(off.inner, state, params)
  to_dev = (lambda x: jax.device_put(x, DEVICE)) if off.transfer else (lambda x: x)
  to_host = (lambda x: jax.device_put(x, HOST)) if off.transfer else (lambda x: x)
  if off.transfer:   # the arguments' avals in host memory, so that slices of them stay there
    s_leaves = [to_host(x) if j >= 0 else x for x, j in zip(s_leaves, owner)]
  keep = (lambda new, old: new) if finite is None else (
      lambda new, old: jnp.where(finite, new, old))

  def update(chosen, get, put, p_leaves, s_leaves):
    """``off.inner`` on the parameters ``chosen`` (``get``: their slice; the rest empty)."""
    g = [get(a) * scale.astype(a.dtype) if i in chosen else _empty(a)
         for i, a in enumerate(g_leaves)]
    p = [get(a) if i in chosen else _empty(a) for i, a in enumerate(p_leaves)]
    st = [x if j < 0 else (to_dev(get(x)) if j in chosen else _empty(x))
          for x, j in zip(s_leaves, owner)]
    ups, new = off.inner.update(jax.tree_util.tree_unflatten(p_def, g),
                                jax.tree_util.tree_unflatten(s_def, st),
                                jax.tree_util.tree_unflatten(p_def, p))
    ups, new = jax.tree_util.tree_leaves(ups), jax.tree_util.tree_leaves(new)
    p_leaves = [put(a, keep(p[i] + ups[i].astype(a.dtype), p[i])) if i in chosen else a
                for i, a in enumerate(p_leaves)]
    s_leaves = [put(x, to_host(keep(n, o))) if j in chosen else x
                for x, j, o, n in zip(s_leaves, owner, st, new)]
    return p_leaves, s_leaves, [n for n, j in zip(new, owner) if j < 0]

  layers = {i for i, s in enumerate(stacked) if s}
  if layers:   # the layer stack: one layer of every stacked leaf per iteration
    def layer(i, carry):
      get = lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False)
      put = lambda a, v: lax.dynamic_update_index_in_dim(a, v, i, 0)
      return tuple(update(layers, get, put, *carry)[:2])
    p_leaves, s_leaves = lax.fori_loop(0, off.num_layers, layer, (p_leaves, s_leaves))
  others = None
  for i in [i for i, s in enumerate(stacked) if not s] or [None]:
    # Each parameter outside the stack after the previous one's writes, so that XLA does not
    # bring every parameter's state in at once.
    p_leaves, s_leaves = lax.optimization_barrier((p_leaves, s_leaves))
    p_leaves, s_leaves, others = update(set() if i is None else {i}, lambda a: a,
                                        lambda a, v: v, p_leaves, s_leaves)
  # The state that is not per parameter (Adam's count, the schedule's) advances once.
  others = iter(others)
  s_leaves = [keep(next(others), x) if j < 0 else x for x, j in zip(s_leaves, owner)]
  return (jax.tree_util.tree_unflatten(p_def, p_leaves),
          (clip_state, jax.tree_util.tree_unflatten(s_def, s_leaves)))


def apply_gradients_streamed(off: Offload, state, loss, grads, model_state, guard: bool):
  """:func:`training.step.train_step.apply_gradients` with :func:`streamed_update`."""
  finite = None
  if guard:
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    model_state = jax.tree_util.tree_map(lambda a, b: jnp.where(finite, a, b), model_state,
                                         state.model_state)
  params, opt_state = streamed_update(off, grads, state.opt_state, state.params, finite)
  new = state.replace(step=state.step + 1, params=params, model_state=model_state,
                      opt_state=opt_state)
  if not guard:
    return new, loss
  return new, jnp.stack([loss.astype(jnp.float32), grad_norm.astype(jnp.float32)])


def state_memory_kinds(off: Offload, state):
  """The train state's tree of memory kinds: ``'pinned_host'`` for the streamed optimizer state."""
  kinds = jax.tree_util.tree_map(lambda _: 'device', state)
  clip_state, inner = state.opt_state
  host = host_leaves(off.inner, inner, state.params)
  inner_kinds = jax.tree_util.tree_map(lambda h: 'pinned_host' if h else 'device', host)
  return kinds.replace(opt_state=(jax.tree_util.tree_map(lambda _: 'device', clip_state),
                                  inner_kinds))


def host_bytes(off: Offload, state) -> int:
  """Bytes of the optimizer state that live in host memory between steps."""
  _, inner = state.opt_state
  return sum(a.size * a.dtype.itemsize for a, h in zip(
      jax.tree_util.tree_leaves(inner),
      jax.tree_util.tree_leaves(host_leaves(off.inner, inner, state.params))) if h)


def compile_for_target(step, state, batch, off: Offload, target):
  """AOT-compiles ``step(state, batch)`` for a GPU ``target`` with the state on the host.

  A compile-only GPU device (:mod:`remat.targets`) has no memory spaces, so JAX
  drops the ``pinned_host`` kind of its shardings. The step is therefore lowered
  for CUDA with this machine's CPU device, whose ``pinned_host`` memory JAX
  knows (the module's arguments and results carry ``mhlo.memory_kind``, and the
  transfers their ``annotate_device_placement`` calls), and that module is
  compiled by XLA's GPU pipeline in place of the plain lowering's. On a real
  GPU, :func:`jax.jit` with ``pinned_host`` shardings does this directly.
  """
  cpu = jax.sharding.SingleDeviceSharding(jax.devices('cpu')[0])
  kinds = state_memory_kinds(off, state)
  state_sh = jax.tree_util.tree_map(lambda k: cpu.with_memory_kind(k), kinds)
  batch_sh = jax.tree_util.tree_map(lambda _: cpu, batch)
  with compiling_for(target.platform):   # stacks with layout='auto' choose for the target
    traced = jax.jit(step, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, cpu),
                     donate_argnums=0).trace(state, batch)
  module = traced.lower(lowering_platforms=('cuda',))._lowering.stablehlo()
  carrier = jax.jit(step, donate_argnums=0, keep_unused=True).lower(
      *target.place((state, batch)))
  carrier._lowering._hlo = module   # private: jax 0.10's MeshComputation holds it here
  return carrier.compile(compiler_options=target.compiler_options or None)


def for_run(cfg, inner: optax.GradientTransformation, num_layers: int, state,
            log) -> Offload | None:
  """``--offload-optimizer`` of a run: its :class:`Offload`, or None on the CPU backend.

  Checks the state first (one line for one that cannot be placed), so a refused
  run has written nothing. On the CPU backend host and device memory are the
  same RAM: one line says so, and the run compiles the ordinary step (the same
  results, bit for bit, since it is the same program).

  ``inner`` is the run's optimizer after its clip
  (:func:`training.step.train_step.elementwise_optimizer`).

  Raises:
    OffloadError: the optimizer state cannot be placed.
  """
  off = Offload(cfg.grad_clip, inner, num_layers)
  check_state(off.inner, state.opt_state[1], state.params)
  if jax.default_backend() == 'cpu':
    log('--offload-optimizer: a no-op on the CPU backend (host and device memory are the same '
        'RAM); the ordinary step runs, with the same results')
    return None
  log(f'--offload-optimizer: {host_bytes(off, state) / 2**30:.2f} GiB of optimizer state in '
      'pinned host memory between steps, streamed to the device a layer at a time')
  return off


def state_shardings(off: Offload, state, place):
  """The train state's shardings on ``place`` with the streamed state's in ``pinned_host``."""
  if place.mesh is None:
    one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    base = jax.tree_util.tree_map(lambda _: one, state)
  else:
    base = place.state_shardings(state)
  return jax.tree_util.tree_map(lambda s, k: s.with_memory_kind(k), base,
                                state_memory_kinds(off, state))


def compile_run_step(place, step_fn, state, batch, off: Offload):
  """``step_fn`` (the run's step, made with ``offload=off``) compiled for a GPU with the
  streamed state in host memory (the state donated)."""
  from remat.targets import compiler_options, with_shardings
  state_sh = state_shardings(off, state, place)
  if place.mesh is None:
    one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    batch_sh, out = jax.tree_util.tree_map(lambda _: one, batch), one
  else:
    batch_sh, out = place.batch_shardings(batch), place.replicated()
  step = jax.jit(step_fn, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, out),
                 donate_argnums=0)
  # Traced from inputs with their shardings, as the run's placed arrays are: on a mesh the
  # stacks then see that the program is split (remat.kept_in_gradients.partitioned).
  inputs = with_shardings((state, batch), (state_sh, batch_sh))
  return step.lower(*inputs).compile(compiler_options=compiler_options() or None)
