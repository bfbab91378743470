"""``train.py --remat=auto:...``: the policy of least recompute whose plan of this run's step fits.

The step planned is the one training compiles (:func:`training.step.train_step.make_train_step`
with the run's optimizer, seed and non-finite guard) for the local backend,
so the chosen plan is the plan that trains. With ``--mesh`` it is the step
partitioned over that mesh with the run's shardings
(:meth:`training.step.mesh.Placement.jit_train_step`): plans and the budget are per
device, and the mesh is part of the cache key. The answer is cached
(:mod:`remat.auto_cache`), keyed by the model config, shapes, optimizer
settings and a hash of the model and training source.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax

from models.tasks import Task
from remat import auto
from remat.auto_budget import Budget, parse_budget
from training.step import train_step as st

# The checkout that holds models/, training/ and remat/ (this file: training/step/autoremat.py).
_CHECKOUT = Path(__file__).resolve().parents[2]


def local_budget(text: str) -> Budget:
  """The budget of ``text``; plain ``auto`` on a local GPU is its allocator's limit.

  On a GPU, ``memory_stats()['bytes_limit']`` is the pool JAX allocates from
  (the device memory times XLA_PYTHON_CLIENT_MEM_FRACTION), which is exactly
  what plain ``auto`` means. The CPU backend has no such limit: give a size.
  """
  budget = parse_budget(text)
  if budget.device:
    stats = jax.devices()[0].memory_stats() or {}
    if stats.get('bytes_limit'):
      return Budget(budget.text, nbytes=int(stats['bytes_limit']))
    raise auto.BudgetError(f"'{text}': the {jax.default_backend()} backend reports no device "
                           'memory; give a budget: auto:SIZE (e.g. auto:8GiB) or auto:Fx '
                           '(e.g. auto:0.6x)')
  return budget


def choose_for_run(cfg, named, task: Task, size: int, log, place=None,
                   batch=None) -> tuple[auto.Choice, int]:
  """Runs (or reads from the cache) the search for this run's train step.

  With ``cfg.grad_accum_search`` (``--remat=auto:BUDGET`` without
  ``--grad-accum``) the microbatches are searched with the policy
  (:func:`remat.auto_levers.choose_levers`: every K that divides the batch, and
  its microbatches over the mesh's batch shards), and the fastest plan that fits
  by its cost model is taken; otherwise the policy alone at ``cfg.grad_accum``.
  The optimizer's placement is ``--offload-optimizer``'s, not searched: on the
  CPU backend host and device memory are one.

  Args:
    cfg: the :class:`training.trainer.TrainConfig` (``cfg.remat`` is the auto spec).
    named: the named config.
    task: the task at ``size``.
    size: sequence length or image side.
    log: where the search's lines and the answer go.
    place: the run's :class:`training.step.mesh.Placement` (None or no mesh: one device).
    batch: the run's batch (ShapeDtypeStructs), when it is not the task's plain one (packed
      text carries segment ids and positions, and attends within documents).

  Returns:
    (the policy search's answer, the microbatches K to train with).
  """
  budget = local_budget(cfg.remat)
  tx = st.make_optimizer(cfg.lr, cfg.steps, cfg.warmup_steps, cfg.weight_decay, cfg.grad_clip)
  args = st.abstract_inputs(task.model('none'), tx, cfg.batch_size, size, cfg.seed)
  if batch is not None:
    args = (args[0], batch)

  def build(policy, microbatches=cfg.grad_accum, offload=False):
    # With --grad-accum the loss's batch is one microbatch: the residuals the step keeps at a time.
    return st.measured_step(task.model(policy), tx, cfg.seed, guard=True,
                            microbatches=microbatches)

  key = {'config': named.name, 'model': dataclasses.asdict(named.model), 'batch_size':
         cfg.batch_size, 'size': size, 'optimizer': [cfg.lr, cfg.steps, cfg.warmup_steps,
                                                     cfg.weight_decay, cfg.grad_clip],
         'seed': cfg.seed, 'guard': True, 'source': source_hash(),
         'batch': str(jax.tree_util.tree_map(lambda a: (a.shape, str(a.dtype)), args[1]))}
  shardings = None
  if place is not None and place.mesh is not None:
    state, batch = args   # the shardings Placement.jit_train_step compiles the run's step with
    state_sh = place.state_shardings(state)
    shardings = ((state_sh, place.batch_shardings(batch)), (state_sh, place.replicated()))
    key['mesh'] = cfg.mesh
  if cfg.grad_accum_search:
    from remat.auto_levers import choose_levers
    from training.step.accumulate import AccumError, check
    shards = place.batch_shards if place is not None else 1

    def splits(k: int) -> bool:
      try:
        check(k, cfg.batch_size, shards)
        return True
      except AccumError:
        return False
    ks = [k for k in range(1, cfg.batch_size + 1) if splits(k)]
    levers = choose_levers(build, *args, budget=budget, batch_size=cfg.batch_size,
                           target='cpu', num_layers=task.num_layers, microbatches=ks,
                           weight_bytes=st.weight_bytes(args[0]), cache_key=key, log=log,
                           shardings=shardings)
    for line in levers.table().splitlines():
      log(f'remat: {line}')
    log(f'remat: {levers.choice.summary()}')   # the policy search at the chosen microbatches
    log(f'remat: levers: {levers.summary()}')
    return levers.choice, levers.microbatches
  if cfg.grad_accum > 1:
    key['grad_accum'] = cfg.grad_accum
  choice = auto.choose(build, *args, budget=budget, target='cpu', num_layers=task.num_layers,
                       cache_key=key, log=log, shardings=shardings)
  log(f'remat: {choice.summary()}')
  return choice, cfg.grad_accum


def source_files() -> list[Path]:
  """The model, training and remat source (sub-packages too), in a fixed order."""
  return [p for folder in ('models', 'training', 'remat')
          for p in sorted((_CHECKOUT / folder).rglob('*.py'))]


def source_hash() -> str:
  """A hash of :func:`source_files` (paths and bytes): an edit invalidates cached answers."""
  import hashlib
  h = hashlib.sha256()
  for path in source_files():
    h.update(path.relative_to(_CHECKOUT).as_posix().encode() + path.read_bytes())
  return h.hexdigest()[:16]
