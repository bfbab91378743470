"""``bench.report --fit levers``: the fastest (policy, microbatches, optimizer offload) that fits.

For ``--batch-size`` (the global batch), :func:`remat.auto_levers.choose_levers`
searches remat policies, gradient accumulation over every divisor of the batch
and, on a GPU target, the optimizer state on the device or in host memory
(:mod:`training.step.offload`), and prints the choice and its two runners-up
with the cost model's terms. Every peak is XLA's plan of the zoo's train step;
the ranking is the stated cost model's (docs/making-a-run-fit.md).
"""

from __future__ import annotations

import sys

from bench import zoo
from remat.auto_budget import parse_budget
from remat.auto_levers import choose_levers
from training.step import train_step as st


def refuse_combinations(args) -> None:
  """One line for flags the lever search does not take."""
  given = [n for n in ('sweep', 'mesh', 'explain', 'time', 'device_peak', 'fused_update', 'plot',
                       'per_block', 'reference') if getattr(args, n, None)]
  if args.grad_accum > 1:
    given.append('grad_accum')
  if given:
    raise ValueError('--fit levers searches the microbatches itself and prints its table: drop '
                     + ', '.join('--' + n.replace('_', '-') for n in given))


def levers_report(args, named, fam, size, target, header) -> dict:
  """Searches the levers for ``args.batch_size`` within ``args.budget``; prints the table."""
  refuse_combinations(args)
  budget = parse_budget(args.budget)
  gpu = target.sharding is not None
  offload = (True,) if args.offload_optimizer else ((False, True) if gpu else (False,))
  base = zoo.case(named.model, args.batch_size, size, args.layout)
  state, batch = base.step_args()
  if True in offload:   # one line before any compile: a state that cannot be streamed
    from training.step import offload as ol
    ol.check_state(base.offload_settings().inner, state.opt_state[1], state.params)

  def build(policy, k, off):
    return zoo.case(named.model, args.batch_size, size, args.layout, microbatches=k,
                    offload=off).train_step(policy)

  log = (lambda s: print(f'# {s}', file=sys.stderr))
  choice = choose_levers(build, state, batch, budget=budget, batch_size=args.batch_size,
                         target=target, num_layers=base.num_layers, offload=offload,
                         weight_bytes=st.weight_bytes(state), cache_key=base.cache_key(),
                         log=log)
  print(header.replace('# train step', '# train step, levers searched'))
  print(choice.table())
  print(f'# {choice.summary()}')
  return {'levers': choice.to_json()}
