"""Where an update's time goes on a device: each step of a period, and a kernel trace.

One short device call, after `gpu_check.py` has said how far an update is from
its floor; and the same at small sizes on CPU (the tests run it):

    python experiments/gpu_profile.py --out-dir OUT                  # VGG16, density 0.01
    python experiments/gpu_profile.py --models smallcnn --out-dir OUT   # CPU, small
    python experiments/gpu_profile.py --read OUT                     # kernels per step (xprof)
    XLA_FLAGS=--xla_gpu_enable_command_buffer= python experiments/gpu_profile.py --out-dir OUT2

Per model and method (`profiling.periods.checked_updates`, every leaf in one group):

* **Each step of one schedule period timed alone** (median over ``--rounds``),
  from a warmed state on gradients drawn afresh for every step, with the number
  of leaves whose threshold the step computed exactly. The paper's rule computes
  them on the period's first step only, so its exact step and its reuse steps
  are apart; the default rule's cost per step follows its exact leaves.
* **A profiler trace of one period** (``<model>_<method>.xplane.pb``, copied
  out of JAX's profile folder) and the update's compiled HLO
  (``<model>_<method>.hlo.txt``), so a kernel in the trace can be found in the
  program.

``--read`` needs the `xprof` package (``pip install xprof``; not a dependency of
the library). Per trace it prints how much of the period the device computes and
how much it waits, the host's time in XLA:GPU's CUDA graph (rebuilt for each
call's buffers, then launched), and the kernels that take most device time. A
variant under other XLA flags (the last usage line: no CUDA graphs) is recorded
with its flags in ``profile.json``.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import importlib.util
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax

from dlgs_jax.compress.state import comm_stats
from dlgs_jax.profiling.periods import checked_updates, compiled_update, step_gradients
from dlgs_jax.profiling.records import machine, write_json
from dlgs_jax.profiling.update import warm_state
from dlgs_jax.workload import models

HERE = Path(__file__).resolve().parent

METHODS = ("topk", "lags", "dlgs-paper", "dlgs")
TRACED = ("dlgs-paper", "dlgs")
WARM_PERIODS = 2


def step_times(update, gradients: list, warmed, rounds: int) -> list[dict]:
  """Each step of one period from ``warmed``, timed alone: median ms and exact leaves."""
  times = [[] for _ in gradients]
  exact = []
  state = warmed
  for grads in gradients:  # untimed: the exact leaves of each step
    state = update(grads, state)[1]
    exact.append(int(comm_stats(state).exact))
  for _ in range(rounds):
    state = warmed
    for i, grads in enumerate(gradients):
      start = time.perf_counter()
      state = jax.block_until_ready(update(grads, state)[1])
      times[i].append(time.perf_counter() - start)
  return [{"step": i, "ms": statistics.median(t) * 1e3, "exact_leaves": e}
          for i, (t, e) in enumerate(zip(times, exact))]


def trace_period(update, gradients: list, warmed, out: Path) -> bool:
  """One period under JAX's profiler, its xplane.pb copied to `out`; False if none was written."""
  with tempfile.TemporaryDirectory() as folder:
    with jax.profiler.trace(folder):
      warm_state(update, warmed, gradients, None, len(gradients))  # one period, waited for
    found = sorted(Path(folder).rglob("*.xplane.pb"))
    if found:
      shutil.copyfile(found[-1], out)
  return bool(found)


def profile(args) -> dict:
  """Step times for every method and traces for the DLGS rules; the JSON is rewritten per row."""
  result = {"command": "python experiments/gpu_profile.py " + " ".join(args.argv),
            "machine": machine(), "density": args.density, "rows": []}
  for name in args.models:
    params = models.param_shapes(name)
    gradients = step_gradients(params, args.reuse_every)
    for method, group, tx in checked_updates(args.density, args.reuse_every, params):
      if method not in args.methods or group == "default":
        continue
      # The warmed state serves every round, so it is not donated.
      update, counts, hlo = compiled_update(tx, gradients[0], donate=False)
      warmed = warm_state(update, tx.init(gradients[0]), gradients, None,
                          WARM_PERIODS * len(gradients))
      steps = step_times(update, gradients, warmed, args.rounds)
      row = {"model": name, "method": method, "kernels": counts["kernels"],
             "conditionals": counts["conditionals"], "steps": steps}
      if method in TRACED:
        stem = f"{name}_{method}"
        row["trace"] = trace_period(update, gradients, warmed,
                                    args.out_dir / f"{stem}.xplane.pb")
        (args.out_dir / f"{stem}.hlo.txt").write_text(hlo)
      result["rows"].append(row)
      write_json(args.out_dir / "profile.json", result)
      print(f"{name} {method:10s} step 0 {steps[0]['ms']:.2f} ms ({steps[0]['exact_leaves']} "
            f"exact leaves), the others {statistics.median(s['ms'] for s in steps[1:]):.2f} ms "
            f"(median), {counts['kernels']} kernels", flush=True)
  return result


# The host's spans in XLA:GPU's runtime that say where a call's time goes when
# the device idles: the CUDA graph ("command buffer") rebuilt for each call's
# buffers, its launch, and the call's own bookkeeping.
HOST_SPANS = ("command_buffer::update", "command_buffer::execute", "cuGraphLaunch",
              "Build buffer allocations", "ParseArguments")


def trace_events(trace: Path) -> tuple[dict, dict]:
  """The device's and the host's events of a trace (``.xplane.pb`` or its gzip).

  Needs `xprof` (``pip install xprof``).

  Returns:
    ``(lines, host)``: per line of the device planes (``/device:*``) its
    ``(name, start_ns, duration_ns)`` events; per name of `HOST_SPANS` (a
    prefix) the host's total ms in it.
  """
  from xprof.profile_data import ProfileData  # optional: not a dependency of the library

  raw = trace.read_bytes()
  if trace.suffix == ".gz":
    raw = gzip.decompress(raw)
  lines, host = collections.defaultdict(list), dict.fromkeys(HOST_SPANS, 0.0)
  with ProfileData.from_serialized_xspace(raw) as data:
    for plane in data.planes:
      for line in plane.lines:
        events = [(e.name, e.start_ns, e.duration_ns) for e in line.events]
        if plane.name.startswith("/device:"):
          lines[line.name] += events
        elif plane.name.startswith("/host:"):
          for name, _, ns in events:
            span = next((h for h in HOST_SPANS if name.startswith(h)), None)
            if span:
              host[span] += ns / 1e6
  return dict(lines), host


def kernel_table(lines: dict, top: int, wait_ns: float = 1e5) -> dict:
  """The device's kernels in a trace: busy time, idle waits, and the costliest kernels.

  Args:
    lines: `trace_events`'s device lines; every line but XLA's summaries holds kernels.
    top: how many kernel names to list, by summed time.
    wait_ns: an idle gap between consecutive kernels (any stream) at least this
      long counts as a wait: the device has nothing queued while the host works
      (updating and launching a call's CUDA graph, reading a predicate,
      dispatching the next call; the host spans of `trace_events` say which).

  Returns:
    {} without kernels; else ``busy_ms``, ``span_ms`` (first start to last end),
    ``launches``, ``waits`` and ``wait_ms``, and ``kernels``: (name, ms, launches).
  """
  summaries = ("XLA Ops", "XLA Modules", "Steps", "Framework Ops", "Source code")
  kernels = sorted((e for name, events in lines.items() if name not in summaries
                    for e in events), key=lambda e: e[1])
  if not kernels:
    return {}
  by = collections.defaultdict(lambda: [0.0, 0])
  for name, _, ns in kernels:
    by[name][0] += ns / 1e6
    by[name][1] += 1
  end, gaps = kernels[0][1], []
  for _, start, ns in kernels:
    gaps.append(start - end)
    end = max(end, start + ns)
  waits = [g for g in gaps if g >= wait_ns]
  return {"busy_ms": sum(e[2] for e in kernels) / 1e6, "launches": len(kernels),
          "span_ms": (end - kernels[0][1]) / 1e6, "waits": len(waits),
          "wait_ms": sum(waits) / 1e6,
          "kernels": sorted(((n, ms, c) for n, (ms, c) in by.items()), key=lambda r: -r[1])[:top]}


def read(folder: Path, top: int) -> int:
  """Prints each trace's kernel table (`kernel_table`)."""
  traces = sorted(folder.glob("*.xplane.pb*"))
  if not traces:
    print(f"--read: no *.xplane.pb in {folder}; run without --read on a device first")
    return 1
  if importlib.util.find_spec("xprof") is None:
    print("--read needs the xprof package to parse traces: pip install xprof")
    return 1
  for trace in traces:
    lines, host = trace_events(trace)
    table = kernel_table(lines, top)
    if not table:
      print(f"\n{trace.name}: no device kernels (a CPU trace)")
      continue
    print(f"\n{trace.name}: {table['launches']} kernel launches; of "
          f"{table['span_ms']:.2f} ms the device computes {table['busy_ms']:.2f} and waits "
          f"{table['wait_ms']:.2f} in {table['waits']} gaps of >= 0.1 ms")
    print("host: " + ", ".join(f"{name} {ms:.2f} ms" for name, ms in host.items()))
    print("| kernel | ms | launches |\n|---|---|---|")
    for name, ms, n in table["kernels"]:
      print(f"| {name[:80]} | {ms:.3f} | {n} |")
  return 0


def parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", nargs="+", choices=sorted(models.MODELS), default=["vgg16"])
  parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
  parser.add_argument("--density", type=float, default=0.01)
  parser.add_argument("--reuse-every", type=int, default=10)
  parser.add_argument("--rounds", type=int, default=5, help="timed passes over the period")
  parser.add_argument("--out-dir", type=Path, default=None,
                      help="where profile.json, the traces and the HLO go")
  parser.add_argument("--read", type=Path, default=None,
                      help="print the kernel tables of this folder's traces (needs xprof)")
  parser.add_argument("--top", type=int, default=15, help="--read: kernels shown per trace")
  args = parser.parse_args(argv)
  if not 0 < args.density <= 1:
    parser.error(f"--density {args.density} is invalid: give a fraction in (0, 1]")
  if args.reuse_every < 2 or args.rounds < 1:
    parser.error(f"--reuse-every {args.reuse_every} / --rounds {args.rounds} is invalid: "
                 "a period has an exact step and reuse steps (>= 2), and rounds >= 1")
  if args.read is None and args.out_dir is None:
    parser.error("give --out-dir (to measure) or --read (to read traces)")
  args.argv = list(argv)
  return args


def main(argv=None) -> int:
  args = parse_args(sys.argv[1:] if argv is None else argv)
  if args.read is not None:
    return read(args.read, args.top)
  args.out_dir.mkdir(parents=True, exist_ok=True)
  profile(args)
  print(f"wrote {args.out_dir}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
