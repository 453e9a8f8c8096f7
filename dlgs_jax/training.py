"""A data-parallel training step for Flax classifiers with any dlgs_jax transform.

The step runs under `jax.jit(jax.shard_map(...))` over a 1-D data mesh:
parameters and BatchNorm statistics are replicated, the batch and the optimizer
state (error-feedback residuals) are per worker (see `dlgs_jax.parallel`).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, PartitionSpec

from dlgs_jax import data, parallel


class TrainState(NamedTuple):
  params: Any       # replicated parameter tree
  batch_stats: Any  # replicated BatchNorm statistics ({} if the model has none)
  opt_state: Any    # per worker: leading worker axis
  step: jax.Array   # int32[], replicated


def init_train_state(model: nn.Module, tx: optax.GradientTransformation, sample: np.ndarray,
                     mesh: Mesh, seed: int) -> TrainState:
  """Initialises parameters from `seed` (identical in every process) and places them."""
  variables = jax.jit(lambda key: model.init(key, jnp.asarray(sample), train=False))(
      jax.random.key(seed))
  params = variables["params"]
  batch_stats = variables.get("batch_stats", {})
  return TrainState(
      params=parallel.replicate(params, mesh),
      batch_stats=parallel.replicate(batch_stats, mesh),
      opt_state=parallel.stack_per_worker(tx.init(params), mesh),
      step=parallel.replicate(np.zeros((), np.int32), mesh),
  )


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def make_train_step(model: nn.Module, tx: optax.GradientTransformation, mesh: Mesh,
                    *, augment: bool = True, seed: int = 0) -> Callable:
  """Builds ``step(state, images, labels) -> (state, metrics)``.

  Args:
    model: Flax classifier called as ``model(x, train=...)``.
    tx: optimizer, containing a dlgs_jax transform with the mesh's axis name.
    mesh: 1-D data mesh.
    augment: CIFAR crop+flip augmentation on the fly.
    seed: augmentation seed.

  Returns:
    A jitted function. `images` (uint8) and `labels` are per-worker arrays of
    shape ``(workers, batch, ...)``; metrics are replicated scalars: loss,
    accuracy, and the optimizer's communication statistics.
  """
  axis = mesh.axis_names[0]

  def step(state: TrainState, images, labels):
    images, labels = images[0], labels[0]
    opt_state = parallel.squeeze(state.opt_state)
    if augment:
      key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), state.step),
                               jax.lax.axis_index(axis))
      images = data.augment_cifar(key, images)
    inputs = data.normalize(images)

    def loss_fn(params):
      variables = {"params": params}
      if state.batch_stats:
        variables["batch_stats"] = state.batch_stats
        logits, updates = model.apply(variables, inputs, train=True, mutable=["batch_stats"])
      else:
        logits, updates = model.apply(variables, inputs, train=True), {}
      return cross_entropy(logits, labels), (logits, updates)

    (loss, (logits, model_updates)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        state.params)
    updates, opt_state = tx.update(grads, opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    # Per-worker running statistics are averaged so every worker keeps the same.
    batch_stats = jax.lax.pmean(model_updates.get("batch_stats", {}), axis)
    accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
    metrics = {"loss": jax.lax.pmean(loss, axis), "accuracy": jax.lax.pmean(accuracy, axis)}
    new_state = TrainState(params, batch_stats, parallel.unsqueeze(opt_state), state.step + 1)
    return new_state, metrics

  state_spec = TrainState(PartitionSpec(), PartitionSpec(), PartitionSpec(axis), PartitionSpec())
  # check_vma=False: sparse updates are identical on all workers by construction
  # (tested bit for bit) but JAX's type system cannot prove it for all-gather
  # results, and the replicated out_specs would be refused.
  return jax.jit(jax.shard_map(
      step, mesh=mesh,
      in_specs=(state_spec, PartitionSpec(axis), PartitionSpec(axis)),
      out_specs=(state_spec, PartitionSpec()),
      check_vma=False), donate_argnums=0)


def make_eval_fn(model: nn.Module) -> Callable:
  """``evaluate(params, batch_stats, images, labels) -> (loss_sum, correct)`` on one device."""

  @jax.jit
  def evaluate(params, batch_stats, images, labels):
    variables = {"params": params}
    if batch_stats:
      variables["batch_stats"] = batch_stats
    logits = model.apply(variables, data.normalize(images), train=False)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return losses.sum(), jnp.sum(jnp.argmax(logits, -1) == labels)

  return evaluate


def evaluate_dataset(evaluate: Callable, params, batch_stats, dataset: data.Dataset,
                     batch_size: int = 500) -> dict[str, float]:
  """Test loss and accuracy over a whole dataset (host copies of the parameters)."""
  params, batch_stats = parallel.fetch((params, batch_stats))
  loss_sum, correct = 0.0, 0
  for start in range(0, len(dataset.labels), batch_size):
    images = dataset.images[start:start + batch_size]
    labels = dataset.labels[start:start + batch_size]
    batch_loss, batch_correct = evaluate(params, batch_stats, images, labels)
    loss_sum += float(batch_loss)
    correct += int(batch_correct)
  n = len(dataset.labels)
  return {"test_loss": loss_sum / n, "test_accuracy": correct / n}
