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


# Up to this size a full sort is as cheap as the sampled path on one core; at
# four times it the sort costs several times more (experiments/performance_notes.md).
SMALL_LEAF = 1 << 15


def sample_stride(size: int, k: int) -> int:
  """Stride of the sample that bounds a leaf's k-th largest value from below.

  At least 16,384 and 128 n/k samples: about 190 sample values then lie above
  a bound aimed at 1.5k values, so the count passing it has a relative spread
  of ~7% and leaves the window [k, 2k] very rarely. The stride shares no
  factor with the size (`coprime_stride`).
  """
  return coprime_stride(size // min(size, max(16384, 128 * size // k)), size)


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


def topk_indices(x: jax.Array, k: int) -> jax.Array:
  """Flat indices (int32[k]) of the k largest ``|x|`` (exact, sorts the input)."""
  flat = jnp.abs(x.reshape(-1))
  if k == flat.shape[0]:
    return jnp.arange(k, dtype=jnp.int32)
  return lax.top_k(flat, k)[1].astype(jnp.int32)


def passing_mask(x: jax.Array, threshold: jax.Array) -> jax.Array:
  """Flat bool mask of the values threshold selection passes: ``|x| >= threshold``, ``x != 0``.

  Zeros never pass: sending them moves nothing.
  """
  magnitude = jnp.abs(x.reshape(-1))
  return (magnitude >= threshold.astype(magnitude.dtype)) & (magnitude > 0)


def pack_passing(x: jax.Array, threshold: jax.Array) -> jax.Array:
  """`passing_mask` packed 32 to a word: uint32[ceil(x.size / 32)], bit i of word w = value 32w+i.

  The packed form is all `indices_from_words` needs, and its popcount is the
  number of values passing (`count_packed`), so one pass over ``x`` serves
  both the count and the selection.
  """
  mask = passing_mask(x, threshold)
  pad = (-mask.shape[0]) % 32
  if pad:
    mask = jnp.concatenate([mask, jnp.zeros((pad,), bool)])
  # Distinct powers of two: the sum is the bitwise OR of the word's bits.
  return jnp.sum(mask.reshape(-1, 32).astype(jnp.uint32) << jnp.arange(32, dtype=jnp.uint32),
                 axis=1, dtype=jnp.uint32)


def count_packed(words: jax.Array) -> jax.Array:
  """Number of set bits of a packed mask (int32 scalar)."""
  return jnp.sum(lax.population_count(words).astype(jnp.int32))


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
    ``(indices, passed)``: int32[capacity] indices in increasing order, padded
    with the sentinel ``x.size``, and the int32 number of values that passed
    the threshold (possibly more than `capacity`).
  """
  return indices_from_words(pack_passing(x, threshold), x.size, capacity)


def indices_from_words(words: jax.Array, size: int, capacity: int
                       ) -> tuple[jax.Array, jax.Array]:
  """`threshold_indices` from a mask already packed by `pack_passing`.

  A scatter of all n positions into the buffer is the obvious way and costs as
  much as a sort on CPU. Instead a prefix sum over the n/32 word popcounts
  gives each word its first output slot, a running max spreads word indices
  over the slots, and a 5-step bit search finds the bit in the word: a scatter
  of n/32 words and O(capacity) work.

  Args:
    words: uint32[ceil(size / 32)] from `pack_passing`.
    size: number of values the mask covers (the sentinel).
    capacity: static buffer size, 1 <= capacity <= size.

  Returns:
    ``(indices, passed)`` as `threshold_indices`.
  """
  counts = lax.population_count(words).astype(jnp.int32)
  starts = jnp.cumsum(counts) - counts  # exclusive prefix sums: first slot of each word
  passed = starts[-1] + counts[-1]
  # Mark each nonempty word at its first slot; a running max then carries the
  # word index over the slots it fills (starts never decrease).
  marks = jnp.zeros((capacity,), jnp.int32).at[jnp.where(counts > 0, starts, capacity)].max(
      jnp.arange(words.shape[0], dtype=jnp.int32), mode="drop")
  word_index = lax.cummax(marks)
  slot = jnp.arange(capacity, dtype=jnp.int32)
  rank = slot - starts[word_index]  # rank of the wanted bit within its word
  bit = bit_of_rank(words[word_index], rank)
  indices = jnp.where(slot < passed, word_index * 32 + bit, size)
  return indices, passed


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


def count_valid(indices: jax.Array, size: int) -> jax.Array:
  """Number of non-sentinel entries of an index buffer (int32 scalar)."""
  return jnp.sum(indices < size, dtype=jnp.int32)
