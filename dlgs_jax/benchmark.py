"""Iteration time and its measured breakdown, on the processes of the current job.

Run one copy per process (e.g. by `dlgs_jax.cluster` or ``dlgs-launch
--module dlgs_jax.benchmark``). Every process times, in lockstep (a barrier
before each repetition), five jitted programs:

* ``compute``  -- forward + backward on the local batch;
* ``compress`` -- compute + the method's update with ``axis_name=None`` and
  the params update: selection, residual bookkeeping and the optimizer, no
  communication;
* ``exchange`` -- the method's update and the params update inside
  ``shard_map`` on fixed gradients: selection + collectives, no
  forward/backward;
* ``update``   -- the same update on the same gradients and state with
  ``axis_name=None``: ``exchange`` without its collectives;
* ``step``     -- the real training step (compute, selection, collectives).

The step is timed first, from initialisation; the four others then run at
the params and optimizer state the timed steps left (``compress`` moves its
own copy of the params on, as training does): at initialisation ResNets'
gradients are mostly exact zeros, which makes selections cheaper than in
training. Each repetition takes the next of ``--batches`` distinct batches per worker:
real CIFAR-10 images (the embedded subset) when the input is 32x32x3, random
images otherwise, and the train step uses training's learning rate: DLGS's
refresh rule and DGC's threshold search depend on how gradients and residuals
change from step to step, so they must change as in training. The result
records how many leaves DLGS computed exact thresholds for per step.

Breakdown (medians): compute; sparsification = compress - compute;
non-overlapped communication = step - compress; communication alone =
exchange - update (the two programs differ only by the collectives; before,
exchange - (compress - compute), which also counted what the update costs
differently fused with the backward pass); overlap = communication alone -
non-overlapped (how much of the collectives XLA hid behind the backward pass).
"Communication alone" can be far below what the collectives cost by
themselves: TernGrad's 161 all-gathers on ResNet-50 added 0.22 s to its update,
about a sixth of their latency-bound price (experiments/README.md, "Where
TernGrad's collectives go").

With ``--compare dense,topk,dlgs-paper,...`` it instead times only the train
steps of several methods in one job, interleaved: ``--rounds`` rounds, each
timing ``--steps`` steps of every method, the methods' order rotated from round
to round. Each round's medians are a paired comparison: on a machine whose
speed drifts (shared or virtualised cores), the methods of one round ran under
the same conditions, where separate jobs minutes apart do not.

With ``--profile-out`` it instead measures a planner profile on the same
processes (`profiler.profile_model`) and writes it from process 0. With
``--overlap-out`` it instead asks whether the runtime hides a collective behind
independent computation (`profiler.measure_overlap`, once per
``--overlap-rounds`` value, ``--steps`` repetitions each) and writes the
results from process 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# The programs every process times, in the order of ``per_process_median``'s columns.
PROGRAMS = ("compute", "compress", "exchange", "update", "step")


def parse_args(argv=None):
  parser = argparse.ArgumentParser(prog="python -m dlgs_jax.benchmark",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="resnet20")
  parser.add_argument("--method", default="dlgs")
  parser.add_argument("--density", type=float, default=0.01)
  parser.add_argument("--reuse-every", type=int, default=10)
  parser.add_argument("--refresh-below", default="0.5",
                      help="DLGS refresh rule, as in dlgs-train ('none': the paper's schedule)")
  parser.add_argument("--min-ndim", type=int, default=0,
                      help="DLGS/LAGS: leaves with fewer dimensions sent whole, as in dlgs-train")
  parser.add_argument("--send-whole", default="",
                      help="DLGS/LAGS: leaves sent whole ('head': the output layer), as in "
                      "dlgs-train")
  parser.add_argument("--batch-size", type=int, default=8)
  parser.add_argument("--image-size", type=int)
  parser.add_argument("--plan", help="plan JSON giving the method's groups")
  parser.add_argument("--steps", type=int, default=20, help="timed repetitions per program")
  parser.add_argument("--warmup", type=int, default=3)
  parser.add_argument("--batches", type=int, default=8,
                      help="distinct batches per worker, taken in turn by the repetitions")
  parser.add_argument("--out", help="JSON result (written by process 0)")
  parser.add_argument("--profile-out", help="measure a planner profile instead, write it here")
  parser.add_argument("--profile-methods", default="",
                      help="--profile-out: the methods whose update is timed (comma-separated; "
                      "default every modelled method)")
  parser.add_argument("--overlap-out",
                      help="measure whether collectives overlap independent work instead "
                      "(profiler.measure_overlap), write the JSON here")
  parser.add_argument("--overlap-rounds", default="1,4",
                      help="--overlap-out: work per collective, in elementwise passes over a "
                      "leaf (comma-separated: one measurement each)")
  parser.add_argument("--overlap-leaves", type=int, default=32,
                      help="--overlap-out: collectives per program")
  parser.add_argument("--overlap-size", type=int, default=200_000,
                      help="--overlap-out: elements of work per collective")
  parser.add_argument("--compare",
                      help="time the train steps of these methods or variants (comma-separated, "
                      "e.g. dense,topk,dlgs-paper) interleaved in rounds instead")
  parser.add_argument("--rounds", type=int, default=8,
                      help="--compare: rounds; each times --steps steps of every method")
  parser.add_argument("--plans", default="",
                      help="--compare: METHOD=PLAN.json,... groups for dense/DLGS/LAGS methods; "
                      "dense and DLGS methods without one send the model as one message, LAGS "
                      "one message per leaf")
  return parser.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  for name in ("batches", "steps", "batch_size"):
    if getattr(args, name) < 1:
      raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
  profile_methods = check_profile_methods(args)
  if args.compare:
    check_compare(args)
  elif args.plans:
    raise SystemExit(f"--plans is for --compare; got --plans {args.plans!r} without it")
  from dlgs_jax import distributed
  distributed.initialize()

  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax.experimental import multihost_utils
  from jax.sharding import PartitionSpec as P

  import dlgs_jax
  from dlgs_jax import data, grouping, models, parallel, planner, profiler, train, training

  settings = train.parse_args(["--method", args.method, "--density", str(args.density),
                               "--reuse-every", str(args.reuse_every),
                               "--refresh-below", args.refresh_below,
                               "--min-ndim", str(args.min_ndim),
                               "--send-whole", args.send_whole])
  train.check_args(settings)
  mesh = parallel.data_mesh()
  if args.overlap_out:
    return _overlap(args, mesh, multihost_utils)
  workers = int(mesh.devices.size)
  leader = jax.process_index() == 0
  model, shape = models.create_model(args.model)
  if args.image_size:
    shape = (args.image_size, args.image_size, shape[2])
  local = parallel.local_worker_count(mesh)
  images, labels = data.benchmark_batches(shape, model.num_classes, args.batches, local,
                                          args.batch_size, first_worker=jax.process_index() * local)
  if args.profile_out:
    # In lockstep, as the timed runs are: processes sharing a core share it.
    barrier = ((lambda: multihost_utils.sync_global_devices("profile"))
               if jax.process_count() > 1 else None)
    # The refresh rate is measured on the batches the timed runs take (this
    # process's first worker's).
    profile, details = profiler.profile_model(
        args.model, density=args.density, batch_size=args.batch_size,
        image_size=args.image_size, mesh=mesh, reuse_every=args.reuse_every, barrier=barrier,
        refresh_below=train.refresh_below(settings),
        batches=(images[:, 0], labels[:, 0]), **profile_methods,
        progress=report_profile if leader else lambda message: None)
    if leader:
      profile.save(args.profile_out)
      with open(args.profile_out + ".details.json", "w") as f:
        # The raw timings too, so a profile can be fitted again without measuring.
        json.dump(details, f, indent=1)
      print(f"profile written to {args.profile_out}: {profile.source}", flush=True)
    return 0

  sample = np.zeros((1,) + shape, np.uint8)
  variables = training.init_variables(model, sample, seed=0)
  order = train.backward_order_of(model, variables["params"], variables.get("batch_stats", {}),
                                  sample.shape)
  global_batches = [parallel.shard_batch((images[i], labels[i]), mesh)
                    for i in range(args.batches)]
  if args.compare:
    return _compare(args, mesh, model, variables, order, global_batches, shape,
                    multihost_utils)
  plan = planner.Plan.load(args.plan) if args.plan else None
  if plan is not None:
    plan.check_compatible(paths=grouping.leaf_paths(variables["params"]), workers=workers)
  groups = plan.groups if plan else None
  # Training's learning rate: how fast gradients drift decides how often DLGS
  # must recompute a reused threshold.
  tx = train.build_optimizer(settings, "data", settings.lr, groups, order)
  tx_local = train.build_optimizer(settings, None, settings.lr, groups, order)
  state = training.train_state_from_variables(variables, tx, mesh)
  step_fn = training.make_train_step(model, tx, mesh, augment=False)

  # This process's first worker's batches, for the programs that run on one device.
  xs = [jnp.asarray(images[i, 0]) for i in range(args.batches)]
  ys = [jnp.asarray(labels[i, 0]) for i in range(args.batches)]

  def timed(run):
    for _ in range(args.warmup):
      jax.block_until_ready(run())
    return time_repetitions(run, args.steps, lambda: multihost_utils.sync_global_devices("bench"))

  holder = {"state": state, "turn": 0}

  def next_batch():
    holder["turn"] = (holder["turn"] + 1) % args.batches
    return holder["turn"]

  exact_leaves = []  # per step of the train-step program (device scalars)

  def run_step():
    holder["state"], metrics = step_fn(holder["state"], *global_batches[next_batch()])
    exact_leaves.append(metrics.get("exact"))
    return metrics

  raw = {"step": timed(run_step)}

  # The other programs start where the timed steps left the model, not at
  # initialisation: there ResNets' zero-initialised residual scales make most
  # gradients exact zeros (81% on ResNet-50), and a selection's cost depends on
  # its values (sorting ties is cheap).
  params = jax.device_put(parallel.fetch(holder["state"].params), jax.local_devices()[0])
  batch_stats = jax.device_put(parallel.fetch(holder["state"].batch_stats),
                               jax.local_devices()[0])

  grad_fn = jax.jit(lambda p, x, y: training.batch_gradients(model, p, batch_stats, x, y)[0])

  @jax.jit
  def compress_fn(p, s, x, y):
    # Moves its own copy of the params as the step does, so the gradients'
    # values keep changing as in training.
    updates, s = tx_local.update(grad_fn(p, x, y), s, p)
    return optax.apply_updates(p, updates), s

  # Every worker exchanges the same gradients; `update` takes them unstacked.
  grads_one = grad_fn(params, xs[0], ys[0])
  grads_fixed = parallel.stack_per_worker(grads_one, mesh)

  def exchange(g, s, p):
    # The params update too, as in compress: their difference is the collectives.
    u, s = tx.update(parallel.squeeze(g), parallel.squeeze(s), p)
    return optax.apply_updates(p, u), parallel.unsqueeze(s)

  exchange_fn = jax.jit(jax.shard_map(exchange, mesh=mesh, in_specs=(P("data"), P("data"), P()),
                                      out_specs=(P(), P("data")), check_vma=False))
  # Committed to the device like compress's outputs: an uncommitted initial state
  # compiles compress a second time, inside the first timed repetition.
  holder.update(local_params=params,
                local=jax.device_put(tx_local.init(params), jax.local_devices()[0]))

  def run_compress():
    i = next_batch()
    holder["local_params"], holder["local"] = compress_fn(holder["local_params"],
                                                          holder["local"], xs[i], ys[i])
    return holder["local_params"]

  def run_compute():
    i = next_batch()
    return grad_fn(params, xs[i], ys[i])

  raw["compute"] = timed(run_compute)
  raw["compress"] = timed(run_compress)
  raw["exchange"] = timed(lambda: exchange_fn(grads_fixed, holder["state"].opt_state,
                                              holder["state"].params))
  # exchange's inputs as this process's first worker holds them, updated without
  # collectives: the difference between the two programs is the collectives alone.
  state_local = jax.device_put(jax.tree_util.tree_map(
      lambda x: x[0], parallel.fetch(holder["state"].opt_state)), jax.local_devices()[0])

  @jax.jit
  def update_fn(g, s, p):
    u, s = tx_local.update(g, s, p)
    return optax.apply_updates(p, u), s

  raw["update"] = timed(lambda: update_fn(grads_one, state_local, params))
  stats = dlgs_jax.stats_summary(parallel.fetch(dlgs_jax.comm_stats(holder["state"].opt_state)))
  med = {k: float(np.median(v)) for k, v in raw.items()}
  # Every process's medians, so the slowest worker is visible too.
  all_med = np.asarray(multihost_utils.process_allgather(
      np.asarray([med[k] for k in PROGRAMS], np.float32)))
  result = {
      "model": args.model, "method": args.method, "density": args.density,
      "workers": workers, "batch_size": args.batch_size, "image_shape": list(shape),
      "plan_groups": len(plan.groups) if plan else None,
      "median": med, "per_process_median": all_med.reshape(-1, len(PROGRAMS)).tolist(),
      "per_process_programs": list(PROGRAMS),
      "breakdown": {
          "compute": med["compute"],
          "sparsify": max(med["compress"] - med["compute"], 0.0),
          "comm_exposed": max(med["step"] - med["compress"], 0.0),
          "comm_alone": max(med["exchange"] - med["update"], 0.0),
          "update": med["update"],
      },
      "bytes_sent": stats["bytes_sent"], "selected": stats["selected"],
      # DLGS: leaves whose threshold was computed exactly, mean over the timed
      # steps, out of `leaves` (the schedule alone gives leaves / reuse_every).
      "exact_leaves": (float(np.mean([float(x) for x in exact_leaves[-args.steps:]]))
                       if exact_leaves and exact_leaves[-1] is not None else None),
      "leaves": len(jax.tree_util.tree_leaves(variables["params"])),
      "raw": raw,
  }
  result["breakdown"]["overlap"] = (result["breakdown"]["comm_alone"]
                                    - result["breakdown"]["comm_exposed"])
  if leader:
    print(f"{args.model} {args.method} P={workers}: step {med['step'] * 1e3:.1f} ms, compute "
          f"{med['compute'] * 1e3:.1f}, sparsify {result['breakdown']['sparsify'] * 1e3:.1f}, "
          f"comm exposed {result['breakdown']['comm_exposed'] * 1e3:.1f}, comm alone "
          f"{result['breakdown']['comm_alone'] * 1e3:.1f} ms, {stats['bytes_sent'] / 1e6:.2f} MB "
          "sent per worker", flush=True)
    if args.out:
      with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
  return 0


def time_repetitions(run, repetitions: int, barrier) -> list[float]:
  """Seconds of each of `repetitions` calls of `run`, every process starting together.

  Args:
    run: does one repetition and returns its (device) result.
    repetitions: how many to time.
    barrier: called before each repetition (all processes wait for each other).

  Returns:
    The wall time of each repetition, up to its result being ready.
  """
  import jax

  times = []
  for _ in range(repetitions):
    barrier()
    start = time.perf_counter()
    jax.block_until_ready(run())
    times.append(time.perf_counter() - start)
  return times


def parse_plans(text: str) -> dict:
  """``"dense=a.json,dlgs=b.json"`` -> ``{"dense": "a.json", "dlgs": "b.json"}``."""
  plans = {}
  for item in filter(None, text.split(",")):
    method, sep, path = item.partition("=")
    if not sep or not method or not path:
      raise SystemExit(f"--plans entries are METHOD=PLAN.json, got {item!r}")
    plans[method] = path
  return plans


def report_profile(message: str) -> None:
  """Prints a profile phase (`profile_model`'s progress), at once."""
  print(f"profile: {message}", flush=True)


def check_profile_methods(args) -> dict:
  """`profile_model`'s methods argument from --profile-methods ({} for its default)."""
  if not args.profile_methods:
    return {}
  if not args.profile_out:
    raise SystemExit(f"--profile-methods is for --profile-out; got --profile-methods "
                     f"{args.profile_methods!r} without it")
  from dlgs_jax.timeline import MODELLED

  methods = args.profile_methods.split(",")
  unknown = [m for m in methods if m not in MODELLED]
  if unknown or len(set(methods)) != len(methods):
    raise SystemExit(f"--profile-methods {args.profile_methods!r}: give distinct methods of "
                     f"{', '.join(MODELLED)}" + (f" (unknown: {', '.join(unknown)})"
                                                 if unknown else ""))
  return {"methods": tuple(methods)}


def check_compare(args) -> None:
  """Exits with a message naming the bad value unless ``--compare``'s settings make sense."""
  from dlgs_jax.train import METHODS, variant

  methods = args.compare.split(",")
  if len(set(methods)) != len(methods) or "" in methods:
    raise SystemExit(f"--compare needs distinct method names, got {args.compare!r}")
  bases = {name: variant(name)[0] for name in methods}
  unknown = [name for name, base in bases.items() if base not in METHODS]
  if unknown:
    raise SystemExit(f"--compare: unknown methods {unknown} (methods: {', '.join(METHODS)}, "
                     "or a variant such as dlgs-paper)")
  if args.rounds < 1:
    raise SystemExit(f"--rounds must be >= 1, got {args.rounds}")
  if args.plan:
    raise SystemExit(f"--compare takes its plans as --plans METHOD=PLAN.json, got --plan "
                     f"{args.plan!r}")
  plans = parse_plans(args.plans)
  stray = sorted(set(plans) - set(methods))
  if stray:
    raise SystemExit(f"--plans names methods not in --compare: {stray}")
  fixed = sorted(name for name in plans if bases[name] not in ("dense", "dlgs", "lags"))
  if fixed:
    raise SystemExit(f"--plans: {fixed} send a fixed message layout and take no plan")


def compare_settings(args, name: str):
  """Checked ``dlgs-train`` settings of method or variant `name` in a ``--compare`` run.

  The shared flags apply as given (--min-ndim and --send-whole to the LAGS
  and DLGS methods only, the others have no such setting), and a variant's own
  flags win over them (``dlgs-paper`` is DLGS with ``--refresh-below none``).
  """
  from dlgs_jax import train

  base, extra = train.variant(name)
  layer_wise = (["--min-ndim", str(args.min_ndim), "--send-whole", args.send_whole]
                if base in ("lags", "dlgs") else [])
  settings = train.parse_args(["--method", base, "--density", str(args.density),
                               "--reuse-every", str(args.reuse_every),
                               "--refresh-below", args.refresh_below, *layer_wise, *extra])
  train.check_args(settings)
  return settings


def _compare(args, mesh, model, variables, order, global_batches, shape,
             multihost_utils) -> int:
  """``--compare``: every method's train step, timed in interleaved rounds."""
  import jax
  import numpy as np

  import dlgs_jax
  from dlgs_jax import grouping, parallel, planner, train, training

  methods = args.compare.split(",")
  plans = parse_plans(args.plans)
  workers = int(mesh.devices.size)
  paths = grouping.leaf_paths(variables["params"])
  leader = jax.process_index() == 0
  runs = {}
  for name in methods:
    base = train.variant(name)[0]
    settings = compare_settings(args, name)
    if name in plans:
      plan = planner.Plan.load(plans[name])
      plan.check_compatible(paths=paths, workers=workers)
      groups, grouping_name = plan.groups, f"plan {os.path.basename(plans[name])}"
    elif base in ("dense", "dlgs"):
      # What the optimal planner chooses where collectives do not overlap computation.
      groups, grouping_name = [list(order)], "one message"
    else:
      groups, grouping_name = None, "the method's own"
    tx = train.build_optimizer(settings, "data", settings.lr, groups, order)
    runs[name] = {"state": training.train_state_from_variables(variables, tx, mesh),
                  "step": training.make_train_step(model, tx, mesh, augment=False),
                  "turn": 0, "exact": [], "grouping": grouping_name,
                  "groups": len(groups) if groups else None}

  def one_step(run):
    # Each method takes the batches in the same order.
    batch = global_batches[run["turn"] % len(global_batches)]
    run["turn"] += 1
    run["state"], metrics = run["step"](run["state"], *batch)
    run["exact"].append(metrics.get("exact"))
    return metrics

  for name in methods:
    for _ in range(args.warmup):
      jax.block_until_ready(one_step(runs[name]))
    runs[name]["exact"].clear()
  raw = {name: [] for name in methods}
  orders = []
  for r in range(args.rounds):
    # Rotated, so no method always runs first, right after the warm-ups.
    orders.append([methods[(r + j) % len(methods)] for j in range(len(methods))])
    for name in orders[-1]:
      raw[name].append(time_repetitions(lambda: one_step(runs[name]), args.steps,
                                        lambda: multihost_utils.sync_global_devices("compare")))
    if leader:
      print(f"round {r + 1}/{args.rounds}: " + ", ".join(
          f"{name} {np.median(raw[name][-1]) * 1e3:.1f}" for name in methods) + " ms",
            flush=True)
  result = {"model": args.model, "density": args.density, "workers": workers,
            "batch_size": args.batch_size, "image_shape": list(shape),
            "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup,
            "round_orders": orders, "methods": {}}
  for name in methods:
    run = runs[name]
    stats = dlgs_jax.stats_summary(parallel.fetch(dlgs_jax.comm_stats(run["state"].opt_state)))
    exact = [float(x) for x in run["exact"] if x is not None]
    result["methods"][name] = {
        "grouping": run["grouping"], "groups": run["groups"],
        "median": float(np.median(np.concatenate(raw[name]))),
        "round_medians": [float(np.median(t)) for t in raw[name]],
        "raw": raw[name], "bytes_sent": stats["bytes_sent"],
        "exact_leaves": float(np.mean(exact)) if exact else None}
  if leader:
    for name in methods:
      m = result["methods"][name]
      print(f"{name}: median step {m['median'] * 1e3:.1f} ms over {args.rounds} rounds "
            f"({m['grouping']})", flush=True)
    if args.out:
      with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
  return 0


def _overlap(args, mesh, multihost_utils) -> int:
  """``--overlap-out``: `profiler.measure_overlap` at each ``--overlap-rounds``."""
  import jax

  from dlgs_jax import profiler

  try:
    rounds = [int(r) for r in args.overlap_rounds.split(",")]
  except ValueError:
    raise SystemExit(f"--overlap-rounds must be comma-separated integers, got "
                     f"{args.overlap_rounds!r}") from None
  if min(rounds) < 1 or args.overlap_leaves < 1 or args.overlap_size < 2_000:
    raise SystemExit(f"--overlap-rounds must be >= 1 (got {args.overlap_rounds!r}), "
                     f"--overlap-leaves >= 1 (got {args.overlap_leaves}), --overlap-size "
                     f">= 2000 (got {args.overlap_size})")
  barrier = lambda: multihost_utils.sync_global_devices("overlap")  # noqa: E731
  leader = jax.process_index() == 0
  results = []
  for r in rounds:
    result = profiler.measure_overlap(mesh, leaves=args.overlap_leaves, size=args.overlap_size,
                                      rounds=r, repeats=args.steps, barrier=barrier)
    results.append(result)
    if leader:
      ms = {k: f"{v * 1e3:.1f}" for k, v in result["seconds"].items()}
      print(f"overlap, {r} rounds of work per collective: {ms} ms, hidden "
            f"{result['hidden']:+.2f}", flush=True)
  if leader:
    with open(args.overlap_out, "w") as f:
      json.dump({"backend": jax.default_backend(), "processes": jax.process_count(),
                 "results": results}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
