"""Gradient accumulation inside the one compiled step (``--grad-accum K``).

The step's batch is cut into ``K`` microbatches, and a :func:`jax.lax.scan`
runs forward and backward over one microbatch at a time, adding its gradient
into float32 sums; the optimizer then updates once, from the sums. Activations
are sized by the microbatch (``B / K`` rows); the sums cost one float32 copy
of the parameters.

The update is the whole batch's: each microbatch's mean loss (and gradient) is
weighted by its share of the labels that count, ``n_k / N``, so a packed text
batch whose microbatches hold different numbers of counted labels (masked
prompts, document boundaries) still gives the whole batch's mean, the same
value as :func:`models.tasks.Task.loss` over all ``B`` rows, within float32
rounding. Batches without a loss mask (plain windows, images) weigh each
microbatch ``1 / K``.

Microbatch ``k`` holds rows ``k, k + K, k + 2K, ...`` of the batch. A batch
split over a mesh (rows ``[d B / D, (d + 1) B / D)`` on batch shard ``d``) thus
gives every shard ``B / (K D)`` rows of every microbatch, and no row moves
between devices; the batch must split into ``K`` microbatches that each split
over the shards (:func:`check`).

Where a step is not the whole batch's one, on purpose:

* dropout: microbatch ``k`` draws its masks from ``fold_in(key, k)``, ``key``
  being the step's (another draw of the same distribution);
* BatchNorm (ResNet): batch statistics are each microbatch's, and the running
  averages are updated once per microbatch, in order (as PyTorch's
  accumulation does).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

GRAD_DTYPE = jnp.float32   # the sums' dtype, whatever the parameters' or the compute dtype


class AccumError(ValueError):
  """A ``--grad-accum`` that cannot split the batch; the message is one line."""


def check(microbatches: int, batch_size: int, shards: int = 1) -> None:
  """``batch_size`` must split into ``microbatches`` of equal size, each split over ``shards``.

  Raises:
    AccumError: one line naming the flags and the sizes that would work.
  """
  if microbatches < 1:
    raise AccumError(f'--grad-accum must be >= 1, got {microbatches}')
  if batch_size % microbatches:
    raise AccumError(f'--batch-size {batch_size} does not split into --grad-accum '
                     f'{microbatches} microbatches of equal size; pass a batch that is a '
                     f'multiple of {microbatches}')
  if (batch_size // microbatches) % shards:
    raise AccumError(f'--batch-size {batch_size} in --grad-accum {microbatches} microbatches of '
                     f'{batch_size // microbatches} does not split over the mesh\'s {shards} '
                     f'batch shards; pass a batch that is a multiple of {microbatches * shards}')


def split(batch, microbatches: int):
  """``[B, ...] -> [K, B / K, ...]`` for every array of ``batch``; microbatch k = rows k::K."""
  def one(a):
    rows = a.shape[0] // microbatches
    return jnp.swapaxes(a.reshape(rows, microbatches, *a.shape[1:]), 0, 1)
  return jax.tree_util.tree_map(one, batch)


def counted_labels(batch) -> jax.Array:
  """The number of labels of ``batch`` that its mean loss averages over (float32).

  A packed text batch (a dict with ``loss_mask`` and ``segment_ids``) counts the
  labels :meth:`models.tasks.Task.loss` weighs: in the loss mask and in the same
  document as their input. Any other batch counts its rows.
  """
  if isinstance(batch, dict) and 'loss_mask' in batch:
    segs = batch['segment_ids']
    counted = (batch['loss_mask'][:, 1:] > 0) & (segs[:, 1:] == segs[:, :-1])
    return jnp.sum(counted.astype(jnp.float32))
  return jnp.asarray(jax.tree_util.tree_leaves(batch)[0].shape[0], jnp.float32)


def accumulated_value_and_grad(loss_fn, params, model_state, batch, microbatches: int, rng):
  """The whole batch's mean loss and gradient, from ``microbatches`` passes of ``B / K`` rows.

  Args:
    loss_fn: ``loss_fn(params, model_state, batch, rng) -> (loss, (model_state, metrics))``,
      the mean loss of a batch (:meth:`models.tasks.Task.loss`'s form).
    params: the parameters (the gradient's tree).
    model_state: non-trained state, threaded through the microbatches in order.
    batch: the step's whole batch, ``B`` rows.
    microbatches: ``K``, dividing ``B``.
    rng: the step's dropout key (None: deterministic); microbatch k gets ``fold_in(rng, k)``.

  Returns:
    ``(loss, model_state, grads)``: ``grads`` in the parameters' dtypes, summed in float32.
  """
  micro = split(batch, microbatches)
  counts = jax.vmap(counted_labels)(micro)
  total = jnp.maximum(jnp.sum(counts), 1.0)   # the whole batch's denominator (Task.loss's)

  def body(carry, xs):
    sums, loss_sum, state = carry
    mb, count, k = xs
    key = None if rng is None else jax.random.fold_in(rng, k)
    (loss, (state, _)), grads = jax.value_and_grad(
        lambda p: loss_fn(p, state, mb, key), has_aux=True)(params)
    # n_k / N (1 / K without a loss mask); a microbatch with no counted label has loss 0 and
    # gradient 0 (Task.loss divides by max(n, 1)), so its weight 0 changes nothing.
    weight = count / total
    sums = jax.tree_util.tree_map(lambda s, g: s + g.astype(GRAD_DTYPE) * weight, sums, grads)
    return (sums, loss_sum + loss.astype(jnp.float32) * weight, state), None

  zeros = jax.tree_util.tree_map(lambda p: jnp.zeros(p.shape, GRAD_DTYPE), params)
  (sums, loss, model_state), _ = jax.lax.scan(
      body, (zeros, jnp.float32(0.0), model_state),
      (micro, counts, jnp.arange(microbatches, dtype=jnp.uint32)))
  grads = jax.tree_util.tree_map(lambda s, p: s.astype(p.dtype), sums, params)
  return loss, model_state, grads
