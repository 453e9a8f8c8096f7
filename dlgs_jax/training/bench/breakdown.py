"""One method's iteration time broken down into compute, selection and communication.

The five programs and how the breakdown follows from them are described in
`dlgs_jax.training.bench.benchmark`.
"""

from __future__ import annotations

from typing import Callable

from dlgs_jax.training.bench.benchmark import (PROGRAMS, BenchmarkConfig, Workload,
                                               optimizer_for, time_repetitions, workload,
                                               write_result)


class _Programs:
  """The five timed programs of one method, sharing their state as training would."""

  def __init__(self, config: BenchmarkConfig, work: Workload, groups):
    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils

    from dlgs_jax import training

    self.config, self.work = config, work
    self.tx = optimizer_for(config.method, "data", groups, work.order)
    self.tx_local = optimizer_for(config.method, None, groups, work.order)
    self.state = training.train_state_from_variables(work.variables, self.tx, work.mesh)
    self.step_fn = training.make_train_step(work.model, self.tx, work.mesh, augment=False)
    # This process's first worker's batches, for the programs that run on one device.
    self.xs = [jnp.asarray(work.images[i, 0]) for i in range(config.batches)]
    self.ys = [jnp.asarray(work.labels[i, 0]) for i in range(config.batches)]
    self.turn = 0
    self.exact_leaves = []  # per step of the train-step program (device scalars)
    self.barrier = lambda: multihost_utils.sync_global_devices("bench")
    self.jax = jax

  def timed(self, run: Callable) -> list[float]:
    for _ in range(self.config.warmup):
      self.jax.block_until_ready(run())
    return time_repetitions(run, self.config.steps, self.barrier)

  def next_batch(self) -> int:
    self.turn = (self.turn + 1) % self.config.batches
    return self.turn

  def run_step(self):
    self.state, metrics = self.step_fn(self.state, *self.work.global_batches[self.next_batch()])
    self.exact_leaves.append(metrics.get("exact"))
    return metrics

  def local_programs(self) -> dict[str, list[float]]:
    """Times compute, compress, exchange and update where the timed steps left the model.

    Not at initialisation: there ResNets' zero-initialised residual scales make
    most gradients exact zeros, and a selection's cost depends
    on its values (sorting ties is cheap).
    """
    import optax
    from jax.sharding import PartitionSpec as P

    from dlgs_jax.workload import losses, parallel

    jax, work, tx, tx_local = self.jax, self.work, self.tx, self.tx_local
    device = jax.local_devices()[0]
    params = jax.device_put(parallel.fetch(self.state.params), device)
    batch_stats = jax.device_put(parallel.fetch(self.state.model_state), device)
    grad_fn = jax.jit(lambda p, x, y: losses.batch_gradients(work.model, p, batch_stats, x, y)[0])

    @jax.jit
    def compress_fn(p, s, x, y):
      # Moves its own copy of the params as the step does, so the gradients'
      # values keep changing as in training.
      updates, s = tx_local.update(grad_fn(p, x, y), s, p)
      return optax.apply_updates(p, updates), s

    # Every worker exchanges the same gradients; `update` takes them unstacked.
    grads_one = grad_fn(params, self.xs[0], self.ys[0])
    grads_fixed = parallel.stack_per_worker(grads_one, work.mesh)

    def exchange(g, s, p):
      # The params update too, as in compress: their difference is the collectives.
      u, s = tx.update(parallel.squeeze(g), parallel.squeeze_state(s), p)
      return optax.apply_updates(p, u), parallel.unsqueeze_state(s)

    specs = parallel.state_specs(self.state.opt_state, "data")
    exchange_fn = jax.jit(jax.shard_map(exchange, mesh=work.mesh,
                                        in_specs=(P("data"), specs, P()),
                                        out_specs=(P(), specs)))
    # Committed to the device like compress's outputs: an uncommitted initial state
    # compiles compress a second time, inside the first timed repetition.
    local = {"params": params, "state": jax.device_put(tx_local.init(params), device)}

    def run_compress():
      i = self.next_batch()
      local["params"], local["state"] = compress_fn(local["params"], local["state"],
                                                    self.xs[i], self.ys[i])
      return local["params"]

    def run_compute():
      i = self.next_batch()
      return grad_fn(params, self.xs[i], self.ys[i])

    raw = {"compute": self.timed(run_compute), "compress": self.timed(run_compress)}
    raw["exchange"] = self.timed(lambda: exchange_fn(grads_fixed, self.state.opt_state,
                                                     self.state.params))
    # exchange's inputs as this process's first worker holds them, updated without
    # collectives: the difference between the two programs is the collectives alone.
    state_local = jax.device_put(parallel.map_state(
        lambda x: x[0], lambda x: x, parallel.fetch(self.state.opt_state)), device)

    @jax.jit
    def update_fn(g, s, p):
      u, s = tx_local.update(g, s, p)
      return optax.apply_updates(p, u), s

    raw["update"] = self.timed(lambda: update_fn(grads_one, state_local, params))
    return raw


def breakdown(config: BenchmarkConfig, mesh) -> dict:
  """Times the five programs of ``config.method``; process 0 prints and writes the result."""
  import jax

  from dlgs_jax.compress import grouping
  from dlgs_jax.planning import planner

  work = workload(config, mesh)
  plan = planner.Plan.load(config.plan) if config.plan else None
  if plan is not None:
    plan.check_compatible(paths=grouping.leaf_paths(work.variables["params"]),
                          workers=work.workers)
  programs = _Programs(config, work, plan.groups if plan else None)
  raw = {"step": programs.timed(programs.run_step)}
  raw.update(programs.local_programs())
  result = _result(config, programs, raw, plan)
  if jax.process_index() == 0:
    med, parts = result["median"], result["breakdown"]
    print(f"{config.model} {config.method.name} P={work.workers}: step "
          f"{med['step'] * 1e3:.1f} ms, compute {med['compute'] * 1e3:.1f}, sparsify "
          f"{parts['sparsify'] * 1e3:.1f}, comm exposed {parts['comm_exposed'] * 1e3:.1f}, "
          f"comm alone {parts['comm_alone'] * 1e3:.1f} ms, "
          f"{result['bytes_sent'] / 1e6:.2f} MB sent per worker", flush=True)
  write_result(result, config.out)
  return result


def _result(config: BenchmarkConfig, programs: _Programs, raw: dict, plan) -> dict:
  import jax
  import numpy as np
  from jax.experimental import multihost_utils

  from dlgs_jax.compress.state import comm_stats, stats_summary
  from dlgs_jax.workload import parallel

  work = programs.work
  stats = stats_summary(parallel.fetch(comm_stats(programs.state.opt_state)))
  med = {k: float(np.median(v)) for k, v in raw.items()}
  # Every process's medians, so the slowest worker is visible too.
  all_med = np.asarray(multihost_utils.process_allgather(
      np.asarray([med[k] for k in PROGRAMS], np.float32)))
  exact = programs.exact_leaves
  parts = {
      "compute": med["compute"],
      "sparsify": max(med["compress"] - med["compute"], 0.0),
      "comm_exposed": max(med["step"] - med["compress"], 0.0),
      "comm_alone": max(med["exchange"] - med["update"], 0.0),
      "update": med["update"],
  }
  parts["overlap"] = parts["comm_alone"] - parts["comm_exposed"]
  return {
      "model": config.model, "method": config.method.name, "density": config.method.density,
      "workers": work.workers, "batch_size": config.batch_size, "image_shape": list(work.shape),
      "plan_groups": len(plan.groups) if plan else None,
      "median": med, "per_process_median": all_med.reshape(-1, len(PROGRAMS)).tolist(),
      "per_process_programs": list(PROGRAMS),
      "breakdown": parts,
      "bytes_sent": stats["bytes_sent"], "selected": stats["selected"],
      # DLGS: leaves whose threshold was computed exactly, mean over the timed
      # steps, out of `leaves` (the schedule alone gives leaves / reuse_every).
      "exact_leaves": (float(np.mean([float(x) for x in exact[-config.steps:]]))
                       if exact and exact[-1] is not None else None),
      "leaves": len(jax.tree_util.tree_leaves(work.variables["params"])),
      "raw": raw,
  }
