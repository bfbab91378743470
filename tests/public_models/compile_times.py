"""Prints docs/own-model.md's compile times: each deep public model's loss gradient, scanned and as ``auto`` lays it out.

    PYTHONPATH=. python -m tests.public_models.compile_times [--models vit,lm1b,gemma,gemma3]
        [--rules full,dots,none] [--target h100]

For each model (:func:`tests.public_models.deep_case`, >= 8 layers) and rule:
the process CPU seconds of lowering and compiling ``jax.value_and_grad`` of the
stacked loss for the target, and its ``temp``, once with the stack as one scan
and once under the default ``layout='auto'``, ``jax.clear_caches()`` before
each. CPU time rather than wall time, so that other work on the machine counts
less (XLA's GPU compiler also runs ``ptxas`` in child processes, which it does
not count; on an idle machine the wall times were within 10% of it).
"""

import argparse
import time

from remat.targets import prefer_cpu_without_gpu

prefer_cpu_without_gpu()

import jax  # noqa: E402

import remat.layout  # noqa: E402
from remat.measuring import compile_step  # noqa: E402
from remat.memory import compiled_memory  # noqa: E402
from remat.targets import get_target  # noqa: E402
from tests.public_models import deep_case  # noqa: E402


def compile_time(name: str, rule: str, target, layout: str) -> tuple[float, float]:
  """(CPU seconds, temp in MiB) of one compile of the model's gradient under ``layout``."""
  case = deep_case(name)
  stacked = case.stack(case.params)
  deepest = remat.layout.AUTO_UNROLL_MAX
  # 'scan': auto's own rule for stacks deeper than it unrolls, applied to this one.
  remat.layout.AUTO_UNROLL_MAX = 0 if layout == 'scan' else deepest
  try:
    jax.clear_caches()
    start = time.process_time()
    compiled = compile_step(case.stacked(rule), stacked, case.batch, target=target)
    seconds = time.process_time() - start
  finally:
    remat.layout.AUTO_UNROLL_MAX = deepest
  return seconds, compiled_memory(compiled, target.name).temp / 2**20


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument('--models', default='vit,lm1b,gemma,gemma3')
  ap.add_argument('--rules', default='full,dots,none')
  ap.add_argument('--target', default='h100')
  args = ap.parse_args()
  target = get_target(args.target)
  print(f'# loss gradient, {target.name} plan, jax {jax.__version__}; process CPU seconds of '
        'lowering + compiling; temp in MiB')
  print('| model | rule | scan | `auto` | ratio | temp scan / `auto` |')
  print('|---|---|---|---|---|---|')
  for name in args.models.split(','):
    for rule in args.rules.split(','):
      scan_s, scan_t = compile_time(name, rule, target, 'scan')
      auto_s, auto_t = compile_time(name, rule, target, 'auto')
      print(f'| {name} | `{rule}` | {scan_s:.1f} s | {auto_s:.1f} s | {auto_s / scan_s:.2f}x '
            f'| {scan_t:.2f} / {auto_t:.2f} |', flush=True)


if __name__ == '__main__':
  main()
