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
3. Each owner sums what it received per position and keeps at most its
   region's share of the global k, ``ceil(k / P)``. On an exact step it keeps
   the exact top of its sums (the library's one top-k path, `segmented.top`),
   and the owners' exact thresholds, averaged, become the *global* threshold.
   On the steps between (DLGS's reuse, Ju et al. 2024; Ok-Topk re-estimates
   every 32 steps), every owner keeps the sums at or above that global
   threshold -- no select, and a region with more large sums sends more of
   its share -- the first ``ceil(k / P)`` of them in the order received.
   `keep` holds both, and one conditional serves every group of a step.
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
all-gather and a ring all-reduce of ``P·ceil(k/P)`` values (and the owners'
thresholds' sum and count): about ``16c + 4k + 8k`` bytes, flat in P
(`wire.owners_bytes`).

`owners_mean` runs the three stages for one group, its owners exact; the
transforms run `to_owners` for every group, then `keep` once for all of
them, then `share` for every group.
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from dlgs_jax.compress import collectives, common, segmented, wire

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


def _candidates(values, positions, size: int):
  """An owner's received pairs summed per position, one candidate a position.

  Returns:
    float32[received, padded to a word] the sum at each position's first pair
    (0 elsewhere), and its `segmented.Segments`.
  """
  received = positions.shape[0]
  sums = jnp.zeros((size,), jnp.float32).at[positions].add(values, mode="drop")
  first = jnp.full((size,), received, jnp.int32).at[positions].min(
      jnp.arange(received, dtype=jnp.int32), mode="drop")
  index = jnp.arange(received, dtype=jnp.int32)
  lead = (positions < size) & (first.at[positions].get(mode="fill", fill_value=-1) == index)
  candidates = jnp.where(lead, sums.at[positions].get(mode="fill", fill_value=0.0), 0.0)
  segs = segmented.Segments((received,))
  return jnp.pad(candidates, (0, segs.length - received)), segs


def _kept_positions(chosen, positions, size: int):
  """Positions of the candidates at `chosen` (indices into the received pairs), sentinel `size`."""
  received = positions.shape[0]
  where = jnp.minimum(chosen, received - 1)
  return jnp.where(chosen < received, positions[where], size)


def _exact(values, positions, size: int, keep: int):
  """The `keep` largest sums' positions, and the keep-th largest |sum| (0 if fewer are nonzero)."""
  candidates, segs = _candidates(values, positions, size)
  keep = min(keep, positions.shape[0])
  found = segmented.exact_thresholds(candidates, segs, [keep], [False])
  chosen, _ = segmented.top_at(candidates, found, segs, [keep])
  return _kept_positions(chosen, positions, size), found[0]


def _passing(values, positions, size: int, keep: int, threshold):
  """The first `keep` positions whose |sum| >= `threshold`, in the order received."""
  candidates, segs = _candidates(values, positions, size)
  keep = min(keep, positions.shape[0])
  chosen, _ = segmented.compact(segmented.pack(candidates, threshold[None], segs), segs, [keep])
  return _kept_positions(chosen, positions, size)


def to_owners(values: jax.Array, positions: jax.Array, size: int, *, axis_name
              ) -> tuple[jax.Array, jax.Array]:
  """Stage 1: this worker's pairs sent to the owners of their positions (one all-to-all).

  Args:
    values: float32[c] the pairs this worker selected (`engine.pick`), values...
    positions: int32[c] ...and positions, sentinel `size`.
    size: the group's buffer length.
    axis_name: the data-parallel axis (None: one worker).

  Returns:
    ``(values, positions)`` of the pairs this worker owns, from every sender
    (``P·S`` of them, S slots per owner), the values divided by P as the mean
    is, so that no sum of finite values overflows.
  """
  workers = collectives.num_workers(axis_name)
  slots = wire.owner_slots(positions.shape[0], workers)
  out_values, out_positions = _into_slots(values, positions, size, workers, slots)
  if axis_name is None:
    return out_values / workers, out_positions
  message = collectives.pack_pairs(out_values.reshape(workers, slots),
                                   out_positions.reshape(workers, slots))
  # Row w goes to owner w; what comes back is, per sender, the pairs this worker owns.
  got_values, got_positions = collectives.unpack_pairs(
      lax.all_to_all(message, axis_name, 0, 0, tiled=False))
  return got_values.reshape(-1) / workers, got_positions.reshape(-1)


def keep(received: Sequence[tuple[jax.Array, jax.Array]], sizes: Sequence[int],
         ks: Sequence[int], *, axis_name, exact=None, thresholds=None
         ) -> tuple[list, list]:
  """Stage 2: what every group's owner keeps of what it received, in one conditional.

  Args:
    received: per group, `to_owners`' ``(values, positions)``.
    sizes: per group, the buffer length.
    ks: per group, the global k.
    axis_name: the data-parallel axis (None: one worker).
    exact: a bool scalar, the same on every worker: keep each region's exact
      top and measure the thresholds; else keep what passes `thresholds`.
      None: exact (no conditional).
    thresholds: per group, float32[] the global threshold (with `exact`).

  Returns:
    ``(kept, found)``: per group, int32[ceil(k/P)] the kept positions
    (sentinel: the group's size), and float32[] this owner's exact threshold
    (0 on a reused step).
  """
  workers = collectives.num_workers(axis_name)
  shares = [wire.owner_share(k, workers) for k in ks]
  # Both branches typed varying (shard_map's checks) over every axis the pairs
  # vary over: each owner keeps its own (and, sliced over a node, each slice's).
  axes = tuple(sorted(set(common.axes_of(axis_name)).union(
      *(collectives.varying_axes(v) for v, _ in received)), key=str))

  def exact_step(_):
    out = [_exact(v, p, size, share) for (v, p), size, share in zip(received, sizes, shares)]
    return common.as_varying(([kept for kept, _ in out], [found for _, found in out]), axes)

  def reused_step(_):
    return common.as_varying(
        ([_passing(v, p, size, share, t)
          for (v, p), size, share, t in zip(received, sizes, shares, thresholds)],
         [jnp.zeros((), jnp.float32) for _ in received]), axes)

  if exact is None:
    return exact_step(None)
  return lax.cond(exact, exact_step, reused_step, None)


def share(flat: jax.Array, kept: jax.Array, found: jax.Array, *, axis_name,
          apply: Optional[jax.Array] = None) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Stage 3: the owners' kept positions to everyone, and the workers' mean there.

  Args:
    flat: float32[n] this worker's g = residual + gradient.
    kept: int32[ceil(k/P)] the positions this worker keeps as an owner (`keep`).
    found: float32[] its exact threshold (`keep`; 0 on a reused step).
    axis_name: the data-parallel axis (None: one worker).
    apply: a bool scalar, the same on every worker: False sends nothing on
      (every mean zero, nothing removed from any residual); None: True.

  Returns:
    ``(mean, sent, threshold)``: float32[n], identical on every worker (typed
    replicated); int32[P·ceil(k/P)] the positions every worker removes from
    its residual (sentinel ``n``); float32[] the owners' exact thresholds
    averaged over the owners that kept any (0 on a reused step, or when none did).
  """
  size = flat.shape[0]
  workers = collectives.num_workers(axis_name)
  if apply is not None:
    kept = jnp.where(apply, kept, size)
  chosen = (kept if axis_name is None
            else collectives.gather_replicated(kept, axis_name).reshape(-1))
  # Divided by P before they are summed, as every mean here is: finite values
  # then never sum past the float range (exact for P a power of two). The
  # owner's threshold, and whether it found one, ride in the same all-reduce:
  # two values more, no collective of their own.
  local = jnp.concatenate([
      flat.astype(jnp.float32).at[chosen].get(mode="fill", fill_value=0.0) / workers,
      jnp.stack([found, (found > 0).astype(jnp.float32)])])
  summed = local if axis_name is None else lax.psum(local, axis_name)
  threshold = summed[-2] / jnp.maximum(summed[-1], 1.0)
  summed = summed[:-2]
  if apply is not None:
    summed = jnp.where(apply, summed, 0.0)
  # Each position has one owner, which keeps it once: no two entries write one place.
  mean = jnp.zeros((size,), jnp.float32).at[chosen].set(summed, mode="drop")
  return mean, chosen, threshold


def owners_mean(
    flat: jax.Array,
    values: jax.Array,
    positions: jax.Array,
    k: int,
    *,
    axis_name,
    apply: Optional[jax.Array] = None,
) -> tuple[jax.Array, jax.Array]:
  """Mean over workers at the positions the owners of their regions keep, each owner exact.

  Args:
    flat: float32[n] this worker's g = residual + gradient.
    values: float32[c] the pairs it selected (`engine.pick`), values...
    positions: int32[c] ...and positions, sentinel ``n``.
    k: the group's global k: the owners together keep about k positions.
    axis_name: the data-parallel axis (None: one worker).
    apply: as in `share`.

  Returns:
    ``(mean, sent)`` as `share`'s first two.
  """
  size = flat.shape[0]
  received = to_owners(values, positions, size, axis_name=axis_name)
  kept, found = keep([received], [size], [k], axis_name=axis_name)
  mean, sent, _ = share(flat, kept[0], found[0], axis_name=axis_name, apply=apply)
  return mean, sent
