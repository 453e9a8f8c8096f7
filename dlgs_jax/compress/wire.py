"""Bytes each worker puts on (and takes off) the wire for each collective.

One place for the traffic model, used both by the transforms' per-step
statistics and by the planner's communication-cost model. The counts assume the
bandwidth-optimal algorithms NCCL and gloo use: a ring all-reduce sends
2(P-1)/P of the data per worker; a ring all-gather forwards P-1 chunks.
Values are float32 and indices int32, so a sparse pair is 8 bytes (6 with
bfloat16 values on the wire).
"""

from __future__ import annotations

import math

import jax.numpy as jnp

PAIR_BYTES = 8  # float32 value + int32 index
HALF_PAIR_BYTES = 6  # bfloat16 value + int32 index (``wire_dtype="bfloat16"``)
INDEX_BYTES = 4  # an int32 index alone


WIRE_DTYPES = ("float32", "bfloat16")
# Owners' slots over an even share of a message (`owners`): a hash spreads a
# message's pairs over P owners about evenly, and what a full owner's slots
# cannot take waits in the residual for a later step.
OWNER_SLACK = 2.0


def check_wire_dtype(dtype) -> str:
  """The name of a value dtype a message may carry: float32 or bfloat16."""
  try:
    name = jnp.dtype(dtype).name
  except TypeError:
    name = None
  if name not in WIRE_DTYPES:
    raise ValueError(f"wire_dtype must be one of {WIRE_DTYPES}, got {dtype!r}")
  return name


def value_scale(collective: str, wire_dtype: str = "float32") -> float:
  """Bytes of a message with `wire_dtype` values over those of its float32 form."""
  if wire_dtype == "float32":
    return 1.0
  return {"allreduce": 0.5, "allgather": HALF_PAIR_BYTES / PAIR_BYTES}[collective]


def pair_bytes(wire_dtype: str = "float32") -> int:
  """Bytes of one (value, index) pair with values of `wire_dtype`."""
  return HALF_PAIR_BYTES if wire_dtype == "bfloat16" else PAIR_BYTES


def allreduce_bytes(num_values: int, workers: int, itemsize: int = 4) -> float:
  """Bytes sent (= received) per worker by a ring all-reduce of `num_values`."""
  if workers <= 1:
    return 0.0
  return 2.0 * (workers - 1) / workers * num_values * itemsize


def allgather_bytes(num_pairs: int, workers: int, wire_dtype: str = "float32") -> float:
  """Bytes sent (= received) per worker by a ring all-gather of `num_pairs` pairs each."""
  if workers <= 1:
    return 0.0
  return float((workers - 1) * num_pairs * pair_bytes(wire_dtype))


def gtopk_bytes(k: int, workers: int, rank=None):
  """Bytes (sent, received) by one worker in `collectives.gtopk_mean`.

  Args:
    k: pairs per message.
    workers: P.
    rank: this worker's index (int or traced int32); ``None`` gives the busiest
      worker's count, the one on the critical path.

  Returns:
    ``(sent, received)`` as floats, or float32 arrays when `rank` is traced.
  """
  if workers <= 1:
    return 0.0, 0.0
  p2 = 1 << (workers.bit_length() - 1)
  extra = workers - p2
  rounds = (p2 - 1).bit_length()
  message = k * PAIR_BYTES
  # Exact values at the agreed indices, and worker 0's copy of those indices.
  reduce = allreduce_bytes(2 * k, workers)
  if rank is None:
    # Ranks below `extra` receive the handed-over set and send the result back.
    busiest_sent = rounds * message + (extra > 0) * 4 * k + reduce
    busiest_received = rounds * message + (extra > 0) * message + reduce
    return float(busiest_sent), float(busiest_received)
  rank = jnp.asarray(rank)
  in_doubling = rank < p2
  helps_extra = rank < extra
  sent = (jnp.where(in_doubling, rounds * message, message)
          + jnp.where(helps_extra, 4 * k, 0) + reduce)
  received = (jnp.where(in_doubling, rounds * message, 4 * k)
              + jnp.where(helps_extra, message, 0) + reduce)
  return sent.astype(jnp.float32), received.astype(jnp.float32)


def owner_slots(pairs: int, workers: int) -> int:
  """Slots each owner gets in one worker's all-to-all message of `pairs` selected pairs."""
  return max(1, math.ceil(OWNER_SLACK * pairs / workers))


def owner_share(k: int, workers: int) -> int:
  """Positions each owner keeps of a group's global k (its region's share)."""
  return max(1, math.ceil(k / workers))


def owners_bytes(pairs: int, k: int, workers: int) -> float:
  """Bytes sent (= received) per worker by the owners' exchange (`owners`): flat in P.

  Args:
    pairs: the pairs a worker selects (its message's slots).
    k: the group's global k.
    workers: P.

  Returns:
    The all-to-all's ``(P-1)·S`` pairs (S slots per owner), the all-gather of
    every owner's ``ceil(k/P)`` indices, and the all-reduce of the values
    there (and of the owners' thresholds' sum and count): about
    ``16·pairs + 12·k``.
  """
  if workers <= 1:
    return 0.0
  share = owner_share(k, workers)
  return (float((workers - 1) * owner_slots(pairs, workers) * PAIR_BYTES)
          + float((workers - 1) * share * INDEX_BYTES)
          + allreduce_bytes(workers * share + 2, workers))


def packed_allgather_bytes(num_bytes: int, workers: int) -> float:
  """Bytes sent (= received) per worker by a ring all-gather of `num_bytes` bytes each."""
  if workers <= 1:
    return 0.0
  return float((workers - 1) * num_bytes)


def ternary_bytes(num_values: int) -> int:
  """Bytes of `num_values` ternary values packed four to a byte (2 bits each)."""
  return -(-num_values // 4)
