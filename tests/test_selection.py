import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlgs_jax import selection


@pytest.mark.parametrize("density,size,expected", [
    (0.01, 100, 1), (0.1, 30, 3), (0.001, 10, 1), (1.0, 7, 7), (0.5, 3, 2), (0.25, 1000, 250)])
def test_num_to_keep(density, size, expected):
  assert selection.num_to_keep(density, size) == expected


def test_kth_largest_abs_matches_numpy():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((17, 9)).astype(np.float32)
  for k in (1, 5, 100, x.size):
    got = jax.jit(selection.kth_largest_abs, static_argnums=1)(x, k)
    assert float(got) == np.sort(np.abs(x).ravel())[::-1][k - 1]


def test_topk_indices_matches_numpy():
  rng = np.random.default_rng(1)
  x = rng.standard_normal(500).astype(np.float32)
  got = np.asarray(jax.jit(selection.topk_indices, static_argnums=1)(x, 25))
  assert set(got) == set(np.argsort(-np.abs(x))[:25])


def reference_threshold(x, threshold, capacity):
  flat = x.ravel()
  passing = np.flatnonzero((np.abs(flat) >= threshold) & (flat != 0))
  chosen = passing[:capacity]
  out = np.full(capacity, flat.size, np.int32)
  out[:len(chosen)] = chosen
  return out, len(passing)


@pytest.mark.parametrize("threshold,capacity", [(0.5, 40), (1.5, 40), (0.0, 10), (3.0, 5)])
def test_threshold_indices_matches_numpy(threshold, capacity):
  rng = np.random.default_rng(2)
  x = rng.standard_normal((8, 25)).astype(np.float32)
  x[0, :5] = 0.0  # zeros never pass, even with threshold 0
  fn = jax.jit(selection.threshold_indices, static_argnums=2)
  got, passed = fn(x, jnp.float32(threshold), capacity)
  want, want_passed = reference_threshold(x, threshold, capacity)
  np.testing.assert_array_equal(np.asarray(got), want)
  assert int(passed) == want_passed
  assert int(selection.count_valid(got, x.size)) == min(capacity, want_passed)


def test_threshold_at_exact_kth_selects_exactly_k():
  rng = np.random.default_rng(3)
  x = rng.standard_normal(1000).astype(np.float32)
  k = 37
  h = selection.kth_largest_abs(jnp.asarray(x), k)
  got, passed = jax.jit(selection.threshold_indices, static_argnums=2)(x, h, k)
  assert int(passed) == k
  assert set(np.asarray(got)) == set(np.argsort(-np.abs(x))[:k])
