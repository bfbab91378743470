"""--remat=auto: budgets, the search against every stock policy, the cache, and --fit."""

from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import user_mlp
from remat import auto, auto_cache, get_policy
from remat.auto_budget import BudgetError, parse_budget
from remat.fit import largest_fitting
from remat.measuring import step_flops, step_memory
from remat.memory import format_bytes
from remat.targets import get_target

CPU = get_target('cpu')
MLP_STOCK = ('none', 'full', 'dots', 'dots_no_batch', 'names:up', 'names:down', 'names:down,up')


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
  monkeypatch.setenv('REMAT_CACHE', str(tmp_path / 'cache'))


def _real(build, args, specs, num_layers=None):
  """spec -> (plan peak, FLOPs), from real compiles and counts, as the search's rivals."""
  out = {}
  for s in specs:
    program = build(get_policy(s, num_layers=num_layers))
    out[s] = (auto.plan(program, args, CPU).peak, step_flops(program, *args).flops)
  return out


@pytest.fixture(scope='module')
def mlp_stock():
  return _real(user_mlp.build, user_mlp.example_args(), MLP_STOCK)


@pytest.mark.parametrize('text,field,value', [
    ('auto:40GiB', 'nbytes', 40 * 2**30), ('auto:512MiB', 'nbytes', 512 * 2**20),
    ('auto:1.5GB', 'nbytes', 1_500_000_000), ('auto:0.5x', 'fraction', 0.5),
    ('auto', 'device', True), ('auto: 2gib', 'nbytes', 2 * 2**30),
])
def test_budget_forms(text, field, value):
  assert getattr(parse_budget(text), field) == value


@pytest.mark.parametrize('text,needle', [
    ('auto:', "cannot read the budget ''"), ('auto:40', "cannot read the budget '40'"),
    ('auto:40PB', "cannot read the budget '40PB'"), ('auto:0x', 'must be > 0'),
    ('auto:-1GiB', "cannot read"), ('automatic', "is not a budget"),
])
def test_budget_errors_are_one_line(text, needle):
  with pytest.raises(BudgetError) as e:
    parse_budget(text)
  assert needle in str(e.value) and '\n' not in str(e.value)


def test_plain_auto_needs_device_memory():
  with pytest.raises(BudgetError, match='has no known device memory; give a budget'):
    parse_budget('auto').resolve(100, None, 'cpu')
  assert parse_budget('auto').resolve(100, 1000, 'h200') == 750   # JAX's default 75% pool


def test_plan_options_keep_the_plan():
  """The search compiles CPU plans without LLVM's optimisation: same buffers as measure's."""
  args = user_mlp.example_args()
  for spec in ('none', 'full'):
    program = user_mlp.build(get_policy(spec))
    assert auto.plan(program, args, CPU) == step_memory(program, *args, target=CPU)


def _check_choice(choice, stock, budget_bytes):
  assert choice.memory.peak <= budget_bytes
  meets = {s: f for s, (peak, f) in stock.items() if peak <= budget_bytes}
  assert meets, 'the test budget must admit some stock policy'
  assert choice.flops <= min(meets.values()), (choice.spec, meets)


@pytest.mark.parametrize('where', [0.0, 0.3, 0.7, 0.999])
def test_user_mlp_least_recompute_within_budget(where, mlp_stock):
  none, full = mlp_stock['none'][0], mlp_stock['full'][0]
  budget = int(full + where * (none - full))
  choice = auto.choose(user_mlp.build, *user_mlp.example_args(), budget=f'auto:{budget}B',
                       cache=False)
  _check_choice(choice, mlp_stock, budget)
  program = user_mlp.build(get_policy(choice.spec))    # the spec reproduces the plan
  assert auto.plan(program, user_mlp.example_args(), CPU) == choice.memory


def test_fraction_budget_is_of_nones_plan(mlp_stock):
  choice = auto.choose(user_mlp.build, *user_mlp.example_args(), budget='auto:0.9x', cache=False)
  assert choice.budget_bytes == int(0.9 * mlp_stock['none'][0])
  _check_choice(choice, mlp_stock, choice.budget_bytes)


def test_impossible_budget_is_one_line_with_the_least_memory(mlp_stock):
  least = min(peak for peak, _ in mlp_stock.values())
  with pytest.raises(auto.AutoError) as e:
    auto.choose(user_mlp.build, *user_mlp.example_args(), budget='auto:0.1x', cache=False)
  msg = str(e.value)
  assert '\n' not in msg
  assert f'the least memory any reaches is {format_bytes(least)} peak' in msg


def test_cache_hit_compiles_nothing(mlp_stock, monkeypatch, tmp_path):
  none, full = mlp_stock['none'][0], mlp_stock['full'][0]
  budget = f'auto:{(none + full) // 2}B'
  first = auto.choose(user_mlp.build, *user_mlp.example_args(), budget=budget)
  assert not first.cached and list((tmp_path / 'cache').glob('*.json'))

  def no_compile(*a, **k):
    raise AssertionError('compiled on a cache hit')
  monkeypatch.setattr(auto, 'plan', no_compile)
  monkeypatch.setattr(jax.stages.Lowered, 'compile', no_compile)
  again = auto.choose(user_mlp.build, *user_mlp.example_args(), budget=budget)
  assert again.cached and again.seconds < 1.0
  assert (again.spec, again.memory, again.flops) == (first.spec, first.memory, first.flops)
  # Anything that changes the answer is in the key: another budget is a miss.
  with pytest.raises(AssertionError, match='compiled on a cache hit'):
    auto.choose(user_mlp.build, *user_mlp.example_args(), budget=f'auto:{full}B')


def test_cache_key_covers_shapes_and_budget():
  args = user_mlp.example_args()
  parts = lambda a, b: auto._key_parts(user_mlp.build, a, parse_budget(b), CPU, None, None, 8)
  k = auto_cache.key(parts(args, 'auto:1MiB'))
  assert k == auto_cache.key(parts(args, 'auto:1MiB'))
  assert k != auto_cache.key(parts(args, 'auto:2MiB'))
  bigger = (args[0], jax.ShapeDtypeStruct((2 * user_mlp.B, user_mlp.D), jnp.float32))
  assert k != auto_cache.key(parts(bigger, 'auto:1MiB'))


def test_cache_key_covers_the_mesh():
  """A plan on a mesh is per device: another mesh (or none) is another question."""
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  args = user_mlp.example_args()
  dev = np.asarray(jax.devices()[:1])

  def shardings(axes, spec):
    mesh = Mesh(dev.reshape((1,) * len(axes)), axes)
    s = NamedSharding(mesh, spec)
    return ((s, s), s)
  key = lambda sh: auto_cache.key(auto._key_parts(user_mlp.build, args, parse_budget('auto:1MiB'),
                                                  CPU, None, {'program': 1}, 8, sh))
  one = key(None)
  fsdp = key(shardings(('data', 'fsdp'), P()))
  assert fsdp == key(shardings(('data', 'fsdp'), P()))
  assert len({one, fsdp, key(shardings(('fsdp',), P())),
              key(shardings(('data', 'fsdp'), P('fsdp')))}) == 4
  assert auto.mesh_description(shardings(('data', 'fsdp'), P()))['axes'] == {'data': 1, 'fsdp': 1}


def test_cached_answers_are_keyed_by_every_source_file():
  """train.py's cache key hashes the model, training and remat source, sub-packages included."""
  from training.step.autoremat import source_files, source_hash
  root = Path(__file__).resolve().parents[1]
  names = {p.relative_to(root).as_posix() for p in source_files()}
  assert {'models/gpt.py', 'models/hf/load.py', 'training/trainer.py', 'training/data/tokenizer.py',
          'training/step/autoremat.py', 'remat/policies.py'} <= names
  assert not any(n.startswith(('bench/', 'baselines/', 'tests/')) for n in names)
  assert len(source_hash()) == 16 and source_hash() == source_hash()


@pytest.mark.slow
def test_parallel_compiles_give_the_same_answer(mlp_stock):
  """Compiling two finalists at once changes the time, not the answer or its plan.

  Slow: two whole searches (about 25 s on the loaded 2-core machine). The default suite's
  searches run with two compiles at once already (PARALLEL is 2 on 2 cores).
  """
  none, full = mlp_stock['none'][0], mlp_stock['full'][0]
  budget = f'auto:{int(full + 0.5 * (none - full))}B'
  one, two = (auto.choose(user_mlp.build, *user_mlp.example_args(), budget=budget, cache=False,
                          parallel=p) for p in (1, 2))
  assert (one.spec, one.memory, one.flops) == (two.spec, two.memory, two.flops)
  assert [c['spec'] for c in one.compiled][:2] == ['none', 'full']
  assert all(c['compile_s'] > 0 for c in two.compiled) and 'plans compiled' in two.profile
  # The FLOPs come from the trace that is lowered: the same count as remat.measure's.
  args = user_mlp.example_args()
  assert two.flops == step_flops(user_mlp.build(get_policy(two.spec)), *args).flops


def _mlp_at(batch):
  params, _ = user_mlp.example_args()
  return user_mlp.build, (params, jax.ShapeDtypeStruct((batch, user_mlp.D), jnp.float32))


@pytest.mark.parametrize('per_item,fixed,budget', [(1000, 5000, 123_456), (7, 0, 7 * 9999 + 3),
                                                   (1000, 5000, 5999), (3, 10, 9)])
def test_fit_bisection_on_a_known_plan(per_item, fixed, budget, monkeypatch):
  """The search logic alone, on plans peak(b) = fixed + per_item * b (+ a kink): no compile."""
  import remat.fit as fit_mod
  from remat.memory import MemoryStats
  peak = lambda b: fixed + per_item * b + (per_item // 2 if b > 50 else 0)
  monkeypatch.setattr(fit_mod, 'plan', lambda program, args, target: MemoryStats(
      0, 0, 0, peak(args[1].shape[0]), 0, 'cpu'))
  monkeypatch.setattr(fit_mod, 'step_flops', lambda *a: type('F', (), {'flops': 1})())
  got = largest_fitting(_mlp_at, 'none', budget, CPU)
  want = max([b for b in range(1, 100_000) if peak(b) <= budget], default=0)
  assert got.value == want
  if want:
    assert got.next_peak == peak(want + 1) > budget


def test_fit_after_a_flat_start_plans_no_absurd_size(monkeypatch):
  """Plans flat over the first sizes, then linear (saved values filling gradient rows first): the
  fit is still exact, and the first guess stays near the sizes planned."""
  import remat.fit as fit_mod
  from remat.memory import MemoryStats
  peak = lambda b: 10**9 + 10**6 * max(0, b - 20)   # flat to 20, then 1 MB per item
  asked = []

  def plan(program, args, target):
    asked.append(args[1].shape[0])
    return MemoryStats(0, 0, 0, peak(args[1].shape[0]), 0, 'cpu')
  monkeypatch.setattr(fit_mod, 'plan', plan)
  monkeypatch.setattr(fit_mod, 'step_flops', lambda *a: type('F', (), {'flops': 1})())
  budget = peak(300)
  assert largest_fitting(_mlp_at, 'none', budget, CPU).value == 300
  # the slope between 1 and 2 is zero: the guess from it alone was 10**9 items; it starts the
  # gallop at FLAT_GUESS * 2 instead, which never plans twice the answer
  assert asked[:3] == [1, 2, fit_mod.FLAT_GUESS * 2] and max(asked) < 2 * 300, asked


@pytest.mark.slow
def test_fit_returns_the_largest_fitting_batch():
  peak = lambda spec, b: auto.plan(user_mlp.build(get_policy(spec)), _mlp_at(b)[1], CPU).peak
  budget = peak('none', 40)
  fit = largest_fitting(_mlp_at, 'full', budget, CPU)
  assert fit.value > 40                      # full fits a larger batch than none in none's plan
  assert peak('full', fit.value) == fit.peak <= budget < fit.next_peak == peak('full', fit.value + 1)
  assert largest_fitting(_mlp_at, 'none', 1000, CPU).value == 0   # not even batch 1


@pytest.mark.slow
def test_gpt_least_recompute_against_every_stock_policy(small_config):
  """A 5-layer GPT through the zoo: stack candidates (segmentings, mixes) against stock ones."""
  from bench import zoo
  case = zoo.case(small_config, 4, 16)
  args = case.step_args()
  stock = ['none', 'full', 'dots', 'dots_no_batch', 'minimal', 'save_qkv_proj',
           'save_dot_except_mlp', 'sqrt', 'full@sqrt', 'seg:5', 'full@seg:5']
  real = _real(case.train_step, args, stock, case.num_layers)
  none, full = real['none'][0], real['full'][0]
  for where in (0.25, 0.75):
    budget = int(full + where * (none - full))
    choice = case.choose(f'auto:{budget}B', CPU, cache=False)
    _check_choice(choice, real, budget)


@pytest.mark.slow
def test_train_resolves_auto_and_records_the_spec(tmp_path, text_file):
  """train.py --remat=auto:1x trains under the chosen spec and records it in the run's meta.

  (At this small shape the optimizer state dominates: even full plans 99% of none.)
  """
  from training.run.checkpoints import read_meta
  from training.trainer import TrainConfig, train
  lines = []
  cfg = TrainConfig(config='tiny', remat='auto:1x', steps=2, batch_size=2, seq_len=32,
                    data=str(text_file), out=str(tmp_path / 'run'), eval_every=2,
                    eval_batches=1, save_every=2, memory_report=False)
  rows = train(cfg, log=lines.append)
  said = [l for l in lines if l.startswith('remat: auto:1x -> none: peak ')]
  assert said, lines
  _, meta = read_meta(tmp_path / 'run')
  assert meta['auto']['spec'] == meta['policy'] == rows[-1]['policy'] == 'none'
  assert meta['auto']['budget'] == 'auto:1x' and meta['train']['remat'] == 'auto:1x'
  assert meta['auto']['memory']['temp'] > 0 and meta['auto']['compiled'][0]['spec'] == 'none'


@pytest.mark.slow
def test_train_auto_plans_the_mesh_step(tmp_path, text_file):
  """train.py --remat=auto --mesh fsdp=2 searches the per-device plan, cached per mesh.

  Runs train.py on 2 simulated CPU devices (a subprocess: the suite's process has one):
  the fsdp=2 search's none plan holds half the state and batch, so it is below one
  device's, the two meshes are two cache entries, and a rerun on fsdp=2 is a cache
  hit. (auto:1x: none fits, so each search is its two anchor compiles.)
  """
  import json
  import os
  import re
  import subprocess
  import sys
  from pathlib import Path
  root = Path(__file__).resolve().parents[1]
  env = dict(os.environ, JAX_PLATFORMS='cpu', REMAT_CACHE=str(tmp_path / 'cache'))
  env['XLA_FLAGS'] = (env.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=2')

  def run(name, *mesh):
    out = subprocess.run(
        [sys.executable, 'train.py', '--config=tiny', '--steps=1', '--batch-size=8',
         '--seq-len=128', f'--data={text_file}', f'--out={tmp_path / name}', '--eval-every=1',
         '--eval-batches=1', '--no-memory-report', '--remat=auto:1x', *mesh],
        cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    line = next(l for l in out.stdout.splitlines() if l.startswith('remat: auto:1x -> '))
    return line, float(re.search(r'; none ([\d.]+) MiB', line).group(1))
  mesh_line, mesh_none = run('mesh', '--mesh=fsdp=2')
  one_line, one_none = run('one')
  assert mesh_none < one_none, (mesh_line, one_line)
  records = [json.loads(p.read_text()) for p in (tmp_path / 'cache').glob('*.json')]
  assert len(records) == 2
  again, _ = run('again', '--mesh=fsdp=2')
  assert again.endswith('(from the cache)') and again.split(' (')[0] == mesh_line.split(' (')[0]


def test_train_cli_rejects_a_bad_budget_in_one_line(capsys):
  from training import cli
  assert cli.main(['--remat=auto:lots', '--steps', '1']) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("train.py: error: 'auto:lots': cannot read the budget") and '\n' not in err


@pytest.mark.slow
def test_train_auto_plans_the_packed_batch(tmp_path):
  """With a tokenizer the windows are packed (segment ids, positions): the plan auto picks from is
  of that batch, to the byte the step the run compiles (the plain windows' plan is 80 bytes off
  at this size: without segment ids the attention mask is another computation)."""
  import sys
  from pathlib import Path
  sys.path.insert(0, str(Path(__file__).parent))
  from text_fixtures import bpe_tokenizer, rows, write_jsonl
  from training.run.checkpoints import read_meta
  from training.trainer import TrainConfig, train
  tok = bpe_tokenizer(tmp_path / 'tok', [r['prompt'] + r['completion'] for r in rows(100)])
  data = write_jsonl(tmp_path / 'd.jsonl', rows(50))
  cfg = TrainConfig(config='tiny', remat='auto:1x', steps=1, batch_size=2, seq_len=32,
                    data=str(data), tokenizer=str(tok), out=str(tmp_path / 'run'), eval_every=1,
                    eval_batches=1, save_every=1, memory_report=False)
  train(cfg, log=lambda _: None)
  _, meta = read_meta(tmp_path / 'run')
  # The step the run compiled (meta['memory']) is the one auto planned, to the byte.
  assert meta['auto']['memory']['temp'] == meta['memory']['temp'], (meta['auto'], meta['memory'])
  assert meta['auto']['memory']['argument'] == meta['memory']['argument']
