"""The device check: each method's update against its memory floor, and forward+backward.

One command that fits a limited time on an accelerator (`--budget-s`; its run
time is in the report), and the same script at reduced sizes on CPU (the tests
run it):

    python experiments/gpu_check.py                          # VGG16, ResNet-50; 0.01, 0.1
    python experiments/gpu_check.py --small                  # ResNet-20, tiny batches (CPU)
    python experiments/gpu_check.py --models vgg16 --densities 0.01 --budget-s 300
    python experiments/gpu_check.py --methods dlgs-paper dlgs --one-group   # the targets only

What it measures, per model (VGG16 and ResNet-50 leaf shapes) and density:

* **The floor**: one fused program that adds the residual to the gradient,
  compares with a per-leaf threshold, and writes the masked values and the new
  residual. Every error-feedback sparsifier reads the gradient and the residual
  and writes both, so no update can cost less.
* **Each method's whole update on one worker** (residual, selection, pack,
  unpack, scatter back; ``axis_name=None``, so no communication): dense,
  Top-k, gTop-k, LAGS, and DLGS on the paper's fixed reuse and with the
  default rule, LAGS and DLGS with every leaf in one group and with the
  default grouping. Each update runs one whole reuse period on gradients drawn
  afresh for every step, from a state warmed over two periods and then carried
  from call to call, donated as a training step donates it (the floor's
  residuals too; `profiling.periods.schedule_period`). Rounds alternate the floor and the
  update; the ratio reported is the median of the rounds' ratios.
* **What each compiled update is made of** on this backend: conditionals
  (each waits for the host on GPU), sorts and top-k calls, kernels
  (`profiling.programs`), read from the executable that is timed.
* **Forward+backward** of the model at a realistic batch, so the update's share
  of a step is known.
* **The whole step** (``--whole-step``, on by default): forward, backward and
  the update in one jitted program, one worker (P = 1), at that batch, for
  dense, Top-k and DLGS under both rules (default grouping), over one reuse
  period: what a user's step costs, fused as XLA fuses it.
* **The bandwidth floor**: the floor pass's bytes (the gradient and the
  residual read, the message and the residual written) over the bandwidth a
  large device-to-device copy reaches, so each update is also given as a
  multiple of what memory allows.
* **Exactness first**: whether the selection's running sums, float32 products
  with a triangle of ones, come out exact on this device (a dot that rounded
  its inputs, as TF32 does, would compact the wrong values).

Work runs in order of importance (floors and forward+backward, then density
0.01 with one group, then the default grouping, then 0.1) and stops starting
new work once ``--budget-s`` is spent; the JSON is rewritten after every row,
so a slot cut short still leaves what was measured. Prints a table at the end.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import dlgs_jax
from dlgs_jax.compress import segmented
from dlgs_jax.profiling import programs
from dlgs_jax.profiling.periods import (checked_updates, compiled_update, schedule_period,
                                        step_gradients)
from dlgs_jax.profiling.records import machine, write_json
from dlgs_jax.workload import losses, models

HERE = Path(__file__).resolve().parent

# Realistic per-device batches for forward+backward: (batch, image side).
FULL_BATCH = {"vgg16": (128, 32), "resnet50": (64, 224), "resnet20": (128, 32),
              "smallcnn": (128, 32)}
SMALL_BATCH = {"vgg16": (4, 32), "resnet50": (2, 32), "resnet20": (4, 32), "smallcnn": (4, 32)}


def floor_pass(grads: list, residuals: list, thresholds: list):
  """The least an error-feedback sparsifier costs: one pass, per leaf, over g and e.

  Returns:
    Per leaf ``(sent, new_residual)``: ``acc = e + g``; values with
    ``|acc| >= t`` are sent, the rest stay, so ``sent + new_residual == acc``.
  """
  out = []
  for g, e, t in zip(grads, residuals, thresholds):
    acc = e + g
    sent = jnp.where(jnp.abs(acc) >= t, acc, 0.0)
    out.append((sent, acc - sent))
  return out


# DLGS's rows name their budget: results written before the message budget was
# the default call the per-layer adapted rule "dlgs" (`render` reads it so).
METHODS = ("dense", "topk", "gtopk", "lags", "dlgs-paper", "dlgs-layer", "dlgs-message")


def paired_ratio(first, second, rounds: int) -> tuple[float, float, float]:
  """Medians of ``first()``'s and ``second()``'s seconds and of their per-round ratio.

  The two alternate within each round after one untimed call each, so drift
  in the machine's speed touches both alike.
  """
  jax.block_until_ready(first())
  jax.block_until_ready(second())
  a, b = [], []
  for _ in range(rounds):
    for fn, times in ((first, a), (second, b)):
      start = time.perf_counter()
      jax.block_until_ready(fn())
      times.append(time.perf_counter() - start)
  return (statistics.median(a), statistics.median(b),
          statistics.median(y / x for x, y in zip(a, b)))


def floor_period(gradients: list, density: float):
  """A callable running `floor_pass` once per gradient of the period, and one call's inputs."""
  leaves = [jax.tree_util.tree_leaves(g) for g in gradients]
  residuals = [jnp.zeros_like(x) for x in leaves[0]]
  # The normal quantile passing `density` of standard-normal values; the cost
  # does not depend on it, only what is kept.
  cut = statistics.NormalDist().inv_cdf(1 - density / 2)
  thresholds = [jnp.float32(cut) for _ in residuals]
  # The residuals are carried and donated, as the updates' states are.
  run_floor = jax.jit(floor_pass, donate_argnums=1)
  carried = [residuals]

  def run():
    out = None
    for grads in leaves:
      out = run_floor(grads, carried[0], thresholds)
      carried[0] = [new for _, new in out]
    return out

  # A few periods untimed: the first calls also fault in the memory their
  # outputs take (on this project's CPU VM the first row's floor timed ~2x).
  for _ in range(3):
    jax.block_until_ready(run())
  return run, (leaves[0], [jnp.zeros_like(x) for x in leaves[0]], thresholds)


def median_seconds(fn, rounds: int) -> float:
  """Median seconds of `fn()` over `rounds` calls, after one untimed call."""
  jax.block_until_ready(fn())
  times = []
  for _ in range(rounds):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def model_and_batch(name: str, batch: int, side: int):
  """`name`'s model, a random uint8 batch of `batch` images and labels, and its variables."""
  model, shape = models.create_model(name)
  rng = np.random.default_rng(0)
  images = jnp.asarray(rng.integers(0, 256, (batch, side, side, shape[2]), dtype=np.uint8))
  labels = jnp.asarray(rng.integers(0, 10, batch).astype(np.int32))
  variables = losses.init_variables(model, np.zeros((1, side, side, shape[2]), np.float32), 0)
  return model, images, labels, variables["params"], variables.get("batch_stats", {})


def forward_backward_ms(name: str, batch: int, side: int, rounds: int) -> float:
  """Median ms of one training-mode forward+backward of `name` on a random uint8 batch."""
  model, images, labels, params, batch_stats = model_and_batch(name, batch, side)
  grad_fn = jax.jit(lambda p, x, y: losses.batch_gradients(model, p, batch_stats, x, y)[0])
  return median_seconds(lambda: grad_fn(params, images, labels), rounds) * 1e3


def copy_bandwidth(values: int, rounds: int) -> float:
  """Bytes per second a device-to-device copy of `values` float32 reaches (read + write)."""
  x = jnp.arange(values, dtype=jnp.float32)
  copy = jax.jit(lambda v: v * 1.0)
  return 2 * 4 * values / median_seconds(lambda: copy(x), rounds)


def exact_on_device(values: int) -> bool:
  """Whether the selection's running sums (float32 products) are exact on this device.

  They rely on float32 products that round nothing (no TF32); a device whose
  dot rounded would compact the wrong values, so the check runs before any timing.
  """
  rng = np.random.default_rng(0)
  words = rng.integers(0, 33, values).astype(np.int32)  # popcounts of a buffer's words
  # A radix select's histograms, of counts TF32 would round (12 significant bits).
  bins = rng.integers(0, 1 << 12, (40, 2048)).astype(np.int32)
  # Both totals stay below 2^24: the float32 products are what is checked.
  return all(np.array_equal(np.asarray(jax.jit(lambda v, b=bound: segmented.running_sums(
      v, b))(jnp.asarray(x))), np.cumsum(x, axis=-1))
             for x, bound in ((words, 32 * values), (bins, (1 << 12) * 2048)))


def floor_bytes(params: int) -> int:
  """Bytes the floor pass moves: g and e read, the message and the new e written (float32)."""
  return 4 * 4 * params


def whole_step_ms(name: str, batch: int, side: int, tx, reuse_every: int, rounds: int
                  ) -> float:
  """Median ms of one step of forward, backward and `tx`'s update in one program (P = 1).

  Timed over whole reuse periods of `reuse_every` steps, after one, so that
  DLGS's exact and reuse steps both count.
  """
  import optax  # pylint: disable=g-import-not-at-top

  model, images, labels, params, batch_stats = model_and_batch(name, batch, side)

  @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
  def step(params, opt_state, batch_stats):
    grads, mutated = losses.batch_gradients(model, params, batch_stats, images, labels)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state,
            mutated.get("batch_stats", batch_stats))

  carry = (params, tx.init(params), batch_stats)

  def period():
    nonlocal carry
    for _ in range(reuse_every):
      carry = step(*carry)
    return carry

  return median_seconds(period, rounds) / reuse_every * 1e3


def whole_step_transforms(density: float, reuse_every: int) -> list[tuple[str, object]]:
  """The updates the whole-step mode puts in the step: dense, Top-k, the paper's DLGS, and the
  adapted rule with a threshold per layer and per message (the default)."""
  adapted = dlgs_jax.AdaptedReuse(reuse_every)
  return [("dense", dlgs_jax.dense()), ("topk", dlgs_jax.topk(density)),
          ("dlgs-paper", dlgs_jax.dlgs(density, thresholds=dlgs_jax.FixedReuse(reuse_every),
                                       budget="layer")),
          ("dlgs-layer", dlgs_jax.dlgs(density, thresholds=adapted, budget="layer")),
          ("dlgs-message", dlgs_jax.dlgs(density, thresholds=adapted, budget="message"))]


def update_row(name, density, method, group, tx, gradients, floor, rounds) -> dict:
  """One method's update on one model and density, with its floor ratio and program counts."""
  update, counts, hlo = compiled_update(tx, gradients[0])
  values = sum(int(np.size(g)) for g in jax.tree_util.tree_leaves(gradients[0]))
  run, exact = schedule_period(tx, gradients, update=update)
  floor_s, update_s, ratio = paired_ratio(floor, run, rounds)
  steps = len(gradients)
  return {"model": name, "density": density, "method": method, "grouping": group,
          "update_ms": update_s / steps * 1e3, "floor_ms": floor_s / steps * 1e3,
          "over_floor": ratio, "exact_leaves_per_step": exact, **counts,
          "passes": programs.memory_passes(hlo, values)}


def with_bandwidth_floor(row: dict, params: int, bytes_per_s: float) -> dict:
  """`row` with the bandwidth floor's ms and the update as a multiple of it."""
  floor_ms = floor_bytes(params) / bytes_per_s * 1e3
  return {**row, "bandwidth_floor_ms": floor_ms,
          "over_bandwidth_floor": row["update_ms"] / floor_ms}


def run_whole_steps(args, result: dict, batches: dict, started: float) -> None:
  """The whole-step rows, at the lowest density, within what is left of the budget."""
  density = min(args.densities)
  for name in args.models:
    batch, side = batches[name]
    for method, tx in whole_step_transforms(density, args.reuse_every):
      if args.methods is not None and method not in args.methods:
        continue
      if time.perf_counter() - started > args.budget_s:
        result["skipped"].append(f"{name} {density:g} {method} (whole step)")
        continue
      row = {"model": name, "density": density, "method": method, "batch": batch,
             "step_ms": whole_step_ms(name, batch, side, tx, args.reuse_every, args.rounds)}
      result["whole_step"].append(row)
      dense = next((r["step_ms"] for r in result["whole_step"]
                    if r["model"] == name and r["method"] == "dense"), None)
      row["over_dense"] = None if dense is None else row["step_ms"] / dense
      print(f"{name} {density:g} {method:10s} whole step {row['step_ms']:9.2f} ms"
            + ("" if dense is None else f"  {row['over_dense']:.2f}x dense"), flush=True)
      write_json(args.out, result)


def run_check(args) -> dict:
  """Measures everything in order of importance within the budget; returns the results."""
  started = time.perf_counter()
  batches = SMALL_BATCH if args.small else FULL_BATCH
  result = {"command": "python experiments/gpu_check.py " + " ".join(args.argv),
            "machine": machine(), "models": {}, "rows": [], "whole_step": [], "skipped": []}
  result["machine"]["copy_bytes_per_s"] = copy_bandwidth(
      1 << (22 if args.small else 28), args.rounds)
  result["machine"]["exact_running_sums"] = exact_on_device(1 << (16 if args.small else 18))
  print(f"running sums exact on {jax.default_backend()}: "
        f"{result['machine']['exact_running_sums']}", flush=True)
  periods = {}
  for name in args.models:
    params = models.param_shapes(name)
    periods[name] = (params, step_gradients(params, args.reuse_every))
    batch, side = batches[name]
    result["models"][name] = {
        "params": sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params)),
        "leaves": len(jax.tree_util.tree_leaves(params)),
        "forward_backward_batch": batch, "forward_backward_image": side,
        "forward_backward_ms": None if args.no_forward_backward else
        forward_backward_ms(name, batch, side, args.rounds)}
    if not args.no_forward_backward:
      print(f"{name}: forward+backward at batch {batch} ({side}x{side}) "
            f"{result['models'][name]['forward_backward_ms']:.2f} ms", flush=True)
    write_json(args.out, result)
  # Density 0.01 with one group first (the targets), the whole step, then the default
  # grouping, then the rest.
  work = []
  for density in sorted(args.densities):
    for name in args.models:
      listed = [(m, g, tx) for m, g, tx in checked_updates(density, args.reuse_every,
                                                      periods[name][0])
                if args.methods is None or m in args.methods]
      if args.one_group:
        listed = [(m, g, tx) for m, g, tx in listed if g != "default"]
      work += [(density, name, m, g, tx) for m, g, tx in listed if g != "default"]
      work += [(density, name, m, g, tx) for m, g, tx in listed if g == "default"]
  first = min(args.densities)
  targets = [w for w in work if w[0] == first and w[3] != "default"]
  rest = [w for w in work if not (w[0] == first and w[3] != "default")]
  floors = {}

  def measure(density, name, method, group, tx):
    if time.perf_counter() - started > args.budget_s:
      result["skipped"].append(f"{name} {density:g} {method} ({group})")
      return
    gradients = periods[name][1]
    if (name, density) not in floors:
      floors[(name, density)] = floor_period(gradients, density)[0]
    row = with_bandwidth_floor(
        update_row(name, density, method, group, tx, gradients, floors[(name, density)],
                   args.rounds), result["models"][name]["params"],
        result["machine"]["copy_bytes_per_s"])
    result["rows"].append(row)
    print(f"{name} {density:g} {method:10s} {group:9s} {row['update_ms']:9.2f} ms  "
          f"{row['over_floor']:6.1f}x floor  cond {row['conditionals']} "
          f"sort+topk {row['sorts'] + row['top_k']} kernels {row['kernels']}", flush=True)
    write_json(args.out, result)

  for item in targets:
    measure(*item)
  if args.whole_step:
    run_whole_steps(args, result, batches, started)
  for item in rest:
    measure(*item)
  result["seconds"] = time.perf_counter() - started
  result["table"] = format_table(result)
  write_json(args.out, result)
  return result


def format_table(result: dict) -> str:
  """Markdown: per row the update, the floor, their ratio, the share of forward+backward."""
  header = ["model", "density", "method", "grouping", "update ms", "floor ms", "x floor",
            "x bandwidth floor", "% of fwd+bwd", "exact leaves/step", "cond", "sort+topk",
            "kernels"]
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  for r in result["rows"]:
    step = result["models"][r["model"]]["forward_backward_ms"]
    lines.append("| " + " | ".join([
        r["model"], f"{r['density']:g}", r["method"], r["grouping"], f"{r['update_ms']:.2f}",
        f"{r['floor_ms']:.3f}", f"{r['over_floor']:.1f}", f"{r['over_bandwidth_floor']:.1f}",
        "-" if step is None else f"{100 * r['update_ms'] / step:.1f}",
        f"{r['exact_leaves_per_step']:.1f}", str(r["conditionals"]),
        str(r["sorts"] + r["top_k"]), str(r["kernels"])]) + " |")
  if result.get("whole_step"):
    lines += ["", "| model | density | method | batch | whole step ms | x dense |",
              "|---|---|---|---|---|---|"]
    for r in result["whole_step"]:
      over = "-" if r["over_dense"] is None else f"{r['over_dense']:.2f}"
      lines.append(f"| {r['model']} | {r['density']:g} | {r['method']} | {r['batch']} | "
                   f"{r['step_ms']:.2f} | {over} |")
  return "\n".join(lines)


def parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", nargs="+", choices=sorted(FULL_BATCH), default=None,
                      help="default: vgg16 resnet50 (--small: resnet20)")
  parser.add_argument("--densities", nargs="+", type=float, default=[0.01, 0.1])
  parser.add_argument("--reuse-every", type=int, default=10)
  parser.add_argument("--rounds", type=int, default=5, help="paired rounds per measurement")
  parser.add_argument("--budget-s", type=float, default=420.0,
                      help="start no new measurement after this many seconds")
  parser.add_argument("--small", action="store_true",
                      help="reduced sizes for CPU: ResNet-20 and tiny forward+backward batches")
  parser.add_argument("--methods", nargs="+", choices=METHODS, default=None,
                      help="time only these updates (default: all)")
  parser.add_argument("--one-group", action="store_true",
                      help="LAGS and DLGS with every leaf in one group only")
  parser.add_argument("--no-forward-backward", action="store_true",
                      help="skip timing forward+backward (minutes per model on a CPU core)")
  parser.add_argument("--no-whole-step", dest="whole_step", action="store_false",
                      help="skip the whole step (forward, backward and update in one program)")
  parser.add_argument("--out", default=None, help="JSON (default: experiments/results/"
                      "gpu_check/<backend>.json)")
  args = parser.parse_args(argv)
  if args.models is None:
    args.models = ["resnet20"] if args.small else ["vgg16", "resnet50"]
  bad = [d for d in args.densities if not 0 < d <= 1]
  if bad:
    parser.error(f"--densities must be in (0, 1], got {bad}")
  if args.reuse_every < 1 or args.rounds < 1:
    parser.error(f"--reuse-every and --rounds must be >= 1, got {args.reuse_every}, "
                 f"{args.rounds}")
  args.out = Path(args.out or HERE / "results" / "gpu_check" / f"{jax.default_backend()}.json")
  args.argv = list(argv)
  return args


def main(argv=None) -> int:
  args = parse_args(sys.argv[1:] if argv is None else argv)
  result = run_check(args)
  print()
  print(result["table"])
  if result["skipped"]:
    print(f"\nnot measured (budget {args.budget_s:.0f} s spent): {', '.join(result['skipped'])}")
  print(f"\nwrote {args.out} ({result['seconds']:.0f} s)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
