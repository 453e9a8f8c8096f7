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


def test_step_decay_gives_optax_piecewise_constant_values_bit_for_bit():
  import numpy as np
  import optax

  from dlgs_jax.training.run import step_decay

  for boundaries in ([], [4, 6], [4, 6, 12], list(range(3, 60, 5))):  # 12 drops: two tables
    ours = step_decay(0.05, boundaries)
    theirs = optax.piecewise_constant_schedule(0.05, {b: 0.1 for b in boundaries})
    counts = np.arange(0, 70, dtype=np.int32)
    got = np.array([ours(c) for c in counts])
    want = np.array([theirs(c) for c in counts], np.float32)  # no drops: a Python float
    assert got.dtype == np.float32 and np.array_equal(got.view(np.int32), want.view(np.int32))
    assert got[0] == np.float32(0.05) and (len(boundaries) == 0 or got[-1] < got[0])


def test_step_decay_compiles_one_program_for_up_to_eight_drops():
  import jax
  import numpy as np

  from dlgs_jax.training.run import step_decay

  def program(boundaries):
    text = jax.jit(step_decay(0.05, boundaries)).lower(np.int32(3)).as_text()
    return [line for line in text.splitlines() if "constant" not in line]

  # Extending a run adds a drop: the program, less its constants, must not change.
  assert program([4, 6]) == program([4, 6, 12]) == program(list(range(1, 9)))
  assert program(list(range(1, 10))) != program([4, 6])
