"""Several methods' train steps timed in interleaved rounds (paired comparisons).

Each round times ``steps`` steps of every method, the methods' order rotated
from round to round; on a machine whose speed drifts (shared or virtualised
cores) the methods of one round ran under the same conditions, where separate
jobs minutes apart do not.
"""

from __future__ import annotations

from dlgs_jax.training.benchmark import (BenchmarkConfig, compare_groups, optimizer_for,
                                         time_repetitions, workload, write_result)


def _prepare(config: BenchmarkConfig, work) -> dict:
  """name -> the method's train state, step function and bookkeeping."""
  from dlgs_jax import training

  runs = {}
  for name in config.compare:
    groups, description = compare_groups(config, name, work)
    tx = optimizer_for(config.compared_method(name), "data", groups, work.order)
    runs[name] = {"state": training.train_state_from_variables(work.variables, tx, work.mesh),
                  "step": training.make_train_step(work.model, tx, work.mesh, augment=False),
                  "turn": 0, "exact": [], "grouping": description,
                  "groups": len(groups) if groups else None}
  return runs


def _one_step(run: dict, global_batches: list):
  # Each method takes the batches in the same order.
  batch = global_batches[run["turn"] % len(global_batches)]
  run["turn"] += 1
  run["state"], metrics = run["step"](run["state"], *batch)
  run["exact"].append(metrics.get("exact"))
  return metrics


def _rounds(config: BenchmarkConfig, runs: dict, global_batches: list) -> tuple[dict, list]:
  import jax
  import numpy as np
  from jax.experimental import multihost_utils

  methods = list(config.compare)
  for name in methods:
    for _ in range(config.warmup):
      jax.block_until_ready(_one_step(runs[name], global_batches))
    runs[name]["exact"].clear()
  raw = {name: [] for name in methods}
  orders = []
  barrier = lambda: multihost_utils.sync_global_devices("compare")  # noqa: E731
  for r in range(config.rounds):
    # Rotated, so no method always runs first, right after the warm-ups.
    orders.append([methods[(r + j) % len(methods)] for j in range(len(methods))])
    for name in orders[-1]:
      raw[name].append(time_repetitions(lambda: _one_step(runs[name], global_batches),
                                        config.steps, barrier))
    if jax.process_index() == 0:
      print(f"round {r + 1}/{config.rounds}: " + ", ".join(
          f"{name} {np.median(raw[name][-1]) * 1e3:.1f}" for name in methods) + " ms",
            flush=True)
  return raw, orders


def compare(config: BenchmarkConfig, mesh) -> dict:
  """Times every method of ``config.compare``; process 0 prints and writes the result."""
  import jax
  import numpy as np

  import dlgs_jax
  from dlgs_jax.workload import parallel

  work = workload(config, mesh)
  runs = _prepare(config, work)
  raw, orders = _rounds(config, runs, work.global_batches)
  result = {"model": config.model, "density": config.method.density, "workers": work.workers,
            "batch_size": config.batch_size, "image_shape": list(work.shape),
            "rounds": config.rounds, "steps": config.steps, "warmup": config.warmup,
            "round_orders": orders, "methods": {}}
  for name in config.compare:
    run = runs[name]
    stats = dlgs_jax.stats_summary(parallel.fetch(dlgs_jax.comm_stats(run["state"].opt_state)))
    exact = [float(x) for x in run["exact"] if x is not None]
    result["methods"][name] = {
        "grouping": run["grouping"], "groups": run["groups"],
        "median": float(np.median(np.concatenate(raw[name]))),
        "round_medians": [float(np.median(t)) for t in raw[name]],
        "raw": raw[name], "bytes_sent": stats["bytes_sent"],
        "exact_leaves": float(np.mean(exact)) if exact else None}
  if jax.process_index() == 0:
    for name in config.compare:
      m = result["methods"][name]
      print(f"{name}: median step {m['median'] * 1e3:.1f} ms over {config.rounds} rounds "
            f"({m['grouping']})", flush=True)
  write_result(result, config.out)
  return result
