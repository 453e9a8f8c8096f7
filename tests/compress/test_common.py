"""What every transform shares: the tree check and the skip of non-finite steps."""

import numpy as np
import pytest

import dlgs_jax
from tests.helpers import flat_workers, run_steps

PARAMS = {"a": np.zeros((8, 16), np.float32), "b": np.zeros((16,), np.float32)}
W = 4


def factories(axis_name=None):
  return {
      "dense": dlgs_jax.dense(axis_name=axis_name),
      "topk": dlgs_jax.topk(0.25, axis_name=axis_name),
      "gtopk": dlgs_jax.gtopk(0.25, axis_name=axis_name),
      "lags": dlgs_jax.lags(0.25, axis_name=axis_name),
      "dlgs": dlgs_jax.dlgs(0.25, axis_name=axis_name),
      "dgc": dlgs_jax.dgc(0.25, axis_name=axis_name, min_ndim=1),
      "terngrad": dlgs_jax.terngrad(axis_name=axis_name),
  }


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
def test_finite_gradients_whose_mean_overflows_skip_the_step(name):
  """3e38 on every worker is finite, its sum is not: the step is skipped and counted."""
  tx = factories("data")[name]
  rng = np.random.default_rng(0)
  good = {k: rng.standard_normal((W,) + v.shape).astype(np.float32) for k, v in PARAMS.items()}
  huge = {k: np.full((W,) + v.shape, 3e38, np.float32) for k, v in PARAMS.items()}
  updates, _, states = run_steps(tx, PARAMS, [good, huge], W)
  assert np.all(flat_workers(updates[1]) == 0.0)
  assert np.all(states[1].stats.skipped == 1) and np.all(states[1].count == 1)
  residuals = getattr(states[1], "residuals", None)
  if residuals is not None:  # kept as they were after the good step
    np.testing.assert_array_equal(flat_workers(residuals), flat_workers(states[0].residuals))

