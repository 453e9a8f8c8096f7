"""Threshold selection over every leaf at once.

DLGS picks, in each leaf l, the values with ``|g| >= H_l`` (Ju et al. 2024,
Algorithm 1). Done leaf by leaf, every step launches a few kernels per leaf
and, where thresholds are recomputed only sometimes, a conditional per leaf --
on a GPU each conditional waits for its predicate on the host and the small
kernels are launch-bound. Here the leaves are laid end to end in one float32
buffer (`Segments`), each padded with zeros to a multiple of 32 so that every
32-value word of a packed mask belongs to one leaf, and every pass handles all
leaves together:

* `pack`: one comparison against per-leaf thresholds broadcast by word, the
  mask packed 32 to a word (zeros never pass);
* `segment_sums`: per-leaf totals of per-word numbers from one prefix sum;
* `kth_largest`: exact k_l-th largest ``|g|`` of every leaf by a radix
  select on the float's bits (three histogram passes, no sort, no
  conditional, no data-dependent loop);
* `compact`: indices of the passing values into per-leaf fixed-capacity
  buffers, the first ones in index order (`threshold_indices`: one array);
* `exact_thresholds`: `kth_largest` of a laid-out buffer; leaf by leaf
  (large groups on CPU), of candidates above a strided sample's lower bound,
  with one conditional for the whole leaves where a bound misses.

The number of kernels and conditionals of these passes does not depend on the
number of leaves.

Every exact threshold of the package comes from `exact_thresholds` (DLGS on
any backend and group size; DGC's fallback through `exact_threshold`).
Whether a group is laid out is decided by the caller
(`lay_out_by_default`) through `values_of`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dlgs_jax.compress import selection

WORD = 32

# A lower bound needs no more precision than the sample gives: the 17 highest
# bits of a positive float32 fix it to 2^-9 of its value.
_BOUND_BITS = 17


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


# On CPU a laid-out group costs a copy of its values every step, which XLA:CPU
# allocates afresh. Up to this many values the copy costs less than the few
# kernels per leaf it saves, and the update compiles in a third to a half of the
# time; past it (VGG16's large leaves) the leaves are cheaper as they are
# (`experiments/layout_views.py`).
CPU_LAY_OUT_MAX = 1 << 21


def lay_out_by_default(length: int) -> bool:
  """Whether selection lays a group of `length` values out in one buffer (`Values`).

  On accelerators always: one pass over one buffer replaces a few kernels per
  leaf. On CPU, where a kernel costs little and a pass its bytes, groups of up
  to `CPU_LAY_OUT_MAX` values.
  """
  return jax.default_backend() != "cpu" or length <= CPU_LAY_OUT_MAX


@contextlib.contextmanager
def forced_view(laid_out: Optional[bool]):
  """Within the block, every group is laid out (True) or kept leaf by leaf (False).

  For measurements that compare the two views of the same program; None keeps
  `lay_out_by_default`'s choice. Programs traced inside the block keep their view.
  """
  global lay_out_by_default
  chosen = lay_out_by_default
  if laid_out is not None:
    lay_out_by_default = lambda *_: laid_out
  try:
    yield
  finally:
    lay_out_by_default = chosen


def lay_out(leaves: Sequence[jax.Array], segs: Segments) -> jax.Array:
  """The leaves as one float32 buffer of `segs.length` values, zero padded per leaf."""
  parts = []
  for leaf, size, words in zip(leaves, segs.sizes, segs.words):
    flat = leaf.reshape(-1).astype(jnp.float32)
    parts.append(jnp.pad(flat, (0, WORD * words - size)) if WORD * words > size else flat)
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


def segment_sums(per_word_values: jax.Array, segs: Segments) -> jax.Array:
  """Per-leaf totals [L, ...] of int32 per-word numbers [W, ...], from one prefix sum."""
  ends = jnp.cumsum(per_word_values, axis=0)[segs.word_ends - 1]
  return jnp.diff(ends, axis=0, prepend=jnp.zeros_like(ends[:1]))


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


def _pack_bits(mask: jax.Array) -> jax.Array:
  """Bits along the last axis (32 of them) packed into one uint32."""
  powers = jnp.uint32(1) << jnp.arange(WORD, dtype=jnp.uint32)
  # Distinct powers of two: the sum is the bitwise OR of the word's bits.
  return jnp.sum(jnp.where(mask, powers, jnp.uint32(0)), axis=-1, dtype=jnp.uint32)


def passing_counts(words: jax.Array, segs: Segments) -> jax.Array:
  """Values passing per leaf (int32 [L], or [L, M]) from `pack`'s words."""
  return segment_sums(lax.population_count(words).astype(jnp.int32), segs)


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
    at_or_above = jnp.cumsum(histogram[:, ::-1], axis=1)[:, ::-1]
    # Counts fall with the digit: those reaching the rank are a prefix of it.
    chosen = jnp.maximum(jnp.sum(at_or_above >= remaining[:, None], axis=1) - 1, 0)
    above = jnp.sum(jnp.where(jnp.arange(bins) > chosen[:, None], histogram, 0), axis=1)
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


def compact(words: jax.Array, segs: Segments, capacities: Sequence[int]
            ) -> tuple[jax.Array, jax.Array]:
  """Buffer positions of the passing values, capacities[l] slots per leaf, leaf after leaf.

  A scatter of every position into the buffer is the obvious way and costs
  as much as a sort on CPU. Instead a prefix sum over the words' popcounts
  gives each word its first slot within its leaf, a running max spreads word
  indices over the slots, and a 5-step bit search finds the bit: a scatter of
  n/32 words and O(capacity) work. Leaf l's slots are ``[sum(capacities[:l]), + capacities[l])``,
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
  inclusive = jnp.cumsum(counts)
  word_starts = inclusive - counts
  passed = segment_sums(counts, segs)
  leaf_base = inclusive[segs.word_ends - 1] - passed  # passing values before each leaf
  rank = word_starts - per_word(leaf_base, segs)  # rank in its leaf of the word's first value
  fits = (counts > 0) & (rank < per_word(jnp.asarray(capacities, jnp.int32), segs))
  first_slot = per_word(jnp.asarray(slot_starts), segs) + rank
  # Each nonempty word marks its first slot; a running max carries it over the
  # slots it fills (slots and word indices grow together, leaf after leaf).
  marks = jnp.zeros((total,), jnp.int32).at[jnp.where(fits, first_slot, total)].max(
      jnp.arange(num_words, dtype=jnp.int32), mode="drop")
  word_index = lax.cummax(marks)
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


def threshold_indices(x: jax.Array, threshold: jax.Array, capacity: int
                      ) -> tuple[jax.Array, jax.Array]:
  """Flat indices of one array's values with ``|x| >= threshold`` and ``x != 0``.

  `pack` and `compact` of a single leaf. At most `capacity` indices are
  returned, the first ones in flat index order; values that pass but do not
  fit are not selected (the caller keeps them in its residual). Zeros are
  never selected: sending them moves nothing.

  Args:
    x: any-shaped array.
    threshold: scalar.
    capacity: static buffer size, 1 <= capacity <= x.size.

  Returns:
    ``(indices, passed)``: int32[capacity] indices in increasing order, padded
    with the sentinel ``x.size``, and the int32 number of values that passed
    the threshold (possibly more than `capacity`).
  """
  segs = segments_of([x.size])
  words = pack(lay_out([x], segs), jnp.reshape(threshold, (1,)).astype(jnp.float32), segs)
  positions, passed = compact(words, segs, [capacity])
  return local_indices(positions, segs, [capacity])[0], passed[0]


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


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["flat", "leaves"], meta_fields=["segs"])
@dataclasses.dataclass(frozen=True)
class Values:
  """Every leaf's values for one step: one laid-out buffer, or the leaves as they are.

  Both give the same words, samples and values. The buffer makes each pass
  one kernel over all leaves (accelerators, and groups of up to
  `CPU_LAY_OUT_MAX` values on CPU); leaf by leaf avoids writing a copy
  of the group, which XLA:CPU allocates afresh every step, and which for large
  groups costs more than the passes themselves (experiments/performance_notes.md).
  """
  segs: Segments
  flat: Optional[jax.Array] = None
  leaves: Optional[tuple] = None

  def pack(self, thresholds: jax.Array) -> jax.Array:
    """`pack` of every leaf: uint32[W] for thresholds [L], [W, M] for [L, M]."""
    if self.flat is not None:
      return pack(self.flat, thresholds, self.segs)
    parts = []
    for i, (leaf, size) in enumerate(zip(self.leaves, self.segs.sizes)):
      one = Segments((size,))
      parts.append(pack(lay_out([leaf], one), thresholds[i:i + 1], one))
    return jnp.concatenate(parts) if len(parts) > 1 else parts[0]

  def leaf(self, i: int) -> jax.Array:
    """Leaf i's values, flat float32."""
    if self.flat is not None:
      offset = self.segs.offsets[i]
      return self.flat[offset:offset + self.segs.sizes[i]]
    return self.leaves[i].reshape(-1).astype(jnp.float32)

  def take(self, positions: jax.Array, capacities: Sequence[int]) -> jax.Array:
    """The values at `compact`'s positions (0 at the sentinel), float32."""
    if self.flat is not None:
      return self.flat.at[positions].get(mode="fill", fill_value=0.0)
    parts = [self.leaf(i).at[local].get(mode="fill", fill_value=0.0)
             for i, local in enumerate(local_indices(positions, self.segs, capacities))]
    return jnp.concatenate(parts) if len(parts) > 1 else parts[0]

  def count_at(self, thresholds: jax.Array, strides: Sequence[int],
               leaves: Optional[Sequence[int]] = None) -> jax.Array:
    """Values ``|x| >= t`` (and nonzero) per leaf and threshold, from a sample.

    Args:
      thresholds: float32 [N, M], M thresholds for each leaf counted.
      strides: per leaf counted, the count takes every stride-th value and
        scales by the stride (an estimate where the stride is > 1).
      leaves: the N leaves counted (default: all, in order).

    Returns:
      int32 [N, M].
    """
    leaves = range(len(self.segs.sizes)) if leaves is None else leaves
    parts = [self.leaf(i)[::stride] for i, stride in zip(leaves, strides)]
    if self.flat is None:
      counts = jnp.stack([_count_leaf(part, thresholds[i]) for i, part in enumerate(parts)])
    else:
      sample_segs = Segments(tuple(part.shape[0] for part in parts))
      counts = passing_counts(pack(lay_out(parts, sample_segs), thresholds, sample_segs),
                              sample_segs)
    return counts * _int32(strides)[:, None]

  def kth_largest(self, ks: Sequence[int]) -> jax.Array:
    """`kth_largest` of every whole leaf (laid out first in either view)."""
    flat = self.flat if self.flat is not None else lay_out(self.leaves, self.segs)
    return kth_largest(flat, self.segs, ks)


def _count_leaf(values: jax.Array, thresholds: jax.Array) -> jax.Array:
  """Values of one flat leaf passing each of thresholds [M]: int32 [M], from packed words.

  Summing the comparisons along the leaf instead made XLA:CPU write the [M, n]
  comparisons out before reducing them (ResNet-50, 7 thresholds: ~8x slower).
  """
  one = Segments((values.shape[0],))
  words = pack(lay_out([values], one), thresholds[None, :], one)
  return jnp.sum(lax.population_count(words).astype(jnp.int32), axis=0)


def values_of(leaves: Sequence[jax.Array], segs: Segments, laid_out: bool) -> Values:
  """`Values` of the leaves: laid out in one buffer, or kept leaf by leaf."""
  if laid_out:
    return Values(segs, flat=lay_out(leaves, segs))
  return Values(segs, leaves=tuple(leaves))


def exact_thresholds(values: Values, ks: Sequence[int], whole: Sequence[bool]) -> jax.Array:
  """Every leaf's exact k_l-th largest ``|x|`` (float32 [L]; 0 for leaves sent whole).

  Laid out (accelerators): `kth_largest` of the whole buffer, three passes
  and no conditional, so an exact step is the reuse step's program plus a
  fixed handful of kernels.

  Leaf by leaf (large groups on CPU, where a pass costs its bytes and a kernel little):
  per large leaf a strided sample gives a lower bound that about 1.5 k_l
  values exceed; the values above the bounds are compacted into buffers of
  about 2 k_l (small leaves: all their values) and `kth_largest` runs on
  those, a few percent of the bytes. Where a bound misses (fewer than k_l or
  more than the buffer pass, unless the bound is 0 and every nonzero value
  passed), one conditional runs `kth_largest` on the whole leaves, so the
  result is always exact.
  """
  segs = values.segs
  if values.flat is not None:
    return jnp.where(jnp.asarray(whole), 0.0, kth_largest(values.flat, segs, ks))
  large = [leaf for leaf, (size, k) in enumerate(zip(segs.sizes, ks))
           if not whole[leaf] and size > selection.SMALL_LEAF and 2 * k < size // 2]
  bounds = jnp.where(jnp.asarray(whole), jnp.inf, 0.0).astype(jnp.float32)
  if large:
    bounds = bounds.at[np.asarray(large)].set(_sample_bounds(values, ks, large))
  capacities = [WORD * -(-2 * ks[leaf] // WORD) if leaf in large
                else WORD if whole[leaf] else WORD * segs.words[leaf]
                for leaf in range(len(segs.sizes))]
  positions, passed = compact(values.pack(bounds), segs, capacities)
  found = kth_largest(values.take(positions, capacities), Segments(tuple(capacities)), ks)
  if not large:
    return jnp.where(jnp.asarray(whole), 0.0, found)
  is_large = np.zeros(len(segs.sizes), bool)
  is_large[large] = True
  # A bound of 0 lets every nonzero value pass: fewer than k_l of them make the
  # k_l-th largest 0, which is what the candidates give (an all-zero leaf would
  # otherwise run the whole-leaf select only to find 0).
  short = (passed < _int32(ks)) & (bounds > 0)
  missed = jnp.asarray(is_large) & (short | (passed > _int32(capacities)))
  found = lax.cond(jnp.any(missed),
                   lambda: jnp.where(missed, values.kth_largest(ks), found),
                   lambda: found)
  return jnp.where(jnp.asarray(whole), 0.0, found)


def exact_threshold(x: jax.Array, k: int) -> jax.Array:
  """The exact k-th largest ``|x|`` of one array (float32 scalar): `exact_thresholds` of one leaf.

  This is the DLGS threshold H_l (Ju et al. 2024, Algorithm 1): with
  ``|x| >= H`` exactly k values pass when there are no ties.

  Args:
    x: any-shaped array.
    k: 1 <= k <= x.size.
  """
  segs = segments_of([int(np.prod(x.shape, dtype=np.int64))])
  return exact_thresholds(values_of([x], segs, lay_out_by_default(segs.length)), [k],
                          [False])[0]


def _int32(numbers: Sequence[int]) -> jax.Array:
  return jnp.asarray(np.asarray(numbers, np.int64).clip(max=np.iinfo(np.int32).max), jnp.int32)


def _sample_bounds(values: Values, ks, large):
  """Lower bounds for the large leaves from strided samples (float32 [len(large)])."""
  parts, sample_sizes, ranks = [], [], []
  for leaf in large:
    size, k = values.segs.sizes[leaf], ks[leaf]
    # >= 128 n/k samples put ~190 sample values above the bound: the candidate
    # count then has a relative spread of ~7% around 1.5 k.
    stride = selection.sample_stride(size, k)
    sample = values.leaf(leaf)[::stride]
    count = sample.shape[0]
    parts.append(jnp.pad(sample, (0, -count % WORD)))
    sample_sizes.append(count)
    ranks.append(max(1, math.ceil(count * 1.5 * k / size)))
  samples = jnp.concatenate(parts) if len(parts) > 1 else parts[0]
  return kth_largest(samples, Segments(tuple(sample_sizes)), ranks, bits=_BOUND_BITS)
