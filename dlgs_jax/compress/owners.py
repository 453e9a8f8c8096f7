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
4. One all-gather of the owners' kept positions (indices only) tells every
   worker the ~k positions of the step.
5. As in gTop-k's last phase, every worker contributes its *full* value at
   those positions to one all-reduce of ~k values, and removes exactly them from
   its residual: the mean is the workers' whole mean there, and
   ``P·mean + Σ new residuals == Σ (gradients + old residuals)``. Everything
   else a worker selected (it overflowed a slot, or its owner did not keep it)
   stays in its residual.

A worker sends ``(P-1)·S`` pairs in the all-to-all (S slots per owner, about
``2c/P`` for a message of c pairs), ``(P-1)·ceil(k/P)`` indices in the
all-gather and a ring all-reduce of ``P·ceil(k/P)`` values: about
``16c + 4k + 8k`` bytes, flat in P (`wire.owners_bytes`).
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
  """This worker's pairs in ``[P, slots]`` per owner; those past an owner's slots are left out.

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
  return out_values, out_positions


def _region_top(values, positions, size: int, keep: int):
  """The positions of the `keep` largest sums of an owner's received pairs.

  Returns:
    int32[keep] positions, sentinel `size`.
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
  return jnp.where(taken & lead[where], positions[where], size)


def owners_mean(
    flat: jax.Array,
    values: jax.Array,
    positions: jax.Array,
    k: int,
    *,
    axis_name,
    apply: Optional[jax.Array] = None,
) -> tuple[jax.Array, jax.Array]:
  """Mean over workers at the positions the owners of their regions keep.

  Args:
    flat: float32[n] this worker's g = residual + gradient.
    values: float32[c] the pairs it selected (`engine.pick`), values...
    positions: int32[c] ...and positions, sentinel ``n``.
    k: the group's global k: the owners together keep about k positions.
    axis_name: the data-parallel axis (None: one worker).
    apply: a bool scalar, the same on every worker: False sends nothing on
      (every mean zero, nothing removed from any residual); None: True.

  Returns:
    ``(mean, sent)``: float32[n], identical on every worker (typed
    replicated), and int32[P·ceil(k/P)] the positions every worker removes
    from its residual (sentinel ``n``).
  """
  size = flat.shape[0]
  workers = collectives.num_workers(axis_name)
  slots = wire.owner_slots(positions.shape[0], workers)
  out_values, out_positions = _into_slots(values, positions, size, workers, slots)
  if axis_name is None:
    got_values, got_positions = out_values, out_positions
  else:
    message = collectives.pack_pairs(out_values.reshape(workers, slots),
                                     out_positions.reshape(workers, slots))
    # Row w goes to owner w; what comes back is, per sender, the pairs this worker owns.
    received = lax.all_to_all(message, axis_name, 0, 0, tiled=False)
    got_values, got_positions = collectives.unpack_pairs(received)
    got_values, got_positions = got_values.reshape(-1), got_positions.reshape(-1)
  # Scaled by 1/P as the mean is, so no sum of finite values overflows.
  kept = _region_top(got_values / workers, got_positions, size, wire.owner_share(k, workers))
  if apply is not None:
    kept = jnp.where(apply, kept, size)
  chosen = (kept if axis_name is None
            else collectives.gather_replicated(kept, axis_name).reshape(-1))
  # Divided by P before they are summed, as every mean here is: finite values
  # then never sum past the float range (exact for P a power of two).
  local = flat.astype(jnp.float32).at[chosen].get(mode="fill", fill_value=0.0) / workers
  summed = local if axis_name is None else lax.psum(local, axis_name)
  if apply is not None:
    summed = jnp.where(apply, summed, 0.0)
  # Each position has one owner, which keeps it once: no two entries write one place.
  mean = jnp.zeros((size,), jnp.float32).at[chosen].set(summed, mode="drop")
  return mean, chosen
