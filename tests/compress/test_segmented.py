"""Selection over a group's leaves at once, against leaf-by-leaf NumPy references."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dlgs_jax
from dlgs_jax.compress import engine, rules, segmented, selection
from dlgs_jax.profiling import programs
from tests.helpers import random_grads, run_steps

# Sizes off the 32-value word (1, 33, 100), one large enough to be sampled.
SIZES = (1, 33, 100, 4096, 70000)
VIEWS = [pytest.param(False, id="leaf_by_leaf"), pytest.param(True, id="laid_out")]
# The stride of the sample that bounds a leaf of 70,000 values at k = 700.
STRIDE = selection.coprime_stride(70000 // 16384, 70000)


def make_leaves(rng, sizes=SIZES, zeros=0.0):
  leaves = []
  for size in sizes:
    x = rng.standard_normal(size).astype(np.float32)
    x[rng.random(size) < zeros] = 0.0
    leaves.append(x)
  return leaves


def kth_largest_np(x, k):
  return np.sort(np.abs(x))[::-1][k - 1]


@pytest.mark.parametrize("laid_out", VIEWS)
@pytest.mark.parametrize("density,zeros", [(0.01, 0.0), (0.1, 0.0), (0.3, 0.9)])
def test_exact_thresholds_are_the_kth_largest_of_every_leaf(laid_out, density, zeros):
  leaves = make_leaves(np.random.default_rng(0), zeros=zeros)
  segs = segmented.segments_of(SIZES)
  ks = [selection.num_to_keep(density, size) for size in SIZES]
  whole = [False, False, True, False, False]
  fn = jax.jit(lambda ls: segmented.exact_thresholds(segmented.values_of(ls, segs, laid_out),
                                                     ks, whole))
  got = np.asarray(fn([jnp.asarray(x) for x in leaves]))
  expected = [0.0 if w else kth_largest_np(x, k) for x, k, w in zip(leaves, ks, whole)]
  np.testing.assert_array_equal(got, np.asarray(expected, np.float32))


@pytest.mark.parametrize("laid_out", VIEWS)
@pytest.mark.parametrize("smalls", [1, 5], ids=["few_leaves", "many_leaves"])
def test_a_sample_that_misses_falls_back_to_the_exact_value(laid_out, smalls):
  # The large values sit off the sample's stride, so its bound lets far more
  # than 2k values through: leaf by leaf, the whole-leaf select must take
  # over; laid out, the whole buffer's select is the only one.
  size, k = 70000, 700
  x = np.random.default_rng(1).uniform(0.1, 0.2, size).astype(np.float32)
  x[1::STRIDE] = np.random.default_rng(2).uniform(1.0, 2.0, x[1::STRIDE].shape)
  small = [np.random.default_rng(3 + i).standard_normal(40).astype(np.float32)
           for i in range(smalls)]
  segs = segmented.segments_of([size] + [40] * smalls)
  fn = jax.jit(lambda ls: segmented.exact_thresholds(
      segmented.values_of(ls, segs, laid_out), [k] + [4] * smalls, [False] * (1 + smalls)))
  got = np.asarray(fn([jnp.asarray(v) for v in [x] + small]))
  np.testing.assert_array_equal(got, [kth_largest_np(x, k)] + [kth_largest_np(v, 4)
                                                               for v in small])


@pytest.mark.slow
@pytest.mark.parametrize("laid_out", VIEWS)
@pytest.mark.parametrize("nonzeros", [0, 300])
def test_a_leaf_with_fewer_nonzeros_than_k_is_exact_without_the_fallback(
    monkeypatch, laid_out, nonzeros):
  # Its sampled bound is 0, every nonzero value passes, and its k-th largest
  # is 0: the candidates give it. The fallback, made to answer -1 here, is
  # taken only for a real miss (the last leaf's bound lets too many through);
  # a laid-out buffer has no sample and no fallback.
  monkeypatch.setattr(segmented.Values, "kth_largest",
                      lambda self, ks: jnp.full((len(ks),), -1.0, jnp.float32))
  size, k = 70000, 700
  rng = np.random.default_rng(6)
  sparse = np.zeros(size, np.float32)
  sparse[rng.choice(size, nonzeros, replace=False)] = rng.standard_normal(nonzeros)
  normal = rng.standard_normal(size).astype(np.float32)
  missing = rng.uniform(0.1, 0.2, size).astype(np.float32)
  missing[1::STRIDE] = rng.uniform(1.0, 2.0, missing[1::STRIDE].shape)

  def thresholds(leaves):
    segs = segmented.segments_of([size] * len(leaves))
    return np.asarray(jax.jit(lambda ls: segmented.exact_thresholds(
        segmented.values_of(ls, segs, laid_out), [k] * len(ls), [False] * len(ls)))(
            [jnp.asarray(v) for v in leaves]))

  others = [normal * (i + 1) for i in range(4)]
  want = [0.0] + [kth_largest_np(x, k) for x in others]
  np.testing.assert_array_equal(thresholds([sparse, *others]), want)
  last = kth_largest_np(missing, k) if laid_out else -1.0
  np.testing.assert_array_equal(thresholds([sparse, *others, missing]), want + [last])


@pytest.mark.parametrize("laid_out", VIEWS)
def test_a_kernel_whose_channels_differ_in_scale_is_bounded_by_its_sample(monkeypatch, laid_out):
  # 1x1 kernels of 256 x 1024 whose 100 live output channels (the fastest
  # axis) have log-normal scales, as a ResNet's do early on. Every 16th value
  # would see 64 of the 1024 channels and miss in most draws; the sample's
  # stride coprime to the size sees them all, so no leaf needs the fallback
  # (made to answer -1).
  monkeypatch.setattr(segmented.Values, "kth_largest",
                      lambda self, ks: jnp.full((len(ks),), -1.0, jnp.float32))
  rng = np.random.default_rng(8)
  leaves = []
  for _ in range(6):
    x = np.zeros((256, 1024), np.float32)
    live = rng.choice(1024, 100, replace=False)
    x[:, live] = rng.standard_normal((256, 100)) * np.exp(2 * rng.standard_normal(100))
    leaves.append(x.ravel())
  size = leaves[0].size
  k = selection.num_to_keep(0.01, size)
  assert size // 16384 == 16 and selection.coprime_stride(16, size) == 15
  segs = segmented.segments_of([size] * len(leaves))
  got = np.asarray(jax.jit(lambda ls: segmented.exact_thresholds(
      segmented.values_of(ls, segs, laid_out), [k] * len(ls), [False] * len(ls)))(
          [jnp.asarray(x) for x in leaves]))
  np.testing.assert_array_equal(got, [kth_largest_np(x, k) for x in leaves])


@pytest.mark.parametrize("laid_out", VIEWS)
def test_an_output_layer_whose_classes_differ_in_scale_is_bounded_by_its_sample(
    monkeypatch, laid_out):
  # A 2048 x 1000 output layer's gradient from a batch of 8: features times
  # (softmax - one-hot), so the 8 labels' columns hold the large values. Every
  # 125th value (2,048,000 / 16,384) sees only classes 0, 125, ..., 875, and
  # its bound passes fewer than k or more than the buffer (2 k); the coprime
  # stride sees every class. Five such leaves: fewer are selected leaf by leaf.
  monkeypatch.setattr(segmented.Values, "kth_largest",
                      lambda self, ks: jnp.full((len(ks),), -1.0, jnp.float32))
  rng = np.random.default_rng(3)
  leaves = []
  for _ in range(5):
    features = np.abs(rng.standard_normal((8, 2048))).astype(np.float32)
    logits = rng.standard_normal((8, 1000))
    probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    probs[np.arange(8), rng.choice(np.arange(1000)[np.arange(1000) % 125 > 0], 8)] -= 1.0
    leaves.append((features.T @ probs.astype(np.float32)).ravel())
  size = leaves[0].size
  k = selection.num_to_keep(0.01, size)
  for x in leaves:
    sample = np.sort(np.abs(x[::125]))[::-1]
    naive = sample[int(np.ceil(sample.size * 1.5 * k / size)) - 1]
    assert not k <= np.sum(np.abs(x) >= naive) <= 2 * k  # the stride dividing 1000 misses
  segs = segmented.segments_of([size] * len(leaves))
  got = jax.jit(lambda ls: segmented.exact_thresholds(
      segmented.values_of(ls, segs, laid_out), [k] * len(ls), [False] * len(ls)))(
          [jnp.asarray(x) for x in leaves])
  np.testing.assert_array_equal(np.asarray(got), [kth_largest_np(x, k) for x in leaves])


@pytest.mark.slow
@pytest.mark.parametrize("laid_out", VIEWS)
def test_compaction_matches_the_leaf_by_leaf_selection(laid_out):
  rng = np.random.default_rng(4)
  leaves = make_leaves(rng, zeros=0.3)
  segs = segmented.segments_of(SIZES)
  thresholds = np.array([0.0, 1.0, 0.5, 2.0, 1.5], np.float32)
  # Capacities below, at and above the number passing.
  capacities = [1, 3, 100, 500, 12000]

  @jax.jit
  def batched(ls):
    values = segmented.values_of(ls, segs, laid_out)
    words = values.pack(jnp.asarray(thresholds))
    positions, passed = segmented.compact(words, segs, capacities)
    return (segmented.local_indices(positions, segs, capacities), passed,
            values.take(positions, capacities))

  indices, passed, taken = batched([jnp.asarray(x) for x in leaves])
  offset = 0
  for x, t, c, got, n in zip(leaves, thresholds, capacities, indices, passed):
    want, want_passed = reference_threshold(x, t, c)
    np.testing.assert_array_equal(got, want)
    assert int(n) == int(want_passed) == int(np.sum((np.abs(x) >= t) & (x != 0)))
    chosen = np.asarray(got)[np.asarray(got) < x.size]
    np.testing.assert_array_equal(np.asarray(taken)[offset:offset + chosen.size], x[chosen])
    offset += c


def test_both_views_count_the_same_and_match_numpy_for_all_leaves_or_some():
  rng = np.random.default_rng(5)
  leaves = make_leaves(rng, zeros=0.2)
  segs = segmented.segments_of(SIZES)
  trials = rng.uniform(0.1, 2.0, (len(SIZES), 3)).astype(np.float32)
  strides = [1, 1, 2, 1, 7]
  counts = [np.asarray(jax.jit(lambda ls, v=v: segmented.values_of(ls, segs, v).count_at(
      jnp.asarray(trials), strides))([jnp.asarray(x) for x in leaves])) for v in (False, True)]
  np.testing.assert_array_equal(counts[0], counts[1])
  for x, t, s, got in zip(leaves, trials, strides, counts[0]):
    sample = np.abs(x[::s])
    want = [s * int(np.sum((sample >= v) & (sample > 0))) for v in t]
    np.testing.assert_array_equal(got, want)
  some = [4, 1]
  for v in (False, True):
    subset = jax.jit(lambda ls, v=v: segmented.values_of(ls, segs, v).count_at(
        jnp.asarray(trials[some]), [strides[i] for i in some], some))(
            [jnp.asarray(x) for x in leaves])
    np.testing.assert_array_equal(subset, counts[0][some])


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
  segs = segmented.segments_of([x.size for x in leaves])
  for ks in ([1, 1, 1, 1], [120, 3, 7, 2500], [200, 95, 40, 4999], [151, 6, 33, 17]):
    got = np.asarray(jax.jit(lambda v, ks=ks: segmented.kth_largest(v, segs, ks))(
        segmented.lay_out([jnp.asarray(x) for x in leaves], segs)))
    want = [kth_largest_np(x, k) if k <= x.size else 0.0 for x, k in zip(leaves, ks)]
    np.testing.assert_array_equal(got, np.asarray(want, np.float32), err_msg=str(ks))


def test_a_select_of_fewer_bits_gives_a_close_lower_bound():
  x = np.random.default_rng(6).standard_normal(5000).astype(np.float32)
  segs = segmented.segments_of([5000])
  exact = kth_largest_np(x, 50)
  bound = float(jax.jit(lambda v: segmented.kth_largest(v, segs, [50], bits=17))(
      jnp.asarray(segmented.lay_out([jnp.asarray(x)], segs)))[0])
  assert exact * (1 - 2.0**-6) <= bound <= exact


@pytest.mark.slow
@pytest.mark.parametrize("candidates,refresh", [(1, 0.5), (7, 0.5), (1, None)])
def test_the_transform_gives_the_same_updates_in_both_views(monkeypatch, candidates, refresh):
  params = {"a": jnp.zeros((40, 50)), "b": jnp.zeros((7,)), "c": jnp.zeros((300, 130))}
  rng = np.random.default_rng(7)
  steps = [random_grads(params, 2, rng, scale=s) for s in (1.0, 1.0, 0.1, 1.0, 5.0)]
  results = []
  for laid_out in (False, True):
    monkeypatch.setattr(segmented, "lay_out_by_default", lambda *_, v=laid_out: v)
    rule = (dlgs_jax.FixedReuse(3) if refresh is None else dlgs_jax.RefreshReuse(3, refresh)
            if candidates == 1 else dlgs_jax.AdaptedReuse(3, refresh, candidates))
    tx = dlgs_jax.dlgs(0.05, axis_name="data", thresholds=rule, groups=[["a", "b", "c"]])
    results.append(run_steps(tx, params, steps, 2))
  for one, other in zip(jax.tree_util.tree_leaves(results[0]),
                        jax.tree_util.tree_leaves(results[1])):
    np.testing.assert_array_equal(one, other)


@pytest.mark.slow
@pytest.mark.parametrize("laid_out", VIEWS)
def test_a_groups_selection_has_the_same_conditionals_for_any_number_of_leaves(
    monkeypatch, laid_out):
  """Selection batched over a group: one conditional (the group's refresh;
  large leaves kept leaf by leaf add the sampled bound's fallback), for 3
  leaves or 30, and no sort in either view."""
  monkeypatch.setattr(segmented, "lay_out_by_default", lambda *_: laid_out)
  counts = []
  for leaves in (3, 30):
    params = {f"w{i:02d}": jnp.zeros((64, 40 + i)) for i in range(leaves)}
    layout = engine.make_layout(params, None, None, single_group=True)
    select = engine.Selection("threshold", 0.01, rule=rules.AdaptedReuse())
    select_fn = lambda g, t, r, layout=layout: engine.pick(select, layout, g, t, r)
    counts.append(programs.program_counts(select_fn, jax.tree_util.tree_leaves(params),
                                          [jnp.zeros(())] * leaves, jnp.bool_(False)))
  for leaves, c in zip((3, 30), counts):
    assert c["conditionals"] == 1, c
    assert c["sorts"] == 0 and c["top_k"] == 0, c
  if laid_out:
    # The passes are per group; what grows is handing each leaf its buffer.
    assert counts[1]["kernels"] < 2 * counts[0]["kernels"], counts


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
  for a, b in zip(jax.tree_util.tree_leaves(states[0].residuals),
                  jax.tree_util.tree_leaves(states[1].residuals)):
    np.testing.assert_array_equal(a, b)


def test_segments_refuse_an_empty_leaf():
  with pytest.raises(ValueError, match="no empty leaf, got sizes \\(3, 0\\)"):
    segmented.segments_of([3, 0])


@pytest.mark.parametrize("laid_out", VIEWS)
def test_a_groups_program_holds_its_table_of_leaf_numbers_once(monkeypatch, laid_out):
  """Every pass that spreads per-leaf numbers over words indexes one constant
  table; a table per pass put 37 copies of ResNet-50's (3 MB each) into one
  update."""
  monkeypatch.setattr(segmented, "lay_out_by_default", lambda *_: laid_out)
  params = {f"w{i:02d}": jnp.zeros((64, 40 + i)) for i in range(30)}
  layout = engine.make_layout(params, None, None, single_group=True)
  select = engine.Selection("threshold", 0.01, rule=rules.AdaptedReuse())
  words = segmented.segments_of(layout.sizes).num_words
  text = jax.jit(lambda g, t, r: engine.pick(select, layout, g, t, r)).lower(
      jax.tree_util.tree_leaves(params), [jnp.zeros(())] * 30, jnp.bool_(False)).as_text()
  tables = [line for line in text.splitlines()
            if "constant" in line and f"tensor<{words}xi32>" in line.split("=")[-1]]
  assert len(tables) == 1, tables


# One leaf kept as it is (DGC): the sampled candidates and their radix select.
def test_exact_threshold_of_one_leaf_matches_numpy():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((17, 9)).astype(np.float32)
  for k in (1, 5, 100, x.size):
    got = jax.jit(segmented.exact_threshold, static_argnums=1)(x, k)
    assert float(got) == np.sort(np.abs(x).ravel())[::-1][k - 1]


def test_threshold_at_exact_kth_selects_exactly_k():
  rng = np.random.default_rng(3)
  x = rng.standard_normal(1000).astype(np.float32)
  k = 37
  h = segmented.exact_threshold(jnp.asarray(x), k)
  got, passed = jax.jit(segmented.threshold_indices, static_argnums=2)(x, h, k)
  assert int(passed) == k
  assert set(np.asarray(got)) == set(np.argsort(-np.abs(x))[:k])


@pytest.mark.parametrize("size,k", [(600_000, 6000), (600_000, 1), (700_001, 7000), (600_000, 60_000),
                                    (33_000, 330), (40_000, 1), (100_003, 10_001)])
def test_sampled_kth_largest_is_exact_on_large_inputs(size, k):
  rng = np.random.default_rng(size + k)
  x = rng.standard_normal(size).astype(np.float32)
  want = np.sort(np.abs(x))[::-1][k - 1]
  assert float(jax.jit(segmented.exact_threshold, static_argnums=1)(x, k)) == want


def test_sampled_kth_largest_falls_back_when_estimate_misses():
  # Fewer nonzeros than k: the buffer path finds fewer than k candidates and
  # the full sort must answer (the k-th largest is 0).
  x = np.zeros(800_000, np.float32)
  x[::8000] = np.arange(1, 101)
  assert float(jax.jit(segmented.exact_threshold, static_argnums=1)(x, 150)) == 0.0
  z = np.zeros(50_000, np.float32)  # the same on a leaf just above the sampling size
  z[::1000] = np.arange(1, 51)
  assert float(jax.jit(segmented.exact_threshold, static_argnums=1)(z, 100)) == 0.0
  # Heavy ties: many more than 4k values equal the k-th largest.
  y = np.ones(600_000, np.float32)
  y[:10] = 5.0
  assert float(jax.jit(segmented.exact_threshold, static_argnums=1)(y, 5000)) == 1.0


def test_exact_threshold_is_exact_on_a_head_whose_classes_differ_in_scale():
  rng = np.random.default_rng(0)
  scale = np.where(np.arange(1000) % 125 == 0, 0.01, 1.0).astype(np.float32)
  x = (rng.standard_normal((2048, 1000)).astype(np.float32) * scale)
  k = 20480
  got = jax.jit(segmented.exact_threshold, static_argnums=1)(jnp.asarray(x), k)
  assert float(got) == float(np.sort(np.abs(x).reshape(-1))[-k])


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
  fn = jax.jit(segmented.threshold_indices, static_argnums=2)
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
    got, passed = jax.jit(segmented.threshold_indices, static_argnums=2)(
        x, jnp.float32(threshold), capacity)
    want, want_passed = reference_threshold(x, threshold, capacity)
    np.testing.assert_array_equal(np.asarray(got), want)
    assert int(passed) == want_passed


def test_a_top_k_keeps_every_value_above_its_threshold_whatever_the_ties():
  # Ties at the k-th largest come first in index order, a larger value last: a
  # compaction of |x| >= t alone would fill the buffer with ties and drop it.
  from dlgs_jax.compress import engine, grouping  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(12)
  tied = np.concatenate([np.full(40, 0.5, np.float32), rng.uniform(0.0, 0.4, 50),
                         np.float32([3.0, -2.0])]).astype(np.float32)
  other = np.round(rng.standard_normal(300), 1).astype(np.float32)  # many ties
  params = {"a": jnp.zeros(tied.shape), "b": jnp.zeros(other.shape)}
  for kind, single in (("layer_topk", False), ("group_topk", True)):
    for laid_out in (True, False):
      layout = engine.make_layout(params, None, None, single_group=single)
      select = engine.Selection(kind, 0.1)
      with segmented.forced_view(laid_out):
        _, picked, _ = jax.jit(lambda ls: engine.pick(select, layout, ls))(
            [jnp.asarray(tied), jnp.asarray(other)])
      arrays = [tied, other]
      for group, members in zip(picked, layout.groups):
        parts = ([np.concatenate([arrays[m] for m in members])] if single
                 else [arrays[m] for m in members])
        for i, (start, part) in enumerate(zip(group.values.segs.offsets, parts)):
          k = selection.num_to_keep(0.1, part.size)
          slots = np.asarray(group.positions)[sum(group.capacities[:i]):][:group.capacities[i]]
          chosen = slots[slots < group.values.segs.length] - start
          kth = kth_largest_np(part, k)
          assert chosen.size == k, (kind, laid_out, chosen.size, k)
          assert set(np.flatnonzero(np.abs(part) > kth)) <= set(chosen), (kind, laid_out)
          assert np.all(np.abs(part[chosen]) >= kth)
