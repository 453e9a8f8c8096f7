"""Moving a run's optimizer state onto another number of workers (resuming on more or fewer).

The per-worker parts of the optimizer state (this library's transform states)
carry a leading worker axis; the rest is replicated and kept as it is. Error-feedback
residuals (and DGC's velocity) hold gradient mass not yet applied: with P workers
it enters the updates as ``sum_w e_w / P``. On P' workers each worker starts from
``sum_w e_w / P``, so ``sum_w' e'_w / P'`` is the same mass and nothing is lost.
The other per-worker values: rows identical on every worker are kept; floats that
differ (DLGS's thresholds) take the workers' mean, to be recomputed at the next
exact step; integers that differ (the statistics of the last step) take worker 0's.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from dlgs_jax.compress.state import is_per_worker

# State fields that hold gradient mass (`compress.state`): redistributed, their sum kept.
MASS_FIELDS = frozenset({"residuals", "velocity"})


def _field_names(path) -> set:
  return {getattr(key, "name", None) for key in path}


def redistribute(opt_state: Any, workers: int) -> Any:
  """One worker's row of each per-worker leaf, for a run of any number of workers.

  Args:
    opt_state: host arrays; those of this library's states with a leading axis
      of the checkpoint's P workers.
    workers: the new worker count P' (only used to check it).

  Returns:
    The tree without the worker axis: every new worker starts from it (place it
    with `workload.parallel.place_state`).

  Raises:
    ValueError: for a worker count below 1 or a leaf without a worker axis.
  """
  if workers < 1:
    raise ValueError(f"workers must be >= 1, got {workers!r}")

  def row(path, x):
    x = np.asarray(x)
    if x.ndim == 0:
      raise ValueError(f"optimizer state leaf {jax.tree_util.keystr(path)} has no worker axis")
    if _field_names(path) & MASS_FIELDS:
      # Summed in float64: the mass is kept to the rounding of one division.
      return (x.astype(np.float64).sum(0) / x.shape[0]).astype(x.dtype)
    if (x == x[:1]).all():
      return x[0]
    if np.issubdtype(x.dtype, np.floating):
      return x.astype(np.float64).mean(0).astype(x.dtype)
    return x[0]

  def visit(node):
    return jax.tree_util.tree_map_with_path(row, node) if is_per_worker(node) else node

  return jax.tree_util.tree_map(visit, opt_state, is_leaf=is_per_worker)
