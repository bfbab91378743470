"""Per-device memory plan of a train step on a mesh: ``python -m bench.report --mesh fsdp=8``.

XLA's SPMD partitioner turns the one-program train step into a per-device
program; ``memory_analysis()`` of that compiled program is therefore per
device. This module splits it into shares:

* ``params``, ``opt_state``, ``batch``: bytes of each device's shards of the
  arguments, from their shardings (their sum plus the step counter is XLA's
  ``argument`` figure, which is printed beside them as a check);
* ``grads``: gradients take their parameters' sharding, so one device's share
  is the ``params`` share (they live inside ``temp`` during the step);
* ``temp - grads``: the rest of XLA's temporary buffer: activations saved for
  the backward pass, the remat recompute working set, the gathered parameters
  of the layer being computed, optimizer temporaries;
* ``peak`` as :class:`remat.memory.MemoryStats` defines it.

Compile only: nothing is allocated, so a mesh of simulated CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``) plans any model shape,
and so does a mesh of abstract GPUs (:func:`gpu_devices`: the deviceless GPU
compiler of the gpu-plan extra plans one host of N H100s or H200s).
"""

from __future__ import annotations

import jax

from remat.layout import compiling_for
from remat.memory import MemoryStats, compiled_memory, format_bytes
from remat.targets import GPU_TARGETS, TARGET_DIR, compiler_options
from training.step.mesh import Placement


def gpu_devices(target: str, count: int) -> list:
  """``count`` abstract devices of GPU ``target`` ('h100', 'h200') on one host, for planning.

  Needs the jax-cuda12 plugin (gpu-plan extra); no GPU or CUDA libraries.
  ``jax.experimental.topologies`` names a topology
  ``slices x hosts-per-slice x devices-per-host``; one host of ``count`` GPUs
  is ``1x1xcount``.
  """
  from jax.experimental import topologies
  text = (TARGET_DIR / GPU_TARGETS[target]).read_text()
  return list(topologies.get_topology_desc(platform='cuda', target_config=text,
                                           topology=f'1x1x{count}').devices)


def shard_bytes(tree, shardings) -> int:
  """Bytes one device holds of ``tree`` (abstract arrays) under ``shardings`` (device 0's share)."""
  total = 0
  for a, s in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(shardings)):
    shape = s.shard_shape(tuple(a.shape))
    n = 1
    for d in shape:
      n *= d
    total += n * a.dtype.itemsize
  return total


def plan_row(place: Placement, step_fn, state, batch, spec: str) -> dict:
  """Compiles ``step_fn(state, batch)`` on ``place``'s mesh; returns the per-device shares."""
  platform = place.mesh.devices.flat[0].platform   # 'cpu', or 'gpu' for abstract GPUs
  with compiling_for('cpu' if platform == 'cpu' else 'gpu'):   # layout='auto' per target
    lowered = place.jit_train_step(step_fn, state, batch).lower(
        *place.step_inputs(state, batch))
  compiled = lowered.compile(
      compiler_options=compiler_options('cpu' if platform == 'cpu' else 'gpu') or None)
  mem: MemoryStats = compiled_memory(compiled, platform)
  sh = place.state_shardings(state)
  grads = shard_bytes(state.params, sh.params)   # what trains (a LoRA run: its adapters)
  params = grads + shard_bytes(state.model_state, sh.model_state) + shard_bytes(state.frozen,
                                                                                sh.frozen)
  opt = shard_bytes(state.opt_state, sh.opt_state)
  return {'policy': spec, 'mesh': dict(place.mesh.shape), 'devices': place.mesh.size,
          'params': params, 'opt_state': opt, 'grads': grads,
          'batch': shard_bytes(batch, place.batch_shardings(batch)),
          'argument': mem.argument, 'output': mem.output, 'alias': mem.alias, 'temp': mem.temp,
          'temp_minus_grads': mem.temp - grads, 'host_temp': mem.host_temp, 'peak': mem.peak}


COLUMNS = (('policy', 'policy'), ('params', 'params'), ('opt_state', 'opt state'),
           ('grads', 'grads'), ('batch', 'batch'), ('temp_minus_grads', 'temp - grads'),
           ('temp', 'XLA temp'), ('argument', 'XLA argument'), ('peak', 'peak'))


def format_plan(rows: list[dict], header: str) -> str:
  """A text table, one row per policy, every figure per device."""
  cells = [[r[k] if k == 'policy' else format_bytes(r[k]) for k, _ in COLUMNS] for r in rows]
  titles = [t for _, t in COLUMNS]
  widths = [max(len(t), *(len(c[i]) for c in cells)) for i, t in enumerate(titles)]
  line = lambda vals: '  '.join(v.ljust(w) if i == 0 else v.rjust(w)
                                for i, (v, w) in enumerate(zip(vals, widths)))
  notes = ['# per device: params/opt state/batch are the shards each device holds; grads take the '
           'params\' sharding (inside XLA temp); temp - grads = saved activations, recompute '
           'working set, gathered layer parameters, optimizer temporaries; '
           'peak = argument + output - alias + temp']
  return '\n'.join([header, line(titles)] + [line(c) for c in cells] + notes)
