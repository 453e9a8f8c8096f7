"""One process of the multi-process transform test (started by test_multiprocess.py).

Usage: python mp_transform_worker.py COORDINATOR NUM_PROCESSES PROCESS_ID LOCAL_DEVICES OUT_DIR
"""

import sys

coordinator, num_processes, process_id, local_devices, out_dir = sys.argv[1:]

from dlgs_jax.training import distributed  # noqa: E402

distributed.initialize(coordinator, int(num_processes), int(process_id),
                       local_cpu_devices=int(local_devices), platform="cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import dlgs_jax  # noqa: E402
from dlgs_jax.workload import parallel  # noqa: E402
from dlgs_jax.compress import grouping  # noqa: E402
from dlgs_jax.compress.state import leaf_residuals  # noqa: E402

mesh = parallel.data_mesh()
workers = mesh.devices.size
local_rows = [i for i, d in enumerate(mesh.devices.flat) if d.process_index == jax.process_index()]
params = {"a": np.zeros((40,), np.float32), "b": {"w": np.zeros((6, 9), np.float32)}}
methods = {
    "dlgs": dlgs_jax.dlgs(0.1, axis_name="data", thresholds=dlgs_jax.AdaptedReuse(2)),
    "dlgs_gtopk": dlgs_jax.dlgs(0.1, axis_name="data", collective="gtopk"),
    "gtopk": dlgs_jax.gtopk(0.1, axis_name="data"),
    "topk": dlgs_jax.topk(0.1, axis_name="data"),
    "dense": dlgs_jax.dense(axis_name="data"),
}
results = {}
for name, tx in methods.items():
  state = parallel.stack_per_worker(tx.init(params), mesh)

  def step(g, s, tx=tx):
    u, s = tx.update(parallel.squeeze(g), parallel.squeeze(s))
    return parallel.unsqueeze(u), parallel.unsqueeze(s)

  fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("data"), P("data")),
                             out_specs=(P("data"), P("data"))))
  for t in range(3):
    rng = np.random.default_rng(t)  # same global gradients in every process
    grads = jax.tree_util.tree_map(
        lambda x: rng.standard_normal((workers,) + x.shape).astype(np.float32), params)
    local = jax.tree_util.tree_map(lambda x: x[local_rows], grads)
    update, state = fn(parallel.shard_batch(local, mesh), state)
    u = parallel.fetch(update)
    results[f"{name}/{t}/update"] = np.concatenate(
        [x.reshape(len(local_rows), -1) for x in jax.tree_util.tree_leaves(u)], axis=1)
    if hasattr(state, "residuals"):
      r = leaf_residuals(parallel.fetch(state))  # by leaf, in the gradients' order
      results[f"{name}/{t}/residual"] = np.concatenate(
          [r[p].reshape(len(local_rows), -1) for p in grouping.leaf_paths(params)], axis=1)
    results[f"{name}/{t}/grads"] = np.concatenate(
        [x.reshape(workers, -1) for x in jax.tree_util.tree_leaves(grads)], axis=1)
# Rank 0 plans; every process gets its plan (paper Sec. 3.4).
from dlgs_jax.planning import planner  # noqa: E402
from dlgs_jax.planning.timeline import LinearCost, Profile  # noqa: E402

plan = None
if jax.process_index() == 0:
  profile = Profile(model="toy", paths=["b/w", "a"], sizes=[54, 40], t_forward=1e-3,
                    t_backward=[1e-3, 2e-3], workers=workers, sparsify={},
                    comm={"allgather": LinearCost(1e-4, 1e-9)})
  plan = planner.make_plan(profile, "dlgs", 0.1, "optimal")
plan = planner.broadcast_plan(plan)
results["plan"] = np.frombuffer(plan.to_json().encode(), np.uint8)
results["rows"] = np.asarray(local_rows)
np.savez(f"{out_dir}/process{process_id}.npz", **results)
print(f"process {process_id}: {workers} workers, rows {local_rows}, done", flush=True)
