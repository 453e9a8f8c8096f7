"""Several methods' train steps timed in interleaved rounds (paired comparisons).

Each round times ``steps`` steps of every method, the methods' order rotated
from round to round; on a machine whose speed drifts (shared or virtualised
cores) the methods of one round ran under the same conditions, where separate
jobs minutes apart do not.
"""

from __future__ import annotations

from pathlib import Path

from dlgs_jax.training.bench.benchmark import (BenchmarkConfig, compare_groups, exchange_of,
                                               optimizer_for, time_repetitions, workload,
                                               write_result)
from dlgs_jax.training.compiling import compile_in_turns


def _prepare(config: BenchmarkConfig, work) -> dict:
  """name -> the method's train state, step function, batches and bookkeeping.

  A name ending in ``@2l`` runs the two-level exchange on a (node, local) mesh of
  the same devices, each process a node; its batches are the same rows placed
  on that mesh.
  """
  from dlgs_jax import training
  from dlgs_jax.workload import parallel

  runs, nodes = {}, None
  for name in config.compare:
    groups, description = compare_groups(config, name, work)
    mesh, axis, fast, batches = work.mesh, "data", None, work.global_batches
    if exchange_of(name)[1]:
      nodes = nodes or _node_workload(work)
      mesh, batches = nodes
      axis, fast = tuple(mesh.axis_names), parallel.devices_per_node(mesh)
    method = config.compared_method(name)
    tx = optimizer_for(method, axis, groups, work.order, fast)
    runs[name] = {"state": training.train_state_from_variables(work.variables, tx, mesh),
                  "step": training.make_train_step(work.model, tx, mesh, augment=False),
                  "batches": batches, "turn": 0, "exact": [], "grouping": description,
                  "groups": len(groups) if groups else None,
                  "budget": method.budget if "budget" in method.spec.options else None,
                  "local": parallel.devices_per_node(mesh)}
  return runs


def _compile(runs: dict) -> None:
  """Compiles every method's step for its state and batches, running none."""
  for run in runs.values():
    run["step"].compile(run["state"], *run["batches"][0])


def _node_workload(work):
  """(node mesh, the workload's batches on it): this process's rows, in its devices' order."""
  from dlgs_jax.workload import parallel

  mesh = parallel.node_mesh()
  if mesh.devices.size != work.workers:
    raise ValueError(f"a two-level method needs every device: the compare mesh has "
                     f"{work.workers} of {mesh.devices.size}")
  return mesh, [parallel.shard_batch((work.images[i], work.labels[i]), mesh)
                for i in range(len(work.global_batches))]


def sent_on_interfaces() -> int:
  """Bytes this process's network namespace has sent, loopback excepted (the NICs' counters)."""
  total = 0
  for device in Path("/sys/class/net").iterdir():
    counter = device / "statistics" / "tx_bytes"
    if device.name != "lo" and counter.exists():
      total += int(counter.read_text())
  return total


def _one_step(run: dict, global_batches: list):
  # Each method takes the batches in the same order.
  batch = global_batches[run["turn"] % len(global_batches)]
  run["turn"] += 1
  run["state"], metrics = run["step"](run["state"], *batch)
  run["exact"].append(metrics.get("exact"))
  return metrics


def _rounds(config: BenchmarkConfig, runs: dict) -> tuple[dict, list]:
  import jax
  import numpy as np
  from jax.experimental import multihost_utils

  methods = list(config.compare)
  for name in methods:
    for _ in range(config.warmup):
      jax.block_until_ready(_one_step(runs[name], runs[name]["batches"]))
    runs[name]["exact"].clear()
  raw = {name: [] for name in methods}
  orders = []
  barrier = lambda: multihost_utils.sync_global_devices("compare")  # noqa: E731
  for r in range(config.rounds):
    # Rotated, so no method always runs first, right after the warm-ups.
    orders.append([methods[(r + j) % len(methods)] for j in range(len(methods))])
    for name in orders[-1]:
      before = sent_on_interfaces()
      raw[name].append(time_repetitions(lambda: _one_step(runs[name], runs[name]["batches"]),
                                        config.steps, barrier))
      runs[name].setdefault("sent", []).append((sent_on_interfaces() - before) / config.steps)
    if jax.process_index() == 0:
      print(f"round {r + 1}/{config.rounds}: " + ", ".join(
          f"{name} {np.median(raw[name][-1]) * 1e3:.1f}" for name in methods) + " ms",
            flush=True)
  return raw, orders


def compare(config: BenchmarkConfig, mesh) -> dict:
  """Times every method of ``config.compare``; process 0 prints and writes the result."""
  import jax
  import numpy as np

  from dlgs_jax.compress.state import comm_stats, stats_summary
  from dlgs_jax.workload import parallel

  from jax.experimental import multihost_utils

  work = workload(config, mesh)
  runs = _prepare(config, work)
  start, end = compile_in_turns(lambda: _compile(runs), config.compile_slots)
  # Every process says when it compiled (wall clock): the turns can be checked.
  print(f"process {jax.process_index()} compiled {len(runs)} steps from {start:.2f} to "
        f"{end:.2f} ({end - start:.0f} s)", flush=True)
  raw, orders = _rounds(config, runs)
  # Every process's interface counts (rounds x processes), gathered for process 0.
  sent = {name: np.asarray(multihost_utils.process_allgather(
      np.asarray(runs[name]["sent"], np.float64))).reshape(jax.process_count(), -1)
      for name in config.compare}
  result = {"model": config.model, "density": config.method.density, "workers": work.workers,
            "batch_size": config.batch_size, "image_shape": list(work.shape),
            "rounds": config.rounds, "steps": config.steps, "warmup": config.warmup,
            "round_orders": orders, "methods": {}}
  for name in config.compare:
    run = runs[name]
    stats = stats_summary(parallel.fetch(comm_stats(run["state"].opt_state)))
    exact = [float(x) for x in run["exact"] if x is not None]
    result["methods"][name] = {
        "grouping": run["grouping"], "groups": run["groups"], "budget": run["budget"],
        "median": float(np.median(np.concatenate(raw[name]))),
        "round_medians": [float(np.median(t)) for t in raw[name]],
        "raw": raw[name], "bytes_sent": stats["bytes_sent"],
        # What this process's devices put on the wire by the model, and what left
        # its network namespace by the interfaces' counters (median over rounds, mean
        # over processes); metrics and barriers count in the second only.
        "model_bytes_per_process": stats["bytes_sent"] * run["local"],
        "interface_bytes_per_process": float(np.mean(np.median(sent[name], axis=1))),
        "exact_leaves": float(np.mean(exact)) if exact else None}
  if jax.process_index() == 0:
    for name in config.compare:
      m = result["methods"][name]
      print(f"{name}: median step {m['median'] * 1e3:.1f} ms over {config.rounds} rounds "
            f"({m['grouping']})", flush=True)
  write_result(result, config.out)
  return result
