import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from dlgs_jax.compress import collectives
from dlgs_jax.workload import parallel
from dlgs_jax.compress import wire


def run(fn, workers, *args, out_specs=P("data")):
  """Runs fn(*per-worker args) under jit + shard_map, returns NumPy with a worker axis."""
  mesh = parallel.data_mesh(workers)
  wrapped = lambda *a: parallel.unsqueeze(fn(*parallel.squeeze(a)))
  specs = tuple(P("data") for _ in args)
  out = jax.jit(jax.shard_map(wrapped, mesh=mesh, in_specs=specs, out_specs=out_specs))(
      *parallel.shard_batch(args, mesh))
  return jax.tree_util.tree_map(np.asarray, out)


def sparse_inputs(rng, workers, size, count):
  """Per-worker unique indices (sentinel padded) and values."""
  values = rng.standard_normal((workers, count)).astype(np.float32)
  indices = np.stack([rng.choice(size, count, replace=False) for _ in range(workers)]).astype(np.int32)
  indices[:, -2:] = size  # padding
  values[:, -2:] = 0.0
  return values, indices


@pytest.mark.parametrize("workers", [1, 3, 8])
def test_sparse_allgather_mean_matches_numpy(workers):
  rng = np.random.default_rng(workers)
  size, count = 50, 12
  values, indices = sparse_inputs(rng, workers, size, count)
  out = run(lambda v, i: collectives.sparse_allgather_mean(v, i, size, axis_name="data"),
            workers, values, indices)
  want = np.zeros(size + 1, np.float64)
  for w in range(workers):
    np.add.at(want, indices[w], values[w])
  want = want[:size] / workers
  for w in range(workers):
    np.testing.assert_allclose(out[w], want, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(out[w], out[0])  # bit-identical


@pytest.mark.parametrize("workers", [1, 4])
def test_sparse_allgather_means_matches_numpy_per_segment(workers):
  """Three vectors in one message: each segment's pairs land in its own vector."""
  rng = np.random.default_rng(10 + workers)
  segments = [(5, 20), (1, 3), (7, 40)]  # (slots, size)
  parts_v, parts_i = [], []
  for slots, size in segments:
    v, i = sparse_inputs(rng, workers, size, slots + 2)
    parts_v.append(v[:, 2:])  # keeps one or two sentinel slots at the end
    parts_i.append(i[:, 2:])
  values, indices = np.concatenate(parts_v, 1), np.concatenate(parts_i, 1)
  out = run(lambda v, i: collectives.sparse_allgather_means(v, i, segments, axis_name="data"),
            workers, values, indices)
  for j, (slots, size) in enumerate(segments):
    want = np.zeros(size + 1, np.float64)
    for w in range(workers):
      np.add.at(want, parts_i[j][w], parts_v[j][w])
    want = want[:size] / workers
    for w in range(workers):
      np.testing.assert_allclose(out[j][w], want, rtol=1e-6, atol=1e-7)
      np.testing.assert_array_equal(out[j][w], out[j][0])  # bit-identical


def test_sparse_allgather_means_rejects_segments_that_do_not_cut_the_buffer():
  values, indices = jnp.zeros((6,), jnp.float32), jnp.zeros((6,), jnp.int32)
  with pytest.raises(ValueError, match=r"segments of \[2, 3\] slots"):
    collectives.sparse_allgather_means(values, indices, [(2, 10), (3, 10)], axis_name=None)


def numpy_gtopk(values, indices, k, size):
  """Reference recursive-doubling gTop-k on dicts (same rounds as the JAX code)."""
  workers = values.shape[0]

  def topk(d):
    items = sorted(d.items(), key=lambda kv: (-abs(kv[1]), kv[0]))[:k]
    return dict(items)

  def merge(a, b):
    out = dict(a)
    for i, v in b.items():
      out[i] = out.get(i, 0.0) + v
    return topk(out)

  sets = [topk({int(i): float(v) for i, v in zip(indices[w], values[w]) if i < size})
          for w in range(workers)]
  p2 = 1 << (workers.bit_length() - 1)
  for j in range(workers - p2):
    sets[j] = merge(sets[j], sets[p2 + j])
  bit = 1
  while bit < p2:
    sets = [merge(sets[j], sets[j ^ bit]) if j < p2 else sets[j] for j in range(workers)]
    bit <<= 1
  for j in range(workers - p2):
    sets[p2 + j] = sets[j]
  return [set(s) for s in sets]


@pytest.mark.parametrize("workers", [2, 3, 5, 6, 8])
def test_gtopk_indices_match_numpy_reference(workers):
  rng = np.random.default_rng(10 + workers)
  size, count, k = 64, 10, 6
  values, indices = sparse_inputs(rng, workers, size, count)
  out = run(lambda v, i: collectives.gtopk_indices(v, i, k, size, axis_name="data"),
            workers, values, indices)
  want = numpy_gtopk(values, indices, k, size)
  for w in range(workers):
    assert set(out[w][out[w] < size]) == want[w], w
    np.testing.assert_array_equal(out[w], out[0])


@pytest.mark.parametrize("workers", [3, 4, 7, 8])
def test_gtopk_mean_loses_nothing(workers):
  """P * mean + sum of residuals == sum of inputs, also when rounds prune values."""
  rng = np.random.default_rng(workers)
  size, k = 40, 5
  flat = rng.standard_normal((workers, size)).astype(np.float32)
  # Candidates: each worker's local top-k -- overlapping but different sets,
  # so intermediate rounds prune values whose index survives elsewhere.
  cand = np.argsort(-np.abs(flat), axis=1)[:, :k].astype(np.int32)
  vals = np.take_along_axis(flat, cand, axis=1)

  def fn(f, v, i):
    mean, sent = collectives.gtopk_mean(f, v, i, k, axis_name="data")
    return mean, f.at[sent].set(0.0, mode="drop"), sent

  mean, residual, sent = run(fn, workers, flat, vals, cand)
  np.testing.assert_allclose(workers * mean[0] + residual.sum(0), flat.sum(0), rtol=1e-5, atol=1e-5)
  for w in range(workers):
    np.testing.assert_array_equal(mean[w], mean[0])
    np.testing.assert_array_equal(sent[w], sent[0])
  assert (mean[0] != 0).sum() <= k


def test_gtopk_identical_inputs_select_exact_topk():
  workers, size, k = 6, 100, 7
  rng = np.random.default_rng(5)
  g = rng.standard_normal(size).astype(np.float32)
  flat = np.broadcast_to(g, (workers, size)).copy()
  cand = np.broadcast_to(np.argsort(-np.abs(g))[:k], (workers, k)).astype(np.int32).copy()
  vals = np.take_along_axis(flat, cand, axis=1)
  mean, sent = run(lambda f, v, i: collectives.gtopk_mean(f, v, i, k, axis_name="data"),
                   workers, flat, vals, cand)
  assert set(sent[0]) == set(np.argsort(-np.abs(g))[:k])
  want = np.zeros(size, np.float32)
  want[sent[0]] = g[sent[0]]
  np.testing.assert_allclose(mean[0], want, rtol=1e-6)


def test_gtopk_traffic_is_k_log_p_not_kp():
  k = 1000
  sent8, _ = wire.gtopk_bytes(k, 8)
  sent64, _ = wire.gtopk_bytes(k, 64)
  # log2(64)/log2(8) = 2 rounds ratio; an all-gather would grow 9x (63/7).
  assert sent64 / sent8 < 2.5
  assert wire.allgather_bytes(k, 64) / wire.allgather_bytes(k, 8) == 9.0


def test_dense_mean_and_single_worker_identity():
  rng = np.random.default_rng(7)
  x = rng.standard_normal((4, 9)).astype(np.float32)
  out = run(lambda a: collectives.dense_mean(a, axis_name="data"), 4, x)
  np.testing.assert_allclose(out[0], x.mean(0), rtol=1e-6)
  y = jnp.asarray(x[0])
  assert collectives.dense_mean(y, axis_name=None) is y
  np.testing.assert_allclose(
      np.asarray(jax.jit(lambda v, i: collectives.sparse_allgather_mean(v, i, 9, axis_name=None))(
          y[:3], jnp.asarray([0, 4, 9], jnp.int32))),
      np.asarray([x[0, 0], 0, 0, 0, x[0, 1], 0, 0, 0, 0]), rtol=1e-6)


def ppermute_payload(fn, workers, x):
  """Number of ppermutes and the elements they carry per worker, from the jaxpr."""
  mesh = parallel.data_mesh(workers)
  wrapped = jax.shard_map(lambda a: parallel.unsqueeze(fn(a[0])), mesh=mesh,
                          in_specs=P("data"), out_specs=P("data"))
  jaxpr = jax.make_jaxpr(wrapped)(x)
  sizes = []

  def walk(jp):
    for eqn in jp.eqns:
      if eqn.primitive.name == "ppermute":
        sizes.append(int(np.prod(eqn.invars[0].aval.shape)))
      for param in eqn.params.values():
        if hasattr(param, "eqns"):
          walk(param)  # a Jaxpr
        elif hasattr(getattr(param, "jaxpr", None), "eqns"):
          walk(param.jaxpr)  # a ClosedJaxpr
  walk(jaxpr.jaxpr)
  return sizes


@pytest.mark.parametrize("workers", [2, 3, 4, 8])
@pytest.mark.parametrize("shape", [(5, 7), (16,), (1,)])
def test_ring_allreduce_equals_psum(workers, shape):
  rng = np.random.default_rng(workers * 100 + len(shape))
  ints = rng.integers(-1000, 1000, (workers,) + shape).astype(np.int32)
  out = run(lambda x: collectives.ring_allreduce(x, axis_name="data"), workers, ints)
  for w in range(workers):  # exact for integers
    np.testing.assert_array_equal(out[w], ints.sum(0))
  floats = rng.standard_normal((workers,) + shape).astype(np.float32)
  ring = run(lambda x: collectives.ring_allreduce(x, axis_name="data"), workers, floats)
  psum = run(lambda x: jax.lax.psum(x, "data"), workers, floats)
  for w in range(workers):
    np.testing.assert_allclose(ring[w], psum[w], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(ring[w], ring[0])  # each chunk summed at one worker


@pytest.mark.parametrize("workers,size", [(2, 10), (3, 35), (4, 35), (8, 64), (8, 3)])
def test_ring_allreduce_sends_two_p_minus_one_chunks(workers, size):
  x = np.zeros((workers, size), np.float32)
  sizes = ppermute_payload(lambda a: collectives.ring_allreduce(a, axis_name="data"), workers, x)
  chunk = -(-size // workers)
  assert len(sizes) == 2 * (workers - 1) and set(sizes) == {chunk}
  # 2(P-1)/P of the data (up to padding to a multiple of P), as a ring all-reduce should.
  assert sum(sizes) == 2 * (workers - 1) * chunk
  if size % workers == 0:
    assert sum(sizes) * 4 == wire.allreduce_bytes(size, workers)


def test_ring_allreduce_single_worker_is_identity():
  x = jnp.arange(6.0).reshape(2, 3)
  np.testing.assert_array_equal(collectives.ring_allreduce(x, axis_name=None), x)


