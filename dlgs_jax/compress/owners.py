"""A sparse all-reduce whose bytes do not grow with the number of workers: region owners.

An all-gather of every worker's k pairs moves (P-1)·8k bytes a worker, which
passes a dense all-reduce near P = 50 at density 0.01. Here, after Li and
Hoefler, "Near-Optimal Sparse Allreduce for Distributed Deep Learning"
(Ok-Topk), and with owners assigned by hashing the index as ZEN does (Wang et
al., "ZEN: Empowering Distributed Training with Sparsity-driven Data
Synchronization"), so that no repartitioning is needed:

1. Every position of a group's buffer has one owner among the P workers, by a
   hash of the position (`owner_of`): the regions are alike whatever the
   layers' shapes.
2. Each worker puts its selected pairs into a fixed number of slots per owner
   and sends them with one ``all_to_all`` (static shapes). A pair that does not
   fit its owner's slots is not sent and stays in the worker's residual.
3. Each owner sums what it received per position and keeps its region's share
   of the global k, ``ceil(k / P)``: the exact top of its sums (the library's
   one top-k path, `segmented.top`).
4. One all-gather of the owners' selections gives every worker the mean.
5. A worker removes from its residual exactly its own values at the positions
   that were finally sent: every other value it selected (overflowed a slot,
   or summed at a position its owner did not keep) returns to its residual, so
   ``P·mean + Σ new residuals == Σ (gradients + old residuals)``.

A worker sends ``(P-1)·S`` pairs in the all-to-all (S slots per owner, about
``slack·c/P`` for a message of c pairs) and ``(P-1)·ceil(k/P)`` in the
all-gather: about ``8·(slack·c + k)`` bytes, flat in P (`wire.owners_bytes`).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from dlgs_jax.compress import collectives, segmented, wire

# MurmurHash3's 32-bit finalizer: every input bit moves every output bit, so
# positions in any stride (a layer's channels) spread over the owners evenly.
_MIX = (0x85EBCA6B, 0xC2B2AE35)


def owner_of(positions: jax.Array, workers: int) -> jax.Array:
  """The owner of each position: its hash's high 16 bits scaled to P.

  Args:
    positions: int32 positions in a group's buffer.
    workers: P (at most 65536).

  Returns:
    int32 owners in ``[0, P)``.
  """
  h = positions.astype(jnp.uint32)
  h = (h ^ (h >> 16)) * jnp.uint32(_MIX[0])
  h = (h ^ (h >> 13)) * jnp.uint32(_MIX[1])
  h = h ^ (h >> 16)
  return ((h >> 16) * jnp.uint32(workers) >> 16).astype(jnp.int32)


def _into_slots(values, positions, size: int, workers: int, slots: int):
  """This worker's pairs in ``[P, slots]`` per owner, and which of its pairs found a slot.

  Pairs keep their message order within an owner; the sort is over the
  message (c pairs), never over the buffer.
  """
  count = positions.shape[0]
  owner = jnp.where(positions < size, owner_of(positions, workers), workers)
  by_owner, order = lax.sort_key_val(owner, jnp.arange(count, dtype=jnp.int32))
  starts = jnp.searchsorted(by_owner, jnp.arange(workers + 1, dtype=jnp.int32), side="left")
  rank = jnp.arange(count, dtype=jnp.int32) - starts[jnp.minimum(by_owner, workers)]
  fits = (by_owner < workers) & (rank < slots)
  slot = jnp.where(fits, by_owner * slots + rank, workers * slots)
  out_positions = jnp.full((workers * slots,), size, jnp.int32).at[slot].set(
      positions[order], mode="drop")
  out_values = jnp.zeros((workers * slots,), jnp.float32).at[slot].set(
      values[order].astype(jnp.float32), mode="drop")
  in_slot = jnp.zeros((count,), jnp.bool_).at[order].set(fits)
  return out_values, out_positions, in_slot


def _region_top(values, positions, size: int, keep: int):
  """An owner's received pairs summed per position, and the `keep` largest sums.

  Returns:
    ``(values, positions)`` of ``keep`` pairs, positions sentinel `size`.
  """
  received = positions.shape[0]
  sums = jnp.zeros((size,), jnp.float32).at[positions].add(values, mode="drop")
  # One candidate per position: the first pair that carried it.
  first = jnp.full((size,), received, jnp.int32).at[positions].min(
      jnp.arange(received, dtype=jnp.int32), mode="drop")
  index = jnp.arange(received, dtype=jnp.int32)
  lead = (positions < size) & (first.at[positions].get(mode="fill", fill_value=-1) == index)
  candidates = jnp.where(lead, sums.at[positions].get(mode="fill", fill_value=0.0), 0.0)
  segs = segmented.Segments((received,))
  candidates = jnp.pad(candidates, (0, segs.length - received))
  chosen, _ = segmented.top(candidates, segs, [min(keep, received)], (min(keep, received),))
  taken = chosen < received
  where = jnp.minimum(chosen, received - 1)
  out_positions = jnp.where(taken & lead[where], positions[where], size)
  out_values = jnp.where(out_positions < size, candidates[where], 0.0)
  return out_values, out_positions


def owners_mean(
    flat: jax.Array,
    values: jax.Array,
    positions: jax.Array,
    k: int,
    *,
    axis_name,
    apply: Optional[jax.Array] = None,
) -> tuple[jax.Array, jax.Array]:
  """Mean over workers of their selected pairs, summed and cut at the owners of their regions.

  Args:
    flat: float32[n] this worker's g = residual + gradient (its length is all that is read).
    values: float32[c] the pairs it selected (`engine.pick`), values...
    positions: int32[c] ...and positions, sentinel ``n``.
    k: the group's global k: the owners together keep about k positions.
    axis_name: the data-parallel axis (None: one worker).
    apply: a bool scalar, the same on every worker: False sends nothing on
      (every mean zero, nothing removed from any residual); None: True.

  Returns:
    ``(mean, sent)``: float32[n], identical on every worker (typed
    replicated), and int32[c] this worker's positions whose values the mean
    holds (sentinel ``n``): exactly those leave its residual.
  """
  size = flat.shape[0]
  workers = collectives.num_workers(axis_name)
  slots = wire.owner_slots(positions.shape[0], workers)
  keep = wire.owner_share(k, workers)
  out_values, out_positions, in_slot = _into_slots(values, positions, size, workers, slots)
  if axis_name is None:
    got_values, got_positions = out_values, out_positions
  else:
    message = collectives.pack_pairs(out_values.reshape(workers, slots),
                                     out_positions.reshape(workers, slots))
    # Row w goes to owner w; what comes back is, per sender, the pairs this worker owns.
    received = lax.all_to_all(message, axis_name, 0, 0, tiled=False)
    got_values, got_positions = collectives.unpack_pairs(received)
    got_values, got_positions = got_values.reshape(-1), got_positions.reshape(-1)
  # Divided by P before they are summed, as every mean here is: finite values
  # then never sum past the float range (exact for P a power of two).
  kept_values, kept_positions = _region_top(got_values / workers, got_positions, size, keep)
  if apply is not None:
    kept_positions = jnp.where(apply, kept_positions, size)
    kept_values = jnp.where(apply, kept_values, 0.0)
  if axis_name is None:
    rows_values, rows_positions = kept_values[None], kept_positions[None]
  else:
    rows_values, rows_positions = collectives.unpack_pairs(collectives.gather_replicated(
        collectives.pack_pairs(kept_values, kept_positions), axis_name))
  # Each position has one owner, and an owner keeps it once: no two rows add
  # into one place, so one scatter gives the same mean on every worker.
  mean = jnp.zeros((size,), jnp.float32).at[rows_positions.reshape(-1)].add(
      rows_values.reshape(-1), mode="drop")
  final = jnp.zeros((size,), jnp.bool_).at[rows_positions.reshape(-1)].set(True, mode="drop")
  mine = in_slot & final.at[positions].get(mode="fill", fill_value=False)
  return mean, jnp.where(mine, positions, size)
