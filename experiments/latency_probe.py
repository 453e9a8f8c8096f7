"""Does the profile's collective latency depend on how many collectives it chains?

`profiling.measure_comm` prices a collective's latency as the marginal cost of
one more collective in a program, ``(T(chain) - T(1)) / (chain - 1)`` at the
smallest message, with ``chain = 8``. The methods that send one collective per
leaf pay 59-161 of them a step, so a chain of 8 could carry too much of the
program's launch and the workers' arrival skew. This script builds the
emulated cluster (`dlgs_jax.cluster`) and measures that latency with each of
``--chains``, in ``--passes`` interleaved passes, on every worker at once.

    python experiments/latency_probe.py                 # P=4 at 1 Gbit/s, chains 8,32,64

Writes latency.json and latency.md under --out-dir. Needs root.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
KINDS = ("allreduce", "allgather", "gtopk")


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workers", type=int, default=4)
  parser.add_argument("--bandwidth", default="1gbit")
  parser.add_argument("--chains", default="8,32,64", help="collectives per timed program")
  parser.add_argument("--passes", type=int, default=2, help="times each chain is measured")
  parser.add_argument("--size", type=int, default=4096, help="leaf size of the chained message")
  parser.add_argument("--density", type=float, default=0.1)
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--out-dir", default=str(HERE / "results" / "latency"))
  parser.add_argument("--worker-out", help=argparse.SUPPRESS)  # set for the launched workers
  args = parser.parse_args(argv)
  try:
    args.chain_list = [int(c) for c in args.chains.split(",")]
  except ValueError:
    parser.error(f"--chains takes integers, got {args.chains!r}")
  if min(args.chain_list) < 2 or args.passes < 1:
    parser.error(f"--chains must be >= 2 and --passes >= 1, got {args.chains!r}, {args.passes}")
  return args


def worker(args) -> int:
  """One process of the cluster: measure_comm at each chain, every process together."""
  from dlgs_jax.training import distributed
  distributed.initialize()
  import jax
  from dlgs_jax.workload import parallel
  from dlgs_jax import profiling

  mesh = parallel.data_mesh()
  rows = []
  for p in range(args.passes):
    for chain in args.chain_list:
      # A second, larger size only because measure_comm fits a slope over sizes.
      _, raw = profiling.measure_comm(mesh, [args.size, 16 * args.size], args.density,
                                     repeats=args.repeats, chain=chain)
      rows += latency_rows(raw["latency"], p)
  if jax.process_index() == 0:
    Path(args.worker_out).write_text(json.dumps(rows))
  return 0


def latency_rows(latency: dict, pass_index: int) -> list[dict]:
  """One row per collective kind of `measure_comm`'s ``raw["latency"]``.

  ``marginal`` is the latency the profile prices (before it subtracts the
  message's bytes times the fitted slope): ``(chained - lone) / (chain - 1)``.
  """
  return [{"pass": pass_index, "chain": lat["chain"], "kind": kind, "lone": lat["lone"],
           "chained": lat["chained"],
           "marginal": (lat["chained"] - lat["lone"]) / (lat["chain"] - 1)}
          for kind, lat in ((k, latency[k]) for k in KINDS)]


def markdown(rows, chains) -> str:
  lines = ["| chain | " + " | ".join(f"{k} marginal ms" for k in KINDS) + " | "
           + " | ".join(f"{k} lone ms" for k in KINDS) + " |",
           "|---|" + "---|" * (2 * len(KINDS))]
  for chain in chains:
    def cell(kind, key):
      return ", ".join(f"{r[key] * 1e3:.2f}" for r in rows
                       if r["chain"] == chain and r["kind"] == kind)
    lines.append(f"| {chain} | " + " | ".join(cell(k, "marginal") for k in KINDS) + " | "
                 + " | ".join(cell(k, "lone") for k in KINDS) + " |")
  return "\n".join(lines)


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.worker_out:
    return worker(args)
  from dlgs_jax.cluster import netns
  from dlgs_jax.cluster import jobs
  from dlgs_jax.cluster import launch

  job = jobs.start("latency_probe.py", args.out_dir, "latency_raw.json", argv)
  out, raw, command, started = job.out, job.raw, job.command, job.started
  env = {"PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent),
                                        os.environ.get("PYTHONPATH", "")])}
  child = ["--chains", args.chains, "--passes", str(args.passes), "--size", str(args.size),
           "--density", str(args.density), "--repeats", str(args.repeats),
           "--worker-out", str(raw)]
  with netns.EmulatedCluster(args.workers, args.bandwidth) as c:
    status = launch.launch(args.workers, child, grace=5, module="latency_probe",
                           coordinator=c.coordinator(), wrap=c.wrap, extra_env=env)
  if status != 0:
    print(f"the latency measurement failed with status {status}", file=sys.stderr)
    return 1
  rows = json.loads(raw.read_text())
  raw.unlink()
  payload = {"workers": args.workers, "bandwidth": args.bandwidth, "size": args.size,
             "density": args.density, "chains": args.chain_list, "rows": rows,
             "command": command, "seconds": time.time() - started}
  (out / "latency.json").write_text(json.dumps(payload, indent=1))
  table = markdown(rows, args.chain_list)
  (out / "latency.md").write_text(table + "\n")
  print(table)
  return 0


if __name__ == "__main__":
  sys.exit(main())
