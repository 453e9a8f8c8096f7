"""Which method is faster, measured as a paired comparison on the emulated cluster.

`bench_cluster.py` profiles the cluster, plans each method and times it as its
own job, minutes apart: what the timeline model is checked against. On a machine
whose speed drifts, a few percent between two such jobs is not a measured
difference, so which method is faster is measured here: this script runs `dlgs_jax.cli.benchmark --compare` once on the
cluster's workers: every method's train step is compiled in the same job and
timed in interleaved rounds (``--steps`` steps of each method per round, the
order rotated each round). Per round, each method's median step gives a paired
ratio to the reference method (the first in ``--methods``) and an ordering of the
methods; over the rounds that gives a speedup with its spread and how often
each method beat each other one.

    python experiments/compare_cluster.py --model resnet20 --density 0.01
    python experiments/compare_cluster.py --model vgg16 --rounds 6 --steps 3
    python experiments/compare_cluster.py --model resnet20 --rounds 2 --steps 2 --warmup 1  # quick

Dense and DLGS methods send the model as one message unless ``--plan-dir``
holds `bench_cluster.py`'s plan for them (``plan_<model>_<method>_<density>.json``),
which is what the optimal planner chooses on this cluster (collectives do not
overlap computation there: `overlap_probe.py`). With ``--profile`` each
method's step predicted by the timeline model from that profile goes next to
its measured median (``--measure-profile``: the profile is measured first, on
the same cluster, in the same run). Writes
``compare_<model>_<density>.{json,md,png}`` under --out-dir. Needs root.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="resnet20")
  parser.add_argument("--density", type=float, default=0.01)
  parser.add_argument("--methods", default="dense,topk,gtopk,dlgs,dlgs-paper",
                      help="comma-separated; the first is the reference of the speedups")
  parser.add_argument("--workers", type=int, default=4, help="namespaces (nodes)")
  parser.add_argument("--local-devices", type=int, default=1,
                      help="CPU devices per node; METHOD@2l names then run the two-level "
                      "exchange, plain names one flat axis over every device")
  parser.add_argument("--bandwidth", default="1gbit")
  parser.add_argument("--batch-size", type=int, default=8)
  parser.add_argument("--image-size", type=int)
  parser.add_argument("--rounds", type=int, default=10)
  parser.add_argument("--steps", type=int, default=5, help="steps of each method per round")
  parser.add_argument("--warmup", type=int, default=3)
  parser.add_argument("--plan-dir", help="use bench_cluster.py's plans from this directory")
  parser.add_argument("--profile",
                      help="a planner profile (JSON) of this model on this cluster: each "
                      "method's predicted step goes next to its measured one")
  parser.add_argument("--measure-profile", action="store_true",
                      help="measure --profile first, on the same cluster (the update timed for "
                      "the compared methods only)")
  parser.add_argument("--compile-slots", type=int,
                      help="nodes compiling at once, the others waiting their turn: the "
                      "emulated nodes share this machine's memory (default: all at once)")
  parser.add_argument("--out-dir", default=str(HERE / "results" / "compare"))
  return parser.parse_args(argv)


def sign_test(wins: int, losses: int) -> float:
  """Two-sided sign test: the chance of a split at least this uneven if neither is faster."""
  n = wins + losses
  if n == 0:
    return 1.0
  tail = sum(math.comb(n, i) for i in range(min(wins, losses) + 1)) / 2 ** n
  return min(1.0, 2 * tail)


def summarize(payload) -> list[dict]:
  """Per method: median step, round medians' range, paired speedup over the reference.

  The speedup of method m in round r is reference_r / m_r (round medians); its
  median over the rounds and the smallest and largest are reported, with the
  sign test's p-value of m being faster or slower than the reference in as
  many rounds as it was.
  """
  methods = list(payload["methods"])
  ref = np.asarray(payload["methods"][methods[0]]["round_medians"])
  rows = []
  for name in methods:
    m = payload["methods"][name]
    rounds = np.asarray(m["round_medians"])
    ratio = ref / rounds
    faster, slower = int(np.sum(rounds < ref)), int(np.sum(rounds > ref))
    predicted = payload.get("predicted", {}).get(name)
    rows.append({"method": name, "grouping": m["grouping"], "groups": m.get("groups"),
                 "predicted": predicted["t_iter"] if predicted else None,
                 "prediction_error": (predicted["t_iter"] / m["median"] - 1.0
                                      if predicted else None),
                 "median": m["median"],
                 "round_min": float(rounds.min()), "round_max": float(rounds.max()),
                 "speedup": float(np.median(ratio)), "speedup_min": float(ratio.min()),
                 "speedup_max": float(ratio.max()), "bytes_sent": m["bytes_sent"],
                 "faster_than_reference": faster, "p_value": sign_test(faster, slower)})
  return rows


def predictions(payload, profile, shapes, plans: dict) -> dict:
  """The timeline model's step of every compared method that it models, as the comparison ran it.

  Args:
    payload: the comparison (its "methods" and "density").
    profile: a `timeline.Profile` of the model on this cluster.
    shapes: leaf path -> parameter shape.
    plans: method -> `planner.Plan` the method ran with; dense and DLGS
      methods without one sent the model as one message (the benchmark's
      --compare), the others their fixed layout.

  Returns:
    method -> the predicted breakdown (`timeline.Timeline.breakdown`, seconds).
  """
  from dlgs_jax.planning.pricing import PREDICTABLE, method_costs
  from dlgs_jax.compress.methods import METHODS, base_method
  from dlgs_jax.planning import planner
  from dlgs_jax.planning.timeline import simulate

  out = {}
  for name in payload["methods"]:
    if name not in PREDICTABLE:
      continue
    costs = method_costs(name, payload["density"], profile, shapes)
    if name in plans:
      groups = plans[name].group_indices(profile.paths)
    elif METHODS[base_method(name)].grouping == "optimal":
      groups = [list(range(profile.num_layers))]
    else:
      groups = planner.PLANNER_FUNCTIONS[METHODS[base_method(name)].grouping](profile, costs)
    out[name] = simulate(profile, groups, costs).breakdown()
  return out


def wins(payload) -> dict:
  """``wins[a][b]``: rounds in which a's median step was shorter than b's."""
  medians = {k: np.asarray(v["round_medians"]) for k, v in payload["methods"].items()}
  return {a: {b: int(np.sum(medians[a] < medians[b])) for b in medians if b != a}
          for a in medians}


def markdown(payload) -> str:
  methods = list(payload["methods"])
  rounds = payload["rounds"]
  predicted = bool(payload.get("predicted"))
  lines = [f"| method | grouping | median step ms | round medians ms (min-max) | speedup vs "
           f"{methods[0]} (median, min-max over rounds) | rounds faster than {methods[0]} "
           "| sign test p | MB sent/worker | MB/step leaving a node: model / interface counters |"
           + (" predicted ms | error |" if predicted else ""),
           "|---|---|---|---|---|---|---|---|---|" + ("---|---|" if predicted else "")]
  for r in summarize(payload):
    model = ""
    if predicted:
      model = (f" {r['predicted'] * 1e3:.1f} | {r['prediction_error'] * 100:+.0f}% |"
               if r["predicted"] is not None else " - | - |")
    grouping = r["grouping"] + (f" ({r['groups']} group{'s' if r['groups'] > 1 else ''})"
                                if r["groups"] else "")
    reference = r["method"] == methods[0]
    lines.append(
        f"| {r['method']} | {grouping} | {r['median'] * 1e3:.1f} | "
        f"{r['round_min'] * 1e3:.1f}-{r['round_max'] * 1e3:.1f} | {r['speedup']:.2f}x "
        f"({r['speedup_min']:.2f}-{r['speedup_max']:.2f}) | "
        f"{'-' if reference else r['faster_than_reference']} / {rounds} | "
        f"{'-' if reference else format(r['p_value'], '.2g')} | "
        f"{r['bytes_sent'] / 1e6:.2f} | {_node_bytes(payload['methods'][r['method']])} |"
        + model)
  table = wins(payload)
  lines += ["", f"Rounds (of {rounds}) in which the row's method had the shorter median step "
            "than the column's:", "",
            "| | " + " | ".join(methods) + " |", "|---|" + "---|" * len(methods)]
  for a in methods:
    lines.append(f"| {a} | " + " | ".join("-" if a == b else str(table[a][b])
                                           for b in methods) + " |")
  return "\n".join(lines)


def _node_bytes(m) -> str:
  if "interface_bytes_per_process" not in m:
    return "-"
  return (f"{m['model_bytes_per_process'] / 1e6:.2f} / "
          f"{m['interface_bytes_per_process'] / 1e6:.2f}")


def plot(payload, path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from dlgs_jax.profiling import figures

  fig, ax = plt.subplots(figsize=(7, 3.8))
  for name, m in payload["methods"].items():
    rounds = np.arange(1, len(m["round_medians"]) + 1)
    ax.plot(rounds, np.asarray(m["round_medians"]) * 1e3, marker="o", label=name)
  ax.set_xlabel("round (every method timed in each, order rotated)")
  ax.set_ylabel("median step ms in the round")
  figures.finish(fig, ax, path, f"{payload['model']}, density {payload['density']:g}: "
                 f"P={payload['workers']} at {payload.get('bandwidth', '?')}, "
                 f"{payload['steps']} steps per method per round")


def main(argv=None) -> int:
  args = parse_args(argv)
  methods = args.methods.split(",")
  from dlgs_jax.cluster import netns
  from dlgs_jax.cluster import jobs
  from dlgs_jax.cluster import launch
  from dlgs_jax.compress import state as state_layout
  from dlgs_jax.workload.models import leaf_shapes
  from dlgs_jax.planning.planner import Plan
  from dlgs_jax.planning.timeline import Profile
  from dlgs_jax.compress.methods import METHODS, base_method
  from dlgs_jax.training.bench.benchmark import exchange_of

  from dlgs_jax.training.compiling import check_slots
  try:
    check_slots(args.compile_slots)
  except ValueError as error:
    raise SystemExit(str(error)) from None
  if args.measure_profile and not args.profile:
    raise SystemExit("--measure-profile writes the profile to --profile: give its path")
  if args.profile and not args.measure_profile and not Path(args.profile).exists():
    raise SystemExit(f"--profile {args.profile!r}: no such file (add --measure-profile to "
                     "measure it on the cluster)")
  from dlgs_jax.planning.pricing import plan_file, profiled_methods, require_update_costs

  if args.profile and not args.measure_profile:
    # Before the comparison runs, not after: a method the profile did not time
    # cannot be predicted.
    try:
      require_update_costs(methods, Profile.load(args.profile))
    except ValueError as error:
      raise SystemExit(f"--profile {args.profile!r}: {error} (add --measure-profile)") from None
  plans = {}
  if args.plan_dir:
    for name in methods:
      path = plan_file(args.plan_dir, args.model, name, args.density)
      if path.exists() and METHODS[base_method(exchange_of(name)[0])].takes_groups:
        plans[name] = path
  stem = f"compare_{args.model}_{args.density:g}"
  job = jobs.start("compare_cluster.py", args.out_dir, f"{stem}_raw.json", argv)
  out, raw, command = job.out, job.raw, job.command
  common = ["--model", args.model, "--density", str(args.density), "--batch-size",
            str(args.batch_size)] + (["--image-size", str(args.image_size)]
                                     if args.image_size else [])
  bench_args = common + ["--compare", args.methods, "--rounds", str(args.rounds),
                         "--steps", str(args.steps), "--warmup", str(args.warmup),
                         "--out", str(raw)] + (
                             ["--compile-slots", str(args.compile_slots)]
                             if args.compile_slots is not None else [])
  if plans:
    bench_args += ["--plans", ",".join(f"{name}={path}" for name, path in plans.items())]
  started = time.time()
  with netns.EmulatedCluster(args.workers, args.bandwidth) as c:
    def bench(extra, what):
      status = launch.launch(args.workers, extra, grace=5, module="dlgs_jax.cli.benchmark",
                             coordinator=c.coordinator(), wrap=c.wrap,
                             local_devices=args.local_devices)
      if status != 0:
        print(f"{what} failed with status {status}", file=sys.stderr)
      return status

    if args.measure_profile:
      if bench(common + ["--profile-out", args.profile,
                         "--profile-methods", ",".join(profiled_methods(methods))],
               "the profile"):
        return 1
    if bench(bench_args, "the comparison"):
      return 1
  payload = json.loads(raw.read_text())
  if args.profile:
    profile = Profile.load(args.profile)
    payload.update(profile=str(args.profile), predicted=predictions(
        payload, profile, leaf_shapes(args.model, image_size=args.image_size),
        {name: Plan.load(path) for name, path in plans.items()}))
  # Which engine's state the sparse methods kept, so a table can tell runs apart.
  payload.update(layout=state_layout.LAYOUT)
  payload.update(bandwidth=args.bandwidth, command=command, seconds=time.time() - started,
                 summary=summarize(payload), wins=wins(payload))
  (out / f"{stem}.json").write_text(json.dumps(payload, indent=1))
  table = markdown(payload)
  (out / f"{stem}.md").write_text(table + "\n")
  plot(payload, out / f"{stem}.png")
  raw.unlink()
  print(table)
  return 0


if __name__ == "__main__":
  sys.exit(main())
