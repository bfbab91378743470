"""The model zoo as programs for :mod:`remat.measuring`: one adapter per model family, one table.

A zoo case is a model config at a batch size and a size (the sequence length for
GPT, the image side for ViT and ResNet). For a policy it gives what ``remat``
measures: the whole train step (forward, backward, AdamW; the state donated),
or the loss alone for the activation-memory sweeps. Everything here is built
from ``training`` (the task, optimizer and train step that ``train.py`` runs),
so the report measures the step that training compiles.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax

from configs import DEFAULT_CONFIG
from models.resnet import DEPTHS as RESNET_DEPTHS, ResNetConfig
from models.tasks import Task
from remat import Policy, get_policy
from remat import measuring
from remat.measuring import Measurement, TrainStep
from remat.memory import MemoryStats
from remat.targets import Target
from training.step import fused_step
from training.step import train_step as st
from training.step.autoremat import source_hash

# The optimizer every measured step uses: AdamW, peak lr 1e-3 (10 warm-up steps of 1000),
# weight decay 0.1, global-norm clip 1.0 (baselines.compare matches its torch side to this).
OPTIMIZER = dict(lr=1e-3, steps=1000, warmup_steps=10, weight_decay=0.1, grad_clip=1.0)

_TRANSFORMER_POLICIES = ('none', 'full', 'dots', 'dots_no_batch', 'sqrt', 'full@sqrt', 'minimal',
                         'save_qkv_proj', 'save_dot_except_mlp', 'qkv_proj_offloaded')


# The presets apply to Llama's gated MLP too (its mlpwi_0/mlpwi_1 stand for GPT-2's mlpwi).
_LLAMA_POLICIES = _TRANSFORMER_POLICIES


def _same_width_at_depth(cfg, n: int):
  return dataclasses.replace(cfg, num_layers=n)


def _resnet_at_depth(cfg: ResNetConfig, n: int) -> ResNetConfig:
  keep = {f: getattr(cfg, f) for f in ('embedding_size', 'num_classes', 'channels',
                                       'image_size', 'bn_momentum', 'bn_eps')}
  return ResNetConfig.from_depth(n, **keep)


@dataclasses.dataclass(frozen=True)
class Family:
  """What the report needs to know about one model family.

  Attributes:
    arch: 'gpt', 'llama', 'vit' or 'resnet' (``models.tasks.Task.arch``).
    policies: the report's default policy set.
    vision: True when the size is an image side (else a sequence length).
    at_depth: ``at_depth(cfg, n)``: the config with ``n`` layers (depth sweeps).
    depths: the depths a sweep may take, or None for any.
  """
  arch: str
  policies: tuple[str, ...]
  vision: bool
  at_depth: Callable[[Any, int], Any]
  depths: tuple[int, ...] | None = None

  @property
  def default_config(self) -> str:
    return DEFAULT_CONFIG[self.arch]

  @property
  def sweeps(self) -> tuple[str, ...]:
    """Sweep kinds: depth, and for vision models the image side."""
    return ('depth', 'resolution') if self.vision else ('depth',)


FAMILIES = {f.arch: f for f in (
    Family('gpt', _TRANSFORMER_POLICIES, False, _same_width_at_depth),
    Family('llama', _LLAMA_POLICIES, False, _same_width_at_depth),
    Family('vit', _TRANSFORMER_POLICIES, True, _same_width_at_depth),
    Family('resnet', ('none', 'full', 'dots', 'dots_no_batch', 'convs', 'save_conv_narrow',
                      'sqrt', 'full@sqrt', 'stage', 'full@stage', 'offload:conv1,conv2'),
           True, _resnet_at_depth, tuple(RESNET_DEPTHS)),
)}


def family(model_cfg) -> Family:
  """The adapter of a GPTConfig, ViTConfig or ResNetConfig."""
  return FAMILIES[Task(model_cfg).arch]


def _optimizer():
  return st.make_optimizer(**OPTIMIZER)


def _loss(task: Task, model):
  """The train-mode loss (dropout on, BatchNorm on batch statistics) as
  ``loss(params, (frozen, model_state, batch))`` (:func:`training.step.train_step.measured_step`)."""
  return st.measured_step(model, _optimizer(), 0).loss


@dataclasses.dataclass(frozen=True)
class Case:
  """One model config at one batch shape; ``task`` is already at ``size``.

  ``microbatches``: the step accumulates the batch's gradient over that many
  microbatches (``--grad-accum``; :mod:`training.step.accumulate`).
  """
  task: Task
  batch_size: int
  size: int
  microbatches: int = 1
  offload: bool = False   # the optimizer state in host memory (training.step.offload; GPU plans)

  @property
  def num_layers(self) -> int:
    return self.task.num_layers

  def tags(self) -> set[str]:
    """The checkpoint names the model emits (what names:/offload: specs are checked against)."""
    return self.task.emitted_tags(self.size)

  def step_args(self):
    """Abstract ``(state, batch)`` of the train step; nothing is allocated."""
    return st.abstract_inputs(self.task.model('none'), _optimizer(), self.batch_size, self.size)

  def real_step_args(self):
    """The initial train state and an all-zero batch, allocated (for timing)."""
    model = self.task.model('none')
    return (st.init_state(model, _optimizer(), 0, self.size),
            self.task.zeros_batch(self.batch_size, self.size))

  def train_step(self, policy: Policy) -> TrainStep:
    """The train step under ``policy``, with the loss it differentiates."""
    # With microbatches the loss's batch is one microbatch (measured_step): the residuals are
    # what the backward pass keeps at a time.
    return st.measured_step(self.task.model(policy), _optimizer(), 0,
                            microbatches=self.microbatches,
                            offload=self.offload_settings() if self.offload else None)

  def offload_settings(self, transfer: bool = True):
    """The :class:`training.step.offload.Offload` of :data:`OPTIMIZER` for this model."""
    from training.step.offload import Offload
    o = OPTIMIZER
    return Offload(o['grad_clip'], st.elementwise_optimizer(o['lr'], o['steps'],
                                                            o['warmup_steps'], o['weight_decay']),
                   self.num_layers, transfer)

  @functools.cached_property
  def stack_path(self) -> tuple[str, ...]:
    """Where the model's stacked blocks are (:func:`training.step.fused_step.stack_path`; traced once)."""
    state, batch = self.step_args()
    return fused_step.stack_path(self.task.model('none'), state.params, batch)

  def fused_step_args(self):
    """Abstract ``(state, batch)`` of the fused step (:mod:`training.step.fused_step`)."""
    model, tx = self.task.model('none'), _optimizer()
    state, batch = self.step_args()
    return jax.eval_shape(lambda p: fused_step.init_fused_state(model, tx, p, self.stack_path),
                          state.params), batch

  def real_fused_step_args(self):
    """The initial fused train state and an all-zero batch, allocated (for timing)."""
    model, tx = self.task.model('none'), _optimizer()
    state, batch = self.real_step_args()
    return fused_step.init_fused_state(model, tx, state.params, self.stack_path), batch

  def fused_train_step(self, policy: Policy) -> TrainStep:
    """The train step with AdamW applied layer by layer in the backward pass (clip per layer)."""
    model, tx = self.task.model(policy), _optimizer()
    step = fused_step.make_fused_train_step(model, tx, self.stack_path)
    return TrainStep(step, _loss(self.task, model), st.loss_inputs)

  def loss_args(self):
    """Abstract ``(params, (frozen, model_state, batch))`` of the loss."""
    return st.loss_inputs(*self.step_args())

  def loss(self, policy: Policy):
    """The loss alone under ``policy``: ``loss(params, (frozen, model_state, batch))``."""
    return _loss(self.task, self.task.model(policy))

  def policy(self, spec: str | Policy) -> Policy:
    return get_policy(spec, num_layers=self.num_layers)

  def cache_key(self, guard: bool = False) -> dict:
    """What the train step's plan depends on, for the ``--remat=auto`` cache (no trace needed)."""
    return {'model': dataclasses.asdict(self.task.config), 'arch': self.task.arch,
            'batch_size': self.batch_size, 'size': self.size, 'optimizer': OPTIMIZER,
            'guard': guard, 'source': source_hash(),
            **({'microbatches': self.microbatches} if self.microbatches > 1 else {}),
            **({'offload': True} if self.offload else {})}

  def choose(self, budget: str, target: Target | str, **kwargs):
    """``--remat=auto`` on this case's train step: :func:`remat.auto.choose`."""
    from remat import auto
    return auto.choose(self.train_step, *self.step_args(), budget=budget, target=target,
                       num_layers=self.num_layers, cache_key=self.cache_key(), **kwargs)


def case(model_cfg, batch_size: int, size: int, layout: str = 'auto', *, microbatches: int = 1,
         offload: bool = False) -> Case:
  """The zoo case; one-line ValueError when ``size`` does not fit the model, or
  ``microbatches`` does not divide ``batch_size``.

  ``layout``: how the model's stacks become a program (:data:`remat.layout.LAYOUTS`).
  ``microbatches``, ``offload``: see :class:`Case`.
  """
  from training.step.accumulate import check
  check(microbatches, batch_size)
  return Case(Task(model_cfg, layout).at_size(size), batch_size, size, microbatches, offload)


def measure(model_cfg, spec: str | Policy, batch_size: int, size: int, target: Target,
            run: bool = False, time_steps: int = 5, fused: bool = False,
            layout: str = 'auto') -> Measurement:
  """Measures the train step (forward, backward, AdamW; state donated) under ``spec``.

  Args:
    model_cfg: a GPTConfig, ViTConfig or ResNetConfig.
    spec: the policy.
    batch_size, size: the batch shape; size is the sequence length (GPT) or
      the image side (vision).
    target: where to compile for (:func:`remat.targets.get_target`).
    run: also time the step on a freshly initialised state (local backend only).
    time_steps: timed steps after 2 warm-up steps.
    fused: measure :mod:`training.step.fused_step`'s step (the optimizer applied layer by
      layer in the backward pass) instead of the ordinary one.
    layout: how the model's stacks become a program (:data:`remat.layout.LAYOUTS`).
  """
  c = case(model_cfg, batch_size, size, layout)
  policy = c.policy(spec)
  if fused:
    return measuring.measure_policy(c.fused_train_step(policy), *c.fused_step_args(),
                                    spec=policy.spec, target=target, time=run,
                                    time_steps=time_steps,
                                    time_args=c.real_fused_step_args() if run else None)
  return measuring.measure_policy(c.train_step(policy), *c.step_args(), spec=policy.spec,
                                  target=target, time=run, time_steps=time_steps,
                                  time_args=c.real_step_args() if run else None)


def step_memory(model_cfg, spec: str | Policy, batch_size: int, size: int,
                target: Target) -> MemoryStats:
  """Compiled memory of the train step alone (no FLOP or residual walk)."""
  c = case(model_cfg, batch_size, size)
  return measuring.step_memory(c.train_step(c.policy(spec)), *c.step_args(), target=target)


def step_flops(model_cfg, spec: str | Policy, batch_size: int, size: int, layout: str = 'auto'):
  """Matmul/conv FLOPs of the train step, recompute included (jaxpr walk, nothing compiled)."""
  c = case(model_cfg, batch_size, size, layout)
  return measuring.step_flops(c.train_step(c.policy(spec)), *c.step_args())


def grad_memory(model_cfg, spec: str | Policy, batch_size: int, size: int,
                target: Target) -> MemoryStats:
  """Compiled memory of the loss gradient alone (no optimizer update).

  Parameters are arguments and their gradients outputs, so ``temp`` is the
  activation memory: saved residuals, recompute working sets and transient
  buffers, without the O(N) gradient and optimizer buffers of the train step.
  """
  c = case(model_cfg, batch_size, size)
  return measuring.step_memory(c.loss(c.policy(spec)), *c.loss_args(), target=target)


def local_step(model_cfg, spec: str | Policy, batch_size: int, size: int):
  """The train step compiled for the local backend, with real inputs to run it on.

  Returns:
    ``(compiled, state, batch)``: call ``compiled(state, batch) -> (state, loss)``
    (the state is donated, so pass the returned one to the next call).
  """
  c = case(model_cfg, batch_size, size)
  compiled = measuring.compile_step(c.train_step(c.policy(spec)), *c.step_args(), target='cpu')
  return (compiled, *c.real_step_args())
