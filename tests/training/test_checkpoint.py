import jax
import numpy as np
import optax
import pytest

import dlgs_jax
from dlgs_jax import training
from dlgs_jax.training import checkpoint
from dlgs_jax.workload import data
from dlgs_jax.workload import models
from dlgs_jax.workload import parallel

RUN = {key: f"value-{key}" for key in checkpoint.IDENTITY_KEYS}


def trained_state(steps=2, workers=4):
  mesh = parallel.data_mesh(workers)
  model, _ = models.create_model("smallcnn")
  tx = optax.chain(dlgs_jax.dlgs(0.05, axis_name="data", reuse_every=3),
                   optax.sgd(0.05, momentum=0.9))
  train, _ = data.load_embedded_cifar10()
  state = training.init_train_state(model, tx, train.images[:1], mesh, seed=0)
  step_fn = training.make_train_step(model, tx, mesh)
  for idx in list(data.epoch_indices(len(train.labels), workers, 4, 0, 0, range(workers)))[:steps]:
    images, labels = parallel.shard_batch((train.images[idx], train.labels[idx]), mesh)
    state, _ = step_fn(state, images, labels)
  fresh = training.init_train_state(model, tx, train.images[:1], mesh, seed=1)
  return state, fresh


@pytest.fixture(scope="module")
def states():
  return trained_state()


def host(tree):
  return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def test_round_trip_restores_everything_bit_for_bit(tmp_path, states):
  state, fresh = states
  saved = host(state)
  ckpt = checkpoint.Checkpointer(tmp_path, RUN)
  ckpt.save(2, state, data_position={"epoch": 0, "batch": 2}, plan_json='{"x": 1}')
  ckpt.wait()
  restored, record = ckpt.restore(fresh)
  assert record["data"] == {"epoch": 0, "batch": 2} and record["plan"] == '{"x": 1}'
  assert record["step"] == 2 and record["run"] == RUN
  assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(state)
  for a, b in zip(host(restored), saved):
    np.testing.assert_array_equal(a, b)
  # The residuals of each worker came back, not one worker's copy.
  opt = restored.opt_state[0]
  residual_rows = np.asarray(jax.tree_util.tree_leaves(opt.residuals)[0])
  assert residual_rows.shape[0] == 4 and not np.array_equal(residual_rows[0], residual_rows[1])
  for x, y in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(fresh)):
    assert x.sharding == y.sharding
  ckpt.close()


def test_keeps_the_last_n_and_refuses_other_runs(tmp_path, states):
  state, fresh = states
  ckpt = checkpoint.Checkpointer(tmp_path, RUN, max_to_keep=2)
  for step in (1, 2, 3):
    ckpt.save(step, state, data_position={"epoch": 0, "batch": step})
  ckpt.wait()
  assert ckpt.all_steps() == [2, 3] and ckpt.latest_step() == 3
  ckpt.close()
  for key, value in (("workers", 8), ("method", "lags"), ("plan_id", "other")):
    other = checkpoint.Checkpointer(tmp_path, dict(RUN, **{key: value}))
    with pytest.raises(checkpoint.CheckpointMismatch, match=f"{key}: checkpoint"):
      other.restore(fresh)
    other.close()


def test_bad_arguments(tmp_path):
  with pytest.raises(ValueError, match="identity keys"):
    checkpoint.Checkpointer(tmp_path, {"model": "x"})
  with pytest.raises(ValueError, match="max_to_keep"):
    checkpoint.Checkpointer(tmp_path, RUN, max_to_keep=0)
  empty = checkpoint.Checkpointer(tmp_path / "none", RUN)
  with pytest.raises(FileNotFoundError, match="no checkpoint"):
    empty.restore({})
