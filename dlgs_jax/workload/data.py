"""Datasets, per-worker batching and augmentation.

Sources: CIFAR-10 in the official binary or python format (`load_cifar10`;
pickles are read by an unpickler that admits plain data only), the real
CIFAR-10 subset shipped in the package (`load_embedded_cifar10`), an
ImageNet-style folder of class sub-folders (`load_image_folder`, decoded lazily
so a process decodes only the images of its own workers), and synthetic data of
the right shapes (`synthetic`).

Batching rule for data parallelism (every process must run the same number of
equal-size steps, or one of them waits forever in a collective): each epoch a
permutation of all examples is drawn from ``(seed, epoch)`` -- the same in every
process -- and cut into global batches of ``workers * batch_size``; the
remainder is dropped. Worker w of a global batch takes rows
``[w * batch_size, (w + 1) * batch_size)``, and each process reads only the rows
of its own workers.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import importlib.resources
import os
import pickle
from pathlib import Path
from typing import Any, Iterator, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

CIFAR10_MEAN = np.asarray([0.4914, 0.4822, 0.4465], np.float32)
CIFAR10_STD = np.asarray([0.2470, 0.2435, 0.2616], np.float32)
IMAGENET_MEAN = np.asarray([0.485, 0.456, 0.406], np.float32)
IMAGENET_STD = np.asarray([0.229, 0.224, 0.225], np.float32)
EMBEDDED_CIFAR10 = "cifar10_subset.npz"
CIFAR10_DIR = "cifar-10-batches-py"
CIFAR10_TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR10_TEST_FILE = "test_batch"
CIFAR10_BIN_DIR = "cifar-10-batches-bin"
CIFAR10_BIN_TRAIN_FILES = tuple(f"data_batch_{i}.bin" for i in range(1, 6))
CIFAR10_BIN_TEST_FILE = "test_batch.bin"
CIFAR10_BIN_ROW = 1 + 3 * 32 * 32
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")


class Dataset(NamedTuple):
  images: Any         # uint8 [N, H, W, C]: an array, or `FolderImages` (decoded on indexing)
  labels: np.ndarray  # int32 [N]
  num_classes: int
  mean: np.ndarray = CIFAR10_MEAN  # float32 [C]: per-channel mean for `normalize`
  std: np.ndarray = CIFAR10_STD    # float32 [C]: per-channel std for `normalize`

  @property
  def image_shape(self) -> tuple[int, ...]:
    return tuple(self.images.shape[1:])


def content_digest(dataset: Dataset) -> str:
  """A short SHA-256 of what a dataset holds: its labels and its images.

  Images in memory are hashed whole (the full CIFAR-10 training set in a
  fraction of a second); an image folder by its file names, sizes and
  modification times, so that nothing is decoded. A run resumes only on data
  of the same digest, wherever it lies.
  """
  digest = hashlib.sha256(np.ascontiguousarray(dataset.labels).tobytes())
  images = dataset.images
  if isinstance(images, FolderImages):
    for path in images.files:
      stat = os.stat(path)
      digest.update(f"{os.path.basename(path)}:{stat.st_size}:{stat.st_mtime_ns};".encode())
  else:
    digest.update(np.ascontiguousarray(images).tobytes())
  return digest.hexdigest()[:16]


def load_embedded_cifar10() -> tuple[Dataset, Dataset]:
  """The real CIFAR-10 subset shipped in the package: (train 3,805, test 761).

  The first 761 images of each official python batch, uint8 NHWC.
  """
  resource = importlib.resources.files("dlgs_jax.workload") / EMBEDDED_CIFAR10
  with resource.open("rb") as f, np.load(f) as npz:
    train = Dataset(npz["train_images"], npz["train_labels"].astype(np.int32), 10)
    test = Dataset(npz["test_images"], npz["test_labels"].astype(np.int32), 10)
  _check_dataset(train, "embedded train")
  _check_dataset(test, "embedded test")
  return train, test


def _check_dataset(data: Dataset, name: str) -> None:
  if len(data.images.shape) != 4 or data.images.shape[0] != data.labels.shape[0]:
    raise ValueError(
        f"{name}: images {data.images.shape} and labels {data.labels.shape} do not match")
  if data.labels.size and not 0 <= data.labels.min() <= data.labels.max() < data.num_classes:
    raise ValueError(
        f"{name}: labels must be in [0, {data.num_classes}), got "
        f"[{data.labels.min()}, {data.labels.max()}]")


def load_cifar10(data_dir) -> tuple[Dataset, Dataset]:
  """CIFAR-10 from an official directory, binary or python version: (train, test).

  The binary version (``cifar-10-batches-bin/``: ``data_batch_1.bin`` ..
  ``data_batch_5.bin`` and ``test_batch.bin``, rows of one label byte and 3,072
  pixel bytes) is read as raw bytes. The python version
  (``cifar-10-batches-py/``) is unpickled by an unpickler that admits only what
  a CIFAR batch holds (`SafeBatchUnpickler`), so a hostile file runs no code.

  Args:
    data_dir: either official directory itself, or a directory containing one
      (the binary version is taken when both are there).

  Returns:
    uint8 NHWC images with int32 labels (50,000 / 10,000 for the full set).

  Raises:
    ValueError: for a missing directory or file, a truncated or unreadable
      batch, a pickle that refers to anything but plain data, wrong shapes or
      labels outside [0, 10).
  """
  root = Path(data_dir)
  for sub in (CIFAR10_BIN_DIR, CIFAR10_DIR):
    if (root / sub).is_dir():
      root = root / sub
      break
  if root.exists() and not root.is_dir():
    raise ValueError(f"CIFAR-10 directory {str(data_dir)!r} is a file, not a directory: give "
                     f"the folder that holds {CIFAR10_BIN_DIR}/ or its batches")
  if not root.is_dir():
    raise ValueError(f"CIFAR-10 directory {str(data_dir)!r} does not exist")
  binary = (root / CIFAR10_BIN_TRAIN_FILES[0]).is_file()
  names = (CIFAR10_BIN_TRAIN_FILES + (CIFAR10_BIN_TEST_FILE,) if binary
           else CIFAR10_TRAIN_FILES + (CIFAR10_TEST_FILE,))
  missing = [f for f in names if not (root / f).is_file()]
  if missing:
    raise ValueError(
        f"{str(root)!r} is not a CIFAR-10 directory: missing {missing} (expected "
        f"{CIFAR10_BIN_DIR}/ with data_batch_1..5.bin and test_batch.bin, or {CIFAR10_DIR}/ "
        f"with data_batch_1..5 and test_batch)")
  read = _read_cifar_bin if binary else _read_cifar_batch
  train = _concat([read(root / f) for f in names[:-1]])
  test = read(root / names[-1])
  _check_dataset(train, f"{root}/data_batch_*")
  _check_dataset(test, f"{root}/{names[-1]}")
  return train, test


def _read_cifar_bin(path: Path) -> Dataset:
  raw = np.fromfile(path, np.uint8)
  if raw.size == 0 or raw.size % CIFAR10_BIN_ROW:
    raise ValueError(
        f"CIFAR-10 batch {str(path)!r} is truncated or not a binary batch: {raw.size} bytes is "
        f"not a positive multiple of {CIFAR10_BIN_ROW} (1 label byte + 3,072 pixel bytes a row)")
  rows = raw.reshape(-1, CIFAR10_BIN_ROW)
  return _cifar_rows(rows[:, 1:], rows[:, 0], path)


class SafeBatchUnpickler(pickle.Unpickler):
  """Unpickles a CIFAR-10 python batch and nothing else.

  A batch holds dicts, lists, bytes, str, ints and one uint8 numpy array; the
  only callables such a pickle names are numpy's array constructors (and
  ``_codecs.encode``, with which Python 3 writes bytes at protocol 2). Every
  other global (``os.system``, ``builtins.eval``, ...) is refused before it is
  looked up, so loading a hostile file runs none of its code.
  """

  ALLOWED = frozenset({
      ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
      ("numpy._core.numeric", "_frombuffer"), ("numpy.core.numeric", "_frombuffer"),
      ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"),
  })

  def find_class(self, module, name):
    if (module, name) not in self.ALLOWED:
      raise pickle.UnpicklingError(
          f"it refers to {module}.{name}, which a CIFAR-10 batch never holds; refused without "
          f"running it (use the official file, or the binary version {CIFAR10_BIN_DIR}/)")
    return super().find_class(module, name)


def _read_cifar_batch(path: Path) -> Dataset:
  try:
    with open(path, "rb") as f:
      batch = SafeBatchUnpickler(f, encoding="bytes").load()
  except pickle.UnpicklingError as e:
    raise ValueError(f"CIFAR-10 batch {str(path)!r} is not plain data: {e}") from None
  except (EOFError, ValueError, OSError, TypeError, AttributeError) as e:
    raise ValueError(f"CIFAR-10 batch {str(path)!r} is truncated or not a pickle: {e!r}") from None
  if not isinstance(batch, dict):
    raise ValueError(f"CIFAR-10 batch {str(path)!r} holds a {type(batch).__name__}, not a dict")
  raw = batch.get(b"data", batch.get("data"))
  labels = batch.get(b"labels", batch.get("labels"))
  if raw is None or labels is None:
    raise ValueError(f"CIFAR-10 batch {str(path)!r} has no 'data' or 'labels' entry")
  return _cifar_rows(np.asarray(raw), np.asarray(labels), path)


def _cifar_rows(raw: np.ndarray, labels: np.ndarray, path: Path) -> Dataset:
  """A batch's [N, 3072] rows (1,024 red, green and blue values, each row-major) as NHWC."""
  if raw.dtype != np.uint8 or raw.ndim != 2 or raw.shape[1] != 3 * 32 * 32:
    raise ValueError(
        f"CIFAR-10 batch {str(path)!r}: data must be uint8 [N, 3072], got {raw.dtype} {raw.shape}")
  if labels.shape != (raw.shape[0],) or not np.issubdtype(labels.dtype, np.integer):
    raise ValueError(
        f"CIFAR-10 batch {str(path)!r}: {raw.shape[0]} images but labels of shape "
        f"{labels.shape} ({labels.dtype}); one integer label per image expected")
  images = raw.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)  # CHW rows -> NHWC
  data = Dataset(np.ascontiguousarray(images), labels.astype(np.int32), 10)
  _check_dataset(data, str(path))
  return data


def _concat(parts: Sequence[Dataset]) -> Dataset:
  return Dataset(np.concatenate([p.images for p in parts]),
                 np.concatenate([p.labels for p in parts]), parts[0].num_classes)


class FolderImages:
  """Images of an ImageNet-style folder, decoded when indexed.

  Indexing with an integer array of any shape returns uint8
  ``index.shape + (size, size, 3)``: each image is converted to RGB, its
  shorter side resized to `size` and the centre cropped square. Decoding runs
  on a thread pool (Pillow releases the GIL while decoding).
  """

  def __init__(self, files: Sequence[str], size: int, threads: Optional[int] = None):
    self.files = list(files)
    self.size = int(size)
    self.threads = threads or min(8, os.cpu_count() or 1)

  @property
  def shape(self) -> tuple[int, int, int, int]:
    return (len(self.files), self.size, self.size, 3)

  def __len__(self) -> int:
    return len(self.files)

  def __getitem__(self, index) -> np.ndarray:
    if isinstance(index, slice):
      index = np.arange(len(self.files))[index]
    index = np.asarray(index)
    flat = index.reshape(-1)
    with concurrent.futures.ThreadPoolExecutor(self.threads) as pool:
      images = list(pool.map(self._decode, flat))
    out = np.stack(images) if images else np.zeros((0,) + self.shape[1:], np.uint8)
    return out.reshape(index.shape + self.shape[1:])

  def _decode(self, i) -> np.ndarray:
    from PIL import Image

    path = self.files[int(i)]
    try:
      with Image.open(path) as image:
        image = image.convert("RGB")
        scale = self.size / min(image.size)
        width, height = (max(self.size, round(d * scale)) for d in image.size)
        image = image.resize((width, height), Image.BILINEAR)
        left, top = (width - self.size) // 2, (height - self.size) // 2
        image = image.crop((left, top, left + self.size, top + self.size))
        return np.asarray(image, np.uint8)
    except OSError as e:
      raise ValueError(f"cannot decode image {path!r}: {e}") from None


def load_image_folder(data_dir, image_size: int = 224,
                      splits: tuple[str, str] = ("train", "val")) -> tuple[Dataset, Dataset]:
  """An ImageNet-style folder: ``<data_dir>/<split>/<class>/<image>.{jpg,jpeg,png}``.

  Class indices follow the sorted class-folder names of the train split; the
  evaluation split (``val``, or ``test`` when there is no ``val``) must use the
  same classes. Only the file list is read here; images are decoded when
  indexed (`FolderImages`), so a process decodes only its own workers' rows.

  Args:
    data_dir: root holding the split folders.
    image_size: side of the square images produced.
    splits: names of the train and evaluation folders.

  Returns:
    (train, evaluation) datasets with ImageNet mean/std.

  Raises:
    ValueError: for a missing split, an empty class folder, or classes that
      differ between the splits.
  """
  if image_size < 8:
    raise ValueError(f"image_size must be >= 8, got {image_size!r}")
  root = Path(data_dir)
  train_dir = root / splits[0]
  eval_dir = root / splits[1]
  if not eval_dir.is_dir() and splits[1] == "val" and (root / "test").is_dir():
    eval_dir = root / "test"
  for d in (train_dir, eval_dir):
    if not d.is_dir():
      raise ValueError(
          f"image folder {str(root)!r} needs {splits[0]}/ and {splits[1]}/ sub-folders "
          f"with one folder of images per class; {str(d)!r} is missing")
  classes = sorted(p.name for p in train_dir.iterdir() if p.is_dir())
  if not classes:
    raise ValueError(f"{str(train_dir)!r} has no class sub-folders")
  eval_classes = sorted(p.name for p in eval_dir.iterdir() if p.is_dir())
  if not set(eval_classes) <= set(classes):
    raise ValueError(
        f"{str(eval_dir)!r} has classes not in {str(train_dir)!r}: "
        f"{sorted(set(eval_classes) - set(classes))[:5]}")
  out = []
  for split_dir in (train_dir, eval_dir):
    files, labels = [], []
    for label, name in enumerate(classes):
      folder = split_dir / name
      if not folder.is_dir():
        continue
      found = sorted(str(p) for p in folder.iterdir()
                     if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())
      if not found and split_dir == train_dir:
        raise ValueError(f"class folder {str(folder)!r} has no .jpg/.jpeg/.png images")
      files += found
      labels += [label] * len(found)
    if not files:
      raise ValueError(f"{str(split_dir)!r} has no images")
    out.append(Dataset(FolderImages(files, image_size), np.asarray(labels, np.int32),
                       len(classes), IMAGENET_MEAN, IMAGENET_STD))
  return out[0], out[1]


def synthetic(num_examples: int, image_shape: Sequence[int], num_classes: int,
              seed: int = 0) -> Dataset:
  """Random uint8 images and labels of the given shapes (for benchmarks).

  Raises:
    ValueError: for non-positive sizes.
  """
  if num_examples < 1 or num_classes < 1 or any(int(d) < 1 for d in image_shape):
    raise ValueError(
        f"synthetic data needs positive sizes, got {num_examples!r} examples of "
        f"{tuple(image_shape)!r}, {num_classes!r} classes")
  rng = np.random.default_rng(seed)
  images = rng.integers(0, 256, (num_examples, *image_shape), dtype=np.uint8)
  labels = rng.integers(0, num_classes, num_examples).astype(np.int32)
  return Dataset(images, labels, num_classes)


def benchmark_batches(shape, num_classes: int, batches: int, workers: int, batch_size: int,
                      *, first_worker: int = 0):
  """Distinct batches per worker: uint8 images [batches, workers, batch_size, *shape], labels.

  Real CIFAR-10 images from the embedded subset when `shape` is (32, 32, 3)
  (each worker its own slice, as a data-parallel loader gives), random images
  and labels otherwise.
  """
  count = batches * workers * batch_size
  if tuple(shape) == (32, 32, 3):
    train, _ = load_embedded_cifar10()
    start = first_worker * batches * batch_size
    pick = (start + np.arange(count)) % train.images.shape[0]
    images, labels = train.images[pick], train.labels[pick] % num_classes
  else:
    rng = np.random.default_rng(first_worker)
    images = rng.integers(0, 256, (count,) + tuple(shape), dtype=np.uint8)
    labels = rng.integers(0, num_classes, count).astype(np.int32)
  order = (workers, batches, batch_size)
  images = images.reshape(order + tuple(shape)).swapaxes(0, 1)
  labels = labels.reshape(order).swapaxes(0, 1).astype(np.int32)
  return images, labels


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


def normalize(images: jax.Array, mean=CIFAR10_MEAN, std=CIFAR10_STD) -> jax.Array:
  """uint8 NHWC -> float32, scaled to [0, 1] then normalised per channel."""
  return (images.astype(jnp.float32) / 255.0 - np.asarray(mean)) / np.asarray(std)


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
