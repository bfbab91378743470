"""Compile targets: the local CPU backend, or an NVIDIA GPU planned on a CPU-only machine.

A GPU target is described by a ``GpuTargetConfigProto`` (``remat/targets/*.txtpb``:
SM count, memory size, bandwidth, compute capability ...). With the jax-cuda12
plugin and PJRT wheels installed (``pip install -e ".[gpu-plan]"``; no CUDA
libraries or GPU needed), ``jax.experimental.topologies`` gives abstract devices
of that GPU, and ``jit(...).lower(...).compile()`` runs XLA's real GPU pipeline,
so ``memory_analysis()`` is the GPU's memory plan, offload to pinned host included.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path

import jax

TARGET_DIR = Path(__file__).parent / 'targets'
GPU_TARGETS = {'h100': 'h100.txtpb', 'h200': 'h200.txtpb'}
TARGETS = ('cpu',) + tuple(GPU_TARGETS)


# XLA's while-loop simplifier inlines loops of one iteration: a one-block stack (a ResNet stage's
# downsampling block), a remainder segment, a `stage` segment. The CPU backend then keeps the
# activations those checkpoints were to drop (ResNet-50 at 1024 px, batch 8: `full` 56% of
# `none`'s temp with the pass, 32% without it); GPU pipelines honour the checkpoints either way.
# Pass these to `.compile(compiler_options=...)` of CPU steps that use the layer stack.
CPU_COMPILER_OPTIONS = {'xla_disable_hlo_passes': 'simplify-while-loops'}


def compiler_options(platform: str | None = None) -> dict:
  """XLA options for compiling layer-stack steps on ``platform`` (default: JAX's default backend)."""
  platform = platform or jax.default_backend()
  return dict(CPU_COMPILER_OPTIONS) if platform == 'cpu' else {}


class TargetError(ValueError):
  """A target that cannot be compiled for here; the message is one line."""


@dataclasses.dataclass(frozen=True)
class Target:
  """Where a step is compiled for: ``sharding`` is None for the local default backend."""
  name: str
  description: str
  sharding: jax.sharding.Sharding | None = None
  device_memory: int | None = None
  memory_bandwidth: float | None = None   # device memory bytes/s (the GPU target config's)

  @property
  def platform(self) -> str:
    """'gpu' for a planned GPU, else the local backend's name: what an 'auto' layout is chosen for."""
    return 'gpu' if self.sharding is not None else jax.default_backend()

  @property
  def compiler_options(self) -> dict:
    """XLA options for this target (see :data:`CPU_COMPILER_OPTIONS`)."""
    return compiler_options() if self.sharding is None else {}

  def place(self, tree):
    """Gives abstract inputs this target's sharding (a no-op for the local backend)."""
    return tree if self.sharding is None else with_shardings(tree, self.sharding)


def with_shardings(tree, shardings):
  """Abstract inputs carrying ``shardings`` (``jax.jit``'s ``in_shardings``: a prefix of ``tree``).

  Traced from these, each value's type names the mesh, as when the program is
  called on sharded arrays; traced from unsharded ones with ``in_shardings``
  alone it names none, and a stack cannot tell that the program is split over
  devices (:func:`remat.kept_in_gradients.partitioned`).
  """
  def leaf(s, sub):
    return jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), sub)
  return jax.tree_util.tree_map(leaf, shardings, tree,
                                is_leaf=lambda v: isinstance(v, jax.sharding.Sharding))


def prefer_cpu_without_gpu() -> None:
  """Keeps JAX on the CPU backend on a machine with no NVIDIA driver, unless JAX_PLATFORMS is set.

  Otherwise an installed jax-cuda12 plugin (the gpu-plan extra) tries to start
  CUDA at the first computation and logs a traceback before falling back to CPU.
  GPU targets are still compiled for explicitly (:func:`get_target`). Call it
  before the first computation.
  """
  if 'JAX_PLATFORMS' not in os.environ and not os.path.exists('/proc/driver/nvidia'):
    jax.config.update('jax_platforms', 'cpu')


def gpu_plugin_available() -> bool:
  """True when the jax-cuda12 plugin (needed to compile for a GPU target) is installed."""
  try:
    return importlib.util.find_spec('jax_plugins.xla_cuda12') is not None
  except ImportError:   # no jax_plugins namespace at all
    return False


def get_target(name: str) -> Target:
  """Returns the named target: 'cpu' (local backend), 'h100' or 'h200'.

  Raises:
    TargetError: unknown name, or the GPU plugin is missing.
  """
  if name == 'cpu':
    return Target('cpu', f'local {jax.default_backend()} backend')
  if name not in GPU_TARGETS:
    raise TargetError(f"unknown target '{name}'; valid: {', '.join(TARGETS)}")
  if not gpu_plugin_available():
    raise TargetError(f"target '{name}' needs the jax-cuda12 plugin: pip install -e \".[gpu-plan]\"")
  from jax.experimental import topologies
  text = (TARGET_DIR / GPU_TARGETS[name]).read_text()
  device = topologies.get_topology_desc(platform='cuda', target_config=text,
                                        topology='1x1x1').devices[0]
  field = lambda key: next(int(l.split(':')[1].split('#')[0]) for l in text.splitlines()
                           if l.strip().startswith(key))
  return Target(name, device.device_kind, jax.sharding.SingleDeviceSharding(device),
                field('device_memory_size'), float(field('memory_bandwidth')))
