"""A modelled network: link bandwidths and the alpha-beta cost of each collective."""

from __future__ import annotations
import math
from typing import Optional

import numpy as np

from dlgs_jax.compress.methods import ConfigError
from dlgs_jax.planning.timeline import LinearCost



def parse_bandwidth(text: str) -> float:
  """'1gbit', '10Gbit', '25gbps', '100mbit' -> bits per second."""
  units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9}
  lowered = str(text).strip().lower()
  for unit, factor in units.items():
    if lowered.endswith(unit):
      number = lowered[:-len(unit)]
      break
  else:
    number, factor = lowered, 1.0
  try:
    value = float(number) * factor
  except ValueError:
    raise ValueError(f"bandwidth must look like '1gbit' or '25gbit', got {text!r}") from None
  if not np.isfinite(value) or value <= 0:
    raise ValueError(f"bandwidth must be positive, got {text!r}")
  return value


def network_comm(workers: int, bandwidth_bits: float, latency: float = 25e-6) -> dict[str, LinearCost]:
  """α-β costs of each collective for `workers` on links of `bandwidth_bits`.

  Latency terms count the sequential steps of each algorithm: 2(P-1) for a ring
  all-reduce, P-1 for a ring all-gather, for gTop-k its pairwise rounds plus
  the 2(P-1) steps of the exact k-value all-reduce, and for the owners'
  exchange the P-1 steps of its all-to-all, P-1 of its all-gather and 2(P-1)
  of its all-reduce.
  Bandwidth terms use the bytes per worker of `wire`.
  """
  if workers < 1:
    raise ValueError(f"workers must be >= 1, got {workers!r}")
  if not bandwidth_bits > 0 or not latency >= 0:
    raise ValueError(f"bad network: bandwidth {bandwidth_bits!r}, latency {latency!r}")
  beta = 8.0 / bandwidth_bits
  p2 = 1 << (workers.bit_length() - 1)
  rounds = (p2 - 1).bit_length() + (2 if workers > p2 else 0)
  return {
      "allreduce": LinearCost(2 * (workers - 1) * latency, beta),
      "allgather": LinearCost((workers - 1) * latency, beta),
      "gtopk": LinearCost((rounds + 2 * (workers - 1)) * latency, beta),
      "owners": LinearCost(4 * (workers - 1) * latency, beta),
  }


def check_link(bandwidth: Optional[str], latency: float, prefix: str = "") -> None:
  """Raises `ConfigError` naming ``bandwidth`` or ``latency`` when it does not describe a link.

  Args:
    bandwidth: e.g. "1gbit", or None.
    latency: seconds per step.
    prefix: the options' prefix in the message (e.g. "fast_" for fast_bandwidth).
  """
  if not (isinstance(latency, (int, float)) and math.isfinite(latency) and latency >= 0):
    raise ConfigError(f"{prefix}latency", latency, "must be a number of seconds >= 0")
  if bandwidth is not None:
    try:
      parse_bandwidth(bandwidth)
    except ValueError as e:
      raise ConfigError(f"{prefix}bandwidth", bandwidth, str(e)) from None
