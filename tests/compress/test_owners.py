"""The owners' sparse all-reduce: a NumPy reference, nothing lost, bytes flat in P."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dlgs_jax
from dlgs_jax.compress import owners, wire


def reference(flat, positions, values, k, threshold=None):
  """The same algorithm in NumPy: ``(mean, kept, found)``.

  kept: the set of positions each owner keeps: its top share, or with a
  `threshold` (a reused step) the first share of the sums at or above it, in
  the order they first arrived. found: each owner's exact threshold, the
  share-th largest |sum| (0 with fewer nonzero sums).
  """
  workers, size = flat.shape
  slots, share = wire.owner_slots(positions.shape[1], workers), wire.owner_share(k, workers)
  owner = np.asarray(owners.owner_of(jnp.asarray(positions), workers))
  inbox = [[] for _ in range(workers)]
  for w in range(workers):
    filled = np.zeros(workers, int)
    for j, position in enumerate(positions[w]):
      o = owner[w, j]
      if position < size and filled[o] < slots:  # past its slots a pair is not sent
        inbox[o].append((position, float(values[w, j])))
        filled[o] += 1
  kept, found = [], []
  for received in inbox:
    sums = {}
    for position, value in received:  # first arrival first: ties keep that order
      sums[position] = sums.get(position, 0.0) + value / workers
    largest = sorted((abs(v) for v in sums.values() if v != 0), reverse=True)
    found.append(largest[share - 1] if len(largest) >= share else 0.0)
    if threshold is None:
      kept.append(set(sorted(sums, key=lambda p: -abs(sums[p]))[:share]))
    else:
      kept.append(set([p for p, v in sums.items() if v != 0 and abs(v) >= threshold][:share]))
  mean = np.zeros(size)
  for position in set().union(*kept):
    mean[position] = flat[:, position].astype(np.float64).mean()  # every worker's value
  return mean, kept, found


def messages(workers, size, pairs, seed):
  """Per worker: g, and `pairs` distinct positions of it (some sentinels), as a selection gives."""
  rng = np.random.default_rng(seed)
  flat = rng.standard_normal((workers, size)).astype(np.float32)
  positions = np.stack([rng.choice(size, pairs, replace=False) for _ in range(workers)])
  positions[:, -3:] = size  # unused slots
  values = np.take_along_axis(flat, np.minimum(positions, size - 1), 1) * (positions < size)
  return flat, positions.astype(np.int32), values.astype(np.float32)


@pytest.mark.parametrize("workers", [1, 4, 16])
def test_the_mean_and_the_positions_sent_match_the_numpy_reference(workers):
  size, pairs, k = 512, 40, 64
  flat, positions, values = messages(workers, size, pairs, seed=workers)
  run = jax.jit(jax.vmap(lambda f, v, p: owners.owners_mean(f, v, p, k, axis_name="w"),
                         axis_name="w"))
  mean, sent = run(jnp.asarray(flat), jnp.asarray(values), jnp.asarray(positions))
  want_mean, want_kept, _ = reference(flat, positions, values, k)
  for w in range(workers):
    np.testing.assert_allclose(np.asarray(mean[w]), want_mean, rtol=1e-5, atol=1e-7)
    # Every worker removes the same positions: each owner's share, in its row.
    rows = np.asarray(sent[w]).reshape(workers, -1)
    assert [set(row[row < size]) for row in rows] == want_kept
  assert sum(map(len, want_kept)) <= workers * wire.owner_share(k, workers)


def staged(k, exact, threshold):
  """`to_owners`, `keep` and `share` as the transforms run them, over vmapped workers."""
  def run(f, v, p):
    received = owners.to_owners(v, p, f.shape[0], axis_name="w")
    kept, found = owners.keep([received], [f.shape[0]], [k], axis_name="w",
                              exact=exact, thresholds=[threshold])
    return owners.share(f, kept[0], found[0], axis_name="w")
  return jax.jit(jax.vmap(run, axis_name="w"))


@pytest.mark.parametrize("workers", [1, 4, 16])
def test_a_reused_global_threshold_keeps_the_first_sums_above_it_as_numpy_does(workers):
  size, pairs, k = 512, 40, 24
  flat, positions, values = messages(workers, size, pairs, seed=10 + workers)
  exact_mean, _, measured = staged(k, jnp.asarray(True), jnp.float32(0))(
      jnp.asarray(flat), jnp.asarray(values), jnp.asarray(positions))
  _, want_exact, found = reference(flat, positions, values, k)
  np.testing.assert_array_equal(np.asarray(exact_mean[0]) != 0,
                                np.isin(np.arange(size), list(set().union(*want_exact))))
  # The global threshold: the owners' exact thresholds, averaged over those that found one.
  np.testing.assert_allclose(np.asarray(measured), np.mean([f for f in found if f > 0]),
                             rtol=1e-5)
  # Reused, lower than measured: some owners pass more sums than their share and
  # send the first ones received; the rest stay behind.
  threshold = 0.6 * float(measured[0])
  mean, sent, again = staged(k, jnp.asarray(False), jnp.float32(threshold))(
      jnp.asarray(flat), jnp.asarray(values), jnp.asarray(positions))
  want_mean, want_kept, _ = reference(flat, positions, values, k, threshold)
  np.testing.assert_array_equal(np.asarray(again), 0.0)  # nothing measured on a reused step
  for w in range(workers):
    np.testing.assert_allclose(np.asarray(mean[w]), want_mean, rtol=1e-5, atol=1e-7)
    rows = np.asarray(sent[w]).reshape(workers, -1)
    assert [set(row[row < size]) for row in rows] == want_kept
  assert want_kept != want_exact


def test_one_worker_keeps_its_top_share_and_sends_to_itself():
  flat, positions, values = messages(1, 256, 20, seed=3)
  mean, sent = owners.owners_mean(jnp.asarray(flat[0]), jnp.asarray(values[0]),
                                  jnp.asarray(positions[0]), 5, axis_name=None)
  top = np.argsort(-np.abs(values[0]))[:5]
  assert set(np.asarray(sent)[np.asarray(sent) < 256]) == set(positions[0][top])
  np.testing.assert_array_equal(np.asarray(mean)[positions[0][top]], values[0][top])
  assert np.count_nonzero(np.asarray(mean)) == 5


@pytest.mark.parametrize("stride", [1, 64, 233])
def test_owners_share_any_stride_of_positions_evenly(stride):
  for workers in (4, 16):
    owner = np.asarray(owners.owner_of(jnp.arange(0, stride * 16384, stride, dtype=jnp.int32),
                                       workers))
    counts = np.bincount(owner, minlength=workers)
    assert counts.min() > 0.85 * counts.mean() and counts.max() < 1.15 * counts.mean()


PARAMS = {"conv": jnp.zeros((3, 3, 32, 64)), "dense": jnp.zeros((2048, 16)),
          "bias": jnp.zeros((16,))}


@pytest.mark.slow
def test_bytes_stay_flat_from_16_to_256_workers_with_nothing_lost():
  sent = {}
  rng = np.random.default_rng(0)
  for workers in (4, 16, 64, 256):
    tx = dlgs_jax.topk(0.1, axis_name="w", collective="owners")
    state = jax.vmap(lambda _: tx.init(PARAMS), axis_name="w")(jnp.arange(workers))
    grads = {name: jnp.asarray(rng.standard_normal((workers, *x.shape)), jnp.float32)
             for name, x in PARAMS.items()}
    update, new = jax.jit(jax.vmap(tx.update, axis_name="w"))(grads, state)
    leaves = jax.tree_util.tree_leaves(update)
    # Every worker applies the same update.
    assert all(np.array_equal(np.asarray(x)[0], np.asarray(x)[-1]) for x in leaves)
    # P * update + the new residuals hold all the gradients held.
    total = workers * sum(float(np.asarray(x)[0].sum()) for x in leaves)
    total += sum(float(np.asarray(r).sum()) for r in new.residuals)
    assert total == pytest.approx(sum(float(np.asarray(g).sum()) for g in grads.values()),
                                  rel=1e-4, abs=1e-2)
    sent[workers] = float(np.asarray(new.stats.bytes_sent)[0])
    k = int(np.ceil(0.1 * sum(x.size for x in PARAMS.values())))
    assert sent[workers] == wire.owners_bytes(k, k, workers)
  flat = [sent[w] for w in (16, 64, 256)]
  assert max(flat) / min(flat) < 1.10
  # The all-gather it replaces grows with P: 16x the bytes from 16 to 256 workers.
  assert wire.allgather_bytes(6554, 256) / wire.allgather_bytes(6554, 16) == 17


def test_bad_collectives_are_refused_with_the_fix():
  with pytest.raises(ValueError, match=r"topk's collective must be one of .* got 'gtopk'; "
                     r"for gTop-k's reduction use gtopk\(\)"):
    dlgs_jax.topk(0.1, collective="gtopk")
  with pytest.raises(ValueError, match="not collective 'owners'.*use wire_dtype='float32'"):
    dlgs_jax.dlgs(0.1, collective="owners", wire_dtype="bfloat16")


def test_dlgs_owners_measure_the_global_threshold_every_period_and_reuse_it_between():
  """Exact on steps 0, 3, 6 (FixedReuse(3)), reused on the others; nothing lost on any."""
  workers, every = 4, 3
  params = {"conv": jnp.zeros((3, 3, 8, 16)), "dense": jnp.zeros((256, 10))}
  tx = dlgs_jax.dlgs(0.05, axis_name="w", collective="owners",
                     thresholds=dlgs_jax.FixedReuse(every))
  state = jax.vmap(lambda _: tx.init(params), axis_name="w")(jnp.arange(workers))
  assert [float(t[0]) for t in state.owner_thresholds] == [0.0]  # one group, not measured yet
  step = jax.jit(jax.vmap(tx.update, axis_name="w"))
  rng = np.random.default_rng(1)
  seen = []
  for count in range(7):
    grads = {name: jnp.asarray(rng.standard_normal((workers, *x.shape)), jnp.float32)
             for name, x in params.items()}
    old = sum(float(np.asarray(r).sum()) for r in state.residuals)
    update, state = step(grads, state)
    threshold = np.asarray(state.owner_thresholds[0])
    assert np.all(threshold == threshold[0]) and threshold[0] > 0  # one global value
    seen.append(float(threshold[0]))
    total = workers * sum(float(np.asarray(x)[0].sum()) for x in jax.tree_util.tree_leaves(update))
    total += sum(float(np.asarray(r).sum()) for r in state.residuals)
    assert total == pytest.approx(sum(float(np.asarray(g).sum()) for g in grads.values()) + old,
                                  rel=1e-4, abs=1e-2)
    if count % every:
      assert seen[-1] == seen[-2]  # reused
  # Measured anew on each exact step.
  assert len({seen[0], seen[3], seen[6]}) == 3


def test_topk_owners_measure_the_threshold_on_every_step():
  params = {"w": jnp.zeros((64, 32))}
  tx = dlgs_jax.topk(0.05, axis_name="w", collective="owners")
  state = jax.vmap(lambda _: tx.init(params), axis_name="w")(jnp.arange(4))
  step = jax.jit(jax.vmap(tx.update, axis_name="w"))
  rng = np.random.default_rng(2)
  seen = set()
  for _ in range(3):
    grads = {"w": jnp.asarray(rng.standard_normal((4, 64, 32)), jnp.float32)}
    _, state = step(grads, state)
    seen.add(float(np.asarray(state.owner_thresholds[0])[0]))
  assert len(seen) == 3 and min(seen) > 0
