"""A LoRA run's parameter tree in two parts: the frozen base and what trains.

The model's ``init`` makes one tree; :func:`split` cuts it into the frozen
base (every leaf but the adapters and a vision model's head) and the trained
part, :func:`merge` joins them for ``apply``. The train state holds them
apart: the optimizer and the gradient see the trained part only, and
checkpoints hold only it (training.step.train_step.TrainState).

:func:`freeze` stores a base as a LoRA run keeps it: every leaf in the compute
dtype, and under QLoRA each block projection's kernel quantized
(:mod:`models.lora.quantize`), layer by layer. :func:`merged` folds the
adapters back into the kernels (``W + alpha / r * A @ B``), the full model a
Hugging Face export writes.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from models.lora import quantize as q
from models.lora.spec import PROJECTIONS, STACKS, TRAINED_WHOLE, LoraSpec

ADAPTER_LEAVES = ('lora_a', 'lora_b')


def _flat(tree, prefix=()) -> dict[tuple[str, ...], Any]:
  """Nested dicts -> {path: leaf}; a quantized kernel ({'codes', 'scale'}) is one leaf."""
  if isinstance(tree, dict) and not is_quantized(tree):
    out = {}
    for k, v in tree.items():
      out.update(_flat(v, prefix + (k,)))
    return out
  return {prefix: tree}


def _nest(flat: dict[tuple[str, ...], Any]) -> dict:
  out: dict = {}
  for path, leaf in flat.items():
    node = out
    for k in path[:-1]:
      node = node.setdefault(k, {})
    node[path[-1]] = leaf
  return out


def is_quantized(x) -> bool:
  """Whether ``x`` is a quantized kernel (:func:`models.lora.quantize.quantize`'s dict)."""
  return isinstance(x, dict) and set(x) == {'codes', 'scale'}


def is_trained(path: tuple[str, ...], arch: str) -> bool:
  """Whether the leaf at ``path`` trains in a LoRA run: an adapter, or a vision model's head."""
  return path[-1] in ADAPTER_LEAVES or path[0] in TRAINED_WHOLE.get(arch, ())


def split(params: dict, arch: str) -> tuple[dict, dict]:
  """``(frozen, trained)`` parts of a LoRA model's parameter tree."""
  flat = _flat(params)
  return (_nest({p: v for p, v in flat.items() if not is_trained(p, arch)}),
          _nest({p: v for p, v in flat.items() if is_trained(p, arch)}))


def merge(frozen: dict | None, trained: dict) -> dict:
  """The model's whole parameter tree from :func:`split`'s parts (``trained`` alone if no base)."""
  if frozen is None:
    return trained
  return _nest({**_flat(frozen), **_flat(trained)})


def kernel_paths(arch: str) -> dict[tuple[str, ...], str]:
  """Path of each block projection's kernel -> the projection's name."""
  return {STACKS[arch] + tuple(p.split('/')) + ('kernel',): p for p, _ in PROJECTIONS[arch]}


def freeze(base: dict, spec: LoraSpec, arch: str, dtype,
           progress: Callable[[int], Any] | None = None) -> dict:
  """The base as a LoRA run stores it: leaves in ``dtype``, kernels quantized under QLoRA.

  Args:
    base: the frozen part (numpy or JAX arrays; kernels already quantized are kept).
    spec: the run's adapters (``spec.quantize``).
    arch: the model family.
    dtype: the compute dtype.
    progress: called with the number of layers quantized so far (a progress bar).

  Returns:
    The tree, as JAX arrays. Kernels are quantized one layer at a time, so no
    more than one layer's float32 kernel is on the device at once.
  """
  kernels = kernel_paths(arch) if spec.quantize else {}
  quant = jax.jit(lambda w: q.quantize(w, spec.quantize))
  out, done = {}, 0
  for path, leaf in _flat(base).items():
    if is_quantized(leaf):
      out[path] = {k: jnp.asarray(v) for k, v in leaf.items()}
    elif path in kernels:
      layers = []
      for i in range(leaf.shape[0]):
        layers.append(quant(np.asarray(leaf[i], np.float32)))
        done += 1
        if progress is not None:
          progress(done)
      out[path] = {k: jnp.stack([l[k] for l in layers]) for k in ('codes', 'scale')}
    else:
      out[path] = jnp.asarray(leaf, dtype) if jnp.issubdtype(leaf.dtype, jnp.floating) else (
          jnp.asarray(leaf))
  return _nest(out)


def quantized_layers(spec: LoraSpec, arch: str, num_layers: int) -> int:
  """How many kernel slices :func:`freeze` quantizes (a progress bar's total)."""
  return len(PROJECTIONS[arch]) * num_layers if spec.quantize else 0


def merged(params: dict, spec: LoraSpec, arch: str) -> dict:
  """Float32 parameters of the full model: adapters folded into their kernels, kernels dequantized.

  ``W + (alpha / r) * A @ B`` per layer, in float32 from the stored base (so a
  QLoRA run's export is its dequantized base plus the adapters); the adapter
  leaves are dropped, so the tree is the model's without LoRA.
  """
  flat = _flat(jax.device_get(params))
  out = {}
  for path, leaf in flat.items():
    if path[-1] in ADAPTER_LEAVES:
      continue
    if is_quantized(leaf):
      leaf = np.asarray(q.dequantize(leaf, spec.quantize, jnp.float32))
    leaf = np.asarray(leaf, np.float32)
    if path[-1] == 'kernel' and path[:-1] + ('lora_a',) in flat:
      a = np.asarray(flat[path[:-1] + ('lora_a',)], np.float32)
      b = np.asarray(flat[path[:-1] + ('lora_b',)], np.float32)
      leaf = leaf + spec.scale * np.einsum('...ir,...ro->...io', a, b)
    out[path] = leaf
  return _nest(out)


def count(tree) -> int:
  """Parameters in ``tree`` (a quantized kernel counts its weights, not its bytes)."""
  n = 0
  for leaf in _flat(tree).values():
    if is_quantized(leaf):   # nf4 packs two weights a byte
      codes = leaf['codes']
      n += int(np.prod(codes.shape)) * (1 if codes.dtype == jnp.int8 else 2)
    else:
      n += int(np.prod(leaf.shape))
  return n


def nbytes(tree) -> int:
  """Bytes the arrays of ``tree`` occupy as stored."""
  return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize
             for a in jax.tree_util.tree_leaves(tree))
