"""Where a sparse run's error-feedback residual sits, leaf by leaf, in one checkpoint.

A leaf whose residual grows far past its group's threshold passes that
threshold on every step and is still not sent: its message's buffer fills
with passing values laid out before it (the compaction keeps the first
passing values in index order). This reads a `dlgs-train` work directory's
checkpoint and its plan (the messages and their order) and writes, per leaf in
that order, the mean and largest magnitude of worker 0's residual and the share
of its values at or above its threshold.

    python experiments/residual_by_leaf.py RUN_DIR [--step N] [--out JSON]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from dlgs_jax.compress import grouping, segmented


def restore_numpy(path: Path) -> dict:
  """A checkpoint's state tree as NumPy arrays, whatever devices wrote it."""
  checkpointer = ocp.PyTreeCheckpointer()
  meta = checkpointer.metadata(path)
  tree = getattr(getattr(meta, "item_metadata", meta), "tree", meta)
  args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
  return checkpointer.restore(path, restore_args=args)


def leaf_rows(state: dict, groups: list[list[str]]) -> list[dict]:
  """Per leaf, group by group in message order: worker 0's residual statistics.

  A group with one threshold (a budget per message) holds it for every leaf;
  one threshold per leaf (a budget per layer) is read leaf by leaf.
  """
  sparse = state["opt_state"][0]
  # The plan names leaves as `grouping.leaf_paths` does.
  params = state["params"]
  sizes = dict(zip(grouping.leaf_paths(params),
                   (int(np.size(leaf)) for leaf in jax.tree_util.tree_leaves(params))))
  rows = []
  for index, paths in enumerate(groups):
    residual = np.asarray(sparse["residuals"][index])[0]
    thresholds = np.asarray(sparse["thresholds"][index])[0].reshape(-1)
    segs = segmented.segments_of([sizes[path] for path in paths])
    for leaf, (path, offset, n) in enumerate(zip(paths, segs.offsets, segs.sizes)):
      values = np.abs(residual[offset:offset + n])
      threshold = float(thresholds[leaf if thresholds.size > 1 else 0])
      rows.append({"group": index, "leaf": path, "size": n, "threshold": threshold,
                   "mean_abs": float(values.mean()), "max_abs": float(values.max()),
                   "share_at_or_above_threshold": float(np.mean(values >= threshold))})
  return rows


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("run_dir", type=Path)
  parser.add_argument("--step", type=int, default=None,
                      help="the checkpoint's step (default: the latest)")
  parser.add_argument("--out", type=Path, default=None)
  args = parser.parse_args(argv)
  steps = sorted(int(p.name) for p in (args.run_dir / "checkpoints").iterdir() if p.name.isdigit())
  if not steps:
    raise SystemExit(f"{args.run_dir}/checkpoints holds no checkpoint: pass a dlgs-train "
                     "work directory that saved one")
  step = steps[-1] if args.step is None else args.step
  if step not in steps:
    raise SystemExit(f"--step {step} has no checkpoint in {args.run_dir}; it holds {steps}")
  groups = json.loads((args.run_dir / "plan.json").read_text())["groups"]
  # orbax reads only absolute paths.
  state = restore_numpy((args.run_dir / "checkpoints" / str(step) / "state").resolve())
  rows = leaf_rows(state, groups)
  print(f"step {step}, worker 0")
  for row in rows:
    print(f"{row['group']:2d} {row['leaf']:36s} {row['size']:7d}  threshold {row['threshold']:8.3g}  "
          f"mean |r| {row['mean_abs']:9.3g}  "
          f"max {row['max_abs']:9.3g}  at or above {row['share_at_or_above_threshold']:.2f}")
  if args.out:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"run": str(args.run_dir), "step": step, "leaves": rows},
                                   indent=1) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
