"""Compiled memory and recompute FLOPs of the train step per policy: ``python -m remat.report``.

Compile only: inputs are abstract (``jax.ShapeDtypeStruct``), nothing is
allocated, so shapes far larger than the machine can be planned. Figures are
defined in :mod:`remat.memory`; the backend that produced them is printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import jax

from remat.flops import FlopCount, count_flops
from remat.memory import MemoryStats, compiled_memory, format_bytes
from remat.policies import PolicyError, get_policy, registered_specs

DEFAULT_POLICIES = ('none', 'full', 'dots', 'dots_no_batch', 'sqrt', 'full@sqrt', 'minimal',
                    'save_qkv_proj')


@dataclasses.dataclass(frozen=True)
class PolicyCost:
  """What one policy's train step costs: compiled memory and matmul FLOPs (recompute included)."""
  memory: MemoryStats
  flops: FlopCount


def train_step_cost(config_name: str, spec: str, batch_size: int, seq_len: int) -> PolicyCost:
  """Compiles the GPT train step (AdamW update included, state donated) and counts its FLOPs."""
  from configs import load_config
  from models.gpt import GPT
  from training import steps as st
  named = load_config(config_name)
  if seq_len > named.model.max_len:
    raise ValueError(f'--seq-len {seq_len} exceeds config {config_name} max_len {named.model.max_len}')
  policy = get_policy(spec, num_layers=named.model.num_layers)
  model = GPT(named.model, policy)
  tx = st.make_optimizer(1e-3, 1000, 10, 0.1, 1.0)
  state, batch = st.abstract_inputs(model, tx, batch_size, seq_len)
  compiled = st.compile_train_step(model, tx, 0, state, batch)
  return PolicyCost(compiled_memory(compiled),
                    count_flops(st.make_train_step(model, tx, 0), state, batch))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog='python -m remat.report', description=__doc__.splitlines()[0])
  p.add_argument('--config', default='tiny')
  p.add_argument('--batch-size', type=int, default=8)
  p.add_argument('--seq-len', type=int, default=128)
  p.add_argument('--policies', default=','.join(DEFAULT_POLICIES),
                 help="';'-separated specs (',' also works when no spec has tags), or 'all'")
  args = p.parse_args(argv)
  if args.policies == 'all':
    specs = registered_specs() + ['sqrt', 'full@sqrt']
  else:
    specs = [s for s in (args.policies.split(';') if ';' in args.policies
                         else args.policies.split(',')) if s]
  if 'none' not in specs:
    specs = ['none'] + specs
  rows = {}
  try:
    for spec in specs:
      t = time.perf_counter()
      print(f'compiling {spec} ...', file=sys.stderr, flush=True)
      rows[spec] = train_step_cost(args.config, spec, args.batch_size, args.seq_len)
      print(f'  {time.perf_counter() - t:.1f}s', file=sys.stderr, flush=True)
  except (PolicyError, ValueError) as e:
    print(f'remat.report: error: {e}', file=sys.stderr)
    return 2
  base = rows['none']
  print(f'# train step, config {args.config}, batch {args.batch_size} x seq {args.seq_len}, float32, '
        f'XLA {base.memory.backend} backend, compile only (jax {jax.__version__})')
  print(f"{'policy':<22}{'temp':>12}{'peak':>12}{'temp/none':>11}{'host temp':>12}{'recompute':>11}")
  for spec, c in rows.items():
    m = c.memory
    ratio = c.flops.flops / base.flops.flops
    print(f'{spec:<22}{format_bytes(m.temp):>12}{format_bytes(m.peak):>12}'
          f'{m.temp / base.memory.temp:>10.1%}{format_bytes(m.host_temp):>12}{ratio:>10.3f}x'
          + ('' if c.flops.exact else ' (while loop counted once)'))
  print('# recompute = matmul FLOPs of the whole step (jaxpr walk, scans multiplied) / those of none')
  return 0


if __name__ == '__main__':
  sys.exit(main())
