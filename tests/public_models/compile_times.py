"""Prints docs/own-model.md's compile times: each deep public model's loss gradient, scanned and as ``auto`` lays it out.

    PYTHONPATH=. python -m tests.public_models.compile_times [--models vit,lm1b,gemma,gemma3]
        [--rules full,dots,none] [--target h100] [--variants scan,auto,loops,constant,dynamic,rank]

For each model (:func:`tests.public_models.deep_case`, >= 8 layers) and rule:
the process CPU seconds of lowering and compiling ``jax.value_and_grad`` of the
stacked loss for the target, and its ``temp``, per variant, ``jax.clear_caches()``
before each: ``scan``, the stack as one scan; ``auto``, the default layout;
``loops``, the ``'loops'`` layout whatever ``auto`` would choose;
``constant`` and ``dynamic``, ``auto`` with :mod:`remat.unrolled` reading every
parameter slice at a constant offset (as before commit b4c4e97) or every one at
an opaque offset (the variant docs/own-model.md measured and did not adopt);
``rank``, ``auto`` with a leaf read in place when it has more than one
dimension per item (as before matmul operands were found in the block). CPU
time rather than wall time, so that other work on the machine counts less
(XLA's GPU compiler also runs ``ptxas`` in child processes, which it does not
count; on an idle machine the wall times were within 10% of it).
"""

import argparse
import sys
import time

from remat.targets import prefer_cpu_without_gpu

prefer_cpu_without_gpu()

import jax  # noqa: E402

import jax.numpy as jnp  # noqa: E402

import remat.layout  # noqa: E402
import remat.unrolled  # noqa: E402
from remat.measuring import compile_step  # noqa: E402
from remat.memory import compiled_memory  # noqa: E402
from remat.targets import get_target  # noqa: E402
from tests.public_models import deep_case  # noqa: E402


def _take_all(dynamic: bool):
  """``remat.unrolled._Items.take`` with every leaf sliced at a constant, or an opaque, offset."""
  def take(self, tree, b, in_place=None):
    out = {}
    for g, t in tree.items():
      first, n, lead = self.span(b, g)
      if n:
        at = jax.lax.optimization_barrier(jnp.int32(first))
        out[g] = jax.tree_util.tree_map(
            lambda a: (jax.lax.dynamic_slice_in_dim(a, at, n) if dynamic else a[first:first + n]
                       ).reshape(lead + a.shape[1:]), t)
    return out
  return take


def compile_time(name: str, rule: str, target, variant: str) -> tuple[float, float]:
  """(CPU seconds, temp in MiB) of one compile of the model's gradient as ``variant`` says."""
  case = deep_case(name)
  stacked = case.stack(case.params)
  deepest, take = remat.layout.AUTO_UNROLL_MAX, remat.unrolled._Items.take
  choose = remat.layout.choose_layout
  if variant == 'loops':
    remat.layout.choose_layout = lambda *args, **kwargs: 'loops'
  # 'scan': auto's own rule for stacks deeper than it unrolls, applied to this one.
  remat.layout.AUTO_UNROLL_MAX = 0 if variant == 'scan' else deepest
  if variant in ('constant', 'dynamic'):
    remat.unrolled._Items.take = _take_all(variant == 'dynamic')
  elif variant == 'rank':
    remat.unrolled._Items.take = lambda self, tree, b, in_place=None: take(self, tree, b)
  try:
    jax.clear_caches()
    start = time.process_time()
    compiled = compile_step(case.stacked(rule), stacked, case.batch, target=target)
    seconds = time.process_time() - start
  finally:
    remat.layout.AUTO_UNROLL_MAX, remat.unrolled._Items.take = deepest, take
    remat.layout.choose_layout = choose
  return seconds, compiled_memory(compiled, target.name).temp / 2**20


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument('--models', default='vit,lm1b,gemma,gemma3')
  ap.add_argument('--rules', default='full,dots,none')
  ap.add_argument('--target', default='h100')
  ap.add_argument('--variants', default='scan,auto',
                  help='of scan, auto, loops, constant, dynamic, rank; the first is the ratios\' base')
  args = ap.parse_args()
  target, variants = get_target(args.target), args.variants.split(',')
  unknown = set(variants) - {'scan', 'auto', 'loops', 'constant', 'dynamic', 'rank'}
  if unknown:
    print(f'compile_times: unknown variants {sorted(unknown)}; valid: scan, auto, loops, '
          'constant, dynamic, rank', file=sys.stderr)
    sys.exit(2)
  print(f'# loss gradient, {target.name} plan, jax {jax.__version__}; process CPU seconds of '
        f'lowering + compiling (ratio to {variants[0]}); temp in MiB')
  print('| model | rule | ' + ' | '.join(variants) + ' | temp ' + ' / '.join(variants) + ' |')
  print('|---|---|' + '---|' * (len(variants) + 1))
  for name in args.models.split(','):
    for rule in args.rules.split(','):
      runs = [compile_time(name, rule, target, v) for v in variants]
      times = ' | '.join(f'{s:.1f} s ({s / runs[0][0]:.1f}x)' for s, _ in runs)
      print(f'| {name} | `{rule}` | {times} | ' + ' / '.join(f'{t:.2f}' for _, t in runs) + ' |',
            flush=True)


if __name__ == '__main__':
  main()
