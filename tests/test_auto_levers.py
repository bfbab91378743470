"""--remat=auto over every lever: policy x microbatches (x optimizer offload on GPU targets).

A user's own train step in plain JAX (a residual MLP stack in ``remat.scan_layers``,
SGD, gradients accumulated over K microbatches in ``lax.scan``), planned on the
CPU backend, where the plans are deterministic for a given XLA.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name

import remat
from remat import auto, auto_levers, get_policy
from remat.measuring import step_flops
from remat.memory import format_bytes
from remat.targets import get_target

CPU = get_target('cpu')
L, B, D, H = 16, 256, 32, 128
F32 = jnp.float32
ARGS = ((jax.ShapeDtypeStruct((L, D, H), F32), jax.ShapeDtypeStruct((L, H, D), F32)),
        jax.ShapeDtypeStruct((B, D), F32))
STOCK = ('none', 'full', 'dots', 'names:up', 'names:down', 'sqrt', 'full@sqrt', 'seg:2',
         'full@seg:2', 'seg:8', 'full@seg:8')
KS = (1, 2, 4, 8)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
  monkeypatch.setenv('REMAT_CACHE', str(tmp_path / 'cache'))


def build(policy, k=1, offload=False):
  """The train step under ``policy`` with the batch in ``k`` microbatches (no offload on CPU)."""
  def layer(w, h):
    up = checkpoint_name(h @ w[0], 'up')
    return h + checkpoint_name(jnp.tanh(up) @ w[1], 'down')

  def loss(params, x):
    return jnp.mean(remat.scan_layers(layer, params, x, policy=policy) ** 2)

  def step(params, x):
    def body(acc, xm):
      value, g = jax.value_and_grad(loss)(params, xm)
      return jax.tree_util.tree_map(jnp.add, acc, g), value
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    g, values = jax.lax.scan(body, zeros, x.reshape(k, B // k, D))
    return jax.tree_util.tree_map(lambda p, gi: p - 0.1 * gi / k, params, g), values.mean()
  return remat.TrainStep(step, loss, lambda p, x: (p, jax.ShapeDtypeStruct((B // k, D), x.dtype)))


def peak(spec, k):
  return auto.plan(build(get_policy(spec, num_layers=L), k), ARGS, CPU).peak


@pytest.fixture(scope='module')
def stock():
  """(spec, K) -> (plan peak, FLOPs) of every stock policy at every K: the search's rivals."""
  return {(s, k): (peak(s, k), step_flops(build(get_policy(s, num_layers=L), k), *ARGS).flops)
          for s in STOCK for k in KS}


def test_no_cheaper_candidate_fits_where_the_whole_batch_does_not(stock):
  """A budget no policy meets on the whole batch: the pick fits, on microbatches, and no
  stock policy at any K that the cost model rates faster fits."""
  budget = stock[('none', 8)][0]   # none fits at K=8 (exactly), nothing stock at K=1
  assert min(stock[(s, 1)][0] for s in STOCK) > budget
  choice = auto_levers.choose_levers(build, *ARGS, budget=f'auto:{budget}B', batch_size=B,
                                     num_layers=L, microbatches=KS)
  assert choice.settings[0]['microbatches'] == 1
  assert choice.settings[0]['outcome'] == 'nothing fits'
  assert choice.microbatches > 1 and not choice.offload
  # The pick fits: its own plan, compiled again here.
  assert peak(choice.spec, choice.microbatches) == choice.best.peak <= budget
  # The cost model, applied here to every stock candidate with the same terms: weights read
  # twice and the float32 gradient sum read and written per extra microbatch.
  weights = 2 * L * D * H * 4
  model = auto_levers.cost_model(CPU)
  cost = lambda flops, k: sum(model.terms(flops, k, 2 * weights + 2 * weights, 0))
  assert choice.best.seconds == pytest.approx(cost(choice.best.flops, choice.microbatches),
                                              rel=1e-12)
  cheaper = {sk: p for sk, (p, f) in stock.items() if cost(f, sk[1]) < choice.best.seconds}
  assert cheaper, 'the whole batch without remat is faster by the model and must be tried'
  assert all(p > budget for p in cheaper.values()), {
      sk: format_bytes(p) for sk, p in cheaper.items() if p <= budget}
  # The runners-up fit and rank after the pick.
  for r in choice.runners_up:
    assert r.peak <= budget and r.seconds >= choice.best.seconds


def test_settings_that_cannot_win_are_not_searched(stock):
  """With room for none on the whole batch, no other setting is searched: each costs more."""
  budget = stock[('none', 1)][0]
  choice = auto_levers.choose_levers(build, *ARGS, budget=f'auto:{budget}B', batch_size=B,
                                     num_layers=L, microbatches=KS)
  assert (choice.spec, choice.microbatches) == ('none', 1)
  assert [s['outcome'] for s in choice.settings] == ['none'] + ['skipped'] * (len(KS) - 1)
  # The runners-up are plans the search compiled: full, compiled beside none as its anchor.
  assert [(r.spec, r.microbatches) for r in choice.runners_up] == [('full', 1)]


def test_fraction_budget_is_of_the_whole_batch(stock):
  """auto:Fx is relative to none on the whole batch, not to each setting's none."""
  choice = auto_levers.choose_levers(build, *ARGS, budget='auto:0.6x', batch_size=B,
                                     num_layers=L, microbatches=KS)
  assert choice.budget_bytes == int(0.6 * stock[('none', 1)][0])
  assert choice.best.peak <= choice.budget_bytes


def test_a_budget_nothing_meets_is_one_line_with_the_least_plan(stock):
  """Above the arguments (parameters and batch, 544 KiB) but below every plan: the least plan
  found is named; below the arguments, nothing is compiled and they are named."""
  with pytest.raises(auto.AutoError) as e:
    auto_levers.choose_levers(build, *ARGS, budget='auto:1MiB', batch_size=B, num_layers=L,
                              microbatches=(1, 2))
  msg = str(e.value)
  assert '\n' not in msg and msg.startswith('auto:1MiB: no plan fits 1.00 MiB on cpu for batch')
  # The least plan found is named, and it is no more than the per-layer stock policies' least at
  # K=2. A segmented policy may plan less (here full@seg:2, whose segments run their layers in
  # turn): the search compiles only the least-estimated one, and the model ranks it after full.
  per_layer = [s for s in STOCK if '@' not in s and not s.startswith(('seg', 'sqrt'))]
  assert e.value.least_peak <= min(stock[(s, 2)][0] for s in per_layer)
  assert f'the least peak any plan reaches is {format_bytes(e.value.least_peak)}' in msg

  def no_compile(*a, **k):
    raise AssertionError('compiled a plan below its own arguments')
  with pytest.MonkeyPatch.context() as m:
    m.setattr(jax.stages.Lowered, 'compile', no_compile)
    with pytest.raises(auto.AutoError) as e:
      auto_levers.choose_levers(build, *ARGS, budget='auto:64KiB', batch_size=B, num_layers=L,
                                microbatches=KS)
  assert str(e.value).endswith('the arguments alone (parameters, optimizer state, batch) are '
                               '544.00 KiB')


def test_a_cached_search_compiles_nothing(stock, monkeypatch):
  budget = f"auto:{stock[('none', 4)][0]}B"
  first = auto_levers.choose_levers(build, *ARGS, budget=budget, batch_size=B, num_layers=L,
                                    microbatches=KS, cache_key={'model': 'levers-mlp'})

  def no_compile(*a, **k):
    raise AssertionError('compiled on a cache hit')
  monkeypatch.setattr(auto, 'plan', no_compile)
  monkeypatch.setattr(jax.stages.Lowered, 'compile', no_compile)
  again = auto_levers.choose_levers(build, *ARGS, budget=budget, batch_size=B, num_layers=L,
                                    microbatches=KS, cache_key={'model': 'levers-mlp'})
  assert (again.spec, again.microbatches, again.best.peak) == (
      first.spec, first.microbatches, first.best.peak)


def test_train_cli_searches_microbatches_unless_given():
  """--remat=auto:BUDGET makes K a lever; an explicit --grad-accum (or no budget) fixes it."""
  from training import cli
  parse = lambda *a: cli.config_from_args(cli.build_parser().parse_args(list(a)))
  assert parse('--remat=auto:1GiB').grad_accum_search
  assert not parse('--remat=auto:1GiB', '--grad-accum', '2').grad_accum_search
  assert not parse('--remat=full').grad_accum_search


@pytest.mark.slow
def test_train_auto_accumulates_where_the_whole_batch_does_not_fit(tmp_path, text_file):
  """train.py --remat=auto:0.55x on tiny, batch 8 x 128: no policy's plan of the whole batch
  fits (full, the least, plans 0.58x of none: the parameters and AdamW state are most of it),
  so the run trains on microbatches, and records the K and the plan it took."""
  from training.run.checkpoints import read_meta
  from training.trainer import TrainConfig, train
  lines = []
  cfg = TrainConfig(config='tiny', remat='auto:0.55x', steps=1, batch_size=8, seq_len=128,
                    data=str(text_file), out=str(tmp_path / 'run'), eval_every=1,
                    eval_batches=1, save_every=1, memory_report=False, grad_accum_search=True)
  train(cfg, log=lines.append)
  assert any(l.startswith('levers: K=1: nothing fits') for l in lines), lines
  _, meta = read_meta(tmp_path / 'run')
  k = meta['train']['grad_accum']
  assert k > 1 and f'grad-accum: {k} microbatches of {8 // k} per step of 8' in ' '.join(lines)
  m = meta['auto']['memory']
  assert m['argument'] + m['output'] - m['alias'] + m['temp'] <= meta['auto']['budget_bytes']
  assert meta['auto']['spec'] == meta['policy']


@pytest.mark.gpu_plan
def test_h100_plan_moves_the_state_to_the_host_where_nothing_fits_with_it():
  """llama-tiny, batch 4 x 64, whole batch, on the H100 plan, within what `full` plans with the
  AdamW state in host memory: with the state on the device no policy fits, so the pick keeps it
  on the host, and its plan, compiled again, fits with the state as host arguments."""
  from bench import zoo
  from configs import load_config
  named = load_config('llama-tiny')
  n = named.model.num_layers
  target = get_target('h100')
  case = lambda k=1, off=False: zoo.case(named.model, 4, 64, microbatches=k, offload=off)
  state, batch = case().step_args()
  build = lambda policy, k, off: case(k, off).train_step(policy)
  budget = auto.plan(build(get_policy('full', num_layers=n), 1, True), (state, batch), target).peak
  choice = auto_levers.choose_levers(build, state, batch, budget=f'auto:{budget}B', batch_size=4,
                                     target=target, num_layers=n, microbatches=(1,),
                                     offload=(False, True))
  assert [(s['offload'], s['outcome']) for s in choice.settings][0] == (False, 'nothing fits')
  assert choice.offload and choice.best.host > 0
  again = auto.plan(build(get_policy(choice.spec, num_layers=n), 1, True), (state, batch), target)
  assert again.peak == choice.best.peak <= budget
  assert again.host_argument == choice.choice.memory.host_argument > 0
