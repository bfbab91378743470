"""Measure a model, policy family and batch in PyTorch: peak memory, its activations, FLOPs, time.

The train step (:func:`train_step`) is a whole one: forward with the loss
(``model(**batch).loss``; the model output is dropped, so the logits live only
as long as the loss needs them), backward, global-norm clipping at 1.0 and
AdamW (lr 3e-4, betas (0.9, 0.95), weight decay 0.1, torch's default
implementation), as in our JAX train step. :func:`measure_torch` runs

1. one warm-up step, which creates the optimizer state (so the measured step
   is steady-state: parameters and AdamW moments exist, gradients do not);
2. one step for memory: on CPU under ``MemTracker``
   (``torch.distributed._tools.mem_tracker``), which tags every tensor storage
   by category; on CUDA with the allocator's ``max_memory_allocated``, the
   whole measurement in a fresh process (``python -m baselines.torch_measure``);
3. one step under ``torch.utils.flop_counter.FlopCounterMode``;
4. ``steps`` timed steps with no tracker.

Dropout draws from ``torch.manual_seed(seed + step)``, and the batch from
``seed`` (:func:`baselines.torch_models.make_batch`), so every run gives the
same numbers.

MemTracker's categories (bytes of tensor storage, per device, summed here)::

    Parameter   model parameters (tied ones once)
    Buffer      model buffers (ResNet's BatchNorm running statistics)
    Gradient    parameter gradients
    Activation  tensors created in the forward (and in a recompute during
                backward): what the forward keeps for backward, plus its
                transient values while they live
    Temp        tensors created in the backward (outside a recompute)
    Optstate    AdamW moments, and temporaries of the optimizer step
    Other       the input batch
    Total       the sum

It counts tensor storage only: not the allocator's caching or fragmentation,
not memory that bypasses the dispatcher (e.g. oneDNN scratch space), not the
Python process. Its own note: during a recompute in backward some bytes may
be attributed to Activation instead of Temp, but the total is exact.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import functools
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from baselines.torch_models import LANGUAGE_MODELS, build_model, input_shape, make_batch
from baselines.torch_policies import apply_policy, check_supported
from training.arguments import OneLineParser

_aten = torch.ops.aten
# FlopCounterMode has no formula for the CPU flash-attention kernel that sdpa uses on CPU
# without dropout; these are the formulas it uses for the CUDA kernels (same argument order),
# unwrapped because custom_mapping wraps them again.
_raw = lambda op: getattr(flop_registry[op], '__wrapped__', flop_registry[op])
_CPU_SDPA_FLOPS = {
    _aten._scaled_dot_product_flash_attention_for_cpu:
        _raw(_aten._scaled_dot_product_flash_attention),
    _aten._scaled_dot_product_flash_attention_for_cpu_backward:
        _raw(_aten._scaled_dot_product_flash_attention_backward),
} if hasattr(_aten, '_scaled_dot_product_flash_attention_for_cpu_backward') else {}


@dataclasses.dataclass(frozen=True)
class TorchMeasurement:
  """What one policy family's train step costs in PyTorch.

  Attributes:
    model: 'gpt2' | 'llama' | 'vit' | 'resnet'.
    family: the policy family (see :mod:`baselines.torch_policies`).
    batch_size: B.
    seq_len: L for GPT-2 (tokens per row); None for the image models.
    image_size: S for ViT / ResNet (inputs [B, C, S, S]); None for GPT-2.
    device: 'cpu' or 'cuda'.
    method: how memory was measured: 'MemTracker' (CPU) or
      'cuda.max_memory_allocated' (CUDA, fresh process).
    peak_bytes: bytes, peak of all live tensors during the measured step
      (MemTracker: 'Total' at its peak; CUDA: ``max_memory_allocated``).
    activation_bytes: bytes, the activation part of the peak (MemTracker:
      'Activation' at the moment of the peak; CUDA: as saved_activation_bytes).
    saved_activation_bytes: bytes the forward leaves alive for backward:
      right after forward and loss, before backward (MemTracker: 'Activation'
      then; CUDA: ``memory_allocated`` then minus before the step). The
      analogue of the JAX report's residual bytes.
    breakdown: bytes per MemTracker category at the peak (module docstring);
      on CUDA ``{'Total': peak, 'Static': allocated before the step,
      'Parameter': ..., 'Optstate': ...}``.
    after_forward: bytes per category right after forward and loss (CUDA:
      ``{'Total': allocated then}``).
    step_flops: FLOPs of one train step as FlopCounterMode counts them
      (matmuls, convolutions, attention kernels; 2 per multiply-add; elementwise
      ops, norms and the optimizer count 0), recomputation included.
    forward_flops: FLOPs of the forward and loss alone (the same for every family).
    none_step_flops: step_flops of ``none`` at the same shape.
    recompute_ratio: step_flops / none_step_flops (1.0 for ``none``).
    step_seconds: seconds, median wall time of ``steps`` timed steps.
    loss: the warm-up step's loss (nats; the same for every family).
    num_params: parameters (tied ones once).
    steps: timed steps.
  """
  model: str
  family: str
  batch_size: int
  seq_len: int | None
  image_size: int | None
  device: str
  method: str
  peak_bytes: int
  activation_bytes: int
  saved_activation_bytes: int
  breakdown: dict[str, int]
  after_forward: dict[str, int]
  step_flops: int
  forward_flops: int
  none_step_flops: int
  recompute_ratio: float
  step_seconds: float
  loss: float
  num_params: int
  steps: int

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


def make_optimizer(net: torch.nn.Module) -> torch.optim.Optimizer:
  """AdamW as in our JAX train step (constant lr: the schedule does not change memory or FLOPs)."""
  return torch.optim.AdamW(net.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)


def train_step(net: torch.nn.Module, batch: dict, optimizer: torch.optim.Optimizer | None,
               seed: int, after_forward=None) -> float:
  """One train step; returns the loss.

  Args:
    net: the model (train mode).
    batch: from :func:`baselines.torch_models.make_batch`.
    optimizer: AdamW, or None for forward and backward only (gradients are left in ``.grad``).
    seed: ``torch.manual_seed`` for this step's dropout.
    after_forward: called between forward (with loss) and backward.
  """
  torch.manual_seed(seed)
  loss = net(**batch).loss
  if after_forward is not None:
    after_forward()
  loss.backward()
  if optimizer is not None:
    torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
  return loss.item()


def measure_torch(model: str, model_fields: dict, family: str, batch_size: int,
                  seq_len: int | None, image_size: int | None, steps: int = 3, *,
                  seed: int = 0, device: str | None = None, attn_implementation: str = 'sdpa',
                  fresh_process: bool | None = None, timeout: float = 3600) -> TorchMeasurement:
  """Measures one train step of ``model`` under policy ``family``.

  Args:
    model: 'gpt2' | 'llama' | 'vit' | 'resnet'.
    model_fields: the ``"model"`` dict of one of our JSON configs.
    family: 'none' | 'hf' | 'block' | 'sqrt' | 'selective'.
    batch_size: B.
    seq_len: GPT-2 tokens per row (None: the config's ``max_len``); ignored otherwise.
    image_size: ViT / ResNet input side (None: the config's); ignored for GPT-2.
      A ViT is built for this side.
    steps: timed steps (after the warm-up, memory and FLOP steps).
    seed: seeds the weights, the batch and dropout.
    device: 'cpu' or 'cuda' (None: 'cuda' if available).
    attn_implementation: HF attention backend for GPT-2 / ViT ('sdpa' or 'eager').
    fresh_process: run the whole measurement in a fresh
      ``python -m baselines.torch_measure`` process (None: on CUDA only, where
      the allocator peak must be the step's own; MemTracker needs none).
    timeout: seconds allowed for that process.

  Returns:
    A :class:`TorchMeasurement` (bytes, FLOPs, seconds).

  Raises:
    ValueError: one line: unknown model or family, a family the model does not
      support, or a shape the model cannot take.
    RuntimeError: the fresh process failed (its last stderr line in the message).
  """
  check_supported(model, family)
  language = model in LANGUAGE_MODELS
  seq_len, image_size = input_shape(model, model_fields, seq_len if language else None,
                                    None if language else image_size)
  if steps < 1:
    raise ValueError(f'steps must be >= 1, got {steps}')
  device = device or ('cuda' if torch.cuda.is_available() else 'cpu')
  args = dict(model=model, model_fields=model_fields, family=family, batch_size=batch_size,
              seq_len=seq_len, image_size=image_size, steps=steps, seed=seed,
              attn_implementation=attn_implementation)
  if fresh_process is None:
    fresh_process = device != 'cpu'
  if fresh_process:
    return _measure_in_fresh_process(args, device, timeout)
  return _measure(device=device, **args)


def _measure(model, model_fields, family, batch_size, seq_len, image_size, steps, seed,
             attn_implementation, device) -> TorchMeasurement:
  net = apply_policy(model, build_model(model, model_fields, image_size=image_size, seed=seed,
                                        device=device, attn_implementation=attn_implementation),
                     family)
  batch = make_batch(model, model_fields, batch_size, seq_len, image_size, seed, device)
  opt = make_optimizer(net)
  loss = train_step(net, batch, opt, seed)
  if device == 'cpu':
    method, mem = 'MemTracker', _memtracker_step(net, batch, opt, seed + 1)
  else:
    method, mem = 'cuda.max_memory_allocated', _cuda_step(net, batch, opt, seed + 1)
  forward_flops, step_flops = _flop_step(net, batch, opt, seed + 2)
  times = []
  for i in range(steps):
    _sync(device)
    t = time.perf_counter()
    train_step(net, batch, opt, seed + 3 + i)
    _sync(device)
    times.append(time.perf_counter() - t)
  if family == 'none':
    none_flops = step_flops
  else:
    none_flops = _none_step_flops(model, json.dumps(model_fields, sort_keys=True), batch_size,
                                  seq_len, image_size, seed, attn_implementation, device)
  return TorchMeasurement(
      model=model, family=family, batch_size=batch_size, seq_len=seq_len, image_size=image_size,
      device=device, method=method, **mem, step_flops=step_flops, forward_flops=forward_flops,
      none_step_flops=none_flops, recompute_ratio=step_flops / none_flops,
      step_seconds=statistics.median(times), loss=loss,
      num_params=sum(p.numel() for p in net.parameters()), steps=steps)


def _categories(snapshot: dict) -> dict[str, int]:
  """MemTracker's ``{device: {category: bytes}}`` as ``{category name: bytes}`` over all devices."""
  out: dict[str, int] = {}
  for dev_snap in snapshot.values():
    for k, v in dev_snap.items():
      name = k.value if isinstance(k, enum.Enum) else str(k)
      out[name] = out.get(name, 0) + v
  return out


def _memtracker_step(net, batch, opt, seed) -> dict:
  from torch.distributed._tools.mem_tracker import MemTracker
  tracker = MemTracker()
  tracker.track_external(net, opt, *batch.values())
  after: dict[str, int] = {}
  with tracker:
    train_step(net, batch, opt, seed,
               after_forward=lambda: after.update(_categories(tracker.get_tracker_snapshot())))
  peak = _categories(tracker.get_tracker_snapshot('peak'))
  return dict(peak_bytes=peak['Total'], activation_bytes=peak.get('Activation', 0),
              saved_activation_bytes=after.get('Activation', 0), breakdown=peak,
              after_forward=after)


def _cuda_step(net, batch, opt, seed) -> dict:
  torch.cuda.synchronize()
  torch.cuda.reset_peak_memory_stats()
  before = torch.cuda.memory_allocated()
  after: dict[str, int] = {}

  def after_forward():
    torch.cuda.synchronize()
    after['Total'] = torch.cuda.memory_allocated()

  train_step(net, batch, opt, seed, after_forward=after_forward)
  torch.cuda.synchronize()
  peak = torch.cuda.max_memory_allocated()
  saved = after['Total'] - before
  nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)
  opt_state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
  breakdown = {'Total': peak, 'Static': before, 'Parameter': nbytes(net.parameters()),
               'Optstate': nbytes(opt_state)}
  return dict(peak_bytes=peak, activation_bytes=saved, saved_activation_bytes=saved,
              breakdown=breakdown, after_forward=after)


def _flop_step(net, batch, opt, seed) -> tuple[int, int]:
  """``(forward FLOPs, step FLOPs)`` of one train step under FlopCounterMode."""
  counts = {}
  with FlopCounterMode(display=False, custom_mapping=_CPU_SDPA_FLOPS) as counter:
    train_step(net, batch, opt, seed,
               after_forward=lambda: counts.update(forward=counter.get_total_flops()))
    step = counter.get_total_flops()
  return counts['forward'], step


@functools.lru_cache(maxsize=32)
def _none_step_flops(model, fields_json, batch_size, seq_len, image_size, seed,
                     attn_implementation, device) -> int:
  """Step FLOPs of ``none`` at this shape (forward and backward: the optimizer counts 0)."""
  fields = json.loads(fields_json)
  net = build_model(model, fields, image_size=image_size, seed=seed, device=device,
                    attn_implementation=attn_implementation)
  batch = make_batch(model, fields, batch_size, seq_len, image_size, seed, device)
  with FlopCounterMode(display=False, custom_mapping=_CPU_SDPA_FLOPS) as counter:
    train_step(net, batch, None, seed)
  return counter.get_total_flops()


def _sync(device: str) -> None:
  if device != 'cpu':
    torch.cuda.synchronize()


def _measure_in_fresh_process(args: dict, device: str, timeout: float) -> TorchMeasurement:
  """Runs :func:`_measure` in a fresh ``python -m baselines.torch_measure`` process."""
  cmd = [sys.executable, '-m', 'baselines.torch_measure', '--device', device, json.dumps(args)]
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # finds baselines/ uninstalled
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      p for p in (root, os.environ.get('PYTHONPATH')) if p))
  run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
  lines = [l for l in run.stdout.splitlines() if l.startswith('{')]
  if run.returncode or not lines:
    last = (run.stderr.strip().splitlines() or ['no output'])[-1]
    raise RuntimeError(f"torch measurement process for {args['model']} {args['family']} "
                       f'failed: {last}')
  return TorchMeasurement(**json.loads(lines[-1]))


def _json_object(text: str) -> dict:
  try:
    value = json.loads(text)
  except ValueError as e:
    raise argparse.ArgumentTypeError(f'not JSON: {e}') from None
  if not isinstance(value, dict):
    raise argparse.ArgumentTypeError('expected a JSON object of measure_torch arguments')
  return value


def main(argv=None) -> int:
  """``python -m baselines.torch_measure [--device D] ARGS_JSON``: one measurement as a JSON line.

  ARGS_JSON holds :func:`measure_torch`'s arguments (model, model_fields,
  family, batch_size, seq_len, image_size, steps, seed, attn_implementation).
  """
  p = OneLineParser(prog='python -m baselines.torch_measure')
  p.add_argument('--device', default='cpu')
  p.add_argument('args_json', type=_json_object, metavar='ARGS_JSON')
  a = p.parse_args(argv)
  args = a.args_json
  check_supported(args['model'], args['family'])
  m = _measure(device=a.device, **args)
  print(json.dumps(m.to_dict()))
  return 0


if __name__ == '__main__':
  sys.exit(main())
