"""Measured device peak of one train step, in a fresh process: ``python -m remat.device_peak``.

The allocator's ``peak_bytes_in_use`` never resets within a process, so each
measurement runs in its own process (:func:`measured_device_peak` starts it).
The process builds the model for real on the default device, runs two steps
(the second with warm caches), and prints one JSON line: ``peak_bytes`` (None
where the backend keeps no memory statistics, as on CPU) and ``backend``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys


def measured_device_peak(config: str, spec: str, batch_size: int, size: int,
                         timeout: float = 900) -> dict:
  """Runs the measurement in a fresh process; returns ``{'peak_bytes', 'backend'}``.

  Raises:
    RuntimeError: if the process fails (its last stderr line is in the message).
  """
  cmd = [sys.executable, '-m', 'remat.device_peak', '--config', config, '--policy', spec,
         '--batch-size', str(batch_size), '--size', str(size)]
  run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
  lines = [l for l in run.stdout.splitlines() if l.startswith('{')]
  if run.returncode or not lines:
    last = (run.stderr.strip().splitlines() or ['no output'])[-1]
    raise RuntimeError(f'device-peak process for {spec} failed: {last}')
  return json.loads(lines[-1])


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog='python -m remat.device_peak')
  p.add_argument('--config', required=True)
  p.add_argument('--policy', required=True)
  p.add_argument('--batch-size', type=int, required=True)
  p.add_argument('--size', type=int, required=True, help='sequence length or image side')
  args = p.parse_args(argv)

  import jax

  from configs import load_config
  from remat.policies import get_policy
  from remat.targets import prefer_cpu_without_gpu
  from training import steps as st
  from training.tasks import Task

  prefer_cpu_without_gpu()

  task = Task(load_config(args.config).model).at_size(args.size)
  model = task.model(get_policy(args.policy, num_layers=task.num_layers))
  tx = st.make_optimizer(1e-3, 1000, 10, 0.1, 1.0)
  state = st.init_state(model, tx, 0, args.size)
  step = jax.jit(st.make_train_step(model, tx, 0), donate_argnums=0)
  batch = task.zeros_batch(args.batch_size, args.size)
  for _ in range(2):
    state, loss = step(state, batch)
  jax.block_until_ready(loss)
  stats = jax.devices()[0].memory_stats()
  print(json.dumps({'peak_bytes': None if not stats else stats.get('peak_bytes_in_use'),
                    'backend': jax.default_backend()}))
  return 0


if __name__ == '__main__':
  sys.exit(main())
