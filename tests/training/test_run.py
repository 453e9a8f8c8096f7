"""What a run resolves from its config before the first step."""

import os

from dlgs_jax.training.config import DataConfig, RunConfig
from dlgs_jax.training.run import load_data
from tests.helpers import write_cifar_bin_dir


def test_a_data_directory_is_named_by_its_resolved_path(tmp_path, monkeypatch):
  """The same files reached through a symlink or from another working directory are
  the same dataset, so a run resumes there; other files are another dataset."""
  folder, _ = write_cifar_bin_dir(tmp_path / "real")
  (tmp_path / "link").symlink_to(tmp_path / "real")
  other, _ = write_cifar_bin_dir(tmp_path / "other")

  def name(data_dir):
    config = RunConfig(data=DataConfig(data_dir=str(data_dir)))
    return load_data(config, (32, 32, 3))[2]

  expected = f"cifar10:{os.path.realpath(folder)}"
  assert name(folder) == expected
  assert name(tmp_path / "link" / folder.name) == expected
  monkeypatch.chdir(tmp_path / "other")
  assert name(os.path.join("..", "real", folder.name)) == expected
  assert name(other.name) == f"cifar10:{os.path.realpath(other)}" != expected


def test_a_dataset_is_identified_by_its_content_not_its_path(tmp_path):
  """A checkpoint resumes on a copy of its data elsewhere, never on other files at its path."""
  import shutil

  from dlgs_jax.workload import data

  folder, _ = write_cifar_bin_dir(tmp_path / "real")
  copy = shutil.copytree(folder, tmp_path / "copy" / folder.name)
  digest = data.content_digest(data.load_cifar10(folder)[0])
  assert data.content_digest(data.load_cifar10(copy)[0]) == digest
  batch = folder / data.CIFAR10_BIN_TRAIN_FILES[0]
  raw = bytearray(batch.read_bytes())
  raw[100] ^= 1  # one bit of one image
  batch.write_bytes(bytes(raw))
  assert data.content_digest(data.load_cifar10(folder)[0]) != digest
  raw[0] = (raw[0] + 1) % 10  # a label instead
  raw[100] ^= 1
  batch.write_bytes(bytes(raw))
  assert data.content_digest(data.load_cifar10(folder)[0]) != digest
