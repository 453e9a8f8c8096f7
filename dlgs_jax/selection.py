"""Choosing which gradient values a worker sends.

Two ways to pick values, both with static output shapes so they run under
`jax.jit`:

* exact top-k (`topk_indices`): `lax.top_k` sorts the whole input on CPU and GPU,
  so it costs O(n log n) -- the price LAGS pays every step;
* threshold selection into a fixed-capacity buffer (`threshold_indices`): one
  elementwise comparison and a prefix sum, O(n) -- the cheap path DLGS takes on
  the steps where it reuses a threshold (Ju et al. 2024, Algorithm 1).

Index buffers are padded with a *sentinel* equal to the input's size; every
consumer gathers with ``mode="fill"`` and scatters with ``mode="drop"`` so the
padding never touches real data.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
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


def kth_largest_abs(x: jax.Array, k: int) -> jax.Array:
  """Exact k-th largest absolute value of `x` (float32 scalar).

  This is the DLGS threshold H_l (Ju et al. 2024, Algorithm 1): with
  ``|x| >= H`` exactly k values pass when there are no ties.

  Args:
    x: any-shaped array.
    k: 1 <= k <= x.size.

  Returns:
    float32 scalar.
  """
  flat = jnp.abs(x.reshape(-1)).astype(jnp.float32)
  if k == flat.shape[0]:
    return jnp.min(flat)  # no sort needed when everything is kept
  return lax.top_k(flat, k)[0][k - 1]


def topk_indices(x: jax.Array, k: int) -> jax.Array:
  """Flat indices (int32[k]) of the k largest ``|x|`` (exact, sorts the input)."""
  flat = jnp.abs(x.reshape(-1))
  if k == flat.shape[0]:
    return jnp.arange(k, dtype=jnp.int32)
  return lax.top_k(flat, k)[1].astype(jnp.int32)


def threshold_indices(
    x: jax.Array, threshold: jax.Array, capacity: int
) -> tuple[jax.Array, jax.Array]:
  """Flat indices of the values with ``|x| >= threshold`` and ``x != 0``.

  At most `capacity` indices are returned, the first ones in flat index order;
  values that pass but do not fit are simply not selected (the caller keeps
  them in its residual). Zeros are never selected: sending them moves nothing.

  Args:
    x: any-shaped array.
    threshold: scalar.
    capacity: static buffer size, 1 <= capacity <= x.size.

  Returns:
    ``(indices, passed)``: int32[capacity] indices padded with the sentinel
    ``x.size``, and the int32 number of values that passed the threshold
    (possibly more than `capacity`).
  """
  flat = x.reshape(-1)
  size = flat.shape[0]
  magnitude = jnp.abs(flat)
  mask = (magnitude >= threshold.astype(magnitude.dtype)) & (magnitude > 0)
  position = jnp.cumsum(mask, dtype=jnp.int32) - 1
  # Values past the capacity (and values that fail) are scattered to a spare
  # slot `capacity` which is cut off afterwards.
  slot = jnp.where(mask & (position < capacity), position, capacity)
  indices = jnp.full((capacity + 1,), size, jnp.int32)
  indices = indices.at[slot].set(jnp.arange(size, dtype=jnp.int32))
  return indices[:capacity], position[-1] + 1


def count_valid(indices: jax.Array, size: int) -> jax.Array:
  """Number of non-sentinel entries of an index buffer (int32 scalar)."""
  return jnp.sum(indices < size, dtype=jnp.int32)
