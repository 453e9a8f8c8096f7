"""Threshold selection over every leaf of a buffer at once.

DLGS picks, in each leaf l, the values with ``|g| >= H_l`` (Ju et al. 2024,
Algorithm 1). Done leaf by leaf, every step launches a few kernels per leaf
and, where thresholds are recomputed only sometimes, a conditional per leaf --
on a GPU each conditional waits for its predicate on the host and the small
kernels are launch-bound. Here a group's leaves live end to end in one float32
buffer (`Segments`), each padded with zeros to a multiple of 32 so that every
32-value word of a packed mask belongs to one leaf; the transforms keep their
error-feedback residuals in that layout, so a step adds the gradients into it
once and every pass handles all leaves together:

* `pack`: one comparison against per-leaf thresholds broadcast by word, the
  mask packed 32 to a word (zeros never pass); `pack_finite` checks the
  values for NaNs and infinities in the same pass;
* `segment_sums`: per-leaf totals of per-word numbers, one scatter-add;
* `kth_largest`: exact k_l-th largest ``|g|`` of every leaf by a radix
  select on the float's bits (three histogram passes, no sort, no
  conditional, no data-dependent loop);
* `compact`: positions of the passing values in per-leaf fixed-capacity
  slots, the first ones in index order;
* `count_at`: values passing several thresholds per leaf, from strided samples.

The number of kernels and conditionals of these passes does not depend on the
number of leaves. Every threshold of the package comes from here: DLGS's,
LAGS's and Top-k's exact ones (`exact_thresholds`) and DGC's fallback
(`exact_threshold`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dlgs_jax.compress import selection

WORD = 32
# Values summed per product with the triangle: larger blocks do more
# arithmetic per value, smaller ones more levels (128: 7 kernels over 200K
# values on XLA:CPU, against 11 for its own running sum).
_SCAN_BLOCK = 128
# float32 holds every integer below 2^24 exactly.
_FLOAT_EXACT = 1 << 24


@dataclasses.dataclass(frozen=True)
class Segments:
  """Static layout of leaves laid end to end, each padded to whole 32-value words."""
  sizes: tuple[int, ...]  # values per leaf

  @functools.cached_property
  def words(self) -> tuple[int, ...]:
    return tuple(-(-size // WORD) for size in self.sizes)

  @functools.cached_property
  def word_ends(self) -> np.ndarray:
    return np.cumsum(self.words, dtype=np.int64)

  @property
  def num_words(self) -> int:
    return int(self.word_ends[-1])

  @property
  def length(self) -> int:
    return WORD * self.num_words

  @functools.cached_property
  def offsets(self) -> tuple[int, ...]:
    """Where each leaf starts in the buffer."""
    return tuple(int(WORD * (end - words)) for end, words in zip(self.word_ends, self.words))


def segments_of(sizes: Sequence[int]) -> Segments:
  sizes = tuple(int(size) for size in sizes)
  if not sizes or min(sizes) < 1:
    raise ValueError(f"segments need at least one leaf and no empty leaf, got sizes {sizes}")
  return Segments(sizes)


def lay_out(leaves: Sequence[jax.Array], segs: Segments) -> jax.Array:
  """The leaves as one float32 buffer of `segs.length` values, zero padded per leaf."""
  parts = []
  for leaf, size, words in zip(leaves, segs.sizes, segs.words):
    parts.append(leaf.reshape(-1).astype(jnp.float32))
    if WORD * words > size:
      # Zeros joined in, not a pad of each leaf: XLA then lays every leaf out in
      # one fused concatenation instead of a kernel per padded leaf.
      parts.append(jnp.zeros((WORD * words - size,), jnp.float32))
  return jnp.concatenate(parts) if len(parts) > 1 else parts[0]


def cut(flat: jax.Array, segs: Segments, shapes: Sequence[tuple[int, ...]]) -> list[jax.Array]:
  """The leaves back out of a laid-out buffer (the inverse of `lay_out`, in float32)."""
  return [flat[offset:offset + size].reshape(shape)
          for offset, size, shape in zip(segs.offsets, segs.sizes, shapes)]


def per_word(values: jax.Array, segs: Segments) -> jax.Array:
  """A per-leaf array [L, ...] repeated for each of the leaf's words: [W, ...]."""
  return _repeat(values, segs.words)


def _repeat(values: jax.Array, counts: Sequence[int]) -> jax.Array:
  # A gather by a constant table of leaf numbers: joining L broadcasts instead
  # makes every fused pass branch over L operands (LLVM ran out of memory on
  # ResNet-50's 161 leaves), and computing the table makes XLA fold it at
  # compile time (seconds).
  if len(counts) == 1:
    return jnp.broadcast_to(values[0], (int(counts[0]),) + values.shape[1:])
  return values[_leaf_table(tuple(int(c) for c in counts))]


@functools.lru_cache(maxsize=32)
def _leaf_table(counts: tuple[int, ...]) -> jax.Array:
  """Leaf l's number repeated counts[l] times, int32: one concrete array per layout.

  The same array object every time it is asked for, so a program holds it
  once however many passes index by it: a fresh NumPy table per pass put 37
  copies of ResNet-50's 800K-word table (118 MB) into one update's program.
  """
  with jax.ensure_compile_time_eval():
    return jnp.asarray(np.repeat(np.arange(len(counts), dtype=np.int32),
                                 np.asarray(counts, np.int64)))


def segment_sums(per_word_values: jax.Array, segs: Segments, bound: int) -> jax.Array:
  """Per-leaf totals [L, ...] of int32 per-word numbers [W, ...], in one scatter-add.

  A prefix sum would do it too, but XLA splits a long one into a tree of
  about ten kernels; the scatter is one (into L bins, by the leaf table).
  One leaf's is a sum, in float32 where `bound` (a static bound on every
  total) keeps it exact: XLA:CPU fuses that into one kernel, an int32 sum
  into a tree of three.
  """
  if len(segs.sizes) == 1:
    if bound < _FLOAT_EXACT:
      return jnp.sum(per_word_values.astype(jnp.float32), axis=0,
                     keepdims=True).astype(per_word_values.dtype)
    return jnp.sum(per_word_values, axis=0, keepdims=True)
  bins = jnp.zeros((len(segs.sizes),) + per_word_values.shape[1:], per_word_values.dtype)
  return bins.at[_leaf_table(segs.words)].add(per_word_values, mode="drop")


def pack(flat: jax.Array, thresholds: jax.Array, segs: Segments) -> jax.Array:
  """Packed masks of ``|x| >= H_l`` and ``x != 0``: uint32[W], or [W, M] for thresholds [L, M].

  Bit i of word w is value 32w+i of the buffer.
  """
  magnitude = jnp.abs(flat).reshape(-1, WORD)
  bounds = per_word(thresholds, segs)
  if bounds.ndim == 1:
    return _pack_bits((magnitude >= bounds[:, None]) & (magnitude > 0))
  # The word's 32 values last: XLA:CPU then packs each word in registers; with
  # the thresholds last it wrote the [W, 32, M] mask out (ResNet-50, 7
  # thresholds: ~9x slower).
  magnitude = magnitude[:, None, :]
  return _pack_bits((magnitude >= bounds[:, :, None]) & (magnitude > 0))


def finite(x: jax.Array) -> jax.Array:
  """Whether every value of `x` is finite (bool scalar): one reduction, nothing written its size."""
  # A NaN or an infinity minus itself is NaN, which every sum propagates (a max
  # need not: XLA:CPU's dropped NaNs), and a finite value minus itself is 0.
  # A mask of ~isfinite reduced by `any` wrote one byte a value and took three
  # more kernels, and `x * 0.0` made XLA:CPU read a buffer of zeros beside it.
  return ~jnp.isnan(jnp.sum(x - x, dtype=jnp.float32))


def pack_finite(flat: jax.Array, thresholds: jax.Array, segs: Segments
                ) -> tuple[jax.Array, jax.Array]:
  """`pack`'s words for one threshold per leaf, and whether every value is finite.

  One reduction gives both (two outputs of the same pass), so the buffer is
  read once where a separate check read it again; when `flat` is a sum of two
  buffers, XLA fuses the sum into this pass and writes nothing its size.

  Returns:
    ``(words, finite)``: uint32[W] as `pack`; a bool scalar.
  """
  magnitude = jnp.abs(flat).reshape(-1, WORD)
  bounds = per_word(thresholds, segs)
  bits = jnp.where((magnitude >= bounds[:, None]) & (magnitude > 0), _powers(), jnp.uint32(0))
  # As in `finite`: NaN where a value is not finite, 0 elsewhere.
  spread = (flat - flat).astype(jnp.float32).reshape(-1, WORD)
  words, nans = lax.reduce((bits, spread), (jnp.uint32(0), jnp.float32(0)),
                           lambda a, b: (a[0] + b[0], a[1] + b[1]), (1,))
  return words, ~jnp.isnan(jnp.sum(nans))


def _pack_bits(mask: jax.Array) -> jax.Array:
  """Bits along the last axis (32 of them) packed into one uint32."""
  # Distinct powers of two: the sum is the bitwise OR of the word's bits.
  return jnp.sum(jnp.where(mask, _powers(), jnp.uint32(0)), axis=-1, dtype=jnp.uint32)


def _powers() -> jax.Array:
  """uint32[32]: bit i of a word is value i of it."""
  return jnp.uint32(1) << jnp.arange(WORD, dtype=jnp.uint32)


def passing_counts(words: jax.Array, segs: Segments) -> jax.Array:
  """Values passing per leaf (int32 [L], or [L, M]) from `pack`'s words."""
  return segment_sums(lax.population_count(words).astype(jnp.int32), segs, segs.length)


def kth_largest(flat: jax.Array, segs: Segments, ks: Sequence[int], bits: int = 31
                ) -> jax.Array:
  """The ks[l]-th largest ``|x|`` of every leaf of a laid-out buffer (float32 [L]).

  A radix select on the float's bits: for non-negative floats the order of
  the bit patterns is the order of the values, so the k_l-th largest value is
  found digit by digit, high bits first. Each digit costs one pass over the
  buffer: a histogram of the digit per leaf (one scatter-add into [L, 2^d]
  bins, values whose higher digits differ from the leaf's prefix dropped),
  then, per leaf, the largest digit at or above which at least the remaining
  rank lies. Three digits cover 31 bits: exact, no sort, no conditional, and a
  fixed number of kernels however many leaves the buffer holds. Padding zeros
  only matter when a leaf has fewer than k_l nonzero values, and then its
  k_l-th largest value is 0 anyway.

  Args:
    flat: a buffer laid out by `segs`.
    segs: its layout.
    ks: per leaf, 1 <= k_l (k_l > the leaf's padded size gives 0).
    bits: the high bits found (<= 31); with fewer the low bits stay 0 and the
      result is a lower bound within ``2^(bits - 22)`` of the value, relatively.

  Returns:
    float32 [L].
  """
  num_leaves = len(segs.sizes)
  keys = lax.bitcast_convert_type(jnp.abs(flat), jnp.uint32).reshape(-1, WORD)
  leaf = _leaf_table(segs.words)[:, None] if num_leaves > 1 else 0
  remaining = _int32(ks)
  max_size = WORD * max(segs.words)  # a bound on every bin's count
  prefix = jnp.zeros((num_leaves,), jnp.uint32)
  done = 31  # bits above `done` are found (bit 31, the sign, is 0)
  for digit_bits in _digits(bits):
    shift = done - digit_bits
    bins = 1 << digit_bits
    digit = ((keys >> shift) & jnp.uint32(bins - 1)).astype(jnp.int32)
    slot = leaf * bins + digit
    if done < 31:
      same = (keys >> done) == per_word(prefix >> done, segs)[:, None]
      slot = jnp.where(same, slot, num_leaves * bins)  # dropped
    histogram = jnp.zeros((num_leaves * bins,), jnp.int32).at[slot.reshape(-1)].add(
        1, mode="drop").reshape(num_leaves, bins)
    at_or_above = running_sums(histogram[:, ::-1], max_size)[:, ::-1]
    # Counts fall with the digit: those reaching the rank are a prefix of it.
    # (Summed in float32, exact below 2^24: XLA:CPU fuses such a sum into one
    # kernel, an int32 one into a tree of three.)
    reached = jnp.sum(at_or_above >= remaining[:, None], axis=1, dtype=jnp.float32)
    chosen = jnp.maximum(reached.astype(jnp.int32) - 1, 0)
    # Values above the chosen digit: the running sum one digit up (0 past the top).
    above = jnp.take_along_axis(jnp.pad(at_or_above, ((0, 0), (0, 1))),
                                chosen[:, None] + 1, axis=1)[:, 0]
    remaining = remaining - above
    prefix = prefix | (chosen.astype(jnp.uint32) << shift)
    done = shift
  return lax.bitcast_convert_type(prefix, jnp.float32)


# At most this many bits a digit: 2^11 bins per leaf keep the histograms
# small (ResNet-50's 161 leaves: 330K bins) and 31 bits in three passes.
_DIGIT_BITS = 11


def _digits(bits: int) -> list[int]:
  """`bits` high bits cut into as few digits of at most `_DIGIT_BITS` as can be, high first."""
  if not 1 <= bits <= 31:
    raise ValueError(f"bits must be in [1, 31], got {bits}")
  passes = -(-bits // _DIGIT_BITS)
  return [bits // passes + (i < bits % passes) for i in range(passes)]


def running_sums(values: jax.Array, bound: int) -> jax.Array:
  """Inclusive running sums of non-negative int32 `values` along their last axis, exact.

  While every partial sum stays below 2^24 (``bound``, a static bound on each
  row's total, says so), blocks of `_SCAN_BLOCK` values are summed in float32
  by a product with a triangular matrix of ones, and the blocks' totals
  carried by the same running sum one level up: exact whatever order the
  products sum in. Past that bound float32 would round, and XLA's own int32
  running sum is taken.

  Args:
    values: int32 [..., n], >= 0.
    bound: a static upper bound on ``values.sum(-1)``.

  Returns:
    int32, shaped as `values`.
  """
  if bound >= _FLOAT_EXACT:
    return jnp.cumsum(values, axis=-1, dtype=jnp.int32)
  return _block_sums(values.astype(jnp.float32)).astype(jnp.int32)


def _block_sums(values: jax.Array) -> jax.Array:
  *rows, n = values.shape
  width = min(n, _SCAN_BLOCK)
  padded = jnp.pad(values, [(0, 0)] * len(rows) + [(0, -n % width)])
  blocks = padded.reshape(*rows, -1, width)
  # float32 inputs and sums: no product may round its inputs (a GPU's TF32 would).
  within = jnp.dot(blocks, _triangle(width), precision=lax.DotAlgorithmPreset.F32_F32_F32)
  if within.shape[-2] > 1:
    totals = within[..., -1]
    within = within + (_block_sums(totals) - totals)[..., None]
  return within.reshape(*rows, -1)[..., :n]


@functools.lru_cache(maxsize=8)
def _triangle(width: int) -> jax.Array:
  """Upper-triangular ones [width, width] (``x @ T`` is x's running sum), float32."""
  with jax.ensure_compile_time_eval():
    return jnp.asarray(np.triu(np.ones((width, width), np.float32)))


def compact(words: jax.Array, segs: Segments, capacities: Sequence[int]
            ) -> tuple[jax.Array, jax.Array]:
  """Buffer positions of the passing values, capacities[l] slots per leaf, leaf after leaf.

  A scatter of every position into the buffer is the obvious way and costs
  as much as a sort on CPU. Instead a running sum over the words' popcounts
  gives each word its slots within its leaf, a count of the words ending at
  each slot and a running sum over the slots name the word holding each
  slot's value, and a 5-step bit search finds the bit: a scatter of n/32
  words and O(capacity) work. Leaf l's slots are ``[sum(capacities[:l]), + capacities[l])``,
  holding its first ``min(passed_l, capacity_l)`` passing values in index order.

  Args:
    words: uint32[W] from `pack`.
    segs: the layout.
    capacities: static slots per leaf (>= 1 each).

  Returns:
    ``(positions, passed)``: int32[sum(capacities)] positions in the buffer,
    the unused slots holding the sentinel ``segs.length``; int32[L] values
    that passed per leaf (possibly more than the capacity).
  """
  num_words = segs.num_words
  capacities = np.asarray(capacities, np.int64)
  total = int(capacities.sum())
  slot_starts = np.concatenate([[0], np.cumsum(capacities)[:-1]]).astype(np.int32)
  counts = lax.population_count(words).astype(jnp.int32)
  inclusive = running_sums(counts, segs.length)
  word_starts = inclusive - counts
  # Passing values up to each leaf's end, and before its start: its count is
  # their difference, read off the prefix sum the slots need anyway.
  leaf_base = word_starts[segs.word_ends - np.asarray(segs.words)]
  passed = inclusive[segs.word_ends - 1] - leaf_base
  # The slot after each word's last value (its leaf's end if it overflows):
  # the word holding slot s's value is the number of words ending at or
  # before s, leaf after leaf, so a count of word ends per slot and a running
  # sum over the slots name it.
  ends = jnp.minimum(inclusive - per_word(leaf_base, segs),
                     per_word(jnp.asarray(capacities, jnp.int32), segs))
  ends = per_word(jnp.asarray(slot_starts), segs) + ends
  word_ends = jnp.zeros((total,), jnp.int32).at[ends].add(1, mode="drop")
  word_index = jnp.minimum(running_sums(word_ends, num_words), num_words - 1)
  local = jnp.arange(total, dtype=jnp.int32) - _repeat(jnp.asarray(slot_starts), capacities)
  bit = selection.bit_of_rank(words[word_index],
                     local + _repeat(leaf_base, capacities) - word_starts[word_index])
  positions = jnp.where(local < _repeat(passed, capacities), word_index * WORD + bit, segs.length)
  return positions, passed


def compact_top(above: jax.Array, ties: jax.Array, segs: Segments, capacities: Sequence[int]
                ) -> tuple[jax.Array, jax.Array]:
  """`compact` of an exact top-k: every value above the k-th largest, then ties in index order.

  A compaction of ``|x| >= t`` alone keeps its first `capacity` values in
  index order, which with ties at t can drop larger values further on. Here
  the values above t (fewer than k of them) take the first slots of each
  leaf and its ties at t fill the rest.

  Args:
    above: uint32[W] packed ``|x| > t_l`` (`pack` at the next float above t).
    ties: uint32[W] packed ``|x| == t_l`` (nonzero).
    segs: the layout.
    capacities: slots per leaf (k_l each).

  Returns:
    ``(positions, passed)`` as `compact`; passed counts both masks.
  """
  first, taken = compact(above, segs, capacities)
  second, tied = compact(ties, segs, capacities)
  capacities = np.asarray(capacities, np.int64)
  starts = np.concatenate([[0], np.cumsum(capacities)[:-1]]).astype(np.int32)
  slot_start = _repeat(jnp.asarray(starts), capacities)
  local = jnp.arange(int(capacities.sum()), dtype=jnp.int32) - slot_start
  taken_here = _repeat(jnp.minimum(taken, jnp.asarray(capacities, jnp.int32)), capacities)
  from_second = jnp.maximum(slot_start + local - taken_here, 0)
  return jnp.where(local < taken_here, first, second[from_second]), taken + tied


def top(flat: jax.Array, segs: Segments, ks: Sequence[int], capacities: Sequence[int],
        whole: Optional[Sequence[bool]] = None) -> tuple[jax.Array, jax.Array]:
  """Exact top-k of every segment into its slots: the k-th largest found, then `compact_top`.

  Args:
    flat: float32 buffer laid out as `segs`.
    segs: the layout.
    ks: k of each segment.
    capacities: slots of each segment (k each, or the segment whole).
    whole: per segment, whether it is sent whole (threshold 0); None: none.

  Returns:
    ``(positions, passed)`` as `compact`.
  """
  found = exact_thresholds(flat, segs, ks, [False] * len(ks) if whole is None else whole)
  return top_at(flat, found, segs, capacities)


def top_at(flat: jax.Array, found: jax.Array, segs: Segments, capacities: Sequence[int]
           ) -> tuple[jax.Array, jax.Array]:
  """`top` once its exact thresholds are known (float32 [L], `exact_thresholds`)."""
  at_or_above = pack(flat, found, segs)
  above = pack(flat, jnp.nextafter(found, jnp.inf), segs)
  return compact_top(above, at_or_above & ~above, segs, capacities)


def local_indices(positions: jax.Array, segs: Segments, capacities: Sequence[int]
                  ) -> list[jax.Array]:
  """`compact`'s positions as each leaf's own indices (sentinel: the leaf's size)."""
  out = []
  for offset, size, part in zip(segs.offsets, segs.sizes, _split(positions, capacities)):
    out.append(jnp.where(part < segs.length, part - offset, size))
  return out


def _split(buffer: jax.Array, lengths: Sequence[int]) -> list[jax.Array]:
  bounds = np.cumsum(lengths)[:-1]
  return jnp.split(buffer, bounds) if len(lengths) > 1 else [buffer]


def _strided(flat: jax.Array, segs: Segments, leaf: int, stride: int) -> jax.Array:
  """Every stride-th value of one leaf of the buffer, from its first (no padding)."""
  start = segs.offsets[leaf]
  return lax.slice(flat, (start,), (start + segs.sizes[leaf],), (stride,))


def leaf_samples(flat: jax.Array, segs: Segments, leaves: Sequence[int],
                 strides: Sequence[int]) -> tuple[jax.Array, Segments]:
  """Every stride-th value of some leaves, laid out as a buffer of their own.

  One gather over the buffer, whatever the number of leaves: each word of the
  sample knows its leaf from a table of one entry per word, as `pack` does.

  Args:
    flat: a buffer laid out by `segs`.
    segs: its layout.
    leaves: the leaves sampled.
    strides: per leaf sampled, >= 1 (1: the whole leaf).

  Returns:
    ``(samples, sample_segs)``: the samples laid out (zero padded per leaf, as
    `lay_out` does) and their layout.
  """
  counts = [-(-segs.sizes[i] // stride) for i, stride in zip(leaves, strides)]
  sample_segs = Segments(tuple(counts))
  if len(leaves) == 1:  # a strided slice, which fuses into what reads it
    taken = _strided(flat, segs, leaves[0], strides[0])
    return jnp.pad(taken, (0, sample_segs.length - counts[0])), sample_segs
  starts = np.asarray([segs.offsets[i] for i in leaves], np.int64)
  first_word = sample_segs.word_ends - np.asarray(sample_segs.words)
  # Per word of the sample: where its leaf starts in `flat`, its stride, and
  # the rank in the sample of the word's first value.
  base = per_word(jnp.asarray(starts, jnp.int32), sample_segs)
  step = per_word(jnp.asarray(strides, jnp.int32), sample_segs)
  rank = (jnp.arange(sample_segs.num_words, dtype=jnp.int32)
          - per_word(jnp.asarray(first_word, jnp.int32), sample_segs))[:, None] * WORD
  rank = rank + jnp.arange(WORD, dtype=jnp.int32)[None, :]
  inside = rank < per_word(jnp.asarray(counts, jnp.int32), sample_segs)[:, None]
  source = jnp.where(inside, base[:, None] + rank * step[:, None], segs.length)
  return flat.at[source.reshape(-1)].get(mode="fill", fill_value=0.0), sample_segs


def count_at(flat: jax.Array, segs: Segments, thresholds: jax.Array, strides: Sequence[int],
             leaves: Sequence[int]) -> jax.Array:
  """Values ``|x| >= t`` (and nonzero) per leaf and threshold, from strided samples.

  Args:
    flat: a buffer laid out by `segs`.
    segs: its layout.
    thresholds: float32 [N, M], M thresholds for each of the N leaves counted.
    strides: per leaf counted, the count takes every stride-th value and
      scales by the stride (an estimate where the stride is > 1).
    leaves: the N leaves counted.

  Returns:
    int32 [N, M].
  """
  return count_samples(*leaf_samples(flat, segs, leaves, strides), thresholds, strides)


def count_samples(samples: jax.Array, sample_segs: Segments, thresholds: jax.Array,
                  strides: Sequence[int]) -> jax.Array:
  """`count_at` of samples already taken (`leaf_samples`): int32 [N, M]."""
  # Packed even for one leaf: summing the M comparisons of every value directly
  # made XLA:CPU write them out, M floats a value, for its reduction to read.
  counts = passing_counts(pack(samples, thresholds, sample_segs), sample_segs)
  return counts * _int32(strides)[:, None]


def exact_thresholds(flat: jax.Array, segs: Segments, ks: Sequence[int],
                     whole: Sequence[bool]) -> jax.Array:
  """Every leaf's exact k_l-th largest ``|x|`` (float32 [L]; 0 for leaves sent whole).

  `kth_largest` of the whole buffer: three passes and no conditional, so an
  exact step is the reuse step's program plus a fixed handful of kernels.
  """
  return jnp.where(jnp.asarray(whole), 0.0, kth_largest(flat, segs, ks))


def exact_threshold(x: jax.Array, k: int) -> jax.Array:
  """The exact k-th largest ``|x|`` of one array (float32 scalar): `exact_thresholds` of one leaf.

  This is the DLGS threshold H_l (Ju et al. 2024, Algorithm 1): with
  ``|x| >= H`` exactly k values pass when there are no ties.

  Args:
    x: any-shaped array.
    k: 1 <= k <= x.size.
  """
  segs = segments_of([int(np.prod(x.shape, dtype=np.int64))])
  return kth_largest(lay_out([x], segs), segs, [k])[0]


def _int32(numbers: Sequence[int]) -> jax.Array:
  return jnp.asarray(np.asarray(numbers, np.int64).clip(max=np.iinfo(np.int32).max), jnp.int32)
