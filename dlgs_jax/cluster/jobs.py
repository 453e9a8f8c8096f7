"""A job on the emulated cluster, as every experiment starts one: its folder, command and clock."""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from dlgs_jax.cluster import netns


@dataclasses.dataclass(frozen=True)
class ClusterJob:
  """Where a cluster experiment writes, the command that reruns it, and when it started."""
  out: Path       # the results folder (made)
  raw: Optional[Path]  # the workers' raw JSON in it (None: the experiment keeps none)
  command: str    # the command line that reruns the experiment, for its results
  started: float  # time.time() at the start


def start(script: str, out_dir, raw_name: Optional[str] = None,
          argv: Optional[Sequence[str]] = None) -> ClusterJob:
  """Exits with the reason unless the emulated cluster can be built; else the job's place.

  Args:
    script: the experiment's file name under ``experiments/``.
    out_dir: its results folder.
    raw_name: the raw JSON's file name in it, if it keeps one.
    argv: the experiment's arguments (None: this process's).
  """
  netns.exit_if_unavailable()
  out = Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  words = sys.argv[1:] if argv is None else list(argv)
  command = " ".join([f"python experiments/{script}", *words])
  return ClusterJob(out, out / raw_name if raw_name else None, command, time.time())
