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
* `kth_largest`: exact k_l-th largest ``|g|`` of every leaf by bisection on
  the float's bits (31 counting passes, no sort, no data-dependent loop);
* `compact`: indices of the passing values into per-leaf fixed-capacity
  buffers, the first ones in index order -- the same indices
  `selection.indices_from_words` gives leaf by leaf;
* `exact_thresholds`: the k_l-th largest values from a strided sample's lower
  bound, the values above it compacted into buffers of about 2 k_l, and the
  bisection on those; when a bound misses for any leaf, one conditional runs
  the bisection on the whole buffer.

The number of kernels and conditionals of these passes does not depend on the
number of leaves.

Every exact threshold of the package comes from `exact_thresholds` (DLGS on
any backend and group size; DGC's fallback through `exact_threshold`). Its
one choice is the kernel that finds the k-th largest of a leaf's candidates:
the bisection above, batched over a group, or a sort of the candidates leaf by
leaf for a few leaves kept as they are (CPU). Whether a group is laid out is
decided by the caller (`engine.lay_out_by_default`) through `values_of`.
"""

from __future__ import annotations

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

# Groups of at most this many leaves kept leaf by leaf get their exact
# thresholds leaf by leaf (`exact_thresholds`).
_FEW_LEAVES = 4
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

  Bit i of word w is value 32w+i, as `selection.pack_passing` packs one leaf.
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

  By bisection on the float's bits (`bisect`) with counts from one pass over
  the buffer per bit. Padding zeros only matter when a leaf has fewer than
  k_l nonzero values, and then its k_l-th largest value is 0 anyway.

  Args:
    flat: a buffer laid out by `segs`.
    segs: its layout.
    ks: per leaf, 1 <= k_l (k_l > the leaf's size gives 0).
    bits: as `bisect`.

  Returns:
    float32 [L].
  """
  keys = lax.bitcast_convert_type(jnp.abs(flat), jnp.uint32).reshape(-1, WORD)

  def count(trial):
    return segment_sums(jnp.sum(keys >= per_word(trial, segs)[:, None], axis=1,
                                dtype=jnp.int32), segs)

  return bisect(count, ks, bits)


def bisect(count, ks: Sequence[int], bits: int = 31) -> jax.Array:
  """Per leaf the largest float32 t with ``count(t)[l] >= ks[l]``, found bit by bit.

  For non-negative floats the order of the bit patterns is the order of the
  values, so with ``count(t)`` the number of ``|x| >= t`` the result is the
  k_l-th largest value itself: exact, from `bits` counting passes and no sort.

  Args:
    count: uint32 bit patterns [L] -> int32 counts [L] of values at or above them.
    ks: per leaf, >= 1.
    bits: with fewer than 31, the low bits stay 0 and the result is a lower
      bound within ``2^(bits - 22)`` of the value, relatively.

  Returns:
    float32 [L].
  """
  ks = _int32(ks)
  found = jnp.zeros(ks.shape, jnp.uint32)
  # A static loop, not a while loop: on a GPU every iteration of a loop whose
  # trip count XLA must read waits for the host.
  for bit in range(30, 30 - bits, -1):
    trial = found | jnp.uint32(1 << bit)
    found = jnp.where(count(trial) >= ks, trial, found)
  return lax.bitcast_convert_type(found, jnp.float32)


def compact(words: jax.Array, segs: Segments, capacities: Sequence[int]
            ) -> tuple[jax.Array, jax.Array]:
  """Buffer positions of the passing values, capacities[l] slots per leaf, leaf after leaf.

  `selection.indices_from_words` for every leaf at once: a prefix sum over
  the words' popcounts gives each word its first slot within its leaf, a
  running max spreads word indices over the slots, and a 5-step bit search
  finds the bit. Leaf l's slots are ``[sum(capacities[:l]), + capacities[l])``,
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


@dataclasses.dataclass(frozen=True)
class Values:
  """Every leaf's values for one step: one laid-out buffer, or the leaves as they are.

  Both give the same words, samples and values. The buffer makes each pass
  one kernel over all leaves (GPU); leaf by leaf avoids writing a copy of the
  whole model, which XLA:CPU allocates afresh every step, and which on ResNet-50
  cost several times the passes themselves (experiments/performance_notes.md).
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
    """`kth_largest` of every whole leaf.

    Laid out first in either view: passes leaf by leaf would put ~31 kernels
    per leaf into the conditional that holds this fallback, and XLA:CPU pays
    for every kernel of a conditional's branches on each call, taken or not;
    the copy is paid only where the fallback runs.
    """
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

  Per large leaf a strided sample gives a lower bound that about 1.5 k_l
  values exceed; the values above the bounds are compacted into buffers of
  about 2 k_l (small leaves: all their values) and `kth_largest` runs on those.
  Where a bound misses (fewer than k_l or more than the buffer pass, unless
  the bound is 0 and every nonzero value passed), one conditional runs the
  bisection on the whole leaves (`kth_largest`), so the result is always exact.

  A group of a few leaves kept leaf by leaf (CPU) takes the same steps leaf
  by leaf with a sort for the k-th largest (`_kth_by_sort`): XLA:CPU pays for
  every kernel of a conditional's branches on each call, taken or not, and
  the batched passes are ~100 kernels whatever the number of leaves, against
  ~20 per leaf there (measured on ResNet-50: experiments/performance_notes.md).
  """
  segs = values.segs
  if values.flat is None and len(segs.sizes) <= _FEW_LEAVES:
    # A leaf sent whole contributes any of its values, replaced by 0 below:
    # the result stays typed like the values (varying inside shard_map).
    found = jnp.stack([values.leaf(leaf)[0] if whole[leaf]
                       else _kth_by_sort(values.leaf(leaf), ks[leaf])
                       for leaf in range(len(segs.sizes))])
    return jnp.where(jnp.asarray(whole), 0.0, found)
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
  is_large = np.zeros(len(segs.sizes), bool)
  is_large[large] = True
  # A bound of 0 lets every nonzero value pass: fewer than k_l of them make the
  # k_l-th largest 0, which is what the candidates give (an all-zero leaf would
  # otherwise run the whole-leaf bisection only to find 0).
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
  size = int(np.prod(x.shape, dtype=np.int64))
  return exact_thresholds(values_of([x], segments_of([size]), False), [k], [False])[0]


def _kth_by_sort(flat: jax.Array, k: int) -> jax.Array:
  """`exact_thresholds`'s steps for one leaf, the k-th largest of its candidates by a sort.

  A strided sample (`selection.sample_stride`) gives a lower bound ``t`` that
  about 1.5k values exceed, one O(n) pass collects every value ``>= t`` into a
  buffer of 2k, and a top-k of that buffer gives the k-th largest. When the
  bound misses (fewer than k or more than 2k values pass) the full top-k runs
  instead, so the result is always exact. Small leaves are sorted whole.

  Args:
    flat: the leaf's values, flat.
    k: 1 <= k <= size.

  Returns:
    float32 scalar.
  """
  flat = jnp.abs(flat).astype(jnp.float32)
  size = flat.shape[0]
  if k == size:
    return jnp.min(flat)  # no sort needed when everything is kept
  full = lambda: _kth_of_sorted(flat, k)
  capacity = 2 * k
  if size <= selection.SMALL_LEAF or capacity >= size // 2:
    return full()
  sample = flat[::selection.sample_stride(size, k)]
  sample_rank = max(1, math.ceil(sample.shape[0] * 1.5 * k / size))
  # The minimum of the top values, not their last element: see `_kth_of_sorted`.
  lower = jnp.min(lax.top_k(sample, sample_rank)[0])
  candidates, passed = selection.threshold_indices(flat, lower, capacity)
  values = flat.at[candidates].get(mode="fill", fill_value=0.0)
  found = lambda: _kth_of_sorted(values, k)
  return lax.cond((passed >= k) & (passed <= capacity), found, full)


def _kth_of_sorted(values: jax.Array, k: int) -> jax.Array:
  # The minimum of the top k, not `top_k(...)[0][k - 1]`: XLA on CPU turns a
  # top-k followed by a one-element slice into a full sort, ~20x slower at 2.4M.
  return jnp.min(lax.top_k(values, k)[0])


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
