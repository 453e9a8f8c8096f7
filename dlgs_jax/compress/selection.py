"""Choosing which gradient values a worker sends.

Every method picks values one way, with static output shapes so it runs under
`jax.jit`: threshold selection into a fixed-capacity buffer
(`segmented.pack` and `segmented.compact`), one
elementwise comparison and a prefix sum, O(n) -- the cheap path DLGS takes on
the steps where it reuses a threshold (Ju et al. 2024, Algorithm 1). An exact
top-k is the same selection at the exact k-th largest value
(`segmented.exact_thresholds`), which no sort computes. This module holds the
small pieces: how many values to keep, sample strides, and bit ranks.

Index buffers are padded with a *sentinel* equal to the input's size; every
consumer gathers with ``mode="fill"`` and scatters with ``mode="drop"`` so the
padding never touches real data.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def num_to_keep(density: float, size: int) -> int:
  """Number of values kept out of `size` at `density`: ``max(1, ceil(density * size))``.

  Args:
    density: fraction of values to keep, in (0, 1].
    size: number of values in the tensor (> 0).

  Returns:
    k, clipped to ``[1, size]``.
  """
  # The small epsilon keeps float noise (0.1 * 30 = 3.0000000000000004) from
  # rounding k up by one.
  return int(min(size, max(1, math.ceil(density * size - 1e-9))))


def coprime_stride(stride: int, size: int) -> int:
  """The largest stride <= `stride` that shares no factor with `size`.

  A strided sample of a leaf then visits every index of its fastest axis
  evenly: a prime that divides none of a shape's dimensions does not divide
  their product, and gradients differ in scale along those axes. A stride
  that divides the fastest axis sees a few of its entries only: every 64th
  value of a 1x1x512x2048 kernel sees 32 of its 2048 output channels (a
  sampled bound then missed in 148 of 200 draws on kernels with log-normal
  channel scales), every 125th value of a ResNet-50's 2048x1000 output
  layer 8 of its 1000 classes (the bound missed on every exact step).

  Args:
    stride: >= 1, the stride wanted.
    size: the leaf's number of values.

  Returns:
    int in [1, stride].
  """
  stride = max(1, int(stride))
  while math.gcd(stride, int(size)) != 1:
    stride -= 1
  return stride


def bit_of_rank(word: jax.Array, rank: jax.Array) -> jax.Array:
  """Position of the rank-th set bit (from 0) of each uint32 word, in 5 halving steps."""
  bit = jnp.zeros_like(rank)
  for width in (16, 8, 4, 2, 1):
    low_mask = jnp.uint32((1 << width) - 1)
    low_count = lax.population_count(word & low_mask).astype(jnp.int32)
    upper = rank >= low_count
    rank = jnp.where(upper, rank - low_count, rank)
    bit = jnp.where(upper, bit + width, bit)
    word = jnp.where(upper, word >> width, word & low_mask)
  return bit


def set_at(base: jax.Array, at, values: jax.Array) -> jax.Array:
  """`base` with ``base[at[i]] = values[i]`` for static indices `at`, by a gather and a select.

  The two fuse into one pass with what reads the result; a scatter would be a
  kernel of its own (one per group where a step writes several groups' vectors).
  """
  at = np.asarray(at, np.int64)
  row = np.zeros(base.shape[0], np.int32)
  row[at] = np.arange(len(at))
  listed = np.zeros(base.shape[0], bool)
  listed[at] = True
  return jnp.where(listed, values[row], base)


def count_valid(indices: jax.Array, size: int) -> jax.Array:
  """Number of non-sentinel entries of an index buffer (int32 scalar)."""
  return jnp.sum(indices < size, dtype=jnp.int32)
