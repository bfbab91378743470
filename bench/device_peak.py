"""Measured device peak of one zoo train step, in a fresh process: ``python -m bench.device_peak``.

The allocator's ``peak_bytes_in_use`` never resets within a process, so each
measurement runs in its own process (:func:`measured_device_peak` starts it).
The process builds the model for real on the default device, runs two steps
(the second with warm caches), and prints one JSON line: ``peak_bytes`` (None
where the backend keeps no memory statistics, as on CPU) and ``backend``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from training.arguments import OneLineParser, positive_int

# The checkout that holds bench/, configs/, models/ and training/: the child imports them from here.
ROOT = Path(__file__).resolve().parents[1]


def measured_device_peak(config: str, spec: str, batch_size: int, size: int,
                         timeout: float = 900, dtype: str = 'float32') -> dict:
  """Runs the measurement in a fresh process; returns ``{'peak_bytes', 'backend'}``.

  ``dtype`` is the model's compute dtype (it overrides the config's).

  Raises:
    RuntimeError: if the process fails (its last stderr line is in the message).
  """
  cmd = [sys.executable, '-m', 'bench.device_peak', '--config', config, '--policy', spec,
         '--batch-size', str(batch_size), '--size', str(size), '--dtype', dtype]
  # The app packages are not installed (only remat is), so the child finds them on its path.
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [str(ROOT)] + [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p]))
  run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
  lines = [l for l in run.stdout.splitlines() if l.startswith('{')]
  if run.returncode or not lines:
    last = (run.stderr.strip().splitlines() or ['no output'])[-1]
    raise RuntimeError(f'device-peak process for {spec} failed: {last}')
  return json.loads(lines[-1])


def main(argv=None) -> int:
  p = OneLineParser(prog='python -m bench.device_peak')
  p.add_argument('--config', required=True)
  p.add_argument('--policy', required=True)
  p.add_argument('--batch-size', type=positive_int, required=True)
  p.add_argument('--size', type=positive_int, required=True, help='sequence length or image side')
  p.add_argument('--dtype', default=None, help="compute dtype (default: the config's)")
  args = p.parse_args(argv)

  from remat.targets import prefer_cpu_without_gpu
  prefer_cpu_without_gpu()

  import jax

  from bench import zoo
  from configs import load_config, with_dtype

  c = zoo.case(with_dtype(load_config(args.config), args.dtype).model, args.batch_size, args.size)
  policy = c.policy(args.policy)
  step = jax.jit(c.train_step(policy).step, donate_argnums=0)
  state, batch = c.real_step_args()
  for _ in range(2):
    state, loss = step(state, batch)
  jax.block_until_ready(loss)
  stats = jax.devices()[0].memory_stats()
  print(json.dumps({'peak_bytes': None if not stats else stats.get('peak_bytes_in_use'),
                    'backend': jax.default_backend()}))
  return 0


if __name__ == '__main__':
  sys.exit(main())
