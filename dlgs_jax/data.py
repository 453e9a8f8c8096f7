"""Datasets, per-worker batching and CIFAR augmentation.

Batching rule for data parallelism (every process must run the same number of
equal-size steps, or one of them waits forever in a collective): each epoch a
permutation of all examples is drawn from ``(seed, epoch)`` -- the same in every
process -- and cut into global batches of ``workers * batch_size``; the
remainder is dropped. Worker w of a global batch takes rows
``[w * batch_size, (w + 1) * batch_size)``, and each process reads only the rows
of its own workers.
"""

from __future__ import annotations

import importlib.resources
from typing import Iterator, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

CIFAR10_MEAN = np.asarray([0.4914, 0.4822, 0.4465], np.float32)
CIFAR10_STD = np.asarray([0.2470, 0.2435, 0.2616], np.float32)
EMBEDDED_CIFAR10 = "cifar10_subset.npz"


class Dataset(NamedTuple):
  images: np.ndarray  # uint8 [N, H, W, C]
  labels: np.ndarray  # int32 [N]
  num_classes: int


def load_embedded_cifar10() -> tuple[Dataset, Dataset]:
  """The real CIFAR-10 subset shipped in the package: (train 3,805, test 761).

  The first 761 images of each official python batch, uint8 NHWC.
  """
  resource = importlib.resources.files("dlgs_jax") / "data" / EMBEDDED_CIFAR10
  with resource.open("rb") as f, np.load(f) as npz:
    train = Dataset(npz["train_images"], npz["train_labels"].astype(np.int32), 10)
    test = Dataset(npz["test_images"], npz["test_labels"].astype(np.int32), 10)
  _check_dataset(train, "embedded train")
  _check_dataset(test, "embedded test")
  return train, test


def _check_dataset(data: Dataset, name: str) -> None:
  if data.images.ndim != 4 or data.images.shape[0] != data.labels.shape[0]:
    raise ValueError(
        f"{name}: images {data.images.shape} and labels {data.labels.shape} do not match")
  if data.labels.size and not 0 <= data.labels.min() <= data.labels.max() < data.num_classes:
    raise ValueError(
        f"{name}: labels must be in [0, {data.num_classes}), got "
        f"[{data.labels.min()}, {data.labels.max()}]")


def steps_per_epoch(num_examples: int, workers: int, batch_size: int) -> int:
  """Full global batches per epoch (the remainder is dropped)."""
  if workers < 1 or batch_size < 1:
    raise ValueError(f"workers and batch_size must be >= 1, got {workers!r}, {batch_size!r}")
  steps = num_examples // (workers * batch_size)
  if steps == 0:
    raise ValueError(
        f"{num_examples} examples cannot fill one global batch of {workers} workers x "
        f"{batch_size}")
  return steps


def epoch_indices(
    num_examples: int, workers: int, batch_size: int, epoch: int, seed: int,
    local_workers: Sequence[int],
) -> Iterator[np.ndarray]:
  """Example indices for each step of one epoch, for this process's workers.

  Args:
    num_examples: dataset size.
    workers: total number of workers P.
    batch_size: examples per worker per step.
    epoch: epoch number (reshuffles).
    seed: run seed (the same in every process).
    local_workers: global indices of this process's workers, in device order.

  Yields:
    int64 arrays of shape ``(len(local_workers), batch_size)``.
  """
  steps = steps_per_epoch(num_examples, workers, batch_size)
  order = np.random.default_rng([seed, epoch]).permutation(num_examples)
  rows = np.asarray(local_workers)
  for step in range(steps):
    batch = order[step * workers * batch_size:(step + 1) * workers * batch_size]
    yield batch.reshape(workers, batch_size)[rows]


def normalize(images: jax.Array) -> jax.Array:
  """uint8 NHWC -> float32, CIFAR-10 mean/std normalised."""
  return (images.astype(jnp.float32) / 255.0 - CIFAR10_MEAN) / CIFAR10_STD


def augment_cifar(key: jax.Array, images: jax.Array, pad: int = 4) -> jax.Array:
  """Random crop after `pad`-pixel zero padding, and random horizontal flip.

  Args:
    key: PRNG key.
    images: [B, H, W, C] (any dtype).
    pad: padding on each side.

  Returns:
    Augmented images, same shape and dtype.
  """
  batch, height, width, _ = images.shape
  crop_key, flip_key = jax.random.split(key)
  padded = jnp.pad(images, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
  offsets = jax.random.randint(crop_key, (batch, 2), 0, 2 * pad + 1)

  def crop(image, offset):
    return jax.lax.dynamic_slice(image, (offset[0], offset[1], 0), (height, width, image.shape[-1]))

  cropped = jax.vmap(crop)(padded, offsets)
  flip = jax.random.bernoulli(flip_key, 0.5, (batch, 1, 1, 1))
  return jnp.where(flip, cropped[:, :, ::-1, :], cropped)
