"""Real processes, jax.distributed and gloo collectives on localhost."""

import sys
from pathlib import Path

import numpy as np
import pytest

from dlgs_jax.planning import planner
from dlgs_jax.cluster.launch import free_port
from tests.helpers import child_env, run_group

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).resolve().parents[1] / "mp_transform_worker.py"


def start_processes(script, num_processes, args_for, timeout=240):
  """Runs `num_processes` copies of `script`; returns their outputs (fails on any error)."""
  return run_group([([sys.executable, str(script), *args_for(i)], child_env())
                    for i in range(num_processes)], timeout=timeout)


def test_two_processes_gloo_transforms(tmp_path):
  coordinator = f"127.0.0.1:{free_port()}"
  start_processes(WORKER, 2, lambda i: [coordinator, "2", str(i), "2", str(tmp_path)])
  parts = [np.load(tmp_path / f"process{i}.npz") for i in range(2)]
  rows = np.concatenate([p["rows"] for p in parts])
  assert sorted(rows) == [0, 1, 2, 3]
  workers = 4
  plans = [p["plan"].tobytes().decode() for p in parts]
  assert plans[0] == plans[1]
  assert planner.Plan.from_json(plans[1]).workers == workers
  for name in ("dlgs", "dlgs_gtopk", "gtopk", "topk", "dense"):
    old_residual = 0.0
    for t in range(3):
      grads = parts[0][f"{name}/{t}/grads"]
      update = np.concatenate([p[f"{name}/{t}/update"] for p in parts])[np.argsort(rows)]
      for w in range(1, workers):
        np.testing.assert_array_equal(update[w], update[0])  # identical across processes
      if name == "dense":
        np.testing.assert_allclose(update[0], grads.mean(0), rtol=1e-5, atol=1e-6)
        continue
      residual = np.concatenate([p[f"{name}/{t}/residual"] for p in parts])[np.argsort(rows)]
      np.testing.assert_allclose(
          workers * update[0] + residual.sum(0), (grads + old_residual).sum(0),
          rtol=1e-5, atol=1e-5)
      assert np.count_nonzero(update[0]) > 0
      old_residual = residual
