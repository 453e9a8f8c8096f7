"""What each method's compiled update is made of, and how long it takes to compile.

For the leaf shapes of VGG16 (CIFAR) and ResNet-50 at density 0.01, each
transform's update (one worker, ``axis_name=None``) is lowered and compiled
here, and its optimized HLO counted (`profiling.programs`): conditionals,
sorts and top-k calls, loops, the kernels a step launches, and the passes a
step makes over the model's float32 values outside the conditional
(`programs.memory_passes`: the floor pass makes 4, reading the gradient and the
residual and writing the residual and the update). DLGS runs as the
paper's (``FixedReuse(10)``, a threshold per layer), as the adapted rule with
a threshold per layer (``dlgs-layer``) and as the default (the adapted rule,
one threshold per message: ``dlgs``), with every leaf in one group and with
the default buckets; the paper's rule also per message. On this backend the
program is XLA:CPU's, so its counts say how many kernels the passes take, not
what a GPU's fusion makes of them.

Nothing is timed but compilation; the update's run time against its memory
floor is `gpu_check.py`'s.

    python experiments/update_programs.py [--models vgg16 resnet50] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import jax

import dlgs_jax
from dlgs_jax.compress import grouping
from dlgs_jax.profiling import programs
from dlgs_jax.workload import models

DENSITY = 0.01


def transforms(params) -> dict:
  """Label -> transform."""
  one = [list(grouping.leaf_paths(params))]
  paper, adapted = dlgs_jax.FixedReuse(10), dlgs_jax.AdaptedReuse()
  rows = {"dense": dlgs_jax.dense(), "topk": dlgs_jax.topk(DENSITY),
          "lags": dlgs_jax.lags(DENSITY)}
  for name, rule, budget in (("dlgs-paper", paper, "layer"), ("dlgs-layer", adapted, "layer"),
                             ("dlgs", adapted, "message")):
    rows[f"{name}, one group"] = dlgs_jax.dlgs(DENSITY, thresholds=rule, budget=budget,
                                               groups=one)
    rows[f"{name}, buckets"] = dlgs_jax.dlgs(DENSITY, thresholds=rule, budget=budget)
  rows["dlgs-paper-message, buckets"] = dlgs_jax.dlgs(DENSITY, thresholds=paper,
                                                      budget="message")
  return rows


def measure(model: str, only=None) -> list[dict]:
  params = models.param_shapes(model)
  values = sum(leaf.size for leaf in jax.tree_util.tree_leaves(params))
  out = []
  for label, tx in transforms(params).items():
    if only and not any(word in label for word in only):
      continue
    state = jax.eval_shape(tx.init, params)
    start = time.perf_counter()
    compiled = jax.jit(tx.update).lower(params, state).compile()
    seconds = time.perf_counter() - start
    hlo = compiled.as_text()
    row = {"model": model, "method": label, "compile_s": round(seconds, 1),
           **programs.count_hlo(hlo),
           "passes": round(programs.memory_passes(hlo, values), 2)}
    print(f"{model:9s} {label:24s} compile {seconds:6.1f} s  cond {row['conditionals']}  "
          f"sort+topk {row['sorts'] + row['top_k']}  kernels {row['kernels']}  "
          f"passes {row['passes']}", flush=True)
    out.append(row)
  return out


def table(rows: list[dict]) -> str:
  lines = ["| model | update | cond | sort+top-k | kernels | kernels - dense | compile s |",
           "|---|---|---|---|---|---|---|"]
  dense = {r["model"]: r["kernels"] for r in rows if r["method"] == "dense"}
  for r in rows:
    over = r["kernels"] - dense[r["model"]] if r["model"] in dense else "-"
    lines.append(f"| {r['model']} | {r['method']} | {r['conditionals']} | "
                 f"{r['sorts'] + r['top_k']} | {r['kernels']} | {over} | {r['compile_s']} |")
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", nargs="+", default=["vgg16", "resnet50"],
                      choices=["resnet20", "vgg16", "resnet50"])
  parser.add_argument("--only", nargs="*", help="keep the updates whose label holds a word")
  parser.add_argument("--out", type=Path,
                      default=Path("experiments/results/update_programs/cpu.json"))
  args = parser.parse_args()
  rows = [row for model in args.models for row in measure(model, args.only)]
  text = table(rows)
  print(text)
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text(json.dumps({
      "command": f"python experiments/update_programs.py --models {' '.join(args.models)}",
      "machine": {"platform": platform.platform(), "backend": jax.default_backend(),
                  "jax": jax.__version__, "cpus": len(os.sched_getaffinity(0))},
      "density": DENSITY, "rows": rows, "table": text}, indent=1) + "\n")
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
