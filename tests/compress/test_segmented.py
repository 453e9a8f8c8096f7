"""Selection over a buffer of leaves at once, against leaf-by-leaf NumPy references."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dlgs_jax
from dlgs_jax.compress import engine, rules, segmented, selection
from dlgs_jax.profiling import programs
from tests.helpers import random_grads, run_steps

# Sizes off the 32-value word (1, 33, 100), and larger ones.
SIZES = (1, 33, 100, 4096, 70000)


def make_leaves(rng, sizes=SIZES, zeros=0.0):
  leaves = []
  for size in sizes:
    x = rng.standard_normal(size).astype(np.float32)
    x[rng.random(size) < zeros] = 0.0
    leaves.append(x)
  return leaves


def laid(leaves, sizes=SIZES):
  segs = segmented.segments_of(sizes)
  return segmented.lay_out([jnp.asarray(x) for x in leaves], segs), segs


def kth_largest_np(x, k):
  return np.sort(np.abs(x))[::-1][k - 1]


@pytest.mark.parametrize("density,zeros", [(0.01, 0.0), (0.1, 0.0), (0.3, 0.9)])
def test_exact_thresholds_are_the_kth_largest_of_every_leaf(density, zeros):
  leaves = make_leaves(np.random.default_rng(0), zeros=zeros)
  flat, segs = laid(leaves)
  ks = [selection.num_to_keep(density, size) for size in SIZES]
  whole = [False, False, True, False, False]
  got = np.asarray(jax.jit(lambda v: segmented.exact_thresholds(v, segs, ks, whole))(flat))
  expected = [0.0 if w else kth_largest_np(x, k) for x, k, w in zip(leaves, ks, whole)]
  np.testing.assert_array_equal(got, np.asarray(expected, np.float32))


def test_a_buffer_lays_leaves_out_on_words_and_cuts_them_back():
  leaves = make_leaves(np.random.default_rng(1))
  flat, segs = laid(leaves)
  assert flat.shape == (segs.length,) and segs.length % segmented.WORD == 0
  for x, offset, size, words in zip(leaves, segs.offsets, segs.sizes, segs.words):
    np.testing.assert_array_equal(np.asarray(flat)[offset:offset + size], x)
    np.testing.assert_array_equal(np.asarray(flat)[offset + size:offset + 32 * words], 0.0)
  back = segmented.cut(flat, segs, [(x.size,) for x in leaves])
  for x, y in zip(leaves, back):
    np.testing.assert_array_equal(np.asarray(y), x)


def test_pack_finite_packs_as_pack_and_flags_any_nan_or_infinity():
  rng = np.random.default_rng(11)
  leaves = make_leaves(rng, zeros=0.3)
  flat, segs = laid(leaves)
  thresholds = jnp.asarray(rng.uniform(0.2, 1.5, len(SIZES)).astype(np.float32))
  run = jax.jit(lambda v: segmented.pack_finite(v, thresholds, segs))
  words, finite = run(flat)
  np.testing.assert_array_equal(np.asarray(words), np.asarray(segmented.pack(flat, thresholds,
                                                                             segs)))
  assert bool(finite)
  for bad in (np.nan, np.inf, -np.inf):
    for position in (0, segs.offsets[3] + 7, segs.length - 1):  # padding included
      assert not bool(run(flat.at[position].set(bad))[1]), (bad, position)


@pytest.mark.slow
def test_compaction_matches_the_leaf_by_leaf_selection():
  rng = np.random.default_rng(4)
  leaves = make_leaves(rng, zeros=0.3)
  flat, segs = laid(leaves)
  thresholds = np.array([0.0, 1.0, 0.5, 2.0, 1.5], np.float32)
  # Capacities below, at and above the number passing.
  capacities = [1, 3, 100, 500, 12000]

  @jax.jit
  def batched(v):
    words = segmented.pack(v, jnp.asarray(thresholds), segs)
    positions, passed = segmented.compact(words, segs, capacities)
    return (segmented.local_indices(positions, segs, capacities), passed,
            v.at[positions].get(mode="fill", fill_value=0.0))

  indices, passed, taken = batched(flat)
  offset = 0
  for x, t, c, got, n in zip(leaves, thresholds, capacities, indices, passed):
    want, want_passed = reference_threshold(x, t, c)
    np.testing.assert_array_equal(got, want)
    assert int(n) == int(want_passed) == int(np.sum((np.abs(x) >= t) & (x != 0)))
    chosen = np.asarray(got)[np.asarray(got) < x.size]
    np.testing.assert_array_equal(np.asarray(taken)[offset:offset + chosen.size], x[chosen])
    offset += c


@pytest.mark.parametrize("size", [31, 32, 33, 1000, 4099])
def test_one_leafs_compaction_at_word_edges_matches_numpy(size):
  rng = np.random.default_rng(size)
  x = rng.standard_normal(size).astype(np.float32)
  x[:3] = 0.0  # zeros never pass, even with threshold 0
  flat, segs = laid([x], [size])
  for threshold, capacity in ((0.0, size), (0.3, size), (1.0, max(1, size // 3)), (10.0, 5)):
    positions, passed = jax.jit(lambda v, t, c=capacity: segmented.compact(
        segmented.pack(v, t, segs), segs, [c]))(flat, jnp.float32([threshold]))
    want, want_passed = reference_threshold(x, threshold, capacity)
    np.testing.assert_array_equal(segmented.local_indices(positions, segs, [capacity])[0], want)
    assert int(passed[0]) == want_passed


def test_samples_and_counts_match_numpy_for_all_leaves_or_some():
  rng = np.random.default_rng(5)
  leaves = make_leaves(rng, zeros=0.2)
  flat, segs = laid(leaves)
  trials = rng.uniform(0.1, 2.0, (len(SIZES), 3)).astype(np.float32)
  strides = [1, 1, 2, 1, 7]
  counts = np.asarray(jax.jit(lambda v: segmented.count_at(
      v, segs, jnp.asarray(trials), strides, range(len(SIZES))))(flat))
  for x, t, s, got in zip(leaves, trials, strides, counts):
    sample = np.abs(x[::s])
    want = [s * int(np.sum((sample >= v) & (sample > 0))) for v in t]
    np.testing.assert_array_equal(got, want)
  some = [4, 1]
  subset = jax.jit(lambda v: segmented.count_at(v, segs, jnp.asarray(trials[some]),
                                                [strides[i] for i in some], some))(flat)
  np.testing.assert_array_equal(subset, counts[some])
  samples, sample_segs = segmented.leaf_samples(flat, segs, some, [7, 1])
  for part, i, s in zip(segmented.cut(samples, sample_segs, [(n,) for n in sample_segs.sizes]),
                        some, (7, 1)):
    np.testing.assert_array_equal(np.asarray(part), leaves[i][::s])


def test_one_leafs_samples_and_counts_match_those_of_several():
  """A single leaf is sampled by a strided slice and counted unpacked: same numbers."""
  rng = np.random.default_rng(6)
  leaves = make_leaves(rng, zeros=0.2)
  flat, segs = laid(leaves)
  trials = rng.uniform(0.1, 2.0, (1, 5)).astype(np.float32)
  for leaf, stride in ((4, 7), (2, 3), (0, 1)):
    alone = jax.jit(lambda v, i=leaf, s=stride: segmented.count_at(
        v, segs, jnp.asarray(trials), [s], [i]))(flat)
    sample = np.abs(leaves[leaf][::stride])
    want = [stride * int(np.sum((sample >= t) & (sample > 0))) for t in trials[0]]
    np.testing.assert_array_equal(np.asarray(alone)[0], want)
    samples, sample_segs = segmented.leaf_samples(flat, segs, [leaf], [stride])
    assert samples.shape == (sample_segs.length,)
    np.testing.assert_array_equal(np.asarray(samples)[:sample_segs.sizes[0]],
                                  leaves[leaf][::stride])
    assert not np.any(np.asarray(samples)[sample_segs.sizes[0]:])


@pytest.mark.parametrize("bound", [2**20, 2**31 - 1], ids=["float32", "int32"])
def test_running_sums_match_numpy_along_the_last_axis(bound):
  rng = np.random.default_rng(7)
  for shape in ((1,), (127,), (128,), (129,), (40000,), (3, 2048), (2, 5, 300)):
    values = rng.integers(0, 33, shape).astype(np.int32)
    got = jax.jit(lambda v: segmented.running_sums(v, bound))(jnp.asarray(values))
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), np.cumsum(values, axis=-1))


def test_running_sums_stay_exact_past_float32s_integers():
  """Totals past 2^24 are summed in int32: float32 would round them."""
  values = np.full(70000, 255, np.int32)  # total ~1.8e7 > 2^24
  got = segmented.running_sums(jnp.asarray(values), int(values.sum()))
  np.testing.assert_array_equal(np.asarray(got), np.cumsum(values))


def test_radix_select_is_exact_on_ties_extremes_and_short_leaves():
  # Every digit's histogram must carry the rank into the next: ties across a
  # digit boundary, subnormals (exponent 0), infinities (exponent 255),
  # negative zeros, and leaves with fewer values than k (their answer: 0).
  rng = np.random.default_rng(11)
  ties = np.repeat(np.float32([3.0, -3.0, 2.5, 1e-3]), 50)
  extremes = np.concatenate([np.float32([np.inf, -np.inf, 1e-42, -1e-44, -0.0]),
                             rng.standard_normal(90).astype(np.float32) * 1e30])
  short = rng.standard_normal(7).astype(np.float32)
  wide = (rng.standard_normal(5000) * np.exp(6 * rng.standard_normal(5000))).astype(np.float32)
  leaves = [ties, extremes, short, wide]
  flat, segs = laid(leaves, [x.size for x in leaves])
  for ks in ([1, 1, 1, 1], [120, 3, 7, 2500], [200, 95, 40, 4999], [151, 6, 33, 17]):
    got = np.asarray(jax.jit(lambda v, ks=ks: segmented.kth_largest(v, segs, ks))(flat))
    want = [kth_largest_np(x, k) if k <= x.size else 0.0 for x, k in zip(leaves, ks)]
    np.testing.assert_array_equal(got, np.asarray(want, np.float32), err_msg=str(ks))


def test_a_select_of_fewer_bits_gives_a_close_lower_bound():
  x = np.random.default_rng(6).standard_normal(5000).astype(np.float32)
  flat, segs = laid([x], [5000])
  exact = kth_largest_np(x, 50)
  bound = float(jax.jit(lambda v: segmented.kth_largest(v, segs, [50], bits=17))(flat)[0])
  assert exact * (1 - 2.0**-6) <= bound <= exact


@pytest.mark.slow
def test_an_updates_kernels_and_conditionals_barely_grow_with_its_leaves():
  """The passes are per buffer: 3 leaves or 30 in a group, one conditional for
  the whole update and no sort; what grows is cutting the mean into leaves."""
  counts = []
  for leaves in (3, 30):
    params = {f"w{i:02d}": jnp.zeros((64, 40 + i)) for i in range(leaves)}
    tx = dlgs_jax.dlgs(0.01, groups=[sorted(params)])
    counts.append(programs.program_counts(tx.update, params, tx.init(params)))
  for c in counts:
    assert c["conditionals"] == 1 and c["sorts"] == 0 and c["top_k"] == 0, c
  assert counts[1]["kernels"] - counts[0]["kernels"] <= 2 * 27, counts


def test_nonfinite_values_do_not_stall_the_batched_selection():
  params = {"a": jnp.zeros((300, 130)), "b": jnp.zeros((50,))}
  tx = dlgs_jax.dlgs(0.05, axis_name="data", groups=[["a", "b"]])
  rng = np.random.default_rng(8)
  good = random_grads(params, 2, rng)
  bad = jax.tree_util.tree_map(lambda x: x.copy(), good)
  bad["a"][1, 3, 4] = np.nan
  bad["b"][0, 2] = np.inf
  updates, state, states = run_steps(tx, params, [good, bad, good], 2)
  assert int(np.asarray(state.stats.skipped)[0]) == 1
  assert all(np.all(np.asarray(u) == 0) for u in jax.tree_util.tree_leaves(updates[1]))
  for a, b in zip(states[0].residuals, states[1].residuals):
    np.testing.assert_array_equal(a, b)


def test_segments_refuse_an_empty_leaf():
  with pytest.raises(ValueError, match="no empty leaf, got sizes \\(3, 0\\)"):
    segmented.segments_of([3, 0])


def test_a_groups_program_holds_its_table_of_leaf_numbers_once():
  """Every pass that spreads per-leaf numbers over words indexes one constant
  table; a table per pass put 37 copies of ResNet-50's (3 MB each) into one
  update."""
  params = {f"w{i:02d}": jnp.zeros((64, 40 + i)) for i in range(30)}
  layout = engine.make_layout(params, None, None, single_group=True)
  select = engine.Selection("threshold", 0.01, rule=rules.AdaptedReuse())
  words = layout.buffer(0).num_words
  text = jax.jit(lambda v, t: engine.pick(select, layout, 0, engine.Summed(v, None), t)).lower(
      jnp.zeros((layout.buffer(0).length,)), jnp.ones((30,))).as_text()
  tables = [line for line in text.splitlines()
            if "constant" in line and f"tensor<{words}xi32>" in line.split("=")[-1]]
  assert len(tables) == 1, tables


def test_exact_threshold_of_one_leaf_matches_numpy():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((17, 9)).astype(np.float32)
  for k in (1, 5, 100, x.size):
    got = jax.jit(segmented.exact_threshold, static_argnums=1)(x, k)
    assert float(got) == np.sort(np.abs(x).ravel())[::-1][k - 1]


@pytest.mark.parametrize("size,k", [(600_000, 6000), (600_000, 1), (700_001, 7000),
                                    (100_003, 10_001)])
def test_exact_threshold_is_exact_on_large_inputs(size, k):
  rng = np.random.default_rng(size + k)
  x = rng.standard_normal(size).astype(np.float32)
  want = np.sort(np.abs(x))[::-1][k - 1]
  assert float(jax.jit(segmented.exact_threshold, static_argnums=1)(x, k)) == want


def test_exact_threshold_with_fewer_nonzeros_than_k_or_heavy_ties():
  # Fewer nonzeros than k: the k-th largest is 0.
  x = np.zeros(800_000, np.float32)
  x[::8000] = np.arange(1, 101)
  assert float(jax.jit(segmented.exact_threshold, static_argnums=1)(x, 150)) == 0.0
  # Heavy ties: many more than k values equal the k-th largest.
  y = np.ones(600_000, np.float32)
  y[:10] = 5.0
  assert float(jax.jit(segmented.exact_threshold, static_argnums=1)(y, 5000)) == 1.0


def test_a_threshold_at_the_exact_kth_selects_exactly_k():
  rng = np.random.default_rng(3)
  x = rng.standard_normal(1000).astype(np.float32)
  k = 37
  flat, segs = laid([x], [1000])
  h = segmented.exact_threshold(jnp.asarray(x), k)
  positions, passed = segmented.compact(segmented.pack(flat, h[None], segs), segs, [k])
  assert int(passed[0]) == k
  assert set(np.asarray(positions)) == set(np.argsort(-np.abs(x))[:k])


def reference_threshold(x, threshold, capacity):
  flat = x.ravel()
  passing = np.flatnonzero((np.abs(flat) >= threshold) & (flat != 0))
  chosen = passing[:capacity]
  out = np.full(capacity, flat.size, np.int32)
  out[:len(chosen)] = chosen
  return out, len(passing)


def test_a_top_k_keeps_every_value_above_its_threshold_whatever_the_ties():
  # Ties at the k-th largest come first in index order, a larger value last: a
  # compaction of |x| >= t alone would fill the buffer with ties and drop it.
  rng = np.random.default_rng(12)
  tied = np.concatenate([np.full(40, 0.5, np.float32), rng.uniform(0.0, 0.4, 50),
                         np.float32([3.0, -2.0])]).astype(np.float32)
  other = np.round(rng.standard_normal(300), 1).astype(np.float32)  # many ties
  params = {"a": jnp.zeros(tied.shape), "b": jnp.zeros(other.shape)}
  arrays = [tied, other]
  for kind, single in (("layer_topk", False), ("group_topk", True)):
    layout = engine.make_layout(params, None, None, single_group=single)
    select = engine.Selection(kind, 0.1)
    for group, members in enumerate(layout.groups):
      flat = layout.lay_out(group, [jnp.asarray(x) for x in arrays])
      picked = jax.jit(lambda v, g=group: engine.pick(select, layout, g,
                                                      engine.Summed(v, None)))(flat)
      segs = select.segments(layout, group)
      capacities = select.capacities(layout, group)
      buffer = np.asarray(flat)
      starts = np.concatenate([[0], np.cumsum(capacities)[:-1]])
      for i, (offset, size) in enumerate(zip(segs.offsets, segs.sizes)):
        part = buffer[offset:offset + size]
        k = select.ks(layout, group)[i]
        slots = np.asarray(picked.positions)[starts[i]:starts[i] + capacities[i]]
        chosen = slots[slots < segs.length] - offset
        kth = kth_largest_np(part, k)
        assert chosen.size == k, (kind, chosen.size, k)
        assert set(np.flatnonzero(np.abs(part) > kth)) <= set(chosen), kind
        assert np.all(np.abs(part[chosen]) >= kth)
