"""Training on a device mesh: FSDP and data parallelism with ``jax.sharding`` (GSPMD).

``--mesh data=D,fsdp=F`` lays the devices out as a :class:`jax.sharding.Mesh`
with axes ``('data', 'fsdp')``. XLA's SPMD partitioner (GSPMD) does the rest:
the train step is one ``jax.jit`` program with input and output shardings, and
XLA inserts the all-gathers of parameters and the reduce-scatters of gradients.
Nothing here is a hand-written collective.

Sharding rules (docs/sharding.md lists them per model):

* every array of the train state (parameters, optimizer moments, BatchNorm
  statistics) is split along ``fsdp`` on its largest axis whose size ``fsdp``
  divides (ties go to the later axis: leading axes are layer stacks, which a
  scan slices one layer at a time); an array with no such axis, and every
  scalar (step counter, Adam's count), is replicated;
* gradients take their parameter's sharding: GSPMD propagates it from the
  optimizer update, which reads them next to the sharded moments (pinning them
  with ``with_sharding_constraint`` changes no byte of the compiled plan);
* batches are split on their leading (example) axis over ``data`` x ``fsdp``.

Remat policies are untouched: a policy decides what the backward pass keeps,
the mesh decides where each array lives; ``jax.checkpoint`` composes with
``jit`` shardings, offload included.

Multi-process runs (:func:`start_processes`) call ``jax.distributed.initialize``;
the mesh then spans every process's devices and the run is one program.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from remat.targets import with_shardings

AXES = ('data', 'fsdp')
BATCH_AXES = ('data', 'fsdp')   # the batch's leading axis is split over both
_SIM_HINT = 'XLA_FLAGS=--xla_force_host_platform_device_count'


class MeshError(ValueError):
  """A ``--mesh`` (or process) setting that cannot be used; the message is one line."""


def parse_mesh(text: str) -> dict[str, int]:
  """``'data=2,fsdp=4'`` -> ``{'data': 2, 'fsdp': 4}`` (every axis of :data:`AXES`, 1 if absent).

  Raises:
    MeshError: malformed item, unknown or repeated axis, or a size that is not
      a positive integer.
  """
  sizes = {}
  for item in (text or '').split(','):
    name, eq, value = item.strip().partition('=')
    name = name.strip()
    if not eq or not name:
      raise MeshError(f"--mesh '{text}': expected AXIS=N[,AXIS=N...] with axes "
                      f"{', '.join(AXES)}, e.g. data=2,fsdp=4")
    if name == 'tensor':   # a known request, so not "unknown": say it is not built
      raise MeshError(f"--mesh '{text}': axis 'tensor' (tensor parallelism) is not supported; "
                      f"valid: {', '.join(AXES)} (docs/sharding.md)")
    if name not in AXES:
      raise MeshError(f"--mesh '{text}': unknown axis '{name}'; valid: {', '.join(AXES)}")
    if name in sizes:
      raise MeshError(f"--mesh '{text}': axis '{name}' given twice")
    try:
      size = int(value.strip())
    except ValueError:
      size = 0
    if size < 1 or value.strip() != str(size):
      raise MeshError(f"--mesh '{text}': size of '{name}' must be a positive integer, got "
                      f"'{value.strip()}'")
    sizes[name] = size
  return {a: sizes.get(a, 1) for a in AXES}


def format_mesh(sizes: dict[str, int]) -> str:
  return ','.join(f'{a}={n}' for a, n in sizes.items())


def make_mesh(sizes: dict[str, int], devices=None) -> Mesh:
  """The mesh of ``sizes`` over ``devices`` (default: every device of every process).

  Raises:
    MeshError: the product of the sizes is not the number of devices.
  """
  devices = jax.devices() if devices is None else list(devices)
  total = math.prod(sizes.values())
  if total != len(devices):
    hint = (f'; simulate CPU devices with {_SIM_HINT}={total}'
            if devices[0].platform == 'cpu' and jax.process_count() == 1 else '')
    raise MeshError(f'--mesh {format_mesh(sizes)} has {total} devices, this run has '
                    f'{len(devices)} ({devices[0].platform}){hint}')
  # Device order: jax.devices() lists each process's devices together, so 'fsdp' (the inner
  # axis, the one that communicates every layer) stays within a process where it can.
  return Mesh(np.asarray(devices).reshape(tuple(sizes.values())), tuple(sizes))


def array_spec(shape: tuple[int, ...], fsdp: int) -> P:
  """The :class:`PartitionSpec` of one train-state array (rule in the module docstring)."""
  if fsdp == 1:
    return P()
  axes = [i for i, d in enumerate(shape) if d % fsdp == 0]
  if not axes:
    return P()
  axis = max(axes, key=lambda i: (shape[i], i))
  return P(*([None] * axis + ['fsdp']))


class Placement:
  """Where a run's arrays live: one device (``mesh`` None, the plain path) or a mesh.

  Attributes:
    mesh: the device mesh, or None for the single-device path.
  """

  def __init__(self, mesh: Mesh | None = None):
    self.mesh = mesh

  @classmethod
  def from_spec(cls, text: str | None, batch_size: int | None = None,
                devices=None) -> 'Placement':
    """The placement of a ``--mesh`` string (None: one device) over ``devices`` (default: all).

    Raises:
      MeshError: a bad string, a device count that does not match, or a batch
        that does not split evenly over ``data`` x ``fsdp``.
    """
    if text is None:
      return cls(None)
    sizes = parse_mesh(text)
    mesh = make_mesh(sizes, devices)
    shards = math.prod(sizes[a] for a in BATCH_AXES)
    if batch_size is not None and batch_size % shards:
      raise MeshError(f'--batch-size {batch_size} does not split over --mesh {text} '
                      f'({shards} batch shards); pass a multiple of {shards}')
    return cls(mesh)

  @property
  def description(self) -> str:
    if self.mesh is None:
      return 'one device'
    return (f"mesh {format_mesh(dict(self.mesh.shape))} over {self.mesh.size} "
            f"{self.mesh.devices.flat[0].platform} devices"
            f"{f' in {jax.process_count()} processes' if jax.process_count() > 1 else ''}")

  @property
  def is_primary(self) -> bool:
    """True in the one process that writes logs and metrics (process 0)."""
    return jax.process_index() == 0

  # Shardings --------------------------------------------------------------------------------
  def state_shardings(self, state) -> Any:
    """NamedShardings of every array of a (concrete or abstract) train state."""
    fsdp = self.mesh.shape['fsdp']
    return jax.tree_util.tree_map(
        lambda a: NamedSharding(self.mesh, array_spec(tuple(a.shape), fsdp)), state)

  def batch_shardings(self, batch) -> Any:
    """NamedShardings of a batch: the leading axis over ``data`` x ``fsdp``."""
    return jax.tree_util.tree_map(
        lambda a: NamedSharding(self.mesh, P(BATCH_AXES)), batch)

  def local_rows(self, batch_size: int) -> tuple[int, ...] | None:
    """The rows of a global batch that this process's devices hold (None: all of them).

    A data source decodes only these; :meth:`put_batch` reads only these rows
    of the host batch in this process, so the others may be left as zeros.
    """
    if self.mesh is None:
      return None
    sharding = NamedSharding(self.mesh, P(BATCH_AXES))
    rows = set()
    for index in sharding.addressable_devices_indices_map((batch_size,)).values():
      rows.update(range(batch_size)[index[0]])
    return None if len(rows) == batch_size else tuple(sorted(rows))

  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, P())

  def abstract(self, tree, shardings=None):
    """``tree``'s ShapeDtypeStructs with their shardings (the state's rule by default).

    On one device the structs get device 0 (what orbax restores onto, whatever
    mesh wrote the checkpoint).
    """
    if self.mesh is None:
      return with_shardings(tree, jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))
    return with_shardings(tree, self.state_shardings(tree) if shardings is None else shardings)

  # Arrays -----------------------------------------------------------------------------------
  def put(self, tree, shardings):
    """Global arrays from host values that every process holds whole (a batch, a fresh state).

    Each process hands over only its own devices' slices, so the same call
    works in one process and in many (``jax.device_put`` cannot place a host
    array onto devices of other processes).
    """
    def one(x, sharding):
      host = np.asarray(x)
      return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])
    return jax.tree_util.tree_map(one, jax.device_get(tree), shardings)

  def put_state(self, state):
    """``state`` (built on one device, the same in every process) laid out on the mesh."""
    return state if self.mesh is None else self.put(state, self.state_shardings(state))

  def put_batch(self, batch):
    """A host batch (the whole global batch, in every process) split over the mesh."""
    return batch if self.mesh is None else self.put(batch, self.batch_shardings(batch))

  # Programs ---------------------------------------------------------------------------------
  def jit_train_step(self, step_fn: Callable, state, batch):
    """``jax.jit`` of ``step_fn(state, batch) -> (state, stats)`` with the mesh's shardings.

    The state is donated; the new state keeps the state's shardings and the
    stats come back replicated.
    """
    state_sh = self.state_shardings(state)
    return jax.jit(step_fn, in_shardings=(state_sh, self.batch_shardings(batch)),
                   out_shardings=(state_sh, self.replicated()), donate_argnums=0)

  def compile_train_step(self, model, tx, seed: int, state, batch, guard: bool = False,
                         microbatches: int = 1):
    """AOT-compiles the train step for abstract ``state`` and ``batch`` (see :func:`jit_train_step`).

    Off-mesh this is :func:`training.step.train_step.compile_train_step`; on a mesh the
    compiled program is XLA's partitioned (per-device) program, so its
    ``memory_analysis()`` is per device. ``microbatches``: ``--grad-accum``
    (:mod:`training.step.accumulate`).
    """
    from remat.targets import compiler_options
    from training.step import train_step as st
    if self.mesh is None:
      return st.compile_train_step(model, tx, seed, state, batch, guard=guard,
                                   microbatches=microbatches)
    step = self.jit_train_step(st.make_train_step(model, tx, seed, guard, microbatches), state,
                               batch)
    return step.lower(*self.step_inputs(state, batch)).compile(
        compiler_options=compiler_options() or None)

  def step_inputs(self, state, batch):
    """``(state, batch)`` as abstract arrays with their shardings on the mesh.

    Traced from them the program knows it is split over devices, as when it is
    called on the placed arrays (:func:`remat.kept_in_gradients.partitioned`);
    ``in_shardings`` alone leave the traced values' types without the mesh.
    """
    return self.abstract(state), self.abstract(batch, self.batch_shardings(batch))

  @property
  def batch_shards(self) -> int:
    """How many ways a batch's rows are split (``data`` x ``fsdp``; 1 on one device)."""
    return 1 if self.mesh is None else math.prod(self.mesh.shape[a] for a in BATCH_AXES)


# Processes -------------------------------------------------------------------------------------
# JAX_COORDINATOR_ADDRESS is JAX's own (jax.distributed.initialize reads it); JAX 0.10.2 reads no
# variable for the process count or id (it takes them from arguments or a cluster it detects:
# SLURM, Open MPI, Kubernetes, Cloud TPU), so these two are train.py's, named alike.
_ENV = ('JAX_COORDINATOR_ADDRESS', 'JAX_NUM_PROCESSES', 'JAX_PROCESS_ID')


def add_flags(parser: argparse.ArgumentParser):
  """Adds ``--mesh`` and the multi-process flags to a parser."""
  parser.add_argument('--mesh', default=None, metavar='AXIS=N,...',
                      help=f"device mesh, axes {', '.join(AXES)}: parameters, gradients and "
                           "optimizer state split along fsdp, the batch along data x fsdp "
                           "(docs/sharding.md; default: one device)")
  parser.add_argument('--coordinator', default=None, metavar='HOST:PORT',
                      help='multi-process run: address of process 0 (or JAX_COORDINATOR_ADDRESS)')
  parser.add_argument('--num-processes', type=int, default=None, metavar='N',
                      help='multi-process run: number of processes (or JAX_NUM_PROCESSES)')
  parser.add_argument('--process-id', type=int, default=None, metavar='I',
                      help='multi-process run: this process, 0..N-1 (or JAX_PROCESS_ID)')


def start_processes(coordinator: str | None, num_processes: int | None,
                    process_id: int | None) -> bool:
  """Joins a multi-process run when the flags or the variables of :data:`_ENV` ask for one.

  A flag wins over its variable. Any one of the three settings makes a
  multi-process run, which then needs all three. Call before anything touches a
  JAX backend. Returns whether it initialised.

  Raises:
    MeshError: an incomplete or inconsistent set of settings (one line).
  """
  coordinator = coordinator or os.environ.get('JAX_COORDINATOR_ADDRESS') or None
  num_processes = num_processes if num_processes is not None else _env_int('JAX_NUM_PROCESSES')
  process_id = process_id if process_id is not None else _env_int('JAX_PROCESS_ID')
  given = (('--coordinator', coordinator), ('--num-processes', num_processes),
           ('--process-id', process_id))
  if all(v is None for _, v in given):
    return False
  missing = [f for f, v in given if v is None]
  if missing:
    raise MeshError(f"a multi-process run needs {', '.join(missing)} too (or "
                    f"{', '.join(_ENV)})")
  host, _, port = coordinator.rpartition(':')
  if not host or not port.isdigit():
    raise MeshError(f"--coordinator '{coordinator}': expected HOST:PORT")
  if num_processes < 1 or not 0 <= process_id < num_processes:
    raise MeshError(f'--process-id {process_id} must be in 0..{num_processes - 1} '
                    f'(--num-processes {num_processes})')
  # Explicit arguments: jax.distributed.initialize() alone would read only the address and
  # then fail ('Number of processes must be defined.') outside a cluster it detects.
  jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                             process_id=process_id)
  return True


def _env_int(name: str) -> int | None:
  value = os.environ.get(name)
  try:
    return None if value is None else int(value)
  except ValueError:
    raise MeshError(f"{name}='{value}' is not an integer") from None


class NullMetrics:
  """What processes other than 0 write instead of ``metrics.jsonl``: nothing."""

  def write(self, row: dict):
    del row

  def sync(self):
    pass

  def close(self):
    pass
