"""Optimizer states of the communication transforms, and reading their statistics."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np


class CommStats(NamedTuple):
  """What one worker communicated in the last step (for logging)."""
  bytes_sent: jax.Array      # float32[]: bytes this worker put on the wire
  bytes_received: jax.Array  # float32[]: bytes this worker took off the wire
  selected: jax.Array        # int32[num_groups]: values this worker sent per group
  passed: jax.Array          # int32[num_groups]: values that met the selection rule (> selected when a buffer overflowed)
  skipped: jax.Array         # int32[]: steps skipped so far because a gradient was not finite
  exact: jax.Array           # int32[]: leaves whose threshold was computed exactly this step (DLGS; 0 for the others)


class DLGSState(NamedTuple):
  """State of `dlgs` (Ju et al. 2024, Algorithm 1)."""
  count: jax.Array   # int32[]: steps taken (skipped steps not counted)
  residuals: Any     # params-shaped tree, gradient dtype: error feedback e, what was not sent yet
  thresholds: Any    # params-structured tree of float32[]: H_l per leaf, exact every `reuse_every` steps
  stats: CommStats


class SparseState(NamedTuple):
  """State of `lags`, `topk` and `gtopk`."""
  count: jax.Array   # int32[]: steps taken (skipped steps not counted)
  residuals: Any     # params-shaped tree, gradient dtype: error feedback e
  stats: CommStats


class DenseState(NamedTuple):
  """State of `dense`."""
  count: jax.Array   # int32[]: steps taken (skipped steps not counted)
  stats: CommStats


def is_per_worker(node: Any) -> bool:
  """Whether `node` is one of this library's transform states (per worker, with residuals)."""
  return isinstance(node, (DLGSState, SparseState, DenseState, TernGradState, DGCState))


def empty_stats(num_groups: int) -> CommStats:
  return CommStats(
      bytes_sent=jnp.zeros((), jnp.float32),
      bytes_received=jnp.zeros((), jnp.float32),
      selected=jnp.zeros((num_groups,), jnp.int32),
      passed=jnp.zeros((num_groups,), jnp.int32),
      skipped=jnp.zeros((), jnp.int32),
      exact=jnp.zeros((), jnp.int32),
  )


def comm_stats(opt_state: Any) -> Optional[CommStats]:
  """Finds the `CommStats` inside any optimizer state (e.g. of an `optax.chain`).

  Args:
    opt_state: the state of a transform tree containing one of this library's
      transforms, possibly wrapped (chain, MultiSteps, ...).

  Returns:
    The first `CommStats` found, or ``None``.
  """
  found = jax.tree_util.tree_leaves(
      opt_state, is_leaf=lambda x: isinstance(x, CommStats))
  for leaf in found:
    if isinstance(leaf, CommStats):
      return leaf
  return None


def comm_stats_by_path(opt_state: Any) -> dict[str, CommStats]:
  """Every `CommStats` inside an optimizer state, keyed by its path in the state.

  A chain with two compressors (e.g. one per parameter subset, through
  ``optax.multi_transform``) has two entries; a path reads as
  ``jax.tree_util.keystr`` writes it (``[0].stats`` for the first link of a chain).
  """
  found = jax.tree_util.tree_flatten_with_path(
      opt_state, is_leaf=lambda x: isinstance(x, CommStats))[0]
  return {jax.tree_util.keystr(path): leaf for path, leaf in found
          if isinstance(leaf, CommStats)}


def stats_summary(stats: CommStats) -> dict[str, float]:
  """Plain-Python numbers for a log line (averaged over a leading worker axis, if any)."""
  def scalar(x):
    return float(np.mean(np.asarray(x)))
  return {
      "bytes_sent": scalar(stats.bytes_sent),
      "bytes_received": scalar(stats.bytes_received),
      "selected": float(np.mean(np.asarray(stats.selected).sum(axis=-1))),
      "passed": float(np.mean(np.asarray(stats.passed).sum(axis=-1))),
      "skipped": float(np.max(np.asarray(stats.skipped))),
      "exact": float(np.mean(np.asarray(stats.exact))),
  }


class TernGradState(NamedTuple):
  """State of `terngrad`."""
  count: jax.Array   # int32[]: steps taken (skipped steps not counted)
  key: jax.Array     # uint32[2]: raw PRNG key; folded with the step and worker index each step
  stats: CommStats


class DGCState(NamedTuple):
  """State of `dgc` (Lin et al. 2018)."""
  count: jax.Array   # int32[]: steps taken (skipped steps not counted)
  velocity: Any      # params-shaped tree, float32: momentum u, masked where values were sent
  residuals: Any     # params-shaped tree, float32: accumulated velocity v not sent yet (0 for dense leaves)
  key: jax.Array     # uint32[2]: raw PRNG key for threshold sampling
  stats: CommStats
