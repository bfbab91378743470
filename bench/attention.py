"""Attention alone, dense vs blockwise vs cuDNN: planned memory of a fwd+bwd step against T, and CPU speed.

``python -m bench.attention [--seq-lens 512,1024,...] [--targets cpu,h200] [--time-seq-lens 1024,2048]``

One step is ``jax.value_and_grad`` of ``sum(attention(q, k, v) * w)`` with
respect to ``(q, k, v)``, causal, at GPT-2 small's width (12 heads of 64) by
default. Memory is XLA's compiled ``temp`` (:func:`remat.measuring.step_memory`):
every buffer besides the inputs and outputs, so the [B, H, T, T] arrays of
dense attention and the block working set of blockwise attention. Time is the
median of 5 jitted steps after 2 warm-up steps on the local backend, every
implementation in this one process. Prints markdown tables and the environment.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

from remat.targets import prefer_cpu_without_gpu
from training.arguments import OneLineParser, positive_int, positive_ints

# The dtypes the memory tables may be compiled in (attention's inputs; cuDNN takes the 16-bit ones).
DTYPES = ('bfloat16', 'float16', 'float32')


def _commit() -> str:
  try:
    return subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True,
                          check=True, cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return 'unknown'


def _cpu_name() -> str:
  try:
    with open('/proc/cpuinfo') as f:
      for line in f:
        if line.startswith('model name'):
          return line.split(':', 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or 'unknown'


def step_program(implementation: str, causal: bool = True):
  """``loss((q, k, v), w)`` of one attention call: what :func:`remat.measuring.step_memory` compiles."""
  import jax.numpy as jnp

  from models.attention import attention

  def loss(qkv, w):
    q, k, v = qkv
    out = attention(q, k, v, causal=causal, dropout_rate=0.0, deterministic=True, rng=None,
                    implementation=implementation)
    return jnp.sum(out.astype(jnp.float32) * w)
  return loss


def step_args(batch: int, t: int, heads: int, head_dim: int, dtype, kv_heads: int | None = None):
  """Abstract ``((q, k, v), w)`` for :func:`step_program`."""
  import jax
  import jax.numpy as jnp
  kv = kv_heads or heads
  qkv = (jax.ShapeDtypeStruct((batch, t, heads, head_dim), dtype),
         jax.ShapeDtypeStruct((batch, t, kv, head_dim), dtype),
         jax.ShapeDtypeStruct((batch, t, kv, head_dim), dtype))
  return qkv, jax.ShapeDtypeStruct((batch, t, heads, head_dim), jnp.float32)


def planned_temp(implementation: str, target: str, batch: int, t: int, heads: int, head_dim: int,
                 dtype) -> int | str:
  """Compiled temp bytes of one step, or the one-line error that stopped the compile."""
  from remat.measuring import step_memory
  try:
    return step_memory(step_program(implementation), *step_args(batch, t, heads, head_dim, dtype),
                       target=target).temp
  except Exception as e:   # report what the compiler says, e.g. cuDNN missing on a CPU machine
    return f'{type(e).__name__}: {str(e).splitlines()[0][:80]}'


def step_seconds(implementation: str, batch: int, t: int, heads: int, head_dim: int, dtype) -> float:
  """Median seconds of one jitted fwd+bwd step on the local backend."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from remat.measuring import time_step
  from remat.targets import compiler_options
  (q, k, v), w = step_args(batch, t, heads, head_dim, dtype)
  rng = np.random.default_rng(0)
  arrays = [jnp.asarray(rng.standard_normal(a.shape), a.dtype) for a in (q, k, v, w)]
  fn = jax.jit(jax.value_and_grad(step_program(implementation)))
  args = ((arrays[0], arrays[1], arrays[2]), arrays[3])
  compiled = fn.lower(*args).compile(compiler_options=compiler_options() or None)
  return time_step(compiled, args, donated=False)


def _fmt(x) -> str:
  return f'{x / 2**20:,.1f}' if isinstance(x, int) else x


def main(argv=None) -> int:
  p = OneLineParser(prog='python -m bench.attention')
  p.add_argument('--seq-lens', type=positive_ints, default='1024,2048,4096,8192')
  p.add_argument('--time-seq-lens', type=positive_ints, default='1024,2048,4096')
  p.add_argument('--targets', default='cpu,h200')
  p.add_argument('--implementations', default='dense,blockwise,cudnn')
  p.add_argument('--batch', type=positive_int, default=1)
  p.add_argument('--heads', type=positive_int, default=12)
  p.add_argument('--head-dim', type=positive_int, default=64)
  p.add_argument('--dtype', default='bfloat16,float32',
                 help='memory tables in these dtypes (time: float32 only)')
  args = p.parse_args(argv)
  bad = [d for d in args.dtype.split(',') if d not in DTYPES]
  if bad:
    p.error(f"--dtype: '{bad[0]}' is not one of {', '.join(DTYPES)}")
  prefer_cpu_without_gpu()
  import jax
  import jax.numpy as jnp

  seqs = args.seq_lens
  impls = args.implementations.split(',')
  print(f'command: python -m bench.attention {" ".join(argv if argv is not None else sys.argv[1:])}')
  print(f'commit {_commit()}, jax {jax.__version__}, backend {jax.default_backend()}, '
        f'{os.cpu_count()} CPUs ({_cpu_name()})')
  print(f'shape: batch {args.batch}, {args.heads} heads of {args.head_dim}, causal, no dropout; '
        'temp of value_and_grad w.r.t. (q, k, v), MiB')
  for target in args.targets.split(','):
    for dtype_name in args.dtype.split(','):
      dtype = jnp.dtype(dtype_name)
      print(f'\n### target {target}, {dtype_name}\n')
      print('| implementation | ' + ' | '.join(f'T={t}' for t in seqs) + ' | temp(2T)/temp(T), last |')
      print('|---' * (len(seqs) + 2) + '|')
      for impl in impls:
        temps = [planned_temp(impl, target, args.batch, t, args.heads, args.head_dim, dtype)
                 for t in seqs]
        ratio = (f'{temps[-1] / temps[-2]:.2f}' if len(temps) > 1 and all(
            isinstance(x, int) and x for x in temps[-2:]) else '-')
        if all(isinstance(x, str) for x in temps) and len(set(temps)) == 1:
          print(f'| {impl} | ' + f'does not compile: {temps[0]}' + ' |' * len(seqs) + ' - |')
        else:
          print(f'| {impl} | ' + ' | '.join(_fmt(x) for x in temps) + f' | {ratio} |')
        sys.stdout.flush()
  times = args.time_seq_lens
  if times:
    print(f'\n### time on the local {jax.default_backend()} backend, float32, '
          'median of 5 fwd+bwd steps (ms)\n')
    print('| T | dense | blockwise | dense / blockwise |')
    print('|---|---|---|---|')
    for t in times:
      d = step_seconds('dense', args.batch, t, args.heads, args.head_dim, jnp.float32)
      b = step_seconds('blockwise', args.batch, t, args.heads, args.head_dim, jnp.float32)
      print(f'| {t} | {d * 1e3:.0f} | {b * 1e3:.0f} | {d / b:.2f} |')
      sys.stdout.flush()
  return 0


if __name__ == '__main__':
  sys.exit(main())
