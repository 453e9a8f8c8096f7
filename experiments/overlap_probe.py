"""Does XLA hide a collective behind independent computation? Measured on the cluster.

The paper's wait-free backpropagation (DLGS, Sec. 3) sends a group's gradients
while the rest of the backward pass computes; the planner only gains from
splitting the model into groups when the runtime runs the two at once
(`timeline.Profile.overlap`). This script builds the emulated cluster
(`dlgs_jax.cluster`: one network namespace per worker, tbf-shaped links, each
worker pinned to its share of the cores) and runs `dlgs_jax.cli.benchmark
--overlap-out` on every worker: `profiling.measure_overlap` times, per amount
of work per collective, a program of work only, one of collectives only, one
interleaving the two with each collective depending on its own work only
("independent": it may run under the next pieces of work), and the control
where each piece waits for the previous collective ("chained"). ``hidden`` is
the share of the smaller part the independent program hid: 1 fully, 0 not at
all. The table also gives where the compiler placed the collectives among the
independent program's instructions (`profiling.collective_schedule`).

    python experiments/overlap_probe.py                       # P=4 at 1 Gbit/s
    python experiments/overlap_probe.py --rounds 1 --steps 5  # a quick look

Writes overlap.json, overlap.md and overlap.png under --out-dir. Needs root.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROGRAMS = ("compute", "collectives", "independent", "chained")


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workers", type=int, default=4)
  parser.add_argument("--bandwidth", default="1gbit")
  parser.add_argument("--rounds", default="1,4",
                      help="work per collective, in elementwise passes over a leaf of --size "
                      "values (comma-separated)")
  parser.add_argument("--leaves", type=int, default=32, help="collectives per program")
  parser.add_argument("--size", type=int, default=200_000, help="elements per leaf")
  parser.add_argument("--steps", type=int, default=9, help="timed repetitions per program")
  parser.add_argument("--unpinned", action="store_true",
                      help="let every worker use every core (diagnostics: is one core per "
                      "process what keeps a collective from running beside the work?)")
  parser.add_argument("--out-dir", default=str(HERE / "results" / "overlap"))
  return parser.parse_args(argv)


def schedule_text(schedule) -> str:
  """``[["other", 18], ["all-gather", 32]]`` -> ``other x18, all-gather x32``."""
  return ", ".join(f"{kind} x{count}" for kind, count in schedule)


def markdown(payload) -> str:
  lines = ["| work per collective | compute ms | collectives ms | sum ms | independent ms "
           "| chained ms | hidden | compiled order (independent) |",
           "|---|---|---|---|---|---|---|---|"]
  for r in payload["results"]:
    s = {k: v * 1e3 for k, v in r["seconds"].items()}
    lines.append(
        f"| {r['rounds']} pass(es) over {r['size']} values | {s['compute']:.1f} | "
        f"{s['collectives']:.1f} | {s['compute'] + s['collectives']:.1f} | "
        f"{s['independent']:.1f} | {s['chained']:.1f} | {r['hidden']:+.2f} | "
        f"{schedule_text(r['schedule'])} |")
  return "\n".join(lines)


def plot(payload, path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from dlgs_jax.profiling import figures

  results = payload["results"]
  fig, ax = plt.subplots(figsize=(2.2 * len(results) + 2, 3.6))
  width = 0.2
  for j, name in enumerate(PROGRAMS):
    xs = [i + (j - 1.5) * width for i in range(len(results))]
    ax.bar(xs, [r["seconds"][name] * 1e3 for r in results], width, label=name)
  for i, r in enumerate(results):
    total = (r["seconds"]["compute"] + r["seconds"]["collectives"]) * 1e3
    ax.plot([i - 2 * width, i + 2 * width], [total] * 2, color="black", linewidth=1,
            label="compute + collectives" if i == 0 else None)
  ax.set_xticks(range(len(results)))
  ax.set_xticklabels([f"{r['rounds']} pass(es)\nhidden {r['hidden']:+.2f}" for r in results])
  ax.set_ylabel(f"ms per program ({results[0]['leaves']} collectives)")
  figures.finish(fig, ax, path, f"Overlap of collectives with independent work: "
                 f"P={payload['workers']} at {payload['bandwidth']} ({payload['backend']})")


def main(argv=None) -> int:
  args = parse_args(argv)
  from dlgs_jax.cluster import netns
  from dlgs_jax.cluster import jobs
  from dlgs_jax.cluster import launch

  job = jobs.start("overlap_probe.py", args.out_dir, "overlap_raw.json", argv)
  out, raw, command, started = job.out, job.raw, job.command, job.started
  with netns.EmulatedCluster(args.workers, args.bandwidth, pin=not args.unpinned) as c:
    status = launch.launch(
        args.workers, ["--overlap-out", str(raw), "--overlap-rounds", args.rounds,
                       "--overlap-leaves", str(args.leaves), "--overlap-size", str(args.size),
                       "--steps", str(args.steps)],
        grace=5, module="dlgs_jax.cli.benchmark", coordinator=c.coordinator(), wrap=c.wrap)
  if status != 0:
    print(f"the overlap measurement failed with status {status}", file=sys.stderr)
    return 1
  payload = json.loads(raw.read_text())
  raw.unlink()
  # The workers inherit XLA_FLAGS (e.g. the CPU scheduler's settings): part of the result.
  payload.update(workers=args.workers, bandwidth=args.bandwidth, command=command,
                 seconds=time.time() - started, xla_flags=os.environ.get("XLA_FLAGS", ""),
                 pinned=not args.unpinned)
  (out / "overlap.json").write_text(json.dumps(payload, indent=1))
  table = markdown(payload)
  (out / "overlap.md").write_text(table + "\n")
  plot(payload, out / "overlap.png")
  print(table)
  return 0


if __name__ == "__main__":
  sys.exit(main())
