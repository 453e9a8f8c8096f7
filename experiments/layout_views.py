"""DLGS's update on CPU in its two views of a group: laid out in one buffer, and leaf by leaf.

`segmented.lay_out_by_default` lays a group out on CPU up to `CPU_LAY_OUT_MAX`
values; this is the measurement behind that size. For each model's leaf
shapes, DLGS's update (one group per default bucket, density 0.01, one worker)
is compiled in both views, and as the rule chooses per bucket, and timed in
interleaved rounds, on a reuse step and on an exact step, under the paper's
rule and the default. Gradients are normal
noise; both views select the same values, so only their cost differs.

    python experiments/layout_views.py [--models smallcnn resnet20 vgg16] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import jax

import dlgs_jax
from dlgs_jax.compress import segmented
from dlgs_jax.workload import models

DENSITY = 0.01
VIEWS = (True, False, None)  # laid out, leaf by leaf, as chosen
RULES = {"paper": lambda: dlgs_jax.FixedReuse(10), "default": lambda: dlgs_jax.AdaptedReuse()}


def noise(model: str):
  """Normal-noise gradients with `model`'s leaf shapes."""
  shapes = models.param_shapes(model)
  leaves, treedef = jax.tree_util.tree_flatten(shapes)
  key = jax.random.PRNGKey(0)
  return jax.tree_util.tree_unflatten(treedef, [
      jax.random.normal(jax.random.fold_in(key, i), leaf.shape) for i, leaf in enumerate(leaves)])


def compiled(tx, grads, laid_out):
  """``tx.update`` compiled in one view (None: as `segmented.lay_out_by_default` chooses per
  group), its compile seconds, and an exact and a reuse state."""
  with segmented.forced_view(laid_out):
    exact = tx.init(grads)
    start = time.perf_counter()
    update = jax.jit(tx.update).lower(grads, exact).compile()
    seconds = time.perf_counter() - start
  reuse = exact
  for _ in range(3):  # step 0 is exact; steps 1-3 reuse (every 10 steps)
    _, reuse = update(grads, reuse)
  return update, seconds, {"exact": exact, "reuse": reuse}


def measure(model: str, rounds: int) -> list[dict]:
  return measure_tree(model, noise(model), rounds)


def measure_tree(model: str, grads, rounds: int) -> list[dict]:
  """The rows of one gradient tree: per rule and step, each view's median ms and compile s."""
  size = sum(leaf.size for leaf in jax.tree_util.tree_leaves(grads))
  rows = []
  for rule, make in RULES.items():
    views = {laid: compiled(dlgs_jax.dlgs(DENSITY, thresholds=make()), grads, laid)
             for laid in VIEWS}
    for step in ("reuse", "exact"):
      times = {laid: [] for laid in VIEWS}
      for laid in VIEWS:  # one untimed call each
        update, _, states = views[laid]
        jax.block_until_ready(update(grads, states[step]))
      for _ in range(rounds):
        for laid in VIEWS:
          update, _, states = views[laid]
          start = time.perf_counter()
          jax.block_until_ready(update(grads, states[step]))
          times[laid].append(time.perf_counter() - start)
      row = {"model": model, "values": int(size), "rule": rule, "step": step,
             "laid_out_ms": statistics.median(times[True]) * 1e3,
             "leaf_by_leaf_ms": statistics.median(times[False]) * 1e3,
             "chosen_ms": statistics.median(times[None]) * 1e3,
             "laid_over_leaf": statistics.median(a / b for a, b in zip(times[True], times[False])),
             "chosen_over_best": statistics.median(
                 c / min(a, b) for a, b, c in zip(times[True], times[False], times[None])),
             "laid_out_compile_s": views[True][1], "leaf_by_leaf_compile_s": views[False][1],
             "chosen_compile_s": views[None][1]}
      print(f"{model:9s} {rule:8s} {step:6s} laid out {row['laid_out_ms']:8.2f} ms  leaf by leaf "
            f"{row['leaf_by_leaf_ms']:8.2f} ms  chosen {row['chosen_ms']:8.2f} ms  ratio {row['laid_over_leaf']:.2f}  compile "
            f"{row['laid_out_compile_s']:.1f} / {row['leaf_by_leaf_compile_s']:.1f} s", flush=True)
      rows.append(row)
  return rows


def table(rows: list[dict]) -> str:
  lines = ["| model | values | rule | step | laid out ms | leaf by leaf ms | laid / leaf | "
           "as chosen ms | chosen / better view | compile s, laid / leaf / chosen |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['model']} | {r['values']:,} | {r['rule']} | {r['step']} | "
                 f"{r['laid_out_ms']:.2f} | {r['leaf_by_leaf_ms']:.2f} | "
                 f"{r['laid_over_leaf']:.2f} | {r['chosen_ms']:.2f} | "
                 f"{r['chosen_over_best']:.2f} | {r['laid_out_compile_s']:.1f} / "
                 f"{r['leaf_by_leaf_compile_s']:.1f} / {r['chosen_compile_s']:.1f} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", nargs="+", default=["smallcnn", "resnet20", "vgg16"],
                      choices=["smallcnn", "resnet20", "vgg16", "resnet50"])
  parser.add_argument("--rounds", type=int, default=9)
  parser.add_argument("--out", type=Path,
                      default=Path("experiments/results/layout_views/cpu.json"))
  args = parser.parse_args(argv)
  if args.rounds < 1:
    parser.error(f"--rounds must be >= 1, got {args.rounds}")
  rows = [row for model in args.models for row in measure(model, args.rounds)]
  text = table(rows)
  print(text)
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text(json.dumps({
      "machine": {"backend": jax.default_backend(), "cpus": os.cpu_count(),
                  "processor": platform.processor() or platform.machine(),
                  "jax": jax.__version__},
      "density": DENSITY, "cpu_lay_out_max": segmented.CPU_LAY_OUT_MAX, "rows": rows,
      "table": text}, indent=1) + "\n")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
