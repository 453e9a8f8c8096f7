"""What every transform shares: the tree check and the skip of non-finite steps."""

import jax
import numpy as np
import pytest

import dlgs_jax
from dlgs_jax.compress import common
from tests.helpers import flat_workers, run_steps

PARAMS = {"a": np.zeros((8, 16), np.float32), "b": np.zeros((16,), np.float32)}
W = 4


BUILDERS = {
    "dense": lambda axis: dlgs_jax.dense(axis_name=axis),
    "topk": lambda axis: dlgs_jax.topk(0.25, axis_name=axis),
    "gtopk": lambda axis: dlgs_jax.gtopk(0.25, axis_name=axis),
    "lags": lambda axis: dlgs_jax.lags(0.25, axis_name=axis),
    "dlgs": lambda axis: dlgs_jax.dlgs(0.25, axis_name=axis),
    "dlgs-owners": lambda axis: dlgs_jax.dlgs(0.25, axis_name=axis, collective="owners"),
    "dgc": lambda axis: dlgs_jax.dgc(0.25, axis_name=axis, min_ndim=1),
    "terngrad": lambda axis: dlgs_jax.terngrad(axis_name=axis),
}


def factories(axis_name=None):
  return {name: build(axis_name) for name, build in BUILDERS.items()}


@pytest.mark.parametrize("name", sorted(factories()))
def test_a_gradient_tree_that_does_not_match_is_named_the_right_way_round(name):
  tx = factories()[name]
  state = tx.init(PARAMS)
  # dense and TernGrad keep no per-leaf state: they check against the parameters.
  against = "the parameters" if name in ("dense", "terngrad") else "the optimizer state"
  renamed = {"a": PARAMS["a"], "c": PARAMS["b"]}
  with pytest.raises(ValueError) as error:
    tx.update(renamed, state, PARAMS)
  assert (f"the gradients do not match {against}: the gradients have leaves ['a', 'c'], "
          f"{against} has leaves ['a', 'b']") in str(error.value)
  reshaped = {"a": np.zeros((16, 8), np.float32), "b": PARAMS["b"]}
  with pytest.raises(ValueError, match=r"the gradient leaf 'a' has shape \(16, 8\), in "
                     + against + r" it has shape \(8, 16\)"):
    tx.update(reshaped, state, PARAMS)


# TernGrad sends ternary values scaled by the shared maximum, so its exchange meets
# no such sum (at these magnitudes its rounding probabilities underflow instead).
@pytest.mark.parametrize("name", sorted(set(factories()) - {"terngrad"}))
def test_finite_gradients_whose_sum_overflows_have_their_finite_mean_applied(name):
  """3e38 on every worker sums past float32's range, its mean does not: each worker's
  share is divided by P before it is added, so the step applies 3e38 where it sends."""
  tx = factories("data")[name]
  rng = np.random.default_rng(0)
  good = {k: rng.standard_normal((W,) + v.shape).astype(np.float32) for k, v in PARAMS.items()}
  huge = {k: np.full((W,) + v.shape, 3e38, np.float32) for k, v in PARAMS.items()}
  updates, _, states = run_steps(tx, PARAMS, [good, huge], W)
  applied = flat_workers(updates[1])
  assert np.all(np.isfinite(applied)) and np.max(applied) == np.float32(3e38)
  assert np.all(states[1].stats.skipped == 0) and np.all(states[1].count == 2)


@pytest.mark.parametrize("name", ["dlgs", "gtopk", "lags", "topk"])
def test_a_message_that_overflows_skips_the_step_and_keeps_the_residuals(name):
  """Residual plus gradient past the range (2e38 owed + 2e38 new) is not finite where
  the gradient was: the message's check skips the step on every worker."""
  tx = factories("data")[name]
  huge = {k: np.full((W,) + v.shape, 2e38, np.float32) for k, v in PARAMS.items()}
  updates, _, states = run_steps(tx, PARAMS, [huge, huge], W)
  assert np.all(flat_workers(updates[1]) == 0.0)
  assert np.all(states[1].stats.skipped == 1) and np.all(states[1].count == 1)
  np.testing.assert_array_equal(flat_workers(states[1].residuals),
                                flat_workers(states[0].residuals))
  assert np.max(flat_workers(states[0].residuals)) == np.float32(2e38)


@pytest.mark.parametrize("name", sorted(factories()))
def test_axis_names_may_be_a_name_a_tuple_or_a_list(name):
  rng = np.random.default_rng(3)
  grads = {k: rng.standard_normal((W,) + v.shape).astype(np.float32) for k, v in PARAMS.items()}
  reference = flat_workers(run_steps(BUILDERS[name]("data"), PARAMS, [grads], W)[0][0])
  for axis in (("data",), ["data"]):
    updates = run_steps(BUILDERS[name](axis), PARAMS, [grads], W)[0][0]
    np.testing.assert_array_equal(flat_workers(updates), reference)
  with pytest.raises(ValueError, match="axis_name must be None, a mesh axis name or a list"):
    BUILDERS[name](7)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_integer_boolean_and_empty_leaves_pass_through_without_traffic(name):
  mixed = {**PARAMS, "empty": np.zeros((0, 3), np.float32), "steps": np.zeros((5,), np.int32),
           "mask": np.zeros((2,), bool)}
  rng = np.random.default_rng(4)
  grads = {k: rng.standard_normal((W,) + v.shape).astype(np.float32) for k, v in PARAMS.items()}
  passive = {"empty": np.ones((W, 0, 3), np.float32), "steps": np.ones((W, 5), np.int32),
             "mask": np.ones((W, 2), bool)}
  (plain,), plain_state, _ = run_steps(BUILDERS[name]("data"), PARAMS, [grads], W)
  (update,), state, _ = run_steps(BUILDERS[name]("data"), mixed, [{**grads, **passive}], W)
  for key in PARAMS:
    np.testing.assert_array_equal(update[key], plain[key])
  for key, value in passive.items():
    assert update[key].dtype == value.dtype and update[key].shape == value.shape
    assert not np.any(update[key])  # a zero update
  np.testing.assert_array_equal(state.stats.bytes_sent, plain_state.stats.bytes_sent)
  # Only such leaves: nothing to communicate, said before any work.
  with pytest.raises(ValueError, match=r"^the parameter tree has nothing to communicate: every "
                     r"leaf is integer, boolean or empty \(bool\[2\], float32\[0, 3\], "
                     r"int32\[5\]\); pass the floating-point parameters"):
    BUILDERS[name]("data").init({k: mixed[k] for k in ("empty", "steps", "mask")})


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_an_update_outside_any_mapped_axis_is_refused_before_any_work(name):
  tx = BUILDERS[name]("data")
  state = tx.init(PARAMS)
  with pytest.raises(ValueError, match=r"^the update of a transform built with "
                     r"axis_name='data' was called outside any mapped axis: call it inside "
                     r"jax.shard_map, jax.pmap or jax.vmap"):
    tx.update(PARAMS, state)


@pytest.mark.parametrize("name", ["dense", "dlgs"])
def test_an_axis_the_update_does_not_run_under_is_named_with_the_fix(name):
  import jax

  tx = BUILDERS[name]("batch")
  grads = {k: np.ones((W,) + v.shape, np.float32) for k, v in PARAMS.items()}
  state = jax.vmap(lambda _: tx.init(PARAMS), axis_name="data")(np.arange(W))
  with pytest.raises(ValueError, match=r"^axis_name 'batch' is not an axis this update runs "
                     r"under \(mapped here: \['data'\]\): .*axis_name='data'"):
    jax.vmap(tx.update, axis_name="data")(grads, state)


@pytest.mark.parametrize("name", ["dense", "dlgs"])
def test_a_forgotten_axis_name_under_a_named_vmap_or_pmap_is_named_with_the_fix(name):
  # Simulated workers that never communicate would still train, each alone.
  import jax

  tx = BUILDERS[name](None)
  grads = {k: np.ones((W,) + v.shape, np.float32) for k, v in PARAMS.items()}
  state = jax.vmap(lambda _: tx.init(PARAMS))(np.arange(W))
  message = (r"^the transform was built with axis_name=None but runs under the mapped axes "
             r"\['data'\], so each worker would compress alone and never communicate: build "
             r"it with axis_name='data'")
  for mapped in (jax.vmap, jax.pmap):
    with pytest.raises(ValueError, match=message):
      mapped(tx.update, axis_name="data")(grads, state)
  # Mapped without an axis name (per-example work, an ensemble): each runs alone, as asked.
  updates, _ = jax.jit(jax.vmap(tx.update))(grads, state)  # one program, not op by op
  assert jax.tree_util.tree_structure(updates) == jax.tree_util.tree_structure(grads)


@pytest.mark.parametrize("name", ["dense", "dlgs"])
def test_a_forgotten_axis_name_under_shard_map_is_named_with_the_fix(name):
  import jax
  from jax.sharding import PartitionSpec as P

  from dlgs_jax.workload import parallel

  tx = BUILDERS[name](None)
  mesh = parallel.data_mesh(W)

  def step(params, g):
    varying = jax.lax.pcast(params, "data", to="varying")
    return tx.update(jax.tree_util.tree_map(lambda p, x: p + x[0], varying, g),
                     tx.init(PARAMS))[0]

  fn = jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
  grads = {k: np.ones((W,) + v.shape, np.float32) for k, v in PARAMS.items()}
  with pytest.raises(ValueError, match=r"^the gradients vary over the mesh axes \['data'\] but "
                     r"the transform was built with axis_name=None, so it would never "
                     r"communicate: build it with axis_name='data'"):
    jax.jit(fn)(PARAMS, grads)


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan, None])
def test_all_finite_agrees_with_numpy_on_every_kind_of_value(bad):
  """A NaN or an infinity anywhere in any leaf fails it; the largest finite values pass."""
  rng = np.random.default_rng(0)
  leaves = [rng.normal(size=(33, 7)).astype(np.float32), np.full((40,), 3.4e38, np.float32),
            np.float32([-3.4e38, 1e-45, -0.0])]
  if bad is not None:
    leaves[0][5, 3] = bad
  expected = all(np.all(np.isfinite(leaf)) for leaf in leaves)
  assert bool(jax.jit(lambda xs: common.all_finite(xs, None))(leaves)) == expected
