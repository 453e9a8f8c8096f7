"""Per-step cost of choosing what to send: DLGS vs LAGS vs global Top-k (CPU).

On the real leaf shapes of ResNet-20, VGG16 (CIFAR) and ResNet-50, at density
0.1 and 0.01, times under `jax.jit` on random gradients:

* ``dlgs``: DLGS selection amortised over ``reuse_every`` steps -- one step
  computes every leaf's exact threshold, the others reuse it (adapted to the
  values, the default); each step then selects ``|g| >= H`` into the
  fixed-capacity buffers (also reported: the exact and the reuse step alone);
* ``paper``: the same on the paper's fixed schedule (thresholds reused as
  they are: ``FixedReuse``), what the adaptation costs;
* ``lags``: the exact k-th largest of every leaf and a compaction, every step;
* ``topk``: the same over all leaves as one segment;
* ``*_update``: the whole transform update on one worker (residual add,
  selection, gather, scatter back, new residual), for context. DLGS's updates
  run one period of its schedule (``reuse_every`` steps, each on a gradient
  drawn afresh) from a state warmed up over two periods, and report the leaves
  whose threshold was exact per step (``*_update_exact_leaves``).

Next to the times, what each compiled update is made of on this backend
(`profiling.programs`): its conditionals (each waits for its predicate on the
host on GPU), sorts and top-k calls, loops, and kernels launched per step.

Prints a table of medians (ms) and ratios, and writes JSON.

    python experiments/bench_sparsify.py [--models vgg16 resnet50] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import jax
import jax.numpy as jnp

import dlgs_jax
from dlgs_jax.compress import engine, grouping
from dlgs_jax.compress.methods import MethodConfig
from dlgs_jax.workload import models
from dlgs_jax import profiling
from dlgs_jax.profiling import programs
from dlgs_jax.profiling.periods import schedule_period, step_gradients


def median_ms(fn, repeats: int) -> float:
  """Median wall time of fn() in ms after one warm-up call (compilation)."""
  return profiling.median_seconds(fn, repeats) * 1e3


def threshold_step(layout, select, reuse_every):
  """DLGS's selection of one step under `select` (jitted): its positions and the thresholds
  kept for the next step, exact when count % reuse_every == 0 (`engine.settle`)."""

  @jax.jit
  def step(leaves, thresholds, count):
    flats = [engine.Summed(layout.lay_out(g, leaves), None) for g in range(len(layout.groups))]
    picked = [engine.pick(select, layout, g, flat, t)
              for g, (flat, t) in enumerate(zip(flats, thresholds))]
    kept, _ = engine.settle(select, layout, flats, picked, thresholds,
                            count % reuse_every == 0)
    return [p.positions for p in picked], kept

  return step


def initial_thresholds(select, layout) -> list:
  return [engine.initial_thresholds(select, layout, g) for g in range(len(layout.groups))]


def rule_of(candidates, reuse_every):
  """DLGS's reuse with `candidates` thresholds a step, as the method table builds it."""
  return MethodConfig(reuse_every=reuse_every, candidates=candidates).threshold_rule()


def make_selectors(params, density, reuse_every, grouped, candidates):
  """DLGS's (adapted and paper) selection, LAGS's and Top-k's, jitted; `grouped` as `--grouping`."""
  layout = engine.make_layout(params, None, None, single_group=grouped == "single",
                              buckets=grouped == "default")
  select = engine.Selection("threshold", density, rule=rule_of(candidates, reuse_every))
  dlgs_step = threshold_step(layout, select, reuse_every)
  paper = engine.Selection("threshold", density, rule=dlgs_jax.FixedReuse(reuse_every))
  paper_step = threshold_step(layout, paper, reuse_every)

  lags = engine.Selection("layer_topk", density)

  @jax.jit
  def lags_step(leaves):
    return [engine.pick(lags, layout, g, engine.Summed(layout.lay_out(g, leaves), None)).positions
            for g in range(len(layout.groups))]

  whole = engine.make_layout(params, None, None, single_group=True)
  topk = engine.Selection("group_topk", density)

  @jax.jit
  def topk_step(leaves):
    return engine.pick(topk, whole, 0, engine.Summed(whole.lay_out(0, leaves), None)).positions

  return dlgs_step, paper_step, lags_step, topk_step, initial_thresholds(select, layout)


def bench_config(name, density, reuse_every, repeats, with_updates, grouped, candidates):
  params = models.param_shapes(name)
  period = step_gradients(params, reuse_every if with_updates else 1)
  grads = period[0]
  leaves = jax.tree_util.tree_leaves(grads)
  sizes = [int(g.size) for g in leaves]
  dlgs_step, paper_step, lags_step, topk_step, thresholds = make_selectors(
      params, density, reuse_every, grouped, candidates)
  _, thresholds = dlgs_step(leaves, thresholds, jnp.int32(0))

  def cycle(step):
    out = None
    for count in range(reuse_every):
      out = step(leaves, thresholds, jnp.int32(count))
    return out

  row = {
      "model": name, "density": density, "reuse_every": reuse_every,
      "grouping": grouped, "candidates": candidates,
      "params": sum(sizes), "leaves": len(sizes),
      "dlgs_ms": median_ms(lambda: cycle(dlgs_step), repeats) / reuse_every,
      "dlgs_exact_step_ms": median_ms(lambda: dlgs_step(leaves, thresholds, jnp.int32(0)), repeats),
      "dlgs_reuse_step_ms": median_ms(lambda: dlgs_step(leaves, thresholds, jnp.int32(1)), repeats),
      "paper_ms": median_ms(lambda: cycle(paper_step), repeats) / reuse_every,
      "lags_ms": median_ms(lambda: lags_step(leaves), repeats),
      "topk_ms": median_ms(lambda: topk_step(leaves), repeats),
  }
  if with_updates:
    paths = grouping.leaf_paths(params)
    groups = {"single": [paths], "leaf": [[p] for p in reversed(paths)], "default": None}[grouped]
    adapted = rule_of(candidates, reuse_every)
    for method, tx in (("dlgs", dlgs_jax.dlgs(density, thresholds=adapted, groups=groups)),
                       ("paper", dlgs_jax.dlgs(density, thresholds=dlgs_jax.FixedReuse(reuse_every),
                                               groups=groups)),
                       ("lags", dlgs_jax.lags(density, groups=groups)),
                       ("topk", dlgs_jax.topk(density))):
      for key, value in programs.program_counts(tx.update, grads, tx.init(grads)).items():
        row[f"{method}_update_{key}"] = value
      # DLGS runs a period of its schedule; the others are timed one step at a time.
      steps = period if method in SCHEDULED else period[:1]
      run, row[f"{method}_update_exact_leaves"] = schedule_period(tx, steps)
      row[f"{method}_update_ms"] = median_ms(run, max(2, repeats // 2)) / len(steps)
  row["lags_over_dlgs"] = row["lags_ms"] / row["dlgs_ms"]
  row["topk_over_dlgs"] = row["topk_ms"] / row["dlgs_ms"]
  return row


def grouping_counts(leaf_counts=(20, 160), density: float = 0.01) -> list[dict]:
  """Conditionals and kernels of DLGS's and LAGS's updates as the leaves grow.

  A model of `n` leaves (3x3x32x32 kernels and their biases); each transform
  with its default grouping (`grouping.size_buckets`) and, for comparison,
  with one group per leaf. Compiled for this backend, not timed.
  """
  rows = []
  for n in leaf_counts:
    params = {f"layer{i:03d}": {"bias": jax.ShapeDtypeStruct((32,), jnp.float32),
                                "kernel": jax.ShapeDtypeStruct((3, 3, 32, 32), jnp.float32)}
              for i in range(n // 2)}
    per_leaf = [[path] for path in reversed(grouping.leaf_paths(params))]
    for name, tx in (("dlgs", dlgs_jax.dlgs(density)), ("lags", dlgs_jax.lags(density)),
                     ("dlgs per leaf", dlgs_jax.dlgs(density, groups=per_leaf)),
                     ("lags per leaf", dlgs_jax.lags(density, groups=per_leaf))):
      state = tx.init(params)
      counts = programs.program_counts(tx.update, params, state)
      rows.append({"leaves": n, "transform": name, "groups": len(state.stats.groups),
                   **counts})
  return rows


def format_grouping(rows) -> str:
  lines = ["| leaves | transform | groups | conditionals | sorts + top-k | kernels |",
           "|---|---|---|---|---|---|"]
  lines += [f"| {r['leaves']} | {r['transform']} | {r['groups']} | {r['conditionals']} | "
            f"{r['sorts'] + r['top_k']} | {r['kernels']} |" for r in rows]
  return "\n".join(lines)


# The transforms whose whole update is timed and counted.
UPDATED = ("dlgs", "paper", "lags", "topk")
# Those of them that run a threshold schedule (their exact leaves per step are reported).
SCHEDULED = ("dlgs", "paper")


def format_table(rows, with_updates):
  header = ["model", "density", "params", "dlgs ms", "(exact", "reuse)", "paper ms", "lags ms",
            "topk ms", "lags/dlgs", "topk/dlgs"]
  if with_updates:
    header += [f"{m} upd" for m in UPDATED]
    header += [f"{m} exact leaves/step" for m in SCHEDULED]
    header += [f"{m} cond/sort+topk/kernels" for m in UPDATED]
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  for r in rows:
    cells = [r["model"], f"{r['density']:g}", f"{r['params'] / 1e6:.2f}M",
             f"{r['dlgs_ms']:.2f}", f"{r['dlgs_exact_step_ms']:.2f}",
             f"{r['dlgs_reuse_step_ms']:.2f}", f"{r['paper_ms']:.2f}", f"{r['lags_ms']:.2f}",
             f"{r['topk_ms']:.2f}",
             f"{r['lags_over_dlgs']:.1f}x", f"{r['topk_over_dlgs']:.1f}x"]
    if with_updates:
      cells += [f"{r[f'{m}_update_ms']:.1f}" for m in UPDATED]
      cells += [f"{r[f'{m}_update_exact_leaves']:.1f} of {r['leaves']}" for m in SCHEDULED]
      cells += [f"{r[f'{m}_update_conditionals']}/{r[f'{m}_update_sorts'] + r[f'{m}_update_top_k']}"
                f"/{r[f'{m}_update_kernels']}" for m in UPDATED]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", nargs="*", default=["resnet20", "vgg16", "resnet50"],
                      choices=sorted(models.MODELS),
                      help="models to time (none: only --leaf-counts)")
  parser.add_argument("--densities", nargs="+", type=float, default=[0.1, 0.01])
  parser.add_argument("--reuse-every", type=int, default=10)
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--grouping", choices=["single", "leaf", "default"], default="single",
                      help="DLGS and LAGS send every leaf in one message (single; the "
                      "selection runs as one batched pass), one message per leaf, or "
                      "their default buckets")
  parser.add_argument("--leaf-counts", nargs="*", type=int, default=[20, 160],
                      help="also count the default grouping's conditionals and kernels "
                      "at these numbers of leaves (none: skip)")
  parser.add_argument("--candidates", type=int,
                      default=dlgs_jax.AdaptedReuse().candidates,
                      help="DLGS's candidate thresholds per reuse step (default: dlgs's)")
  parser.add_argument("--no-updates", action="store_true",
                      help="skip timing the whole transform updates")
  parser.add_argument("--out", default="experiments/results/bench_sparsify.json")
  args = parser.parse_args(argv)
  rows = []
  for name in args.models:
    for density in args.densities:
      row = bench_config(name, density, args.reuse_every, args.repeats, not args.no_updates,
                         args.grouping, args.candidates)
      rows.append(row)
      print(f"{name} density {density:g}: dlgs {row['dlgs_ms']:.2f} ms, lags "
            f"{row['lags_ms']:.2f} ms, topk {row['topk_ms']:.2f} ms", flush=True)
  table = format_table(rows, not args.no_updates)
  print()
  print(table)
  counted = grouping_counts(args.leaf_counts) if args.leaf_counts else []
  if counted:
    print()
    print(format_grouping(counted))
  out = Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({
      "command": "python experiments/bench_sparsify.py " + " ".join(argv or []),
      "machine": {"platform": platform.platform(), "processor": platform.processor(),
                  "cpus": jax.local_device_count(), "backend": jax.default_backend(),
                  "jax": jax.__version__},
      "rows": rows, "table": table, "grouping_counts": counted}, indent=2))
  print(f"\nwrote {out}")


if __name__ == "__main__":
  import sys
  main(sys.argv[1:])
