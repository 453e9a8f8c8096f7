"""What a run records: per-step metrics (JSONL), hashes of its state, its summary."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


def tree_sha256(tree) -> str:
  """SHA-256 over the raw bytes, shapes and dtypes of a tree of host arrays."""
  import jax
  import numpy as np

  digest = hashlib.sha256()
  for leaf in jax.tree_util.tree_leaves(tree):
    leaf = np.ascontiguousarray(np.asarray(leaf))
    digest.update(f"{leaf.dtype}{leaf.shape}".encode())
    digest.update(leaf.tobytes())
  return digest.hexdigest()


class MetricsLog:
  """JSONL metrics on process 0; on resume, records past the checkpoint are dropped."""

  def __init__(self, path: Path, enabled: bool, resume_step: int):
    self.path = path
    self.enabled = enabled
    self.file = None
    if not enabled:
      return
    kept = []
    if resume_step > 0 and path.exists():
      for line in path.read_text().splitlines():
        try:
          record = json.loads(line)
        except json.JSONDecodeError:
          continue  # a line cut short by a kill
        if record.get("step", 0) <= resume_step:
          kept.append(line)
    path.write_text("".join(line + "\n" for line in kept))
    self.file = open(path, "a")

  def write(self, record: dict) -> None:
    if self.file:
      self.file.write(json.dumps(record) + "\n")
      self.file.flush()

  def close(self) -> None:
    if self.file:
      self.file.close()
