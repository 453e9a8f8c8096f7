import math

import jax
import numpy as np
import pytest

from dlgs_jax.compress import selection


@pytest.mark.parametrize("density,size,expected", [
    (0.01, 100, 1), (0.1, 30, 3), (0.001, 10, 1), (1.0, 7, 7), (0.5, 3, 2), (0.25, 1000, 250)])
def test_num_to_keep(density, size, expected):
  assert selection.num_to_keep(density, size) == expected


def test_coprime_stride_is_the_largest_sharing_no_factor_with_the_size():
  for stride, size in [(1, 64), (16, 1 << 18), (125, 2048 * 1000), (4, 70000), (7, 36864), (9, 9)]:
    got = selection.coprime_stride(stride, size)
    assert 1 <= got <= stride and math.gcd(got, size) == 1
    assert all(math.gcd(s, size) > 1 for s in range(got + 1, stride + 1))
  assert selection.coprime_stride(125, 2048 * 1000) == 123
  assert selection.coprime_stride(0, 10) == 1


def test_the_sample_of_a_head_of_1000_classes_sees_every_class():
  # Every 125th value of a 2048x1000 layer would see 8 of its 1000 classes.
  size = 2048 * 1000
  stride = selection.coprime_stride(125, size)
  assert stride == 123 and math.gcd(stride, 1000) == 1
  assert len(set((np.arange(0, size, stride) % 1000).tolist())) == 1000


def test_set_at_writes_the_listed_entries_as_a_scatter_would():
  rng = np.random.default_rng(0)
  base = rng.standard_normal(9).astype(np.float32)
  at = [7, 0, 4]
  values = rng.standard_normal(3).astype(np.float32)
  expected = base.copy()
  expected[at] = values
  got = jax.jit(lambda b, v: selection.set_at(b, at, v))(base, values)
  np.testing.assert_array_equal(np.asarray(got), expected)
