"""``--remat=auto`` against every stock policy on a zoo model: ``python -m bench.auto``.

For each budget, the policy ``remat.auto.choose`` picks (its compiled plan,
recompute FLOPs, time cold and from the cache) next to the stock policy of
least recompute whose plan meets the same budget. The stock policies are
compiled with the same options as the search (``remat.auto.plan``), so the
two columns are the compiler's figures for the same step. docs/auto.md has
the tables.
"""

from __future__ import annotations

import json
import sys
import time

import jax

from bench import zoo
from remat import auto
from remat.measuring import step_flops
from remat.memory import format_bytes
from remat.policies import PRESETS, PolicyError, get_policy, preset_tags, sqrt_segment_size
from remat.targets import TargetError, get_target, prefer_cpu_without_gpu
from training.arguments import OneLineParser, positive_int

PROG = 'bench.auto'


def stock_specs(num_layers: int, tags: set[str], gpu: bool) -> list[str]:
  """The stock policies: rules, presets the model can take, segmentings and RULE@seg."""
  specs = ['none', 'full', 'dots', 'dots_no_batch']
  specs += [n for n, (kind, _, _) in PRESETS.items()
            if preset_tags(n, tags) is not None and (kind == 'names' or gpu)]
  ks = [k for k in range(2, num_layers + 1) if num_layers % k == 0]
  sq = sqrt_segment_size(num_layers)
  for k in ks:
    seg = 'sqrt' if k == sq else ('stage' if k == num_layers else f'seg:{k}')
    specs += [seg, f'full@{seg}']
  specs += [f'{r}@sqrt' for r in ('dots', 'save_qkv_proj', 'minimal') if r in specs]
  return specs


def main(argv=None) -> int:
  prefer_cpu_without_gpu()
  p = OneLineParser(prog=f'python -m {PROG}', description=__doc__.splitlines()[0])
  p.add_argument('--config', default='gpt2-small')
  p.add_argument('--batch-size', type=positive_int, default=8)
  p.add_argument('--size', type=positive_int, default=1024, help='sequence length (gpt) or image side')
  p.add_argument('--target', default='cpu')
  p.add_argument('--budgets', default='0.7x,0.8x,0.9x',
                 help="budgets after 'auto:', separated by ','")
  p.add_argument('--stock', default=None,
                 help="stock specs to compare with, separated by ';' (default: all, stock_specs)")
  p.add_argument('--all-stock', action='store_true',
                 help='compile every stock policy (default: only those, in order of FLOPs, '
                      'up to the first whose plan meets each budget)')
  p.add_argument('--no-stock', action='store_true',
                 help='the search alone, cold and cached (to time it): no stock policy compiled')
  p.add_argument('--dtype', default=None, help='float32 or bfloat16 (default: the config\'s)')
  p.add_argument('--json', metavar='FILE')
  args = p.parse_args(argv)
  from configs import load_config, with_dtype
  try:
    named = with_dtype(load_config(args.config), args.dtype)
    target = get_target(args.target)
    case = zoo.case(named.model, args.batch_size, args.size)
    budgets = [f'auto:{b.strip()}' for b in args.budgets.split(',') if b.strip()]
    for b in budgets:
      auto.parse_budget(b)
  except (PolicyError, TargetError, ValueError) as e:
    print(f'{PROG}: error: {e}', file=sys.stderr)
    return 2
  state_args = case.step_args()
  # Stock FLOPs and plans are kept in a JSON file as they are counted and compiled, so a rerun
  # (another set of budgets) does only what is missing; the file is keyed like the auto cache.
  from remat import auto_cache
  stock_key = auto_cache.key({'case': case.cache_key(), 'env': auto_cache.environment(target)})
  stock_path = auto_cache.cache_dir() / f'stock-{stock_key}.json'
  try:
    stock = json.loads(stock_path.read_text())
  except (OSError, ValueError):
    stock = {}
  specs = (['none'] + [s.strip() for s in args.stock.split(';') if s.strip()] if args.stock
           else stock_specs(case.num_layers, case.tags(), target.sharding is not None))
  t0 = time.perf_counter()

  def save():
    stock_path.parent.mkdir(parents=True, exist_ok=True)
    stock_path.write_text(json.dumps(stock))

  def planned(spec):   # the stock spec's compiled plan, compiled once
    if 'peak' not in stock[spec]:
      mem = auto.plan(case.train_step(case.policy(spec)), state_args, target)
      stock[spec].update(peak=mem.peak, temp=mem.temp)
      save()
      print(f'# stock {spec}: peak {format_bytes(mem.peak)}, flops {stock[spec]["flops"]:.4g}',
            file=sys.stderr, flush=True)
    return stock[spec]

  if args.no_stock:
    specs = []
  for spec in specs:   # FLOPs of every stock policy: a jaxpr walk each, nothing compiled
    if spec not in stock:
      stock[spec] = {'flops': step_flops(case.train_step(case.policy(spec)), *state_args).flops}
      save()
  if specs:
    planned('none')
  if args.all_stock:
    for spec in specs:
      planned(spec)
  stock = {s: m for s, m in stock.items() if s in specs}
  none = stock.get('none')
  rows = []
  for b in budgets:
    log = lambda s: print(f'#   {s}', file=sys.stderr, flush=True)
    # Cold: this question's cache entry is removed first; the search then stores its answer,
    # and the same call again is answered from the cache (one search per budget, not two).
    key = auto_cache.key(auto._key_parts(case.train_step, state_args, auto.parse_budget(b), target,
                                         case.num_layers, case.cache_key(), auto.MAX_COMPILES))
    (auto_cache.cache_dir() / f'{key}.json').unlink(missing_ok=True)
    try:
      cold = case.choose(b, target, log=log)
    except auto.AutoError as e:
      rows.append({'budget': b, 'error': str(e)})
      continue
    t = time.perf_counter()
    cached = case.choose(b, target)
    cached_s = time.perf_counter() - t
    none = none or {'flops': cold.none_flops}
    # The best stock policy is the first, in order of FLOPs, whose plan meets the budget: every
    # stock policy before it is compiled (and over), none after it can recompute less.
    best, over = None, []
    for spec in sorted(specs, key=lambda s: (stock[s]['flops'], s)):
      if planned(spec)['peak'] <= cold.budget_bytes:
        best = spec
        break
      over.append(spec)
    rows.append({'budget': b, 'budget_bytes': cold.budget_bytes, 'chosen': cold.spec,
                 'peak': cold.memory.peak, 'temp': cold.memory.temp, 'flops': cold.flops,
                 'recompute': cold.flops / none['flops'], 'plans_compiled': len(cold.compiled),
                 'cold_seconds': cold.seconds, 'cached_seconds': cached_s,
                 'exhausted': cold.exhausted, 'profile': cold.profile,
                 'compiled': list(cold.compiled), 'cached_same': cached.spec == cold.spec,
                 'best_stock': best, 'stock_over': over,
                 'stock_peak': stock[best]['peak'] if best else None,
                 'stock_recompute': stock[best]['flops'] / none['flops'] if best else None})
    print(f'# {b}: {cold.spec} {format_bytes(cold.memory.peak)} {rows[-1]["recompute"]:.3f}x; '
          f'best stock {best}; {cold.profile}', file=sys.stderr, flush=True)
  stock_seconds = time.perf_counter() - t0
  compiled = sum('peak' in m for m in stock.values())
  header = (f'# bench.auto: {named.name}, batch {args.batch_size} x {args.size}, '
            f'{named.model.dtype}, target '
            f'{target.name} ({target.description}), jax {jax.__version__}; {len(stock)} stock '
            f'policies ({"all" if not args.stock else "given"}), {compiled} of them compiled; '
            f'{stock_seconds:.0f} s in all')
  print(header)
  print(f"{'budget':<12}{'limit':>11} {'chosen':<45}{'peak':>11}{'recomp':>8}  "
        f"{'best stock':<22}{'peak':>11}{'recomp':>8}{'plans':>6}{'cold':>7}{'cached':>8}")
  for r in rows:
    if 'error' in r:
      print(f"{r['budget']:<12} {r['error']}")
      continue
    # '-': no stock policy was compared (--no-stock) or none of them fits the budget.
    best = r['best_stock']
    stock_cols = (f"{best:<22}{format_bytes(r['stock_peak']):>11}{r['stock_recompute']:>7.3f}x"
                  if best else f"{'-':<22}{'-':>11}{'-':>8}")
    print(f"{r['budget']:<12}{format_bytes(r['budget_bytes']):>11} {r['chosen']:<45}"
          f"{format_bytes(r['peak']):>11}{r['recompute']:>7.3f}x  {stock_cols}"
          f"{r['plans_compiled']:>6}{r['cold_seconds']:>6.0f}s{r['cached_seconds']:>7.2f}s")
  if args.json:
    with open(args.json, 'w') as f:
      json.dump({'header': header, 'stock': stock, 'rows': rows}, f, indent=1)
  return 0


if __name__ == '__main__':
  sys.exit(main())
