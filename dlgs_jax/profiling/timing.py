"""Timing primitives: medians after warm-up, confidence intervals, linear fits."""

from __future__ import annotations
import math
import time
from typing import Any, Callable, Optional, Sequence
import jax
import numpy as np
from dlgs_jax.planning.timeline import LinearCost

def median_seconds(fn: Callable[[], Any], repeats: int = 5, warmup: int = 1,
                   barrier: Optional[Callable[[], Any]] = None,
                   samples: Optional[list] = None) -> float:
  """Median wall time of ``fn()`` (blocking on its result) after `warmup` calls.

  Args:
    fn: the call to time.
    repeats: timed calls.
    warmup: untimed calls first (compilation).
    barrier: called before each timed call, outside the timing (keeps the
      processes of a job in lockstep); None: no barrier.
    samples: if given, every timed call's seconds are appended to it.
  """
  for _ in range(warmup):
    jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    if barrier is not None:
      barrier()
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  if samples is not None:
    samples.extend(times)
  return float(np.median(times))


def fit_linear(x: Sequence[float], t: Sequence[float]) -> LinearCost:
  """Least-squares ``t = alpha + beta * x`` with both coefficients kept >= 0."""
  x = np.asarray(x, np.float64)
  t = np.asarray(t, np.float64)
  beta, alpha = np.polyfit(x, t, 1) if len(x) > 1 else (0.0, float(t[0]))
  if beta < 0:
    beta, alpha = 0.0, float(np.median(t))
  if alpha < 0:
    alpha, beta = 0.0, float(np.sum(x * t) / np.sum(x * x))
  return LinearCost(float(alpha), float(beta))


def median_interval(values: Sequence[float], confidence: float = 0.95
                    ) -> tuple[float, float, float]:
  """The median of `values` and a distribution-free confidence interval for it.

  The interval is between order statistics chosen from the binomial(n, 1/2)
  distribution (the sign test's): with n values sorted (from 0),
  ``[v_j, v_(n-1-j)]`` misses the median with probability ``2 P(X <= j)``,
  X ~ binomial(n, 1/2); j is the largest for which that is at most
  ``1 - confidence`` (12 values at 95%: j = 2), and 0 -- the whole range --
  where even that is more.

  Returns:
    (median, lower, upper).
  """
  v = np.sort(np.asarray(values, np.float64))
  n = len(v)
  if n == 0:
    raise ValueError("median_interval: no values")
  j, below = 0, 1.0 / 2 ** n  # below: P(X <= j)
  while j + 1 <= (n - 1) // 2:
    wider = below + math.comb(n, j + 1) / 2 ** n
    if 2 * wider > 1.0 - confidence:
      break
    j, below = j + 1, wider
  return float(np.median(v)), float(v[j]), float(v[n - 1 - j])
