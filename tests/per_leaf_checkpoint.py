"""Rewrites a run's newest checkpoint as runs before flat residual buffers wrote it.

Those runs kept each sparse transform's residuals as a tree shaped like the
parameters, each leaf with its worker axis, and its thresholds as one scalar
per leaf and worker, in the same state types and fields, and named no
``state_layout`` in their identity (nor DLGS's ``method.budget``, a threshold per
layer, the run's ``--budget layer``, or ``method.aim``, 0.9). Used by tests/cli/test_train.py:

    python -m tests.per_leaf_checkpoint <dlgs-train flags of the run, --workdir included>
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import jax
import numpy as np

from dlgs_jax.cli import train
from dlgs_jax.compress import common, grouping
from dlgs_jax.compress.state import DLGSState, SparseState, leaf_residuals
from dlgs_jax.training.persistence import checkpoint
from dlgs_jax.training.run import build_run, run_identity
from dlgs_jax.workload import parallel


def per_leaf(node, params):
  """A flat-buffer state as the per-leaf one it replaced (host arrays)."""
  seen = jax.tree_util.tree_map(lambda x: None if common.is_passive(x) else x, params)
  structure = jax.tree_util.tree_structure(seen)
  paths = grouping.leaf_paths(seen)
  residuals = leaf_residuals(node)
  node = node._replace(residuals=jax.tree_util.tree_unflatten(
      structure, [np.asarray(residuals[p]) for p in paths]))
  if isinstance(node, DLGSState):
    by_path = {p: np.asarray(row)[:, i] for ps, row in zip(node.stats.groups.paths,
                                                           node.thresholds)
               for i, p in enumerate(ps)}
    node = node._replace(thresholds=jax.tree_util.tree_unflatten(
        structure, [by_path[p] for p in paths]))
  return node


def main(argv) -> None:
  config = train.config_from_args(argv)
  run = build_run(config)
  directory = Path(config.checkpoint.workdir) / "checkpoints"
  reader = checkpoint.Checkpointer(directory, run_identity(run))
  state, record = reader.restore(run.state)
  reader.close()
  host = parallel.fetch(state)
  kinds = (DLGSState, SparseState)
  old = host._replace(opt_state=jax.tree_util.tree_map(
      lambda n: per_leaf(n, host.params) if isinstance(n, kinds) else n, host.opt_state,
      is_leaf=lambda x: isinstance(x, kinds)))
  identity = {k: v for k, v in record["identity"].items()
              if k not in ("state_layout", "method.budget", "method.aim")}
  shutil.rmtree(directory)
  writer = checkpoint.Checkpointer(directory, identity)
  writer.save(int(record["step"]), old, data_position=record["data"],
              plan_json=record["plan"])
  writer.wait()
  writer.close()


if __name__ == "__main__":
  main(sys.argv[1:])
