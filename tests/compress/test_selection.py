import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlgs_jax.compress import selection


@pytest.mark.parametrize("density,size,expected", [
    (0.01, 100, 1), (0.1, 30, 3), (0.001, 10, 1), (1.0, 7, 7), (0.5, 3, 2), (0.25, 1000, 250)])
def test_num_to_keep(density, size, expected):
  assert selection.num_to_keep(density, size) == expected


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


@pytest.mark.parametrize("size", [31, 32, 33, 1000, 4099])
def test_threshold_indices_word_packing_edges(size):
  rng = np.random.default_rng(size)
  x = rng.standard_normal(size).astype(np.float32)
  for threshold, capacity in ((0.3, size), (1.0, max(1, size // 3)), (10.0, 5)):
    got, passed = jax.jit(selection.threshold_indices, static_argnums=2)(
        x, jnp.float32(threshold), capacity)
    want, want_passed = reference_threshold(x, threshold, capacity)
    np.testing.assert_array_equal(np.asarray(got), want)
    assert int(passed) == want_passed


@pytest.mark.parametrize("threshold", [0.0, 0.5, 1.7, 100.0])
def test_packed_mask_counts_and_selects_like_threshold_indices(threshold):
  x = np.random.default_rng(9).standard_normal((7, 13)).astype(np.float32)
  x[0, :5] = 0.0
  words = jax.jit(selection.pack_passing)(jnp.asarray(x), jnp.float32(threshold))
  expected_mask = (np.abs(x) >= threshold) & (x != 0)
  bits = np.unpackbits(np.asarray(words).view(np.uint8), bitorder="little")[:x.size]
  np.testing.assert_array_equal(bits.astype(bool), expected_mask.reshape(-1))
  assert int(jax.jit(selection.count_packed)(words)) == int(expected_mask.sum())
  capacity = 20
  got, passed = jax.jit(selection.indices_from_words, static_argnums=(1, 2))(
      words, x.size, capacity)
  want, want_passed = jax.jit(selection.threshold_indices, static_argnums=2)(
      jnp.asarray(x), jnp.float32(threshold), capacity)
  np.testing.assert_array_equal(got, want)
  assert int(passed) == int(want_passed) == int(expected_mask.sum())


def test_coprime_stride_is_the_largest_sharing_no_factor_with_the_size():
  for stride, size in [(1, 64), (16, 1 << 18), (125, 2048 * 1000), (4, 70000), (7, 36864), (9, 9)]:
    got = selection.coprime_stride(stride, size)
    assert 1 <= got <= stride and math.gcd(got, size) == 1
    assert all(math.gcd(s, size) > 1 for s in range(got + 1, stride + 1))
  assert selection.coprime_stride(125, 2048 * 1000) == 123
  assert selection.coprime_stride(0, 10) == 1


def test_the_sample_of_a_head_of_1000_classes_sees_every_class():
  # Every 125th value of a 2048x1000 layer would see 8 of its 1000 classes.
  size, k = 2048 * 1000, 20480
  stride = selection.sample_stride(size, k)
  assert stride == 123 and math.gcd(stride, 1000) == 1
  assert len(set((np.arange(0, size, stride) % 1000).tolist())) == 1000
