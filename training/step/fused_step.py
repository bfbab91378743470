"""A train step with the optimizer applied per layer in the backward pass (remat.fused_update).

Our models (GPT-2, Llama, ViT) run their blocks through one :class:`remat.LayerStack`.
The step cuts a model's loss there without model-specific code: a Flax method
interceptor stops the forward pass at the stack's call (the embeddings: ``pre``)
or hands it the stack's output (final norm, head and loss: ``post``); the
blocks run as ``layer`` with the stack's extra call arguments (segment ids,
RoPE tables) as the model passed them.

Semantics (docs/own-model.md, docs/pytorch.md): the loss and gradients are the
ordinary step's. AdamW is elementwise, so each layer's update is the ordinary
one; the global-norm clip of :func:`training.step.train_step.make_optimizer` becomes a
clip of each layer's gradient by its own norm (and of the parameters outside
the stack by theirs). Deterministic models only: a block's dropout key would
have to come from the stack.
"""

from __future__ import annotations

import inspect

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import remat
from training.step.train_step import TrainState, _task


class FusedStepError(ValueError):
  """A model the fused step cannot cut at its layer stack; one line."""


class _AtStack(Exception):
  def __init__(self, module, x, args):
    super().__init__('stopped at the layer stack')
    self.module, self.x, self.args = module, x, args


# The config fields that give a model dropout (GPT-2, Llama, ViT).
DROPOUT_FIELDS = ('dropout', 'attention_dropout', 'embed_dropout')


def dropout_of(config) -> dict:
  """The config's non-zero dropout rates by field (empty: the fused step can run it)."""
  return {f: getattr(config, f) for f in DROPOUT_FIELDS if getattr(config, f, 0)}


def _stack_call(context, kwargs) -> bool:
  """True for a LayerStack's ``__call__`` the fused step can cut at; one-line error for others."""
  if not (isinstance(context.module, remat.LayerStack) and context.method_name == '__call__'):
    return False
  if context.module.pattern is not None or kwargs.get('xs') is not None:
    raise FusedStepError('the fused update takes a stack of one block kind with no per-layer '
                         'inputs')
  return True


def _stop_at_stack(next_fun, args, kwargs, context):
  if _stack_call(context, kwargs):
    raise _AtStack(context.module, args[0], args[1:])
  return next_fun(*args, **kwargs)


def _check_model(model: nn.Module) -> None:
  if dropout_of(model.config):
    raise FusedStepError(f'the fused update runs deterministic models only; {type(model).__name__}'
                         "'s config has dropout (set it to 0)")


def _at_stack(task, model, params, model_state, batch) -> _AtStack:
  """Runs the loss up to the stack's call (no further)."""
  try:
    with nn.intercept_methods(_stop_at_stack):
      task.loss(model, params, model_state, batch)
  except _AtStack as stop:
    return stop
  raise FusedStepError(f'{type(model).__name__} runs no remat.LayerStack in its loss')


def stack_path(model: nn.Module, params, batch, model_state=None) -> tuple[str, ...]:
  """Where the model's stacked block variables are: ``params[path]['block']``."""
  _check_model(model)
  if model_state:
    raise FusedStepError(f'the fused update takes models without non-trained state; '
                         f"{type(model).__name__} has {', '.join(sorted(model_state))}")
  task = _task(model)
  calls = []

  def count(next_fun, args, kwargs, context):
    if _stack_call(context, kwargs):
      calls.append(tuple(context.module.scope.path))
    return next_fun(*args, **kwargs)

  def probe(p, b):
    with nn.intercept_methods(count):
      task.loss(model, p, {}, b)
    return 0
  jax.eval_shape(probe, params, batch)   # params and batch may be abstract
  if len(calls) != 1:
    raise FusedStepError(f'the fused update cuts a model at its one layer stack; '
                         f'{type(model).__name__} runs {len(calls)}')
  return calls[0]


def split_params(params, path: tuple[str, ...]):
  """``params -> (outer, stacked)``: the stack's ``block`` subtree and everything else."""
  node = params
  for key in path:
    node = node[key]
  stacked = node['block']
  outer = _drop(params, path)
  return outer, stacked


def _drop(tree, path):
  key, rest = path[0], path[1:]
  child = tree[key]
  child = {k: v for k, v in child.items() if k != 'block'} if not rest else _drop(child, rest)
  out = dict(tree)
  if child:
    out[key] = child
  else:
    del out[key]
  return out


def join_params(outer, stacked, path: tuple[str, ...]):
  """The inverse of :func:`split_params`."""
  out = dict(outer)
  node = out
  for key in path:
    node[key] = dict(node.get(key, {}))
    node = node[key]
  node['block'] = stacked
  return out


def init_fused_state(model: nn.Module, tx: optax.GradientTransformation, params, path,
                     model_state=None) -> TrainState:
  """A train state whose optimizer state is ``(tx.init(outer), tx.init(stacked))``."""
  outer, stacked = split_params(params, path)
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, model_state=model_state or {},
                    opt_state=(tx.init(outer), tx.init(stacked)))


def _live(fn, *args):
  """``fn(*args)``, evaluated from its jaxpr without the equations its output does not need."""
  from jax._src.interpreters import partial_eval as pe  # no public API for it in jax 0.10
  flat, _ = jax.tree_util.tree_flatten(args)
  closed = jax.make_jaxpr(lambda *a: fn(*jax.tree_util.tree_unflatten(
      jax.tree_util.tree_structure(args), a)))(*flat)
  jaxpr, _ = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars), instantiate=True)
  (out,) = jax.core.eval_jaxpr(jaxpr, closed.consts, *flat)
  return out


def make_fused_train_step(model: nn.Module, tx: optax.GradientTransformation, path):
  """Returns ``step(state, batch) -> (state, loss)`` with ``tx`` applied layer by layer.

  ``state.opt_state`` is :func:`init_fused_state`'s. The stack runs under the
  model's own policy (``model.policy``).
  """
  _check_model(model)
  task = _task(model)

  def train_step(state: TrainState, batch):
    outer, stacked = split_params(state.params, path)
    found = {}

    def pre(o):
      stop = _at_stack(task, model, join_params(o, stacked, path), state.model_state, batch)
      found['block'] = stop.module.block_cls(**dict(stop.module.block_kwargs))
      # The stack's other arguments (segment ids, RoPE tables) do not depend on the
      # parameters, so they are values of the step's own trace and may leave this one.
      found['args'] = stop.args
      return stop.x

    def layer(p, x):
      block = found['block']
      rng = {'rng': None} if 'rng' in inspect.signature(type(block).__call__).parameters else {}
      out = block.apply({'params': p}, x, *found['args'], **rng)
      return out[0] if isinstance(out, tuple) else out

    def cut_loss(o, y):
      def give(next_fun, a, kw, context):
        return y if _stack_call(context, kw) else next_fun(*a, **kw)
      with nn.intercept_methods(give):
        return task.loss(model, join_params(o, stacked, path), state.model_state, batch)[0]

    def post(o, y):
      # The cut loss also reruns everything before the stack, whose result it drops: dead
      # code that XLA removes, but that a count of the traced program (the FLOPs column of
      # baselines.compare) would see. Evaluate it without the equations no output reads.
      return _live(cut_loss, o, y)

    fused = remat.fused_update(pre, layer, post, tx, policy=model.policy)
    outer, stacked, opt_state, loss = fused.step(outer, stacked, state.opt_state)
    return TrainState(step=state.step + 1, params=join_params(outer, stacked, path),
                      model_state=state.model_state, opt_state=opt_state), loss
  return train_step
