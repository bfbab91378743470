"""``bench.report --offload-optimizer``: the train step with AdamW's state in host memory, planned.

For each policy, the zoo's train step is compiled twice for a GPU target: with
the optimizer state in pinned host memory between steps, streamed to the device
a layer at a time for the update (:mod:`training.step.offload`), and as usual.
The table shows device and host bytes apart: XLA's plan of each, compile only.
On the CPU backend host and device memory are one: the report says so and plans
the ordinary step.
"""

from __future__ import annotations

import dataclasses
import sys

import jax

from bench import zoo
from remat import measuring
from remat.memory import compiled_memory, format_bytes
from training.step import offload as ol

NOT_WITH = ('sweep', 'mesh', 'explain', 'time', 'device_peak', 'fused_update', 'plot')


def refuse_combinations(args) -> None:
  """One line for flags the offloaded plan does not take."""
  given = [n for n in NOT_WITH if getattr(args, n, None)]
  if given:
    raise ValueError('--offload-optimizer plans the policy table: drop '
                     + ', '.join('--' + n.replace('_', '-') for n in given))


def offload_rows(case: zoo.Case, specs: list[str], target) -> list[dict]:
  """Device and host bytes of each policy's step, with and without the offloaded state."""
  from tqdm import tqdm
  state, batch = case.step_args()
  off = case.offload_settings()
  ol.check_state(off.inner, state.opt_state[1], state.params)   # one line before any compile
  rows = []
  for spec in tqdm(specs, desc='compiling', unit='policy', file=sys.stderr):
    step = dataclasses.replace(case, offload=True).train_step(case.policy(spec))
    mem = compiled_memory(step.compile((state, batch), target), target.name)
    plain = measuring.step_memory(case.train_step(case.policy(spec)), state, batch,
                                  target=target)
    rows.append({'policy': spec, 'device_peak': mem.peak, 'device_temp': mem.temp,
                 'host_argument': mem.host_argument, 'host_temp': mem.host_temp,
                 'state_on_host': ol.host_bytes(off, state), 'plain_peak': plain.peak,
                 'plain_temp': plain.temp})
  return rows


def format_rows(rows: list[dict], header: str) -> str:
  lines = [header, f"{'policy':<20}{'device peak':>13}{'device temp':>13}{'host args':>12}"
                   f"{'host temp':>12}{'peak w/o':>13}{'saved':>12}"]
  for r in rows:
    lines.append(f"{r['policy']:<20}{format_bytes(r['device_peak']):>13}"
                 f"{format_bytes(r['device_temp']):>13}{format_bytes(r['host_argument']):>12}"
                 f"{format_bytes(r['host_temp']):>12}{format_bytes(r['plain_peak']):>13}"
                 f"{format_bytes(r['plain_peak'] - r['device_peak']):>12}")
  lines.append('# device peak/temp: XLA plan of device memory with the optimizer state in pinned '
               'host memory (host args: AdamW moments, streamed a layer at a time); peak w/o: the '
               'same step with the state on the device; saved = peak w/o - device peak')
  return '\n'.join(lines)


def offload_report(args, named, fam, size, target, header, specs) -> dict:
  """The ``--offload-optimizer`` table for a GPU target (see the module docstring)."""
  refuse_combinations(args)
  case = zoo.case(named.model, args.batch_size, size, args.layout, microbatches=args.grad_accum)
  rows = offload_rows(case, specs, target)
  # '# train step (optimizer state in host memory) accumulated over K microbatches of ...'
  print(format_rows(rows, header.replace('# train step', '# train step (optimizer state in '
                                         'host memory)', 1)))
  return {'offload_optimizer': rows, 'jax': jax.__version__}
