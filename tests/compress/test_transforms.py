"""Invariants of the communication transforms on 8 simulated CPU workers."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dlgs_jax
from dlgs_jax.compress import grouping, rules
from dlgs_jax.workload import parallel
from tests.helpers import (flat, flat_workers, leaf_thresholds, random_grads, residual_tree,
                           run_steps)

PARAMS = {
    "conv": {"kernel": jnp.zeros((3, 3, 2, 4)), "bias": jnp.zeros((4,))},
    "dense": {"kernel": jnp.zeros((16, 10)), "bias": jnp.zeros((10,))},
}
ORDER = ["dense/bias", "dense/kernel", "conv/bias", "conv/kernel"]
W = 8


def methods(density, **kw):
  return {
      "dlgs": dlgs_jax.dlgs(density, axis_name="data", thresholds=dlgs_jax.AdaptedReuse(3), **kw),
      "dlgs_grouped": dlgs_jax.dlgs(
          density, axis_name="data", thresholds=dlgs_jax.AdaptedReuse(3), order=ORDER,
          groups=[ORDER[:2], ORDER[2:]], **kw),
      # The grouped layer budget is "dlgs_grouped"'s; these groups take the message budget.
      "dlgs_message": dlgs_jax.dlgs(
          density, axis_name="data", thresholds=dlgs_jax.AdaptedReuse(3), budget="message",
          order=ORDER, groups=[ORDER[:3], ORDER[3:]], **kw),
      "dlgs_gtopk": dlgs_jax.dlgs(
          density, axis_name="data", collective="gtopk", groups=[ORDER[:3], ORDER[3:]],
          order=ORDER, **kw),
      "lags": dlgs_jax.lags(density, axis_name="data", **kw),
      "lags_gtopk": dlgs_jax.lags(density, axis_name="data", collective="gtopk", **kw),
      "topk": dlgs_jax.topk(density, axis_name="data", **kw),
      "gtopk": dlgs_jax.gtopk(density, axis_name="data", **kw),
  }


@pytest.mark.parametrize("name", sorted(methods(0.1)))
@pytest.mark.parametrize("density", [0.05, 0.3])
def test_nothing_lost_and_identical_updates(name, density):
  """P * update + sum_w e_new[w] == sum_w (grad[w] + e_old[w]), every step."""
  tx = methods(density)[name]
  rng = np.random.default_rng(0)
  steps = [random_grads(PARAMS, W, rng) for _ in range(5)]
  updates, _, states = run_steps(tx, PARAMS, steps, W)
  old_residual = np.zeros_like(flat_workers(steps[0]))
  for step, (grads, update, state) in enumerate(zip(steps, updates, states)):
    u = flat_workers(update)
    for w in range(1, W):
      np.testing.assert_array_equal(u[w], u[0])  # bit-identical on all workers
    new_residual = flat_workers(residual_tree(state, PARAMS))
    np.testing.assert_allclose(
        W * u[0] + new_residual.sum(0),
        (flat_workers(grads) + old_residual).sum(0), rtol=1e-5, atol=1e-5)
    assert np.count_nonzero(u[0]) > 0
    old_residual = new_residual


@pytest.mark.parametrize("name", sorted(methods(1.0)))
def test_density_one_equals_dense_mean(name):
  """At density 1 every buffer holds its whole leaf: every value goes out at once."""
  rng = np.random.default_rng(1)
  grads = random_grads(PARAMS, W, rng)
  (update,), state, _ = run_steps(methods(1.0)[name], PARAMS, [grads], W)
  (dense_update,), _, _ = run_steps(dlgs_jax.dense(axis_name="data"), PARAMS, [grads], W)
  np.testing.assert_allclose(flat_workers(update)[0], flat_workers(grads).mean(0), rtol=1e-5,
                             atol=1e-6)
  np.testing.assert_allclose(flat_workers(update)[0], flat_workers(dense_update)[0], rtol=1e-5,
                             atol=1e-6)
  np.testing.assert_allclose(flat_workers(residual_tree(state, PARAMS)), 0.0, atol=1e-6)


def test_dense_fused_groups_equal_mean_and_use_one_collective_per_group():
  rng = np.random.default_rng(2)
  grads = random_grads(PARAMS, W, rng)
  tx = dlgs_jax.dense(axis_name="data", groups=[ORDER], order=ORDER)
  (update,), state, _ = run_steps(tx, PARAMS, [grads], W)
  np.testing.assert_allclose(flat_workers(update)[0], flat_workers(grads).mean(0), rtol=1e-5, atol=1e-6)
  # One fused all-reduce, plus one for the non-finite flag unless disabled.
  assert count_collectives(tx, "psum") == 2
  assert count_collectives(dlgs_jax.dense(
      axis_name="data", groups=[ORDER], order=ORDER, skip_nonfinite=False), "psum") == 1
  assert count_collectives(dlgs_jax.dense(axis_name="data", order=ORDER), "psum") == 5
  total = sum(x.size for x in jax.tree_util.tree_leaves(PARAMS))
  assert state.stats.bytes_sent[0] == pytest.approx(2 * (W - 1) / W * total * 4)


def count_collectives(tx, primitive):
  """Number of `primitive` equations in one traced update on W workers."""
  mesh = parallel.data_mesh(W)
  state = jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct((W,) + x.shape, x.dtype), jax.eval_shape(tx.init, PARAMS))
  grads = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct((W,) + x.shape, x.dtype), PARAMS)
  spec = jax.sharding.PartitionSpec("data")

  def step(g, s):
    u, s = tx.update(parallel.squeeze(g), parallel.squeeze(s))
    return parallel.unsqueeze(u), parallel.unsqueeze(s)

  fn = jax.shard_map(step, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec))
  text = str(jax.make_jaxpr(fn)(grads, state))
  # psum prints as psum or psum_invariant depending on its operand's type.
  return len(re.findall(rf" {primitive}(_invariant)?\[", text))


@pytest.mark.parametrize("groups,expected", [
    ([[p] for p in ORDER], 4), ([ORDER[:2], ORDER[2:]], 2), ([ORDER], 1),
    (None, 1)])  # the default: one bucket for these small leaves
def test_one_collective_per_group(groups, expected):
  tx = dlgs_jax.dlgs(0.1, axis_name="data", groups=groups, order=ORDER)
  assert count_collectives(tx, "all_gather") == expected
  gtx = dlgs_jax.dlgs(0.1, axis_name="data", groups=groups, order=ORDER, collective="gtopk")
  assert count_collectives(gtx, "all_gather") == 0
  # log2(8) = 3 exchanges per group, and per group one all-reduce of the k values and of
  # worker 0's k indices (one psum each in the jaxpr), plus the finite flag.
  assert count_collectives(gtx, "ppermute") == 3 * expected
  assert count_collectives(gtx, "psum") == 2 * expected + 1


def test_dlgs_thresholds_recomputed_only_every_reuse_steps():
  reuse = 3
  tx = dlgs_jax.dlgs(0.1, axis_name="data", thresholds=dlgs_jax.FixedReuse(reuse), budget="layer")
  rng = np.random.default_rng(3)
  steps = [random_grads(PARAMS, W, rng) for _ in range(7)]
  _, _, states = run_steps(tx, PARAMS, steps, W)
  residual = jax.tree_util.tree_map(np.zeros_like, steps[0])
  previous = None
  for step, (grads, state) in enumerate(zip(steps, states)):
    thresholds = leaf_thresholds(state, PARAMS)
    accumulated = jax.tree_util.tree_map(np.add, residual, grads)
    for path_thr, acc in zip(jax.tree_util.tree_leaves(thresholds), jax.tree_util.tree_leaves(accumulated)):
      for w in range(W):
        if step % reuse == 0:
          k = max(1, int(np.ceil(0.1 * acc[w].size)))
          assert path_thr[w] == np.sort(np.abs(acc[w]).ravel())[::-1][k - 1]
    if step % reuse != 0:
      for a, b in zip(jax.tree_util.tree_leaves(thresholds), jax.tree_util.tree_leaves(previous)):
        np.testing.assert_array_equal(a, b)
    else:
      assert previous is None or any(
          not np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(thresholds),
                                                   jax.tree_util.tree_leaves(previous)))
    leaves = len(jax.tree_util.tree_leaves(PARAMS))
    np.testing.assert_array_equal(state.stats.exact, leaves if step % reuse == 0 else 0)
    previous = thresholds
    residual = residual_tree(state, PARAMS)
  assert states[-1].count[0] == len(steps)


def test_dlgs_reused_threshold_respects_capacity_and_counts_overflow():
  tx = dlgs_jax.dlgs(0.1, axis_name="data", thresholds=dlgs_jax.FixedReuse(100))
  rng = np.random.default_rng(4)
  first = random_grads(PARAMS, W, rng)
  # Larger later gradients pass the stale threshold far more often than k.
  later = random_grads(PARAMS, W, rng, scale=10.0)
  _, state, states = run_steps(tx, PARAMS, [first, later], W)
  sizes = [x.size for x in jax.tree_util.tree_leaves(PARAMS)]
  capacity = sum(max(1, int(np.ceil(0.1 * s))) for s in sizes)
  assert states[0].stats.selected[0].sum() == capacity  # thresholds start at 0
  assert state.stats.selected[0].sum() == capacity
  assert state.stats.passed[0].sum() > capacity


def test_dlgs_refreshes_a_reused_threshold_only_when_its_count_leaves_the_band():
  # Gradient scales jump around so reused thresholds pass too few values
  # (x0.01), too many (x30), or about k (x1): with one candidate (the refresh
  # rule) and each leaf its own group, each leaf on each worker must reuse H_l
  # exactly when the count under the old H_l is within [ceil(0.5 k),
  # capacity], and take the exact k-th largest |g| otherwise.
  density, reuse = 0.1, 100
  tx = dlgs_jax.dlgs(density, axis_name="data", thresholds=dlgs_jax.RefreshReuse(reuse),
                     groups=[[p] for p in ORDER], order=ORDER)
  rng = np.random.default_rng(8)
  scales = [1.0, 1.0, 0.01, 1.0, 30.0, 1.0, 1.0]
  steps = [random_grads(PARAMS, W, rng, scale=s) for s in scales]
  _, _, states = run_steps(tx, PARAMS, steps, W)
  residual = [np.zeros_like(x) for x in jax.tree_util.tree_leaves(steps[0])]
  previous = None
  outcomes = set()
  for step, (grads, state) in enumerate(zip(steps, states)):
    accumulated = [r + g for r, g in zip(residual, jax.tree_util.tree_leaves(grads))]
    thresholds = leaf_thresholds(state, PARAMS)
    recomputed = np.zeros(W, int)
    for leaf, (acc, thr) in enumerate(zip(accumulated, thresholds)):
      for w in range(W):
        values = np.abs(acc[w]).ravel()
        k = max(1, int(np.ceil(density * values.size)))
        exact = np.sort(values)[::-1][k - 1]
        if step == 0:
          assert thr[w] == exact
          recomputed[w] += 1
          continue
        old = previous[leaf][w]
        count = int(np.sum((values >= old) & (values > 0)))
        if int(np.ceil(0.5 * k)) <= count <= k:
          assert thr[w] == old, (step, leaf, w, count, k)
          outcomes.add("reused")
        else:
          assert thr[w] == exact, (step, leaf, w, count, k)
          outcomes.add("too few" if count < k else "too many")
          recomputed[w] += 1
    # The state counts the leaves whose threshold was computed exactly.
    np.testing.assert_array_equal(state.stats.exact, recomputed)
    previous = thresholds
    residual = jax.tree_util.tree_leaves(residual_tree(state, PARAMS))
  assert outcomes == {"reused", "too few", "too many"}


@pytest.mark.parametrize("candidates", [1, 7])
def test_a_group_keeps_or_recomputes_its_thresholds_together(candidates):
  # Two groups; scales jump so that some steps drift out of the band. Within
  # a group, on each worker, either every threshold is exact this step or each
  # moved within the candidates' range (exactly a candidate with one); leaves
  # of k < 16 are exact on every step with candidates; and the exact count
  # adds up.
  density = 0.1
  groups = [ORDER[:2], ORDER[2:]]
  rule = (dlgs_jax.RefreshReuse(100) if candidates == 1
          else dlgs_jax.AdaptedReuse(100, candidates=candidates))
  tx = dlgs_jax.dlgs(density, axis_name="data", thresholds=rule, order=ORDER, groups=groups,
                     budget="layer")
  rng = np.random.default_rng(11)
  steps = [random_grads(PARAMS, W, rng, scale=s) for s in (1.0, 1.0, 0.01, 1.0, 30.0, 1.0)]
  _, _, states = run_steps(tx, PARAMS, steps, W)
  paths = grouping.leaf_paths(PARAMS)
  factors = rule.factors() if candidates > 1 else np.ones(1, np.float32)
  residual = [np.zeros_like(x) for x in jax.tree_util.tree_leaves(steps[0])]
  previous, seen = None, set()
  for step, (grads, state) in enumerate(zip(steps, states)):
    accumulated = [r + g for r, g in zip(residual, jax.tree_util.tree_leaves(grads))]
    thresholds = leaf_thresholds(state, PARAMS)
    for w in range(W):
      exact_leaves = 0
      for group in groups:
        leaves = [paths.index(p) for p in group]
        ks = [max(1, int(np.ceil(density * accumulated[i][w].size))) for i in leaves]
        exact = [np.sort(np.abs(accumulated[i][w]).ravel())[::-1][k - 1]
                 for i, k in zip(leaves, ks)]
        got = [thresholds[i][w] for i in leaves]
        few = [candidates > 1 and k < rules.AdaptedReuse().exact_below_k for k in ks]
        assert all(g == e for g, e, f in zip(got, exact, few) if f), (step, w, group)
        if got == exact:
          exact_leaves += len(leaves)
          seen.add("exact")
        else:
          exact_leaves += sum(few)
          ratios = [thresholds[i][w] / previous[i][w] for i, f in zip(leaves, few) if not f]
          assert step > 0 and all(
              factors[0] * (1 - 1e-6) <= r <= factors[-1] * (1 + 1e-6) for r in ratios), (
                  step, w, group, ratios)
          assert candidates > 1 or ratios == [1.0] * len(leaves), (step, w, group, ratios)
          seen.add("adapted")
      assert int(state.stats.exact[w]) == exact_leaves, (step, w)
    previous = thresholds
    residual = jax.tree_util.tree_leaves(residual_tree(state, PARAMS))
  assert "exact" in seen and (candidates == 1 or "adapted" in seen), seen


@pytest.mark.parametrize("name", ["topk", "gtopk"])
def test_identical_gradients_select_exact_topk(name):
  rng = np.random.default_rng(5)
  one = random_grads(PARAMS, 1, rng)
  grads = jax.tree_util.tree_map(lambda x: np.repeat(x, W, axis=0), one)
  tx = methods(0.1)[name]
  (update,), _, _ = run_steps(tx, PARAMS, [grads], W)
  g = flat_workers(one)[0]
  k = int(np.ceil(0.1 * g.size))
  want_idx = np.argsort(-np.abs(g))[:k]
  u = flat_workers(update)[0]
  assert set(np.flatnonzero(u)) == set(want_idx)
  np.testing.assert_allclose(u[want_idx], g[want_idx], rtol=1e-6)


def numpy_allgather_sparse_step(grads, residual, density, per_leaf_k):
  """NumPy reference of one LAGS step (exact per-leaf top-k, all-gather, mean)."""
  leaves_g = [np.asarray(x) for x in jax.tree_util.tree_leaves(grads)]
  leaves_e = [np.asarray(x) for x in jax.tree_util.tree_leaves(residual)]
  means, new_res = [], []
  for g, e in zip(leaves_g, leaves_e):
    acc = (g + e).reshape(W, -1)
    k = per_leaf_k(acc.shape[1])
    total = np.zeros(acc.shape[1])
    res = acc.copy()
    for w in range(W):
      idx = np.argsort(-np.abs(acc[w]))[:k]
      total[idx] += acc[w, idx]
      res[w, idx] = 0
    means.append(total / W)
    new_res.append(res)
  return np.concatenate(means), np.concatenate(new_res, axis=1)


def test_lags_matches_numpy_reference_over_steps():
  tx = dlgs_jax.lags(0.2, axis_name="data")
  rng = np.random.default_rng(6)
  steps = [random_grads(PARAMS, W, rng) for _ in range(3)]
  updates, _, states = run_steps(tx, PARAMS, steps, W)
  residual = jax.tree_util.tree_map(np.zeros_like, steps[0])
  for grads, update, state in zip(steps, updates, states):
    mean, new_res = numpy_allgather_sparse_step(
        grads, residual, 0.2, lambda n: max(1, int(np.ceil(0.2 * n))))
    np.testing.assert_allclose(flat_workers(update)[0], mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(flat_workers(residual_tree(state, PARAMS)), new_res, rtol=1e-5, atol=1e-6)
    residual = residual_tree(state, PARAMS)


@pytest.mark.slow
@pytest.mark.parametrize("make", [
    lambda **kw: dlgs_jax.dlgs(0.1, axis_name="data", thresholds=dlgs_jax.FixedReuse(3),
                               budget="layer", **kw),
    lambda **kw: dlgs_jax.dlgs(0.1, axis_name="data", thresholds=dlgs_jax.FixedReuse(2),
                               budget="layer", capacity_factor=1.5, **kw),
    lambda **kw: dlgs_jax.lags(0.2, axis_name="data", **kw),
])
def test_layer_wise_methods_send_the_same_grouped_or_not(make):
  """A group is one message of per-leaf segments: the same values as one message per leaf.

  (On the fixed schedule: the refresh rule recomputes a whole group at once.)"""
  rng = np.random.default_rng(8)
  steps = [random_grads(PARAMS, W, rng) for _ in range(4)]
  per_leaf = run_steps(make(), PARAMS, steps, W)
  grouped = run_steps(make(order=ORDER, groups=[ORDER[:3], ORDER[3:]]), PARAMS, steps, W)
  for u_leaf, u_group, s_leaf, s_group in zip(per_leaf[0], grouped[0], per_leaf[2], grouped[2]):
    np.testing.assert_array_equal(flat_workers(u_group), flat_workers(u_leaf))
    np.testing.assert_array_equal(flat_workers(residual_tree(s_group, PARAMS)), flat_workers(residual_tree(s_leaf, PARAMS)))
  assert np.count_nonzero(flat_workers(grouped[0][-1])) > 0


HEAD = ["dense/bias", "dense/kernel"]
BIASES = ["conv/bias", "dense/bias"]
# The same leaves as optax-style masks: a callable and a tree of bools.
VECTORS = lambda p: jax.tree_util.tree_map(lambda x: x.ndim < 2, p)  # noqa: E731
HEAD_MASK = {"conv": {"bias": False, "kernel": False}, "dense": {"bias": True, "kernel": True}}


@pytest.mark.parametrize("make,whole", [
    (lambda: dlgs_jax.lags(0.2, axis_name="data", send_whole=VECTORS), BIASES),
    (lambda: dlgs_jax.dlgs(0.2, axis_name="data", thresholds=dlgs_jax.AdaptedReuse(1),
                           send_whole=VECTORS, budget="layer"), BIASES),
    (lambda: dlgs_jax.dlgs(0.2, axis_name="data", thresholds=dlgs_jax.AdaptedReuse(3),
                           send_whole=VECTORS, budget="layer", order=ORDER,
                           groups=[ORDER[:2], ORDER[2:]]), BIASES),
    (lambda: dlgs_jax.lags(0.2, axis_name="data", send_whole=HEAD), HEAD),
    (lambda: dlgs_jax.dlgs(0.2, axis_name="data", thresholds=dlgs_jax.AdaptedReuse(3),
                           send_whole=HEAD, budget="layer"), HEAD),
    (lambda: dlgs_jax.dlgs(0.2, axis_name="data", thresholds=dlgs_jax.AdaptedReuse(3),
                           send_whole=HEAD, budget="layer", order=ORDER,
                           groups=[ORDER[:3], ORDER[3:]]), HEAD),
    (lambda: dlgs_jax.dlgs(0.2, axis_name="data", send_whole=HEAD_MASK, budget="layer"), HEAD),
])
def test_leaves_sent_whole_arrive_exact_and_the_rest_stays_sparse(make, whole):
  """Leaves the mask sends whole: the exact mean, no residual; nothing lost overall."""
  rng = np.random.default_rng(16)
  steps = [random_grads(PARAMS, W, rng) for _ in range(4)]
  updates, _, states = run_steps(make(), PARAMS, steps, W)
  residual = jax.tree_util.tree_map(np.zeros_like, steps[0])
  for step, (grads, update, state) in enumerate(zip(steps, updates, states)):
    for path in whole:
      module, name = path.split("/")
      want = (np.asarray(grads[module][name]) + np.asarray(residual[module][name])).mean(0)
      np.testing.assert_allclose(np.asarray(update[module][name])[0], want,
                                 rtol=1e-5, atol=1e-6)
      assert not np.any(np.asarray(residual_tree(state, PARAMS)[module][name]))
    kernel = np.asarray(update["conv"]["kernel"])[0]
    assert np.count_nonzero(kernel) <= W * int(np.ceil(0.2 * kernel.size))
    assert np.count_nonzero(kernel) > 0
    assert np.any(np.asarray(residual_tree(state, PARAMS)["conv"]["kernel"]))
    np.testing.assert_allclose(
        W * flat_workers(update)[0] + flat_workers(residual_tree(state, PARAMS)).sum(0),
        (flat_workers(grads) + flat_workers(residual)).sum(0), rtol=1e-5, atol=1e-5)
    residual = residual_tree(state, PARAMS)
  # k of a whole leaf is its size: the message carries it whole.
  want = sum(x.size if path in whole else int(np.ceil(0.2 * x.size))
             for path, x in zip(grouping.leaf_paths(PARAMS), jax.tree_util.tree_leaves(PARAMS)))
  assert int(states[0].stats.selected[0].sum()) == want


@pytest.mark.parametrize("kwargs,whole", [
    ({"send_whole": VECTORS}, BIASES), ({"send_whole": ["dense/kernel"]}, ["dense/kernel"])])
def test_lags_with_whole_leaves_matches_numpy_reference(kwargs, whole):
  tx = dlgs_jax.lags(0.2, axis_name="data", **kwargs)
  rng = np.random.default_rng(17)
  steps = [random_grads(PARAMS, W, rng) for _ in range(2)]
  updates, _, states = run_steps(tx, PARAMS, steps, W)
  residual = jax.tree_util.tree_map(np.zeros_like, steps[0])
  sizes = dict(zip(grouping.leaf_paths(PARAMS), (x.size for x in jax.tree_util.tree_leaves(PARAMS))))
  assert len(set(sizes.values())) == len(sizes)  # a leaf is known by its size below
  whole_sizes = {sizes[path] for path in whole}
  for grads, update, state in zip(steps, updates, states):
    mean, new_res = numpy_allgather_sparse_step(
        grads, residual, 0.2,
        lambda n: n if n in whole_sizes else max(1, int(np.ceil(0.2 * n))))
    np.testing.assert_allclose(flat_workers(update)[0], mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(flat_workers(residual_tree(state, PARAMS)), new_res, rtol=1e-5, atol=1e-6)
    residual = residual_tree(state, PARAMS)


@pytest.mark.parametrize("factory", [functools.partial(dlgs_jax.dlgs, budget="layer"),
                                     dlgs_jax.lags])
def test_send_whole_unknown_path_raises_at_init(factory):
  with pytest.raises(ValueError, match="dense/kernl"):
    factory(0.1, send_whole=["dense/kernl"]).init(PARAMS)


@pytest.mark.parametrize("send_whole", ["dense/kernel", [3], {"dense": 1.0}])
def test_send_whole_must_be_a_mask_or_paths(send_whole):
  with pytest.raises(ValueError, match="send_whole"):
    dlgs_jax.dlgs(0.1, send_whole=send_whole, budget="layer")


@pytest.mark.parametrize("none", [None, [], ()])
def test_an_empty_send_whole_sends_no_leaf_whole(none):
  from dlgs_jax.compress import engine
  whole = engine.check_whole(none)
  assert whole is None
  assert engine.make_layout(PARAMS, None, None, whole=whole).whole == (False,) * 4
  dlgs_jax.lags(0.2, send_whole=none).init(PARAMS)  # accepted


@pytest.mark.parametrize("send_whole,match", [
    ({"dense": {"bias": True, "kernel": True}}, "not shaped like the parameters"),
    (lambda p: p["dense"], "not shaped like the parameters"),
    (lambda p: jax.tree_util.tree_map(lambda x: jnp.any(x > 0), p), "Python bools"),
])
def test_a_mask_that_does_not_fit_the_tree_is_refused_at_init(send_whole, match):
  with pytest.raises(ValueError, match=match):
    dlgs_jax.dlgs(0.1, send_whole=send_whole, budget="layer").init(PARAMS)


def numpy_select(acc, thresholds, cap, k, *, exact):
  """One segment's step on every worker (the rows of `acc`): the first `cap` nonzero values
  at or above each worker's threshold are sent; on an `exact` step each worker's threshold
  becomes its k-th largest |g| (in place). Returns (their sum over workers, the residuals)."""
  total, res = np.zeros(acc.shape[1]), acc.copy()
  for w in range(acc.shape[0]):
    idx = np.flatnonzero((np.abs(acc[w]) >= thresholds[w]) & (acc[w] != 0))[:cap]
    total[idx] += acc[w, idx]
    res[w, idx] = 0
    if exact:
      thresholds[w] = np.sort(np.abs(acc[w]))[::-1][k - 1]
  return total, res


def numpy_dlgs_steps(steps, density, every, capacity_factor=1.0):
  """NumPy reference of DLGS on the paper's schedule, per leaf and worker.

  Each step selects the values at or above the thresholds it starts from (the
  first ones in index order when more than the buffer pass), all-gathers them
  and averages; on step 0 and every `every` steps the thresholds kept for the
  next step are the exact k-th largest of this step's g = e + grad (before
  step 0: 0, so every nonzero value passes). Returns (means, residuals) per step, flat.
  """
  leaves = [[np.asarray(x) for x in jax.tree_util.tree_leaves(g)] for g in steps]
  residual = [np.zeros_like(x) for x in leaves[0]]
  thresholds = [np.zeros(W, np.float32) for _ in leaves[0]]
  out = []
  for t, grads in enumerate(leaves):
    means, kept = [], []
    for i, (g, e) in enumerate(zip(grads, residual)):
      acc = (g + e).reshape(W, -1)
      k = max(1, int(np.ceil(density * acc.shape[1])))
      cap = min(acc.shape[1], int(np.ceil(capacity_factor * k)))
      total, res = numpy_select(acc, thresholds[i], cap, k, exact=t % every == 0)
      means.append(total / W)
      kept.append(res.reshape(g.shape))
    residual = kept
    out.append((np.concatenate(means), np.concatenate([r.reshape(W, -1) for r in kept], 1)))
  return out


@pytest.mark.parametrize("every,capacity_factor,groups", [
    (3, 1.0, None), (1, 1.0, None), (2, 1.5, [ORDER[:3], ORDER[3:]])])
def test_dlgs_on_the_papers_schedule_matches_numpy(every, capacity_factor, groups):
  rng = np.random.default_rng(7)
  steps = [random_grads(PARAMS, W, rng) for _ in range(5)]
  tx = dlgs_jax.dlgs(0.2, axis_name="data", thresholds=dlgs_jax.FixedReuse(every),
                     budget="layer", capacity_factor=capacity_factor, groups=groups,
                     order=ORDER if groups else None)
  updates, _, states = run_steps(tx, PARAMS, steps, W)
  for (mean, residual), update, state in zip(
      numpy_dlgs_steps(steps, 0.2, every, capacity_factor), updates, states):
    np.testing.assert_allclose(flat_workers(update)[0], mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(flat_workers(residual_tree(state, PARAMS)), residual,
                               rtol=1e-5, atol=1e-6)


def numpy_message_steps(steps, density, every, groups):
  """NumPy reference of DLGS with a message budget on the paper's schedule.

  As `numpy_dlgs_steps`, but each group (its leaves end to end, in the group's
  order) is selected as one: one threshold, k the sum of its leaves' k_l, the
  first values in that order when more than k pass; the exact threshold is the
  k-th largest ``|g|`` of the whole group. Returns (means, residuals) per step,
  flat in flatten order.
  """
  paths = grouping.leaf_paths(PARAMS)
  leaves = [dict(zip(paths, (np.asarray(x).reshape(W, -1)
                             for x in jax.tree_util.tree_leaves(g)))) for g in steps]
  residual = {p: np.zeros_like(x) for p, x in leaves[0].items()}
  thresholds = [np.zeros(W, np.float32) for _ in groups]
  out = []
  for t, grads in enumerate(leaves):
    means, kept = {}, {}
    for i, group in enumerate(groups):
      acc = np.concatenate([grads[p] + residual[p] for p in group], axis=1)
      k = sum(max(1, int(np.ceil(density * grads[p].shape[1]))) for p in group)
      total, res = numpy_select(acc, thresholds[i], k, k, exact=t % every == 0)
      ends = np.cumsum([0] + [grads[p].shape[1] for p in group])
      for p, a, b in zip(group, ends[:-1], ends[1:]):
        means[p], kept[p] = total[a:b] / W, res[:, a:b]
    residual = kept
    out.append((np.concatenate([means[p] for p in paths]),
                np.concatenate([kept[p] for p in paths], 1)))
  return out


@pytest.mark.parametrize("every,groups", [(3, [ORDER[:3], ORDER[3:]]), (2, [ORDER])])
def test_dlgs_with_a_message_budget_matches_numpy(every, groups):
  """One threshold per message: its leaves share k as a top-k of the message would."""
  rng = np.random.default_rng(11)
  # Leaves of unequal scale: a per-layer budget would give each the same share.
  steps = [jax.tree_util.tree_map(lambda x, s: x * s, random_grads(PARAMS, W, rng),
                                  {"conv": {"kernel": 1.0, "bias": 4.0},
                                   "dense": {"kernel": 0.2, "bias": 1.0}}) for _ in range(6)]
  tx = dlgs_jax.dlgs(0.2, axis_name="data", thresholds=dlgs_jax.FixedReuse(every),
                     budget="message", groups=groups, order=ORDER)
  updates, _, states = run_steps(tx, PARAMS, steps, W)
  assert [t.shape[1:] for t in states[0].thresholds] == [(1,)] * len(groups)
  reference = numpy_message_steps(steps, 0.2, every, groups)
  for (mean, residual), update, state in zip(reference, updates, states):
    np.testing.assert_allclose(flat_workers(update)[0], mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(flat_workers(residual_tree(state, PARAMS)), residual,
                               rtol=1e-5, atol=1e-6)
  # The exact steps' leaves are counted whole, the reuse steps' not at all.
  assert [int(s.stats.exact[0]) for s in states] == [
      len(ORDER) if t % every == 0 else 0 for t in range(len(steps))]


def test_single_worker_axis_none():
  tx = dlgs_jax.dlgs(0.1, thresholds=dlgs_jax.AdaptedReuse(2))
  rng = np.random.default_rng(8)
  g = jax.tree_util.tree_map(lambda x: x[0], random_grads(PARAMS, 1, rng))
  state = tx.init(PARAMS)
  update, new_state = jax.jit(tx.update)(g, state)
  np.testing.assert_allclose(flat(update) + flat(residual_tree(new_state, PARAMS)), flat(g),
                             rtol=1e-6)
  assert float(new_state.stats.bytes_sent) == 0.0
  assert 0 < np.count_nonzero(flat(update)) <= sum(
      int(np.ceil(0.1 * x.size)) for x in jax.tree_util.tree_leaves(PARAMS))


def test_stats_report_bytes_and_selection():
  rng = np.random.default_rng(9)
  grads = random_grads(PARAMS, W, rng)
  sizes = [x.size for x in jax.tree_util.tree_leaves(PARAMS)]
  ks = [max(1, int(np.ceil(0.05 * s))) for s in sizes]
  (_, ), state, _ = run_steps(dlgs_jax.lags(0.05, axis_name="data"), PARAMS, [grads], W)
  assert state.stats.bytes_sent[0] == (W - 1) * sum(ks) * 8
  assert state.stats.bytes_received[0] == (W - 1) * sum(ks) * 8
  assert state.stats.selected[0].sum() == sum(ks)
  summary = dlgs_jax.compress.state.stats_summary(dlgs_jax.compress.state.comm_stats((optax.EmptyState(), state)))
  assert summary["bytes_sent"] == (W - 1) * sum(ks) * 8 and summary["selected"] == sum(ks)


@pytest.mark.parametrize("name", ["dlgs", "gtopk", "topk"])
def test_nonfinite_gradient_skips_step_and_keeps_residuals(name):
  tx = methods(0.1)[name]
  rng = np.random.default_rng(10)
  good = random_grads(PARAMS, W, rng)
  bad = random_grads(PARAMS, W, rng)
  bad["dense"]["kernel"][3, 0, 0] = np.nan  # only worker 3 sees it
  also_bad = random_grads(PARAMS, W, rng)
  also_bad["conv"]["bias"][0, 1] = np.inf
  updates, _, states = run_steps(tx, PARAMS, [good, bad, also_bad, good], W)
  for i in (1, 2):
    assert np.all(flat_workers(updates[i]) == 0.0)
    np.testing.assert_array_equal(flat_workers(residual_tree(states[i], PARAMS)), flat_workers(residual_tree(states[0], PARAMS)))
    assert np.all(states[i].count == 1)
    assert np.all(np.isfinite(flat_workers(residual_tree(states[i], PARAMS))))
  assert np.all(states[2].stats.skipped == 2)
  assert np.all(states[3].count == 2)
  # The step after the skipped ones is the step that would have followed the first.
  expected, _, _ = run_steps(tx, PARAMS, [good, good], W)
  np.testing.assert_array_equal(flat_workers(updates[3]), flat_workers(expected[1]))


def train_toy(tx, steps=60):
  """Linear regression on 8 workers; returns the loss curve."""
  rng = np.random.default_rng(11)
  true_w = rng.standard_normal((16, 4)).astype(np.float32)
  xs = rng.standard_normal((steps, W, 8, 16)).astype(np.float32)
  ys = xs @ true_w
  params = {"w": jnp.zeros((16, 4)), "b": jnp.zeros((4,))}
  mesh = parallel.data_mesh(W)
  spec = jax.sharding.PartitionSpec("data")

  def loss_fn(p, x, y):
    return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

  def step(p, s, x, y):
    loss, g = jax.value_and_grad(loss_fn)(p, x[0], y[0])
    u, s = tx.update(g, parallel.squeeze(s), p)
    return optax.apply_updates(p, u), parallel.unsqueeze(s), jax.lax.pmean(loss, "data")

  fn = jax.jit(jax.shard_map(
      step, mesh=mesh, in_specs=(jax.sharding.PartitionSpec(), spec, spec, spec),
      out_specs=(jax.sharding.PartitionSpec(), spec, jax.sharding.PartitionSpec()),
      check_vma=False))
  p = parallel.replicate(params, mesh)
  s = parallel.stack_per_worker(tx.init(params), mesh)
  losses = []
  for t in range(steps):
    p, s, loss = fn(p, s, *parallel.shard_batch((xs[t], ys[t]), mesh))
    losses.append(float(loss))
  return losses


@pytest.mark.parametrize("make", [
    lambda: optax.chain(dlgs_jax.dlgs(0.25, axis_name="data"), optax.sgd(0.05, momentum=0.9)),
    lambda: optax.chain(dlgs_jax.gtopk(0.25, axis_name="data"), optax.adam(0.05)),
    lambda: optax.chain(dlgs_jax.lags(0.25, axis_name="data"), optax.add_decayed_weights(1e-4),
                        optax.sgd(0.05, momentum=0.9)),
    lambda: optax.MultiSteps(
        optax.chain(dlgs_jax.dlgs(0.25, axis_name="data"), optax.sgd(0.05)), every_k_schedule=2),
], ids=["dlgs+sgd_momentum", "gtopk+adam", "lags+weight_decay+sgd", "multisteps(dlgs+sgd)"])
def test_composes_with_optax_and_trains(make):
  losses = train_toy(make())
  assert losses[-1] < 0.25 * losses[0], losses[::10]


@pytest.mark.parametrize("kwargs,match", [
    ({"density": 0.0}, "density"), ({"density": 1.5}, "density"),
    ({"density": float("nan")}, "density"), ({"density": "0.1"}, "density"),
    ({"density": 0.1, "collective": "ring"}, "ring"),
    ({"density": 0.1, "capacity_factor": 0.5}, "capacity_factor"),
    ({"density": 0.1, "thresholds": 10}, "thresholds=10 is not a threshold rule"),
    ({"density": 0.1, "thresholds": "paper"}, "FixedReuse"),
    ({"density": 0.1, "groups": "dense/bias"}, "dense/bias"),
    ({"density": 0.1, "budget": "global"}, "budget='global' is invalid: choose 'layer'"),
    ({"density": 0.1, "budget": "message", "send_whole": ["dense/kernel"]},
     "does not apply with budget='message'.*send_whole=None or budget='layer'"),
])
def test_bad_arguments_raise(kwargs, match):
  with pytest.raises(ValueError, match=match):
    dlgs_jax.dlgs(**kwargs)


@pytest.mark.parametrize("factory", [dlgs_jax.lags, dlgs_jax.topk, dlgs_jax.gtopk])
def test_bad_density_raises_for_every_method(factory):
  with pytest.raises(ValueError, match="-0.1"):
    factory(-0.1)


@pytest.mark.parametrize("groups,order,match", [
    ([ORDER[:2], ORDER[3:]], ORDER, "conv/bias"),               # misses a leaf
    ([ORDER[:2], ORDER[1:]], ORDER, "dense/kernel"),           # repeats one
    ([[ORDER[0], ORDER[2]], [ORDER[1], ORDER[3]]], ORDER, "contiguous"),
    ([ORDER[:2], ORDER[2:], ["conv/weight"]], ORDER, "conv/weight"),
    ([ORDER[2:], ORDER[:2]], ORDER, "backward order"),
])
def test_bad_groups_raise_at_init(groups, order, match):
  for tx in (dlgs_jax.dlgs(0.1, groups=groups, order=order),
             dlgs_jax.dense(groups=groups, order=order)):
    with pytest.raises(ValueError, match=match):
      tx.init(PARAMS)


def test_tree_that_does_not_match_state_raises():
  tx = dlgs_jax.dlgs(0.1)
  state = tx.init(PARAMS)
  other = {"conv": PARAMS["conv"]}
  with pytest.raises(ValueError, match="conv/bias"):
    tx.update(other, state)
  reshaped = jax.tree_util.tree_map(lambda x: x, PARAMS)
  reshaped["dense"]["bias"] = jnp.zeros((11,))
  with pytest.raises(ValueError, match=r"dense/bias.*\(11,\)"):
    tx.update(reshaped, state)


def test_plan_like_object_is_accepted():
  class Plan:
    groups = [ORDER[:3], ORDER[3:]]
    order = ORDER

  state = dlgs_jax.dlgs(0.1, groups=Plan()).init(PARAMS)
  assert state.stats.selected.shape == (2,)
  assert grouping.resolve_groups(grouping.leaf_paths(PARAMS), Plan.groups, ORDER)[0] == [2, 3, 0]


COLLECTIVE_PRIMITIVES = ("all_gather", "all_gather_invariant", "psum", "psum_invariant", "pmax", "ppermute",
                         "all_to_all", "reduce_scatter")


def _sub_jaxprs(eqn):
  subs = []
  for value in eqn.params.values():
    for item in (value if isinstance(value, (list, tuple)) else [value]):
      inner = getattr(item, "jaxpr", item)
      if hasattr(inner, "eqns"):
        subs.append(inner)
  return subs


def _collective_dependencies(jaxpr, in_deps, found, control=frozenset()):
  """Walks `jaxpr`, recording for every collective the labels of the inputs it waits for.

  An input reaches a collective through its operands (data) or through the
  predicate of a `cond` around it (control): a branch starts only once the
  predicate is known. Loops and other nested programs are taken whole.
  Returns the labels each output of `jaxpr` depends on.
  """
  env = dict(zip(jaxpr.invars, in_deps))
  get = lambda v: frozenset() if hasattr(v, "val") else env.get(v, frozenset())  # noqa: E731
  for eqn in jaxpr.eqns:
    ins = [get(v) for v in eqn.invars]
    union = frozenset().union(*ins)
    name = eqn.primitive.name
    if name in COLLECTIVE_PRIMITIVES:
      found.append((name, eqn.invars[0].aval, union | control))
    subs = _sub_jaxprs(eqn)
    if name == "cond":
      outs = [frozenset()] * len(eqn.outvars)
      for branch in subs:
        got = _collective_dependencies(branch, ins[1:], found, control | ins[0])
        outs = [a | b | ins[0] for a, b in zip(outs, got)]
    elif len(subs) == 1 and len(subs[0].invars) == len(ins):
      outs = _collective_dependencies(subs[0], ins, found, control)
    else:
      for sub in subs:
        _collective_dependencies(sub, [union] * len(sub.invars), found, control | union)
      outs = [union] * len(eqn.outvars)
    env.update(zip(eqn.outvars, outs))
  return [get(v) for v in jaxpr.outvars]


PIPELINED = {
    "dlgs": lambda: dlgs_jax.dlgs(0.1, axis_name="data", thresholds=dlgs_jax.AdaptedReuse(3),
                                  order=ORDER,
                                  groups=[ORDER[:2], ORDER[2:]]),
    "lags": lambda: dlgs_jax.lags(0.1, axis_name="data", order=ORDER,
                                  groups=[[p] for p in ORDER]),
    "dense": lambda: dlgs_jax.dense(axis_name="data", order=ORDER,
                                    groups=[ORDER[:2], ORDER[2:]]),
}


@pytest.mark.parametrize("name", sorted(PIPELINED))
def test_a_groups_collective_waits_for_its_own_gradients_only(name):
  """Wait-free backpropagation needs each group's collective free to start as soon as
  that group's gradients exist. The non-finite check needs every gradient; it must
  not hold back the collectives (as a `lax.cond` around them did)."""
  tx = PIPELINED[name]()
  mesh = parallel.data_mesh(2)
  state = jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct((2,) + x.shape, x.dtype), jax.eval_shape(tx.init, PARAMS))
  paths = grouping.leaf_paths(PARAMS)
  shapes = [x.shape for x in jax.tree_util.tree_leaves(PARAMS)]
  treedef = jax.tree_util.tree_structure(PARAMS)
  spec = jax.sharding.PartitionSpec("data")

  def step(s, *grads):
    g = jax.tree_util.tree_unflatten(treedef, [parallel.squeeze(x) for x in grads])
    u, s = tx.update(g, parallel.squeeze(s))
    return parallel.unsqueeze(u), parallel.unsqueeze(s)

  fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=spec, out_specs=(spec, spec)))
  grads = [jax.ShapeDtypeStruct((2,) + shape, jnp.float32) for shape in shapes]
  closed = jax.make_jaxpr(fn)(state, *grads)
  labels = ([frozenset({"state"})] * len(jax.tree_util.tree_leaves(state))
            + [frozenset({p}) for p in paths])
  found = []
  _collective_dependencies(closed.jaxpr, labels, found)
  groups = ([set(ORDER[:2]), set(ORDER[2:])] if name != "lags"
            else [{p} for p in ORDER])
  # The gradient messages: every collective but the scalar non-finite flag.
  messages = [(prim, aval, deps - {"state"}) for prim, aval, deps in found if aval.size > 1]
  for prim, aval, deps in messages:
    assert deps in groups, (prim, aval.shape, sorted(deps))
  assert sorted(map(sorted, (deps for _, _, deps in messages))) == sorted(map(sorted, groups))
  # The flag needs every gradient (a sparse method's every message too, so the
  # residuals), and only the masks after the collectives wait for it.
  flags = [deps for _, aval, deps in found if aval.size == 1]
  assert flags == [frozenset(paths) | ({"state"} if name != "dense" else set())]


@pytest.mark.parametrize("name", ["dlgs", "dlgs_grouped", "lags", "topk", "gtopk"])
def test_nothing_lost_with_bfloat16_parameters(name):
  """bf16 parameters and gradients: residuals stay float32, and P * update + sum_w e
  accounts for every gradient value in float32 (what rounding the update to bf16
  loses stays owed)."""
  import ml_dtypes
  params = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), PARAMS)
  tx = methods(0.1)[name]
  rng = np.random.default_rng(12)
  steps = [jax.tree_util.tree_map(lambda g: g.astype(ml_dtypes.bfloat16),
                                  random_grads(PARAMS, W, rng)) for _ in range(4)]
  updates, _, states = run_steps(tx, params, steps, W)
  old = np.zeros_like(flat_workers(steps[0]).astype(np.float32))
  for grads, update, state in zip(steps, updates, states):
    assert all(x.dtype == np.float32 for x in state.residuals)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(update))
    u = flat_workers(update).astype(np.float32)
    new = flat_workers(residual_tree(state, PARAMS))
    owed = (flat_workers(grads).astype(np.float32) + old).sum(0)
    np.testing.assert_allclose(W * u[0] + new.sum(0), owed, rtol=1e-6, atol=1e-6)
    old = new


def test_residual_dtype_must_be_floating():
  with pytest.raises(ValueError, match="residual_dtype must be a floating dtype"):
    dlgs_jax.dlgs(0.1, residual_dtype=jnp.int32)


@pytest.mark.slow
@pytest.mark.parametrize("make", [
    lambda **kw: dlgs_jax.dlgs(0.1, axis_name="data", thresholds=dlgs_jax.AdaptedReuse(3), **kw),
    lambda **kw: dlgs_jax.dlgs(0.1, axis_name="data", order=ORDER,
                               groups=[ORDER[:2], ORDER[2:]], **kw),
    lambda **kw: dlgs_jax.lags(0.1, axis_name="data", **kw),
    lambda **kw: dlgs_jax.topk(0.1, axis_name="data", **kw),
], ids=["dlgs", "dlgs_grouped", "lags", "topk"])
def test_bfloat16_on_the_wire_loses_nothing_and_sends_six_bytes_a_pair(make):
  """The rounding to bf16 of every sent value stays in its sender's residual."""
  rng = np.random.default_rng(3)
  steps = [random_grads(PARAMS, W, rng) for _ in range(4)]
  updates, _, states = run_steps(make(wire_dtype="bfloat16"), PARAMS, steps, W)
  _, _, f32_states = run_steps(make(), PARAMS, steps[:1], W)
  old = np.zeros_like(flat_workers(steps[0]))
  for grads, update, state in zip(steps, updates, states):
    u = flat_workers(update)
    nonzero = u[0][u[0] != 0] * W
    # Every value of the mean is a sum of W bf16 values: exact in float32 here.
    assert np.all(nonzero.astype(jnp.bfloat16).astype(np.float32) != 0)
    new = flat_workers(residual_tree(state, PARAMS))
    owed = (flat_workers(grads) + old).sum(0)
    np.testing.assert_allclose(W * u[0] + new.sum(0), owed, rtol=1e-6, atol=1e-6)
    old = new
  sent16, sent32 = np.asarray(states[0].stats.bytes_sent), np.asarray(f32_states[0].stats.bytes_sent)
  np.testing.assert_array_equal(sent16 * 8, sent32 * 6)


def test_bfloat16_wire_pairs_carry_bfloat16_values():
  rng = np.random.default_rng(4)
  steps = [random_grads(PARAMS, W, rng)]
  (update,), _, _ = run_steps(dlgs_jax.lags(0.2, axis_name="data", wire_dtype="bfloat16"),
                              PARAMS, steps, W)
  sent = flat_workers(update)[0] * W
  # Sums of W bf16 values with 8 significant bits fit in far fewer than float32's 24.
  assert np.count_nonzero(sent) > 0
  mantissa = np.frexp(sent[sent != 0])[0] * 2 ** 20
  assert np.all(mantissa == np.round(mantissa))


def test_dense_in_bfloat16_halves_the_bytes():
  rng = np.random.default_rng(5)
  steps = [random_grads(PARAMS, W, rng)]
  u16, _, s16 = run_steps(dlgs_jax.dense(axis_name="data", wire_dtype="bfloat16"), PARAMS,
                          steps, W)
  u32, _, s32 = run_steps(dlgs_jax.dense(axis_name="data"), PARAMS, steps, W)
  np.testing.assert_array_equal(np.asarray(s16[0].stats.bytes_sent) * 2,
                                np.asarray(s32[0].stats.bytes_sent))
  np.testing.assert_allclose(flat_workers(u16[0]), flat_workers(u32[0]), rtol=2e-2, atol=1e-2)
  assert flat_workers(u16[0]).dtype == np.float32  # returned in the gradients' dtype


@pytest.mark.parametrize("make, match", [
    (lambda: dlgs_jax.dlgs(0.1, wire_dtype="float16"),
     r"wire_dtype must be one of \('float32', 'bfloat16'\), got 'float16'"),
    (lambda: dlgs_jax.dense(wire_dtype="int8"), "wire_dtype must be one of"),
    (lambda: dlgs_jax.lags(0.1, collective="gtopk", wire_dtype="bfloat16"),
     "wire_dtype 'bfloat16' works with the all-gather, not collective 'gtopk'"),
])
def test_bad_wire_dtypes_are_refused(make, match):
  with pytest.raises(ValueError, match=match):
    make()
