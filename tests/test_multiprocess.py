"""Real processes, jax.distributed and gloo collectives on localhost."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dlgs_jax import planner

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).with_name("mp_transform_worker.py")


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def start_processes(script, num_processes, args_for, timeout=240):
  """Runs `num_processes` copies of `script`; returns their outputs (fails on any error)."""
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # each process sets its own device count
  env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
  procs = [subprocess.Popen([sys.executable, str(script), *args_for(i)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(num_processes)]
  outputs = []
  try:
    for p in procs:
      out, _ = p.communicate(timeout=timeout)
      outputs.append(out)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for p, out in zip(procs, outputs):
    assert p.returncode == 0, out[-3000:]
  return outputs


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
