import collections
import gc
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
import pytest

import dlgs_jax
from dlgs_jax import training
from dlgs_jax.compress.state import DLGSState
from dlgs_jax.training.persistence import checkpoint
from dlgs_jax.workload import data
from dlgs_jax.workload import models
from dlgs_jax.workload import parallel

RUN = {"model.name": "smallcnn", "method.name": "dlgs", "method.density": 0.05, "workers": 4,
       "plan_id": "default:none", "data.batch_size": 4, "seed": 0}


def trained_state(steps=2, workers=4):
  mesh = parallel.data_mesh(workers)
  model, _ = models.create_model("smallcnn")
  tx = optax.chain(dlgs_jax.dlgs(0.05, axis_name="data", thresholds=dlgs_jax.AdaptedReuse(3)),
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


class OlderState(NamedTuple):
  """The step state as checkpoints wrote it before it had one type."""
  params: Any
  batch_stats: Any
  opt_state: Any
  step: Any


def test_a_checkpoint_with_the_older_field_name_restores_into_the_step_state(tmp_path, states):
  state, fresh = states
  ckpt = checkpoint.Checkpointer(tmp_path, RUN, asynchronous=False)
  ckpt.save(2, OlderState(*state), data_position={"epoch": 0, "batch": 2})
  restored, _ = ckpt.restore(fresh)
  assert type(restored) is type(fresh) and restored._fields[1] == "model_state"
  for a, b in zip(host(restored), host(state)):
    np.testing.assert_array_equal(a, b)
  # Other mismatches are still refused, not renamed into something else.
  with pytest.raises(checkpoint.CheckpointCorrupt, match="cannot be read"):
    ckpt.restore(fresh._replace(params={"other": np.zeros(3, np.float32)}))


# The DLGS state as checkpoints wrote it before the owners' thresholds.
OlderDLGSState = collections.namedtuple("OlderDLGSState", DLGSState._fields[:4])


def test_a_checkpoint_from_before_a_field_was_added_restores_with_it_empty(tmp_path, states):
  state, fresh = states
  dlgs_state = state.opt_state[0]
  assert DLGSState._fields[4:] == ("owner_thresholds",) and dlgs_state.owner_thresholds == ()
  older = state._replace(opt_state=(OlderDLGSState(*dlgs_state[:4]), *state.opt_state[1:]))
  ckpt = checkpoint.Checkpointer(tmp_path, RUN, asynchronous=False)
  ckpt.save(2, OlderState(*older), data_position={"epoch": 0, "batch": 2})
  restored, _ = ckpt.restore(fresh)
  assert type(restored.opt_state[0]) is type(dlgs_state)
  assert restored.opt_state[0].owner_thresholds == ()
  for a, b in zip(host(restored), host(state)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_round_trip_restores_everything_bit_for_bit(tmp_path, states):
  state, fresh = states
  saved = host(state)
  ckpt = checkpoint.Checkpointer(tmp_path, RUN)
  ckpt.save(2, state, data_position={"epoch": 0, "batch": 2}, plan_json='{"x": 1}')
  ckpt.wait()
  restored, record = ckpt.restore(fresh)
  assert record["data"] == {"epoch": 0, "batch": 2} and record["plan"] == '{"x": 1}'
  assert record["step"] == 2 and record["identity"] == RUN
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
  for key, value in (("workers", 8), ("method.name", "lags"), ("plan_id", "other")):
    other = checkpoint.Checkpointer(tmp_path, dict(RUN, **{key: value}))
    with pytest.raises(checkpoint.CheckpointMismatch, match=f"{key}: checkpoint"):
      other.restore(fresh)
    other.close()


def test_bad_arguments(tmp_path):
  with pytest.raises(ValueError, match="identity"):
    checkpoint.Checkpointer(tmp_path, {})
  with pytest.raises(ValueError, match="max_to_keep"):
    checkpoint.Checkpointer(tmp_path, RUN, max_to_keep=0)
  empty = checkpoint.Checkpointer(tmp_path / "none", RUN)
  with pytest.raises(FileNotFoundError, match="no checkpoint"):
    empty.restore({})


def _data_files(step_dir):
  files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
  return sorted(files, key=lambda p: p.stat().st_size, reverse=True)


def _flip(path, offset):
  data = bytearray(path.read_bytes())
  data[offset % len(data)] ^= 0x40
  path.write_bytes(bytes(data))


DAMAGE = {
    "flip a byte early in the largest array file": lambda d: _flip(_data_files(d)[0], 4096),
    "flip a byte mid-way in the largest array file":
        lambda d: _flip(_data_files(d)[0], _data_files(d)[0].stat().st_size // 2),
    "flip a byte mid-way in the second array file":
        lambda d: _flip(_data_files(d)[1], _data_files(d)[1].stat().st_size // 2),
    "truncate the largest array file": lambda d: _data_files(d)[0].write_bytes(
        _data_files(d)[0].read_bytes()[:_data_files(d)[0].stat().st_size // 2]),
    "random bytes in the largest array file": lambda d: _data_files(d)[0].write_bytes(
        np.random.default_rng(0).bytes(_data_files(d)[0].stat().st_size)),
    "empty the record": lambda d: (d / "record" / "metadata").write_text(""),
    "change the record": lambda d: (d / "record" / "metadata").write_text(
        (d / "record" / "metadata").read_text().replace('"epoch": 0', '"epoch": 7')),
    "delete the arrays": lambda d: __import__("shutil").rmtree(d / "state"),
    "delete the record": lambda d: __import__("shutil").rmtree(d / "record"),
}


# A damaged array file fails one read while orbax has others in flight; it abandons
# those coroutines, and Python reports each as an ignored exception when it is
# collected. The test collects them itself, so that they are not printed at the end
# of the session as if something had broken.
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_newest_checkpoint_is_named_and_the_previous_one_restored(
    tmp_path, states, damage):
  state, fresh = states
  later = jax.tree_util.tree_map(lambda x: x + 1 if jax.numpy.issubdtype(x.dtype, jax.numpy.floating)
                                 else x, state)
  warnings = []
  ckpt = checkpoint.Checkpointer(tmp_path, RUN, warn=warnings.append)
  ckpt.save(1, state, data_position={"epoch": 0, "batch": 1})
  ckpt.save(2, later, data_position={"epoch": 0, "batch": 2})
  ckpt.wait()
  ckpt.close()
  DAMAGE[damage](tmp_path / "2")
  ckpt = checkpoint.Checkpointer(tmp_path, RUN, warn=warnings.append)
  restored, record = ckpt.restore_latest_good(fresh)
  assert record["step"] == 1 and record["data"]["batch"] == 1
  for a, b in zip(host(restored), host(state)):
    np.testing.assert_array_equal(a, b)
  assert len(warnings) == 1 and "checkpoint step 2" in warnings[0] and "trying step 1" in warnings[0]
  assert "\n" not in warnings[0] and "pybind11" not in warnings[0]
  # Every checkpoint damaged: refused in one line, never a state that does not verify.
  DAMAGE[damage](tmp_path / "1")
  with pytest.raises(checkpoint.CheckpointCorrupt, match="no checkpoint .* passes its checks"):
    ckpt.restore_latest_good(fresh)
  ckpt.close()
  gc.collect()


@pytest.mark.slow
def test_fingerprints_see_one_flipped_bit_in_any_leaf(states):
  state, _ = states
  prints = checkpoint.tree_fingerprints(state)
  leaves = jax.tree_util.tree_leaves(state)
  assert len(prints) == len(leaves)
  for i in (0, len(leaves) // 2, len(leaves) - 1):
    changed = list(leaves)
    flat = np.array(np.asarray(leaves[i]), copy=True).reshape(-1)
    view = flat.view(np.uint8) if flat.dtype != np.bool_ else flat
    view[-1] ^= 1
    changed[i] = flat.reshape(np.shape(leaves[i]))
    other = checkpoint.tree_fingerprints(changed)
    assert other[i] != prints[i] and other[:i] + other[i + 1:] == prints[:i] + prints[i + 1:]


def test_dgc_state_resumes_bit_for_bit_through_a_checkpoint(tmp_path):
  """DGC's velocity, residuals and per-worker PRNG key come back exactly: 3 steps, a
  checkpoint, a restore onto a fresh state and 3 more steps equal 6 steps in one go
  (through the warm-up's stages). (The CLI's signal tests stop and resume a run.)"""
  from tests.helpers import random_grads, run_steps, worker_mesh

  params = {"fc": jax.numpy.zeros((48, 40)), "bias": jax.numpy.zeros((40,))}
  tx = dlgs_jax.dgc(0.05, axis_name="data", warmup_steps=4)
  rng = np.random.default_rng(3)
  steps = [random_grads(params, 2, rng) for _ in range(6)]
  whole_updates, whole, _ = run_steps(tx, params, steps, 2)
  _, part, _ = run_steps(tx, params, steps[:3], 2)
  template = parallel.stack_per_worker(tx.init(params), worker_mesh(2))
  placed = jax.tree_util.tree_map(lambda t, x: jax.device_put(x, t.sharding), template, part)
  ckpt = checkpoint.Checkpointer(tmp_path, {**RUN, "method.name": "dgc", "workers": 2})
  ckpt.save(3, placed, data_position={"epoch": 0, "batch": 3})
  ckpt.wait()
  restored, record = ckpt.restore(template)
  ckpt.close()
  assert record["step"] == 3
  rest_updates, resumed, _ = run_steps(tx, params, steps[3:], 2, state=restored)
  for a, b in zip(host(resumed), host(whole)):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(host(rest_updates), host(whole_updates[3:])):
    np.testing.assert_array_equal(a, b)
  assert np.asarray(resumed.count).tolist() == [6, 6] and np.any(host(resumed.velocity)[0] != 0)


def test_an_option_added_later_reads_as_the_value_older_checkpoints_ran_with(tmp_path):
  from dlgs_jax.training.config import ADDED_OPTIONS, RunConfig

  # DLGS's default budget is one threshold per message; a run names it in its identity.
  assert RunConfig().identity()["method.budget"] == "message"
  older = {"identity": dict(RUN)}  # written before the budget was an option: a per-layer run
  made = []

  def checker(name, **identity):
    made.append(checkpoint.Checkpointer(tmp_path / name, dict(RUN, **identity),
                                        added=ADDED_OPTIONS))
    return made[-1]

  checker("layer", **{"method.budget": "layer"}).check(older)  # resumes as the run it was
  with pytest.raises(checkpoint.CheckpointMismatch,
                     match="method.budget: checkpoint 'layer', this run 'message'"):
    checker("message", **{"method.budget": "message"}).check(older)
  # DLGS aimed its reused thresholds at 0.9 k before the aim was an option.
  checker("aimed", **{"method.budget": "layer", "method.aim": 0.9}).check(older)
  with pytest.raises(checkpoint.CheckpointMismatch,
                     match="method.aim: checkpoint 0.9, this run 1.0"):
    checker("spend", **{"method.budget": "layer", "method.aim": 1.0}).check(older)
  # A run whose identity holds no budget (a method without one) is not compared on it.
  checker("topk").check(older)
  for ckpt in made:
    ckpt.close()
