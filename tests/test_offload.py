"""``--offload-optimizer`` (training/step/offload.py): AdamW's moments in host memory, streamed.

The streamed update is the ordinary update's arithmetic on slices: the CPU tests
run it without transfers and compare with the ordinary step. Tolerance:
``numerics.RTOL`` (float32 rounding: XLA fuses the slice-wise update otherwise,
so elements differ in the last bits; seen at this commit without the suite's XLA
flags: 4 of the state's 36 leaves bit-equal after 3 steps, all within RTOL). The
GPU-plan test reads XLA's H100 plan of the step with the moments as pinned-host arguments.
"""

import numpy as np
import optax
import pytest

from test_grad_accum import B, packed_batch


def _llama(size: int = 32):
  from configs import load_config
  from models.tasks import Task
  from training.step import train_step as st
  task = Task(load_config('llama-tiny').model).at_size(size)
  return task, st.make_optimizer(3e-3, 100, 2, 0.1, 1.0)


def _offload(task, transfer: bool):
  from training.step import train_step as st
  from training.step.offload import Offload
  return Offload(1.0, st.elementwise_optimizer(3e-3, 100, 2, 0.1), task.num_layers, transfer)


@pytest.mark.parametrize('guard', [False, True])
def test_streamed_update_is_the_ordinary_update(guard):
  """3 steps of the streamed update (no transfers, on CPU) == the ordinary step's state."""
  import jax
  from numerics import assert_trees_close
  from training.step import train_step as st
  task, tx = _llama()
  model = task.model('full')
  init = jax.jit(lambda: st.init_state(model, tx, 0, 32))()
  got = {}
  for name, off in (('ordinary', None), ('streamed', _offload(task, False))):
    step = jax.jit(st.make_train_step(model, tx, 0, guard=guard, offload=off))
    state = init
    for i in range(3):
      state, _ = step(state, packed_batch(i))
    got[name] = jax.device_get(state)
  want, have = got['ordinary'], got['streamed']
  assert int(have.step) == 3
  assert_trees_close(have.params, want.params, err_msg='params: ')
  mu = lambda s: s.opt_state[1][0].mu
  assert_trees_close(mu(have), mu(want), err_msg='first moments: ')
  assert int(have.opt_state[1][0].count) == int(want.opt_state[1][0].count) == 3


def test_the_gpu_path_runs_with_pinned_host_state():
  """train.py's GPU path (jit with pinned_host shardings, transfers in the step) run on the CPU
  backend, whose devices have a pinned_host memory too: the moments stay on the host across
  steps, and 3 steps equal the ordinary step's within RTOL."""
  import jax
  from numerics import assert_trees_close
  from training.step import offload as ol
  from training.step import train_step as st
  from training.step.mesh import Placement
  task, tx = _llama()
  model, off, place = task.model('full'), _offload(task, True), Placement(None)
  shape, _ = st.abstract_inputs(model, tx, B, 32)
  batch = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                                 packed_batch(0))
  step = ol.compile_run_step(place, st.make_train_step(model, tx, 0, True, 1, off), shape,
                             batch, off)
  state = jax.device_put(st.init_state(model, tx, 0, 32), ol.state_shardings(off, shape, place))
  plain, want = jax.jit(st.make_train_step(model, tx, 0, True)), st.init_state(model, tx, 0, 32)
  for i in range(3):
    state, _ = step(state, packed_batch(i))
    want, _ = plain(want, packed_batch(i))
  mu = state.opt_state[1][0].mu
  assert {a.sharding.memory_kind for a in jax.tree_util.tree_leaves(mu)} == {'pinned_host'}
  assert state.params['norm']['scale'].sharding.memory_kind == 'device'
  assert_trees_close(jax.device_get(state.params), jax.device_get(want.params))


def test_a_lora_run_streams_its_adapters_moments_and_keeps_its_frozen_base():
  """--lora with --offload-optimizer (and --grad-accum): the optimizer state is the adapters'
  alone, so it is what goes to the host; the frozen base stays on the device, unchanged, and
  3 steps of the GPU path (run on the CPU's pinned_host memory), accumulated over K
  microbatches, equal the ordinary whole-batch LoRA step's within the bound
  tests/test_grad_accum.py's assert_adapters_close gives adapters (and why)."""
  import dataclasses
  import jax
  from configs import load_config
  from models.lora.spec import LoraSpec
  from models.tasks import Task
  from test_grad_accum import K, assert_adapters_close
  from training.step import offload as ol
  from training.step import train_step as st
  from training.step.mesh import Placement
  cfg = dataclasses.replace(load_config('llama-tiny').model, lora=LoraSpec(rank=4))
  task, (_, tx) = Task(cfg).at_size(32), _llama()
  model, off, place = task.model('full'), _offload(task, True), Placement(None)
  shape, _ = st.abstract_inputs(model, tx, B, 32)
  ol.check_state(off.inner, shape.opt_state[1], shape.params)
  assert ol.host_bytes(off, shape) == 2 * sum(a.size * 4 for a in
                                              jax.tree_util.tree_leaves(shape.params))
  batch = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                                 packed_batch(0))
  step = ol.compile_run_step(place, st.make_train_step(model, tx, 0, True, K, off), shape,
                             batch, off)
  init = jax.jit(lambda: st.init_state(model, tx, 0, 32))
  frozen = jax.device_get(init().frozen)
  # Two copies: device_put may keep the device buffers, which the offloaded step donates.
  state = jax.device_put(init(), ol.state_shardings(off, shape, place))
  plain, want = jax.jit(st.make_train_step(model, tx, 0, True)), init()
  for i in range(3):
    state, _ = step(state, packed_batch(i))
    want, _ = plain(want, packed_batch(i))
  mu = state.opt_state[1][0].mu
  assert {a.sharding.memory_kind for a in jax.tree_util.tree_leaves(mu)} == {'pinned_host'}
  assert {a.sharding.memory_kind for a in jax.tree_util.tree_leaves(state.frozen)} == {'device'}
  jax.tree_util.tree_map(np.testing.assert_array_equal, jax.device_get(state.frozen), frozen)
  assert_adapters_close(jax.device_get(state.params), jax.device_get(want.params))


def test_a_nonfinite_step_keeps_the_streamed_state():
  import jax
  import jax.numpy as jnp
  from training.step import train_step as st
  from training.step.offload import streamed_update
  task, tx = _llama()
  state = st.init_state(task.model('none'), tx, 0, 32)
  grads = jax.tree_util.tree_map(jnp.ones_like, state.params)
  params, opt = streamed_update(_offload(task, False), grads, state.opt_state, state.params,
                                finite=jnp.array(False))
  for a, b in zip(jax.tree_util.tree_leaves((params, opt)),
                  jax.tree_util.tree_leaves((state.params, state.opt_state))):
    np.testing.assert_array_equal(a, b)


def test_state_that_is_not_per_parameter_cannot_be_placed():
  """Adafactor's factored second moments are not shaped like their parameters: one line."""
  import jax
  from training.step.offload import OffloadError, check_state
  task, _ = _llama()
  params = jax.eval_shape(lambda: task.init_variables(task.model('none'), 0, 32)[0])
  inner = optax.adafactor(1e-3, min_dim_size_to_factor=64)
  with pytest.raises(OffloadError, match=r"^--offload-optimizer: the optimizer state leaf .* has "
                                         r"shape \(\d+,?\d*\), not its parameter's \(.*\); only "
                                         r'state shaped like its parameter can be streamed'):
    check_state(inner, jax.eval_shape(inner.init, params), params)
  sgd = optax.sgd(1e-3, momentum=0.9)   # a per-parameter trace: placeable
  check_state(sgd, jax.eval_shape(sgd.init, params), params)


def test_on_the_cpu_backend_it_is_a_one_line_no_op(text_file, tmp_path):
  """train.py --offload-optimizer on CPU: one line, the ordinary step, the same losses."""
  import json
  from training.trainer import TrainConfig, train
  base = dict(config='llama-tiny', remat='full', steps=2, batch_size=4, seq_len=32,
              warmup_steps=1, data=str(text_file), eval_every=2, eval_batches=1, save_every=2,
              memory_report=False)
  rows, lines = {}, []
  for flag in (False, True):
    out = tmp_path / str(flag)
    train(TrainConfig(**base, offload_optimizer=flag, out=str(out)), log=lines.append)
    rows[flag] = [json.loads(l) for l in (out / 'metrics.jsonl').read_text().splitlines()]
  assert [l for l in lines if l.startswith('--offload-optimizer')] == [
      '--offload-optimizer: a no-op on the CPU backend (host and device memory are the same '
      'RAM); the ordinary step runs, with the same results']
  assert [(r['loss'], r['grad_norm']) for r in rows[True]] == [
      (r['loss'], r['grad_norm']) for r in rows[False]]


@pytest.mark.gpu_plan
@pytest.mark.slow
def test_h100_plan_moves_the_moments_to_the_host():
  """On the H100 plan (llama-tiny, batch 2 x 32, full) the moments are host arguments, and the
  device peak drops by the moments less the streamed working set.

  The update holds one layer's moments on the device while it runs (the slice brought in and
  its new value going out: 2 x one layer's moments of every stacked leaf), so the drop is at
  least ``state - 2 x layer slice``; measured at this commit: 8.28 MiB of 9.26 MiB.
  """
  import jax
  from remat.memory import compiled_memory
  from remat.targets import get_target
  from training.step import train_step as st
  from training.step.offload import compile_for_target, host_bytes, stacked_mask
  task, tx = _llama()
  target = get_target('h100')
  model = task.model('full')
  state, batch = st.abstract_inputs(model, tx, 2, 32)
  off = _offload(task, True)
  offloaded = compiled_memory(compile_for_target(
      st.make_train_step(model, tx, 0, offload=off), state, batch, off, target), 'h100')
  plain = compiled_memory(jax.jit(st.make_train_step(model, tx, 0), donate_argnums=0).lower(
      *target.place((state, batch))).compile(), 'h100')
  moments = host_bytes(off, state)
  assert moments == 2 * sum(a.size * 4 for a in jax.tree_util.tree_leaves(state.params))
  assert offloaded.host_argument == offloaded.host_output == moments
  assert plain.argument - offloaded.argument == moments   # the device no longer takes them
  layer = 2 * sum(a.size // a.shape[0] * 4 for a, s in zip(
      jax.tree_util.tree_leaves(state.params),
      jax.tree_util.tree_leaves(stacked_mask(state.params, task.num_layers))) if s)
  assert plain.peak - offloaded.peak >= moments - 2 * layer, (plain, offloaded, moments, layer)


def test_a_train_step_with_its_own_compile_is_planned_by_it():
  """remat.auto.plan (what --fit and --remat=auto compile) uses TrainStep.compile when given."""
  from types import SimpleNamespace
  from remat.auto import plan
  from remat.measuring import TrainStep
  from remat.targets import get_target
  calls = []
  analysis = SimpleNamespace(argument_size_in_bytes=10, output_size_in_bytes=4,
                             alias_size_in_bytes=4, temp_size_in_bytes=7,
                             host_temp_size_in_bytes=0, host_argument_size_in_bytes=20,
                             host_output_size_in_bytes=20)
  step = TrainStep(lambda s, b: (s, 0.0), lambda p, b: 0.0,
                   compile=lambda args, target: calls.append((args, target.name)) or
                   SimpleNamespace(memory_analysis=lambda: analysis))
  mem = plan(step, (1, 2), get_target('cpu'))
  assert calls == [((1, 2), 'cpu')]
  assert (mem.peak, mem.host_argument, mem.host_output) == (17, 20, 20)   # device bytes apart
