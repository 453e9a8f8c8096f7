"""Collectives that carry dense and sparse gradients between workers.

Every function here is pure and meant to run inside `jax.shard_map` (or any
other context that binds `axis_name`); ``axis_name=None`` means a single worker
and makes every collective the identity. `axis_name` may also be a tuple of mesh
axis names (e.g. ``("host", "device")``), which JAX treats as one flattened axis.

Sparse messages are ``(values, indices)`` pairs with indices into a flat buffer
of static `size`; padding entries carry the sentinel index ``size``. Values and
indices travel together in one float32 message (indices bit-cast), so one
group costs exactly one collective.
"""

from __future__ import annotations

import inspect
import itertools
from typing import Hashable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
from jax import lax

from dlgs_jax.compress import wire

AxisName = Union[Hashable, Sequence[Hashable], None]


def axes_of(axis_name) -> tuple:
  """The mesh axis names of a data axis (None: none) as a tuple."""
  if axis_name is None:
    return ()
  return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def varying_axes(x) -> frozenset:
  """The mesh axes over which `x` may differ, as shard_map's checks type it."""
  aval = jax.typeof(x)
  manual = getattr(aval, "manual_axis_type", None)  # jax >= 0.10
  varying = manual.varying if manual is not None else getattr(aval, "vma", None)
  return frozenset(varying or ())


def types_checked(axis_name) -> bool:
  """Whether shard_map's replication checks (``check_vma``) are on for `axis_name`.

  A worker's index always differs between workers, so it is typed varying
  exactly when the checks are on.
  """
  axes = axes_of(axis_name)
  if not axes:
    return False
  try:
    index = lax.axis_index(axes)
  except NameError:  # not inside shard_map: the first collective will say so
    return False
  return set(axes) <= varying_axes(index)


def bound_axes() -> tuple:
  """Names of the mapped axes the current trace runs under (shard_map, pmap, vmap)."""
  try:
    from jax._src import core  # pylint: disable=g-import-not-at-top

    return tuple(core.get_axis_env().axis_names())
  except (ImportError, AttributeError):  # not exported by jax; only the message loses it
    return ()


def is_bound(axis: Hashable) -> bool:
  """Whether `axis` is a mapped axis of the current trace."""
  try:
    lax.axis_size(axis)
  except NameError:
    return False
  return True


def num_workers(axis_name: AxisName) -> int:
  """Static number of workers along `axis_name` (1 for ``None``)."""
  if axis_name is None:
    return 1
  return int(lax.axis_size(axis_name))


def worker_index(axis_name: AxisName) -> jax.Array:
  """This worker's int32 index along `axis_name` (0 for ``None``)."""
  if axis_name is None:
    return jnp.zeros((), jnp.int32)
  return lax.axis_index(axis_name).astype(jnp.int32)


def all_agree(flag: jax.Array, axis_name: AxisName) -> jax.Array:
  """Whether a bool scalar is True on every worker (one int32 all-reduce; None: itself)."""
  if axis_name is None:
    return flag
  return lax.psum((~flag).astype(jnp.int32), axis_name) == 0


def dense_mean(x: jax.Array, *, axis_name: AxisName) -> jax.Array:
  """Mean of `x` over workers: one all-reduce.

  Values are divided by P before they are summed, as the sparse means are:
  finite values then never sum past their dtype's range (float16's is 65504)
  where their mean does not. For P a power of two the result is bit for bit
  the sum divided afterwards (subnormals aside).
  """
  if axis_name is None:
    return x
  if jnp.issubdtype(x.dtype, jnp.floating):
    return lax.psum(x / num_workers(axis_name), axis_name)
  return lax.pmean(x, axis_name)


def gather_replicated(x: jax.Array, axis_name: AxisName) -> jax.Array:
  """All-gather of `x` over `axis_name` (new leading axis), typed replicated.

  Every worker receives the same rows, and shard_map's checks are told so:
  what is computed from them alone (a mean) is typed replicated too, so a step
  can return it with ``out_specs`` ``P()`` with the checks on. ``lax.all_gather``
  types its result as varying. Without the checks (``jax.vmap``, ``jax.pmap``,
  ``check_vma=False``) nothing is typed, and the plain all-gather runs.
  """
  axes = axes_of(axis_name)
  if not types_checked(axes):
    return lax.all_gather(x, axes)
  gather = getattr(lax, "all_gather_invariant", None)
  if gather is None:  # not yet exported by jax 0.10
    from jax._src.lax import parallel  # pylint: disable=g-import-not-at-top
    gather = parallel.all_gather_invariant
  return gather(x, axes)


def pack_pairs(values: jax.Array, indices: jax.Array) -> jax.Array:
  """(value, index) pairs as one float32 message: the values, then the indices' bits."""
  return jnp.concatenate([
      values.astype(jnp.float32),
      lax.bitcast_convert_type(indices.astype(jnp.int32), jnp.float32),
  ], axis=-1)


def unpack_pairs(message: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The (values, indices) of a `pack_pairs` message (along its last axis)."""
  half = message.shape[-1] // 2
  values = message[..., :half]
  indices = lax.bitcast_convert_type(message[..., half:], jnp.int32)
  return values, indices


def _pack_half(values: jax.Array, indices: jax.Array) -> jax.Array:
  """bfloat16 values and int32 indices in one uint16 message: 6 bytes a pair."""
  halves = lax.bitcast_convert_type(indices.astype(jnp.int32), jnp.uint16)  # (c, 2)
  return jnp.concatenate([lax.bitcast_convert_type(values.astype(jnp.bfloat16), jnp.uint16),
                          halves.reshape(-1)], axis=-1)


def _unpack_half(message: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(float32 values, int32 indices) of `_pack_half` messages (rows of a gather)."""
  c = message.shape[-1] // 3
  values = lax.bitcast_convert_type(message[..., :c], jnp.bfloat16).astype(jnp.float32)
  halves = message[..., c:].reshape(message.shape[:-1] + (c, 2))
  return values, lax.bitcast_convert_type(halves, jnp.int32)


def sparse_allgather_mean(
    values: jax.Array, indices: jax.Array, size: int, *, axis_name: AxisName,
    wire_dtype: str = "float32", apply: Optional[jax.Array] = None,
) -> jax.Array:
  """Mean over workers of sparse vectors, by all-gather and scatter-add.

  Each worker sends its c (value, index) pairs to every other worker, so a
  worker receives (P-1)·c pairs: O(cP) traffic (the Top-k S-SGD baseline).

  Args:
    values: float[c] this worker's selected values.
    indices: int32[c] their flat indices, padded with the sentinel `size`.
    size: length of the dense vector.
    axis_name: the data-parallel axis.
    wire_dtype: "float32" (8-byte pairs) or "bfloat16" (6-byte pairs; the
      caller keeps what rounding to it loses).
    apply: as in `sparse_allgather_means`.

  Returns:
    float32[size], identical on all workers.
  """
  return sparse_allgather_means(values, indices, [(values.shape[0], size)],
                                axis_name=axis_name, wire_dtype=wire_dtype, apply=apply)[0]


def sparse_allgather_means(
    values: jax.Array,
    indices: jax.Array,
    segments: Sequence[tuple[int, int]],
    *,
    axis_name: AxisName,
    wire_dtype: str = "float32",
    apply: Optional[jax.Array] = None,
) -> list[jax.Array]:
  """Means over workers of several sparse vectors sent in one all-gather.

  The buffer is cut into consecutive segments, one per vector: segment j holds
  ``slots_j`` (value, index) pairs of a vector of length ``size_j``, indices
  local to that vector and padded with any sentinel ``>= size_j``. Every
  worker uses the same segments, so each row of the gathered buffers is cut
  the same way and every vector's mean is scattered straight into its own
  array -- a layer-wise message (DLGS, LAGS) needs no dense concatenation of
  its layers, before or after the collective.

  Args:
    values: float[c] this worker's selected values, segment after segment.
    indices: int32[c] their indices, local to each segment's vector.
    segments: ``(slots, size)`` per vector; the slots add up to c.
    axis_name: the data-parallel axis.
    wire_dtype: "float32" (8-byte pairs) or "bfloat16" (6-byte pairs: the
      values are rounded to it before they leave; the caller keeps the rounding).
    apply: a bool scalar, the same on every worker: False adds nothing (every
      mean is zero), masking the received pairs rather than the dense means;
      None: True.

  Returns:
    float32[size_j] per segment, identical on all workers (typed replicated).
    Each row is divided by P before it is added, so finite rows never sum
    past the float range.

  Raises:
    ValueError: when the segments do not add up to the buffer.
  """
  slots = [int(s) for s, _ in segments]
  if sum(slots) != values.shape[0] or values.shape != indices.shape:
    raise ValueError(f"segments of {slots} slots do not cut a buffer of "
                     f"{values.shape[0]} values and {indices.shape[0]} indices")
  half = wire.check_wire_dtype(wire_dtype) == "bfloat16"
  if half:
    values = values.astype(jnp.bfloat16)
  if axis_name is None:
    rows_values, rows_indices, num = values[None].astype(jnp.float32), indices[None], 1
  elif half:
    rows_values, rows_indices = _unpack_half(
        gather_replicated(_pack_half(values, indices), axis_name))
    num = num_workers(axis_name)
  else:
    rows_values, rows_indices = unpack_pairs(gather_replicated(pack_pairs(values, indices), axis_name))
    num = num_workers(axis_name)
  starts = list(itertools.accumulate([0] + slots[:-1]))
  rows_values = rows_values / num  # exact for P a power of two
  if apply is not None:
    rows_values = jnp.where(apply, rows_values, 0.0)  # NaN rows of a skipped step too

  def add_row(row, dense):
    # Rows are added one at a time in worker order, and within a row (one
    # worker's buffer) indices are unique, so no scatter adds two values into
    # one slot at once: the result is bit-identical on every worker (a single
    # scatter-add over all rows would let GPU atomics reorder the sums).
    return [d.at[rows_indices[row, a:a + n]].add(rows_values[row, a:a + n], mode="drop")
            for d, a, n in zip(dense, starts, slots)]

  first = add_row(0, [jnp.zeros((size,), jnp.float32) for _, size in segments])
  return lax.fori_loop(1, rows_values.shape[0], add_row, first)


def _merge_topk(
    values: jax.Array, indices: jax.Array, k: int, size: int
) -> tuple[jax.Array, jax.Array]:
  """Sums values that share an index, then keeps the k largest ``|sum|``.

  The output is canonical -- sorted by index before the top-k, so two workers
  merging the same two sets in either order get bit-identical results.
  """
  order_indices, order_values = lax.sort((indices, values), num_keys=1)
  first = jnp.concatenate(
      [jnp.ones((1,), bool), order_indices[1:] != order_indices[:-1]])
  segment = jnp.cumsum(first, dtype=jnp.int32) - 1
  n = values.shape[0]
  sums = jax.ops.segment_sum(order_values, segment, num_segments=n)
  unique = jnp.full((n,), size, jnp.int32).at[segment].set(order_indices)
  # Sentinel segments must never beat a real index of equal magnitude.
  magnitude = jnp.where(unique < size, jnp.abs(sums), -1.0)
  _, keep = _top_k(magnitude, k)
  return sums[keep], unique[keep]


def _top_k(x: jax.Array, k: int):
  """`lax.top_k`, unstable where the installed JAX offers it (0.11 and later).

  Ties here are among equal magnitudes of distinct indices, which every worker
  merges from the same canonical (index-sorted) input, so any fixed order will
  do; XLA:GPU has a select-k kernel for small k only when the order of ties is
  free, and sorts the whole input otherwise.
  """
  if _UNSTABLE_TOP_K:
    return lax.top_k(x, k, is_stable=False)
  return lax.top_k(x, k)


_UNSTABLE_TOP_K = "is_stable" in inspect.signature(lax.top_k).parameters


def gtopk_indices(
    values: jax.Array, indices: jax.Array, k: int, size: int, *, axis_name: AxisName
) -> jax.Array:
  """Indices of the k largest entries of the global sum (gTop-k, Shi et al. 2019).

  Recursive doubling: in round r each worker exchanges its current k
  (value, index) pairs with worker ``rank XOR 2^r``, sums duplicates and keeps
  the top k of the at most 2k entries; after log2(P) rounds every worker holds
  the same set. When P is not a power of two, the P - P2 workers above the
  largest power of two P2 first hand their set to ``rank - P2`` and get the
  result back at the end (two extra messages for those pairs). Each message is
  k pairs, so a worker sends O(k log P) values instead of the O(kP) of an
  all-gather.

  The values summed along the way are approximations (a value pruned in an early
  round is missing from later sums); only the index set is returned, and
  `gtopk_mean` sends the exact values at those indices.

  Args:
    values: float[c] this worker's candidate values.
    indices: int32[c] their indices, padded with the sentinel `size`.
    k: number of global indices to keep (static).
    size: length of the dense vector.
    axis_name: the data-parallel axis.

  Returns:
    int32[k] indices (sentinel-padded when fewer than k are nonzero), identical
    on all workers.
  """
  values = values.astype(jnp.float32)
  # Bring the local candidate set to exactly k pairs.
  values, indices = _merge_topk(
      _pad(values, k, 0.0), _pad(indices, k, size), k, size)
  p = num_workers(axis_name)
  if p == 1:
    return indices
  rank = worker_index(axis_name)
  p2 = 1 << (p.bit_length() - 1)
  extra = p - p2

  def exchange(v, i, perm, receives):
    got_v, got_i = unpack_pairs(partial_permute(pack_pairs(v, i), axis_name, perm))
    # ppermute gives zeros to workers outside `perm`; turn those into padding.
    got_i = jnp.where(receives, got_i, size)
    got_v = jnp.where(receives, got_v, 0.0)
    merged_v, merged_i = _merge_topk(
        jnp.concatenate([v, got_v]), jnp.concatenate([i, got_i]), k, size)
    return jnp.where(receives, merged_v, v), jnp.where(receives, merged_i, i)

  if extra:
    values, indices = exchange(
        values, indices, [(p2 + j, j) for j in range(extra)], rank < extra)
  for r in range((p2 - 1).bit_length()):
    bit = 1 << r
    values, indices = exchange(
        values, indices, [(j, j ^ bit) for j in range(p2)], rank < p2)
  if extra:
    back = partial_permute(indices, axis_name, [(j, p2 + j) for j in range(extra)])
    indices = jnp.where(rank >= p2, back, indices)
  return indices


def partial_permute(x: jax.Array, axis_name: AxisName, perm) -> jax.Array:
  """`lax.ppermute` of `x` along `perm`, which may leave some workers out.

  shard_map and pmap send only the pairs in `perm` (workers outside it
  receive zeros). ``jax.vmap``'s ppermute takes full permutations only, so
  there the pairs are completed: the workers that send nothing send to those
  that receive nothing. Callers mask what a worker outside `perm` receives;
  vmap simulates workers on one device, so the added pairs move no bytes.
  """
  try:
    return lax.ppermute(x, axis_name, perm)
  except AssertionError:  # vmap: "Permutation doesn't match the axis size!"
    size = num_workers(axis_name)
    senders = [s for s in range(size) if s not in {s for s, _ in perm}]
    receivers = [d for d in range(size) if d not in {d for _, d in perm}]
    return lax.ppermute(x, axis_name, list(perm) + list(zip(senders, receivers)))


def gtopk_mean(
    flat: jax.Array,
    values: jax.Array,
    indices: jax.Array,
    k: int,
    *,
    axis_name: AxisName,
    apply: Optional[jax.Array] = None,
) -> tuple[jax.Array, jax.Array]:
  """gTop-k aggregation that loses no gradient mass.

  First `gtopk_indices` agrees on the k global indices; then every worker
  contributes its *full* value at each of those indices (not only the ones it
  had selected) to one k-element all-reduce. The caller removes exactly those
  indices from its residual, so ``P * mean + sum(new residuals) == sum(flat)``
  holds exactly -- unlike the reference tree code, where a value pruned in an
  intermediate round but whose index survives is dropped from both.

  Args:
    flat: float[n] this worker's full (residual + gradient) vector.
    values: float[c] candidate values selected from `flat`.
    indices: int32[c] their indices, sentinel ``n``.
    k: number of global indices.
    axis_name: the data-parallel axis.
    apply: a bool scalar, the same on every worker: False makes the mean zero
      (the k summed values masked, not the dense mean); None: True.

  Returns:
    ``(mean, sent)``: float32[n] dense mean over workers (identical on all,
    typed replicated), and
    int32[k] the indices every worker sent (sentinel-padded). Values are
    divided by P before they are summed, so finite ones never sum past the
    float range.
  """
  size = flat.shape[0]
  sent = gtopk_indices(values, indices, k, size, axis_name=axis_name)
  workers = num_workers(axis_name)
  local = flat.astype(jnp.float32).at[sent].get(mode="fill", fill_value=0.0) / workers
  if axis_name is None:
    summed, agreed = local, sent
  else:
    # Every worker holds the same indices, but they came through ppermute and
    # are typed varying; worker 0's copy rides along in the values' all-reduce
    # (k int32 more), so the mean is typed replicated.
    summed, agreed = lax.psum(
        (local, jnp.where(worker_index(axis_name) == 0, sent, 0)), axis_name)
  if apply is not None:
    summed = jnp.where(apply, summed, 0.0)
  mean = jnp.zeros((size,), jnp.float32).at[agreed].set(summed, mode="drop")
  return mean, sent


def _pad(x: jax.Array, length: int, fill) -> jax.Array:
  if x.shape[0] >= length:
    return x
  return jnp.concatenate([x, jnp.full((length - x.shape[0],), fill, x.dtype)])


def ring_allreduce(x: jax.Array, *, axis_name: AxisName) -> jax.Array:
  """Sum of `x` over workers by the ring algorithm, built from `ppermute`.

  The flattened input is cut into P chunks (zero-padded to a multiple of P).
  Reduce-scatter: in step s (0 <= s < P-1) worker r sends its running sum of
  chunk ``(r - s) mod P`` to worker r+1, which adds it to its own; after P-1
  steps worker r holds the full sum of chunk ``(r + 1) mod P``. All-gather: in
  P-1 more steps each finished chunk travels once around the ring. Each worker
  sends 2(P-1) chunks, i.e. 2(P-1)/P of the data (Patarasuk & Yuan 2009; the
  algorithm behind NCCL/gloo all-reduce). Every chunk is summed at exactly one
  worker, so the result is bit-identical on all workers (though its rounding
  may differ from `lax.psum`'s order).

  Args:
    x: any-shaped array (the same shape on every worker).
    axis_name: the data-parallel axis.

  Returns:
    The elementwise sum over workers, shaped and typed like `x`.
  """
  p = num_workers(axis_name)
  if p == 1:
    return x
  flat = x.reshape(-1)
  chunk = -(-flat.shape[0] // p)
  chunks = jnp.pad(flat, (0, chunk * p - flat.shape[0])).reshape(p, chunk)
  rank = worker_index(axis_name)
  to_next = [(r, (r + 1) % p) for r in range(p)]
  for step in range(p - 1):  # reduce-scatter
    outgoing = lax.dynamic_index_in_dim(chunks, (rank - step) % p, keepdims=False)
    incoming = lax.ppermute(outgoing, axis_name, to_next)
    slot = (rank - step - 1) % p
    current = lax.dynamic_index_in_dim(chunks, slot, keepdims=False)
    chunks = lax.dynamic_update_index_in_dim(chunks, current + incoming, slot, 0)
  for step in range(p - 1):  # all-gather of the finished chunks
    outgoing = lax.dynamic_index_in_dim(chunks, (rank + 1 - step) % p, keepdims=False)
    incoming = lax.ppermute(outgoing, axis_name, to_next)
    chunks = lax.dynamic_update_index_in_dim(chunks, incoming, (rank - step) % p, 0)
  return chunks.reshape(-1)[:flat.shape[0]].reshape(x.shape)
