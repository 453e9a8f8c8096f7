import pickle

import jax
import numpy as np
import pytest
from PIL import Image

from dlgs_jax.workload import data
from tests.helpers import write_cifar_bin_dir, write_cifar_dir


def test_embedded_subset_is_real_cifar10():
  train, test = data.load_embedded_cifar10()
  assert train.images.shape == (3805, 32, 32, 3) and test.images.shape == (761, 32, 32, 3)
  assert train.images.dtype == np.uint8 and train.labels.dtype == np.int32
  assert set(np.unique(train.labels)) == set(range(10))
  assert train.images.std() > 30  # natural images, not constants


def test_cifar10_python_format_round_trip(tmp_path):
  folder, written = write_cifar_dir(tmp_path)
  for where in (tmp_path, folder):  # the parent or the directory itself
    train, test = data.load_cifar10(where)
    assert train.images.shape == (60, 32, 32, 3) and test.images.shape == (12, 32, 32, 3)
    raw, labels = written["data_batch_2"]
    np.testing.assert_array_equal(train.labels[12:24], labels)
    # Row layout is 1024 red, 1024 green, 1024 blue values, each row-major.
    image = train.images[12 + 5]
    np.testing.assert_array_equal(image[..., 0].reshape(-1), raw[5, :1024])
    np.testing.assert_array_equal(image[..., 2].reshape(-1), raw[5, 2048:])
    np.testing.assert_array_equal(test.labels, written["test_batch"][1])


def test_cifar10_wrong_or_truncated_directory(tmp_path):
  with pytest.raises(ValueError, match="does not exist"):
    data.load_cifar10(tmp_path / "nowhere")
  folder, _ = write_cifar_dir(tmp_path)
  (folder / "data_batch_4").unlink()
  with pytest.raises(ValueError, match="data_batch_4"):
    data.load_cifar10(tmp_path)
  folder2, _ = write_cifar_dir(tmp_path / "b")
  content = (folder2 / "data_batch_3").read_bytes()
  (folder2 / "data_batch_3").write_bytes(content[:len(content) // 2])
  with pytest.raises(ValueError, match="data_batch_3.*truncated"):
    data.load_cifar10(folder2)


def test_cifar10_rejects_bad_labels_and_shapes(tmp_path):
  write_cifar_dir(tmp_path, labels_fn=lambda name, labels: (
      [11] + labels[1:] if name == "data_batch_1" else labels))
  with pytest.raises(ValueError, match=r"labels must be in \[0, 10\)"):
    data.load_cifar10(tmp_path)
  folder = tmp_path / "c" / "cifar-10-batches-py"
  write_cifar_dir(tmp_path / "c")
  with open(folder / "test_batch", "wb") as f:
    pickle.dump({b"labels": [0, 1], b"data": np.zeros((2, 100), np.uint8)}, f)
  with pytest.raises(ValueError, match=r"test_batch.*\[N, 3072\]"):
    data.load_cifar10(folder)


def test_cifar10_binary_format_matches_the_python_format(tmp_path):
  folder, written = write_cifar_bin_dir(tmp_path)
  for where in (tmp_path, folder):
    train, test = data.load_cifar10(where)
    assert train.images.shape == (60, 32, 32, 3) and test.images.shape == (12, 32, 32, 3)
    assert train.labels.dtype == np.int32
    raw, labels = written["data_batch_2.bin"]
    np.testing.assert_array_equal(train.labels[12:24], labels)
    image = train.images[12 + 5]
    np.testing.assert_array_equal(image[..., 0].reshape(-1), raw[5, :1024])
    np.testing.assert_array_equal(image[..., 1].reshape(-1), raw[5, 1024:2048])
    np.testing.assert_array_equal(image[..., 2].reshape(-1), raw[5, 2048:])
    np.testing.assert_array_equal(test.labels, written["test_batch.bin"][1])
  # The same rows pickled in the python format load to the same arrays.
  py = tmp_path / "py" / data.CIFAR10_DIR
  py.mkdir(parents=True)
  for name, (raw, labels) in written.items():
    with open(py / name.removesuffix(".bin"), "wb") as f:
      pickle.dump({b"labels": [int(x) for x in labels], b"data": raw}, f, protocol=2)
  py_train, py_test = data.load_cifar10(py)
  np.testing.assert_array_equal(py_train.images, train.images)
  np.testing.assert_array_equal(py_test.labels, test.labels)


def test_cifar10_binary_errors_name_the_file_and_the_fix(tmp_path):
  folder, _ = write_cifar_bin_dir(tmp_path)
  (folder / "data_batch_4.bin").unlink()
  with pytest.raises(ValueError, match=r"missing \['data_batch_4.bin'\].*cifar-10-batches-bin"):
    data.load_cifar10(tmp_path)
  folder, _ = write_cifar_bin_dir(tmp_path / "b")
  content = (folder / "data_batch_3.bin").read_bytes()
  (folder / "data_batch_3.bin").write_bytes(content[:-100])
  with pytest.raises(ValueError, match=r"data_batch_3.bin.*not a positive multiple of 3073"):
    data.load_cifar10(folder)
  folder, _ = write_cifar_bin_dir(tmp_path / "c")
  content = bytearray((folder / "test_batch.bin").read_bytes())
  content[3073] = 10  # the second row's label byte
  (folder / "test_batch.bin").write_bytes(bytes(content))
  with pytest.raises(ValueError, match=r"test_batch.bin.*labels must be in \[0, 10\)"):
    data.load_cifar10(folder)


class _CreatesAFile:
  """Unpickling this calls `open(path, "w")`: the file exists afterwards iff code ran."""

  def __init__(self, path):
    self.path = str(path)

  def __reduce__(self):
    return (open, (self.path, "w"))


@pytest.mark.parametrize("where", ["top", "inside"])
def test_a_hostile_cifar_pickle_is_refused_and_runs_nothing(tmp_path, where):
  folder, written = write_cifar_dir(tmp_path)
  marker = tmp_path / "pwned"
  payload = _CreatesAFile(marker)
  raw, labels = written["data_batch_2"]
  batch = payload if where == "top" else {b"labels": labels, b"data": raw, b"x": [payload]}
  with open(folder / "data_batch_2", "wb") as f:
    pickle.dump(batch, f)
  with open(folder / "probe", "wb") as f:  # the payload does run under plain pickle.load
    pickle.dump(_CreatesAFile(tmp_path / "probe_ran"), f)
  with open(folder / "probe", "rb") as f:
    pickle.load(f).close()
  assert (tmp_path / "probe_ran").exists()
  with pytest.raises(ValueError, match=r"data_batch_2.*is not plain data: it refers to "
                     r"(io|builtins)\.open.*refused without running it"):
    data.load_cifar10(tmp_path)
  assert not marker.exists()


def test_safe_unpickler_admits_the_official_batch_layout(tmp_path):
  # The official batches were written by Python 2 (protocol 2, bytes keys, numpy arrays).
  raw = np.arange(2 * 3072, dtype=np.int64).astype(np.uint8).reshape(2, 3072)
  batch = {b"batch_label": b"testing batch 1 of 1", b"labels": [3, 7], b"data": raw,
           b"filenames": [b"a.png", b"b.png"]}
  for protocol in (2, pickle.HIGHEST_PROTOCOL):
    path = tmp_path / f"batch{protocol}"
    path.write_bytes(pickle.dumps(batch, protocol=protocol))
    with open(path, "rb") as f:
      loaded = data.SafeBatchUnpickler(f, encoding="bytes").load()
    np.testing.assert_array_equal(loaded[b"data"], raw)
    assert loaded[b"labels"] == [3, 7] and loaded[b"filenames"] == [b"a.png", b"b.png"]


def write_image_folder(root, colors, sizes=((40, 30), (17, 25)), split_classes=None):
  for split in ("train", "val"):
    for name, color in colors.items():
      if split_classes and name not in split_classes.get(split, colors):
        continue
      folder = root / split / name
      folder.mkdir(parents=True)
      for i, size in enumerate(sizes):
        image = Image.new("RGB", size, color)
        image.save(folder / (f"{i}.png" if i % 2 == 0 else f"{i}.JPG"),
                   quality=100 if i % 2 else None)


def test_image_folder_decodes_resizes_and_labels(tmp_path):
  colors = {"cat": (250, 10, 10), "ant": (10, 250, 10), "dog": (10, 10, 250)}
  write_image_folder(tmp_path, colors)
  (tmp_path / "train" / "ant" / "notes.txt").write_text("not an image")
  train, val = data.load_image_folder(tmp_path, image_size=16)
  assert train.num_classes == 3 and len(train.labels) == 6 and len(val.labels) == 6
  assert train.images.shape == (6, 16, 16, 3)
  classes = sorted(colors)  # label = position of the sorted folder name
  np.testing.assert_array_equal(train.labels, [0, 0, 1, 1, 2, 2])
  batch = train.images[np.asarray([[0, 3], [5, 2]])]
  assert batch.shape == (2, 2, 16, 16, 3) and batch.dtype == np.uint8
  for index, image in ((0, batch[0, 0]), (3, batch[0, 1]), (5, batch[1, 0])):
    expected = colors[classes[train.labels[index]]]
    np.testing.assert_allclose(image.reshape(-1, 3).mean(0), expected, atol=6)
  assert train.images[1:3].shape == (2, 16, 16, 3)
  np.testing.assert_allclose(train.mean, data.IMAGENET_MEAN)


def test_image_folder_errors(tmp_path):
  write_image_folder(tmp_path / "a", {"x": (0, 0, 0)}, split_classes={"val": []})
  assert not (tmp_path / "a" / "val").exists()
  with pytest.raises(ValueError, match="val.* is missing"):
    data.load_image_folder(tmp_path / "a", 16)
  write_image_folder(tmp_path / "b", {"x": (0, 0, 0), "y": (9, 9, 9)},
                     split_classes={"train": ["x"], "val": ["x", "y"]})
  with pytest.raises(ValueError, match="classes not in"):
    data.load_image_folder(tmp_path / "b", 16)
  write_image_folder(tmp_path / "c", {"x": (0, 0, 0)})
  (tmp_path / "c" / "train" / "empty").mkdir()
  with pytest.raises(ValueError, match="empty.*no .jpg"):
    data.load_image_folder(tmp_path / "c", 16)
  write_image_folder(tmp_path / "d", {"x": (0, 0, 0)})
  (tmp_path / "d" / "train" / "x" / "broken.png").write_bytes(b"\x89PNG broken")
  train, _ = data.load_image_folder(tmp_path / "d", 16)
  with pytest.raises(ValueError, match="broken.png"):
    train.images[np.arange(len(train.labels))]


def test_synthetic_shapes_and_errors():
  ds = data.synthetic(10, (8, 8, 3), 5, seed=1)
  assert ds.images.shape == (10, 8, 8, 3) and ds.images.dtype == np.uint8
  assert ds.labels.min() >= 0 and ds.labels.max() < 5
  np.testing.assert_array_equal(ds.images, data.synthetic(10, (8, 8, 3), 5, seed=1).images)
  with pytest.raises(ValueError, match="positive"):
    data.synthetic(0, (8, 8, 3), 5)


@pytest.mark.parametrize("workers,batch,processes", [(4, 8, 1), (4, 8, 2), (4, 8, 4), (6, 5, 3)])
def test_every_process_reads_only_its_rows_and_all_get_equal_steps(workers, batch, processes):
  n = 203  # not a multiple of any global batch: the remainder is dropped
  per_process = workers // processes
  for epoch in (0, 1):
    views = [list(data.epoch_indices(n, workers, batch, epoch, seed=7,
                                     local_workers=range(p * per_process, (p + 1) * per_process)))
             for p in range(processes)]
    steps = n // (workers * batch)
    assert all(len(v) == steps for v in views)
    whole = list(data.epoch_indices(n, workers, batch, epoch, 7, range(workers)))
    for step in range(steps):
      joined = np.concatenate([v[step] for v in views])
      np.testing.assert_array_equal(joined, whole[step])
      assert joined.shape == (workers, batch)
    seen = np.concatenate([w.reshape(-1) for w in whole])
    assert len(set(seen)) == steps * workers * batch  # no example twice in an epoch
  first = np.concatenate(list(data.epoch_indices(n, workers, batch, 0, 7, range(workers))))
  second = np.concatenate(list(data.epoch_indices(n, workers, batch, 1, 7, range(workers))))
  assert not np.array_equal(first, second)  # reshuffled per epoch


def test_steps_per_epoch_errors():
  with pytest.raises(ValueError, match="cannot fill one global batch"):
    data.steps_per_epoch(10, 4, 3)
  with pytest.raises(ValueError, match="workers and batch_size"):
    data.steps_per_epoch(10, 0, 3)


def test_augment_crops_from_padding_and_flips():
  rng = np.random.default_rng(0)
  images = rng.integers(1, 256, (16, 8, 8, 3), dtype=np.uint8)
  flipped_only = np.asarray(jax.jit(lambda k, x: data.augment_cifar(k, x, pad=0))(
      jax.random.key(0), images))
  flips = 0
  for out, image in zip(flipped_only, images):
    same, mirror = np.array_equal(out, image), np.array_equal(out, image[:, ::-1])
    assert same or mirror
    flips += mirror
  assert 0 < flips < 16
  cropped = np.asarray(jax.jit(data.augment_cifar)(jax.random.key(1), images))
  assert cropped.shape == images.shape
  # Crops expose zero padding somewhere, and never invent pixel values.
  assert (cropped == 0).any()
  for out, image in zip(cropped, images):
    assert set(np.unique(out)) <= set(np.unique(image)) | {0}


def test_normalize_uses_the_given_statistics():
  images = np.full((1, 2, 2, 3), 255, np.uint8)
  out = np.asarray(data.normalize(images, data.IMAGENET_MEAN, data.IMAGENET_STD))
  np.testing.assert_allclose(out[0, 0, 0], (1 - data.IMAGENET_MEAN) / data.IMAGENET_STD, rtol=1e-6)


def test_benchmark_batches_are_real_cifar_slices_distinct_per_worker_and_step():
  images, labels = data.benchmark_batches((32, 32, 3), 10, 3, 2, 4, first_worker=2)
  assert images.shape == (3, 2, 4, 32, 32, 3) and images.dtype == np.uint8
  assert labels.shape == (3, 2, 4) and labels.dtype == np.int32
  train, _ = data.load_embedded_cifar10()
  # Worker 2 (this process's first) starts at image 2 * 3 batches * 4.
  np.testing.assert_array_equal(images[0, 0], train.images[24:28])
  np.testing.assert_array_equal(labels[1, 0], train.labels[28:32])
  np.testing.assert_array_equal(images[0, 1], train.images[36:40])  # worker 3
  flat = images.reshape(24, -1)
  assert len({row.tobytes() for row in flat}) == 24  # no batch repeats


def test_benchmark_batches_other_shapes_are_random_and_in_range():
  images, labels = data.benchmark_batches((16, 16, 3), 1000, 2, 1, 5)
  assert images.shape == (2, 1, 5, 16, 16, 3)
  assert labels.min() >= 0 and labels.max() < 1000
  assert not np.array_equal(images[0], images[1])
