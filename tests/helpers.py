"""Running a transform on P simulated workers and checking what it did."""

from __future__ import annotations

import os
import pickle
import re
import subprocess
from pathlib import Path

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from dlgs_jax.workload import data
from dlgs_jax.cluster import launch
from dlgs_jax.workload import parallel


def worker_mesh(workers: int):
  return parallel.data_mesh(workers)


def run_steps(tx, params, grads_per_step, workers, *, state=None):
  """Applies `tx` for each gradient set in `grads_per_step` on `workers` workers.

  Args:
    tx: transform built with axis_name="data".
    params: parameter tree (only shapes/dtypes matter to the transforms).
    grads_per_step: list of trees of arrays shaped (workers, *leaf_shape).
    workers: P.
    state: per-worker state to start from (default: tx.init stacked).

  Returns:
    (list of per-step updates as NumPy trees with a worker axis, final
    per-worker state as NumPy, list of per-step states as NumPy).
  """
  mesh = worker_mesh(workers)
  if state is None:
    state = parallel.stack_per_worker(tx.init(params), mesh)

  def step(g, s):
    u, s = tx.update(parallel.squeeze(g), parallel.squeeze(s))
    return parallel.unsqueeze(u), parallel.unsqueeze(s)

  spec = P("data")
  fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec)))
  updates, states = [], []
  for grads in grads_per_step:
    u, state = fn(parallel.shard_batch(grads, mesh), state)
    updates.append(jax.tree_util.tree_map(np.asarray, u))
    states.append(jax.tree_util.tree_map(np.asarray, state))
  return updates, states[-1], states


def random_grads(params, workers, rng, scale=1.0):
  return jax.tree_util.tree_map(
      lambda x: (scale * rng.standard_normal((workers,) + x.shape)).astype(np.float32), params)


def residual_tree(state, params):
  """A `DLGSState`'s or `SparseState`'s flat residual buffers as a tree shaped like `params`.

  Leaves keep the buffers' leading worker axis, if any.
  """
  from dlgs_jax.compress import grouping, state as states  # pylint: disable=g-import-not-at-top
  by_path = states.leaf_residuals(state)
  return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params),
                                      [by_path[p] for p in grouping.leaf_paths(params)])


def leaf_thresholds(state, params):
  """A `DLGSState`'s thresholds, one array per leaf of `params` in flatten order."""
  from dlgs_jax.compress import grouping  # pylint: disable=g-import-not-at-top
  by_path = {path: row[..., i] for paths, row in zip(state.stats.groups.paths, state.thresholds)
             for i, path in enumerate(paths)}
  return [by_path[p] for p in grouping.leaf_paths(params)]


def flat(tree):
  return np.concatenate([np.asarray(x).reshape(-1) for x in jax.tree_util.tree_leaves(tree)])


def flat_workers(tree):
  """(workers, total) from a tree of (workers, ...) arrays."""
  leaves = jax.tree_util.tree_leaves(tree)
  w = leaves[0].shape[0]
  return np.concatenate([np.asarray(x).reshape(w, -1) for x in leaves], axis=1)


# ------------------------------------------------------- child processes ---

ROOT = Path(__file__).resolve().parents[1]
_SHA_LINE = re.compile(r"process (\d+): params_sha256 ([0-9a-f]+)")


def inherited_xla_flags() -> str:
  """The suite's XLA flags (see conftest.py) less its device count, which each process sets."""
  return launch.without_forced_device_count(os.environ.get("XLA_FLAGS", ""))


def child_env(*, optimize: bool = False, **extra) -> dict:
  """Environment for a child JAX process: CPU, its own device count, this checkout importable.

  Args:
    optimize: compile at XLA's first optimisation level rather than none, for a child
      that spends more time running its programs than compiling them (an example's 40
      steps of a CNN: a fifth fewer CPU seconds; a transformer's, two fifths more).
    **extra: variables to set.
  """
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  flags = inherited_xla_flags()
  if optimize:
    flags = flags.replace("--xla_backend_optimization_level=0",
                          "--xla_backend_optimization_level=1")
  if flags:
    env["XLA_FLAGS"] = flags
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
  env.update(extra)
  return env


def run_group(commands_envs, timeout=400) -> list[str]:
  """Runs (command, env) pairs at once; returns their outputs, failing on any error."""
  procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True) for cmd, env in commands_envs]
  outputs = []
  try:
    for p in procs:
      outputs.append(p.communicate(timeout=timeout)[0])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for p, out in zip(procs, outputs):
    assert p.returncode == 0, out[-4000:]
  return outputs


def params_shas(output: str) -> dict[int, str]:
  """Process index -> params SHA-256 from the lines dlgs-train prints at the end."""
  return {int(m.group(1)): m.group(2) for m in _SHA_LINE.finditer(output)}


# ------------------------------------------------------------- datasets ---

def write_cifar_dir(root, per_batch=12, seed=0, labels_fn=None):
  """A miniature directory in the official CIFAR-10 python format."""
  rng = np.random.default_rng(seed)
  folder = root / "cifar-10-batches-py"
  folder.mkdir(parents=True)
  written = {}
  for name in data.CIFAR10_TRAIN_FILES + (data.CIFAR10_TEST_FILE,):
    raw = rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
    labels = [int(x) for x in rng.integers(0, 10, per_batch)]
    if labels_fn is not None:
      labels = labels_fn(name, labels)
    with open(folder / name, "wb") as f:
      pickle.dump({b"batch_label": name.encode(), b"labels": labels, b"data": raw,
                   b"filenames": [b"x.png"] * per_batch}, f)
    written[name] = (raw, labels)
  return folder, written


def write_cifar_bin_dir(root, per_batch=12, seed=0):
  """A miniature directory in the official CIFAR-10 binary format: rows of label + 3,072 bytes."""
  rng = np.random.default_rng(seed)
  folder = root / data.CIFAR10_BIN_DIR
  folder.mkdir(parents=True)
  written = {}
  for name in data.CIFAR10_BIN_TRAIN_FILES + (data.CIFAR10_BIN_TEST_FILE,):
    raw = rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
    labels = rng.integers(0, 10, per_batch).astype(np.uint8)
    (folder / name).write_bytes(np.concatenate([labels[:, None], raw], axis=1).tobytes())
    written[name] = (raw, labels)
  return folder, written


def wait_for_step(proc: subprocess.Popen, workdir, step: int, timeout: float = 300):
  """`proc` once `workdir`'s metrics reach `step`; kills it and fails if it ends or stalls first."""
  import time

  metrics = Path(workdir) / "metrics.jsonl"
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline and proc.poll() is None:
    if metrics.exists() and f'"step": {step},' in metrics.read_text():
      return proc
    time.sleep(0.02)
  proc.kill()
  raise AssertionError(f"the run ended or stalled before step {step}: {proc.communicate()}")


def smallcnn_plan(workers, fast_size=1):
  """A DLGS plan (density 0.05) for smallcnn from a made-up profile: several groups.

  Args:
    workers: the workers between which messages go (nodes, with `fast_size`).
    fast_size: devices per node of a two-level exchange; 1: flat.
  """
  from dlgs_jax.compress import grouping
  from dlgs_jax.planning import planner
  from dlgs_jax.planning.timeline import LinearCost, Profile
  from dlgs_jax.training.plans import backward_order_of
  from dlgs_jax.workload import models

  model, shape = models.create_model("smallcnn")
  variables = model.init(jax.random.key(0), jax.numpy.zeros((1,) + shape), train=False)
  order = backward_order_of(model, variables["params"], variables["batch_stats"],
                            (2,) + shape)
  sizes = dict(zip(grouping.leaf_paths(variables["params"]),
                   [int(x.size) for x in jax.tree_util.tree_leaves(variables["params"])]))
  profile = Profile(
      model="smallcnn", paths=order, sizes=[sizes[p] for p in order], t_forward=1e-3,
      t_backward=[1e-4] * len(order), workers=workers,
      sparsify={"dlgs": LinearCost(1e-4, 1e-9)},
      comm={"allgather": LinearCost(1e-3, 1e-9)}, source="test")
  fast = LinearCost(1e-5, 1e-10) if fast_size > 1 else None
  return planner.make_plan(profile, "dlgs", 0.05, "optimal", fast_size=fast_size, fast_link=fast)


def adapted_threshold(x, previous, k, rule):
  """NumPy: `rule`'s (an `AdaptedReuse`) threshold for leaf `x`, re-aimed from `previous`.

  Linear between the two candidates whose counts bracket ``rule.target * k``
  (a leaf's values passing ``|x| >= t``, nonzero, plus one half).
  """
  factors = rule.factors()
  counts = np.array([np.sum((np.abs(x) >= t) & (x != 0))
                     for t in np.float32(previous) * factors]) + 0.5
  target = rule.target * k
  lo = min(max(int(np.sum(counts > target)) - 1, 0), len(factors) - 2)
  rise = counts[lo] - target
  span = counts[lo] - counts[lo + 1]
  part = min(max(rise / span if span > 0 else float(rise > 0), 0.0), 1.0)
  return previous * (factors[lo] + part * (factors[lo + 1] - factors[lo]))
