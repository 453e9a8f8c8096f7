"""How much a local update's cost depends on the gradients it selects from.

ResNets zero-initialise the last BatchNorm scale of each residual branch, so at
initialisation every other parameter of the branch has an exactly zero
gradient; a sort of mostly equal values is cheap. This script takes one
worker's gradients on real CIFAR-10 batches at initialisation and after
``--train-steps`` dense training steps (`profiling.train_locally`), and times
each method's whole-model update on both, from a state warmed up on the same
kind of gradients (`profiling.warm_state`, 10 updates), as the profile does
(DLGS on the fixed schedule: the timed step is an exact one).

    python experiments/selection_values.py --model resnet50 --methods topk,dlgs
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import jax
import jax.numpy as jnp

from dlgs_jax.workload import data
from dlgs_jax.compress import grouping
from dlgs_jax.workload import models
from dlgs_jax import profiling


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="resnet50")
  parser.add_argument("--image-size", type=int, default=32)
  parser.add_argument("--batch-size", type=int, default=8)
  parser.add_argument("--density", type=float, default=0.1)
  parser.add_argument("--methods", default="topk,dlgs")
  parser.add_argument("--train-steps", type=int, default=profiling.PROFILE_TRAIN_STEPS)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--out", default="experiments/results/selection_values.json")
  return parser.parse_args(argv)


def zero_fraction(leaves) -> float:
  return float(sum(int(jnp.sum(g == 0)) for g in leaves) / sum(g.size for g in leaves))


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.train_steps < 1:
    raise SystemExit(f"--train-steps must be >= 1, got {args.train_steps}")
  model, shape = models.create_model(args.model)
  shape = (args.image_size, args.image_size, shape[2])
  batches = args.train_steps + profiling.UPDATE_BATCHES
  images, labels = data.benchmark_batches(shape, model.num_classes, batches, 1, args.batch_size)
  images, labels = images[:, 0], labels[:, 0]
  variables = jax.jit(lambda key: model.init(key, jnp.zeros((1,) + shape), train=False))(
      jax.random.key(0))
  trained = profiling.train_locally(model, variables, images, labels, args.train_steps)
  after = slice(args.train_steps, batches)
  keys = None
  gradients = {}
  for name, at in (("initialisation", variables), ("trained", trained)):
    trees = profiling.model_gradients(model, at, images[after], labels[after])
    keys = keys or [f"{i:04d}" for i in range(len(grouping.leaf_paths(trees[0])))]
    gradients[name] = [dict(zip(keys, jax.tree_util.tree_leaves(t))) for t in trees]
  rows = []
  for method in args.methods.split(","):
    tx = profiling.training_optimizer(method, args.density, order=keys, refresh_below=None)
    update = jax.jit(tx.update)
    for name, batches_of in gradients.items():
      params = {k: jnp.zeros_like(v) for k, v in batches_of[0].items()}
      state = profiling.warm_state(update, tx.init(params), batches_of[:-1], params, 10)
      seconds = profiling.median_seconds(lambda: update(batches_of[-1], state, params),
                                        args.repeats)
      rows.append({"method": method, "gradients": name,
                   "zero_fraction": zero_fraction(list(batches_of[-1].values())),
                   "update_s": seconds})
      print(f"{method:10s} {name:15s} zeros {rows[-1]['zero_fraction']:6.1%}  "
            f"update {seconds * 1e3:9.1f} ms", flush=True)
  result = {"model": args.model, "input": list(shape), "batch_size": args.batch_size,
            "density": args.density, "train_steps": args.train_steps,
            "machine": f"{platform.machine()}, {jax.devices()[0].device_kind}", "rows": rows}
  Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  Path(args.out).write_text(json.dumps(result, indent=1))
  print(f"written to {args.out}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
