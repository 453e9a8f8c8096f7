"""A data-parallel training step for Flax classifiers with any dlgs_jax transform.

The step is `workload.sharded_step.data_parallel`'s, the one users build for
their own models: parameters and BatchNorm statistics are replicated, the batch
and the transforms' states (error-feedback residuals) are per worker (see
`dlgs_jax.workload.parallel`), with shard_map's checks on.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, PartitionSpec

from dlgs_jax.workload import data, fsdp, parallel, sharded_step
from dlgs_jax.workload.losses import apply_for_training, cross_entropy, init_variables
from dlgs_jax.workload.sharded_step import StepState

# A run's state is the step's own (`sharded_step.StepState`): its model state is
# the BatchNorm statistics ({} if the model has none).


def train_state_from_variables(variables: dict, tx: optax.GradientTransformation,
                               mesh: Mesh, workers: Optional[int] = None,
                               fsdp_axis: Optional[str] = None) -> StepState:
  """Places `variables` (from `init_variables`) and `tx`'s initial state on `mesh`.

  Args:
    variables: the model's variables, the same in every process.
    tx: the gradient transformation; this library's transform states are
      placed per worker, the rest replicated (`parallel.place_state`).
    mesh: the 1-D data mesh.
    workers: workers simulated on the mesh's one device (None: one per device).
    fsdp_axis: the mesh axis the parameters are sliced over (None: replicated).

  Returns:
    The `StepState` at step 0.
  """
  if fsdp_axis is not None:
    return sharded_step.sharded_initial_state(tx, variables["params"],
                                              variables.get("batch_stats", {}), mesh, fsdp_axis)
  return sharded_step.initial_state(tx, variables["params"], variables.get("batch_stats", {}),
                                    mesh, workers)


def init_train_state(model: nn.Module, tx: optax.GradientTransformation, sample: np.ndarray,
                     mesh: Mesh, seed: int) -> StepState:
  """Initialises parameters from `seed` (identical in every process) and places them."""
  return train_state_from_variables(init_variables(model, sample, seed), tx, mesh)


def make_train_step(model: nn.Module, tx: optax.GradientTransformation, mesh: Mesh,
                    *, augment: bool = True, pad: int = 4, mean=data.CIFAR10_MEAN,
                    std=data.CIFAR10_STD, seed: int = 0,
                    simulate_workers: Optional[int] = None,
                    fsdp_axis: Optional[str] = None) -> Callable:
  """Builds ``step(state, images, labels) -> (state, metrics)`` on `sharded_step.data_parallel`.

  Args:
    model: Flax classifier called as ``model(x, train=...)``.
    tx: optimizer, containing a dlgs_jax transform with the mesh's axis name.
    mesh: 1-D data mesh.
    augment: random crop (after `pad`-pixel padding) and flip on the fly; the
      key depends on (seed, step, worker), so a resumed run draws the same.
    pad: crop padding in pixels.
    mean, std: per-channel normalisation (`data.normalize`).
    seed: augmentation seed.
    simulate_workers: that many workers on the mesh's one device
      (`sharded_step.data_parallel`); None: one worker per device.
    fsdp_axis: the mesh axis the parameters are sliced over (HSDP); None: replicated.

  Returns:
    A `TrainStep`, called as a function. `images` (uint8) and `labels` are per-worker arrays of
    shape ``(workers, batch, ...)``; metrics are replicated scalars: loss,
    accuracy and, when the optimizer holds `CommStats`, the mean bytes sent and
    values selected and passing per worker this step, the count of skipped steps and the
    leaves whose threshold was computed exactly this step (DLGS). The
    state argument is donated.
  """

  def loss_fn(params, batch_stats, batch, key=None):
    images, labels = batch[0][0], batch[1][0]  # this worker's row of the worker axis
    if augment:
      images = data.augment_cifar(key, images, pad=pad)
    logits, updates = apply_for_training(model, params, batch_stats,
                                         data.normalize(images, mean, std))
    accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
    return cross_entropy(logits, labels), (updates.get("batch_stats", {}),
                                           {"accuracy": accuracy})

  stepper = sharded_step.data_parallel(
      loss_fn if augment else (lambda p, s, b: loss_fn(p, s, b)), tx, mesh,
      model_state=True, has_aux=True, seed=seed if augment else None,
      simulate_workers=simulate_workers, fsdp_axis=fsdp_axis)

  return TrainStep(stepper)


class TrainStep(NamedTuple):
  """``step(state, images, labels) -> (state, metrics)``; `compile` prepares it without running."""
  stepper: sharded_step.DataParallel

  def __call__(self, state: StepState, images, labels):
    return self.stepper.step(state, (images, labels))

  def compile(self, state: StepState, images, labels) -> None:
    """Compiles the step for these inputs; nothing runs or is exchanged."""
    self.stepper.compile(state, (images, labels))


def make_fingerprint_fn(mesh: Mesh, fsdp_axis: Optional[str] = None) -> Callable:
  """Builds ``fingerprint(params, batch_stats) -> uint32[workers, 2]`` (``2·L`` sliced).

  Each worker hashes *its own copy* of the replicated parameters and BatchNorm
  statistics (a wrapping sum of the raw bits and a position-weighted one), so
  copies that drifted apart -- on any device of any process -- give different
  rows. Cheap: two reductions per leaf. With parameters sliced over
  `fsdp_axis`, a device hashes its slices and its row holds its node's hashes
  in slice order: every node's row is the same when their slices are.
  """
  axis = parallel.data_axes(mesh)

  def local(params, batch_stats):
    total = jnp.zeros((2,), jnp.uint32)
    for leaf in jax.tree_util.tree_leaves((params, batch_stats)):
      bits = jax.lax.bitcast_convert_type(leaf.astype(jnp.float32), jnp.uint32).reshape(-1)
      weights = jnp.arange(bits.size, dtype=jnp.uint32) * jnp.uint32(2654435761) + jnp.uint32(1)
      total = total + jnp.stack([jnp.sum(bits), jnp.sum(bits * weights)])
    if fsdp_axis is not None:
      total = jax.lax.all_gather(total, fsdp_axis, tiled=True)
    return total[None]

  params_spec = PartitionSpec() if fsdp_axis is None else PartitionSpec(fsdp_axis)
  return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(params_spec, PartitionSpec()),
                               out_specs=PartitionSpec(axis), check_vma=False))


def check_replicas_identical(fingerprint: Callable, state: StepState, step: int) -> None:
  """Fails loudly unless every worker holds bit-identical parameters.

  Raises:
    RuntimeError: naming the workers whose copies differ from worker 0's.
  """
  from jax.experimental import multihost_utils

  prints = fingerprint(state.params, state.model_state)
  if jax.process_count() > 1:
    prints = multihost_utils.process_allgather(prints, tiled=True)
  prints = np.asarray(prints)
  differ = [w for w in range(prints.shape[0]) if not np.array_equal(prints[w], prints[0])]
  if differ:
    raise RuntimeError(
        f"parameters diverged across workers at step {step}: workers {differ} differ from "
        f"worker 0 (fingerprints {prints.tolist()})")


def make_eval_fn(model: nn.Module, mean=data.CIFAR10_MEAN, std=data.CIFAR10_STD) -> Callable:
  """``evaluate(params, batch_stats, images, labels) -> (loss_sum, correct)`` on one device."""

  @jax.jit
  def evaluate(params, batch_stats, images, labels):
    variables = {"params": params}
    if batch_stats:
      variables["batch_stats"] = batch_stats
    logits = model.apply(variables, data.normalize(images, mean, std), train=False)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return losses.sum(), jnp.sum(jnp.argmax(logits, -1) == labels)

  return evaluate


def evaluate_dataset(evaluate: Callable, params, batch_stats, dataset: data.Dataset,
                     batch_size: int = 500) -> dict[str, float]:
  """Test loss and accuracy over a whole dataset.

  With several processes each evaluates a contiguous 1/P slice (host copies of
  the parameters on its first device) and the sums are combined, so every
  process returns the same numbers.
  """
  from jax.experimental import multihost_utils

  params, batch_stats = parallel.fetch((params, batch_stats))
  if isinstance(params, fsdp.ShardedParams):
    params = fsdp.whole(params)
  n = len(dataset.labels)
  bounds = np.linspace(0, n, jax.process_count() + 1).astype(int)
  lo, hi = bounds[jax.process_index()], bounds[jax.process_index() + 1]
  loss_sum, correct = 0.0, 0
  for start in range(lo, hi, batch_size):
    stop = min(start + batch_size, hi)
    images = dataset.images[start:stop]
    labels = dataset.labels[start:stop]
    batch_loss, batch_correct = evaluate(params, batch_stats, images, labels)
    loss_sum += float(batch_loss)
    correct += int(batch_correct)
  totals = np.asarray([loss_sum, correct], np.float32)
  if jax.process_count() > 1:
    totals = np.asarray(multihost_utils.process_allgather(totals)).reshape(-1, 2).sum(0)
  return {"test_loss": float(totals[0]) / n, "test_accuracy": float(totals[1]) / n}
