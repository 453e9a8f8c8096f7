"""Where global Top-k spends its budget per layer, and what a per-layer budget costs early on.

Layer-wise methods (LAGS, DLGS) send the same fraction of every leaf; global
Top-k sends whatever is largest. This trains one worker (error feedback, SGD
with momentum 0.9, weight decay 5e-4, no augmentation) for --steps steps per
method on the embedded CIFAR-10 subset and reports:

* per leaf, in backward order, the mean fraction of its values global Top-k
  sent (`topk` run) next to the layer-wise fraction (the density);
* per method, the mean training loss of the last 20 steps.

    python experiments/budget_share.py                      # ResNet-20, density 0.1, 60 steps
    python experiments/budget_share.py --density 0.01 --methods dense,topk,lags,lags-head

Writes budget_share.json, budget_share.md and budget_share.png under --out-dir.
Methods: dense, topk, lags, dlgs, or a dlgs-train variant (lags-head, dlgs-head:
the classifier head sent whole).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# On one worker gTop-k is Top-k, and DGC and TernGrad change values rather than choose them.
SUPPORTED = ("dense", "topk", "lags", "dlgs")


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="resnet20")
  parser.add_argument("--density", type=float, default=0.1)
  parser.add_argument("--methods", default="dense,topk,lags,lags-head")
  parser.add_argument("--steps", type=int, default=60)
  parser.add_argument("--batch-size", type=int, default=128)
  parser.add_argument("--lr", type=float, default=0.1)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out-dir", default=str(HERE / "results" / "budget_share"))
  args = parser.parse_args(argv)
  if args.steps < 1 or args.batch_size < 1:
    parser.error(f"--steps and --batch-size must be >= 1, got {args.steps}, {args.batch_size}")
  if not 0 < args.density <= 1:
    parser.error(f"--density must be in (0, 1], got {args.density}")
  return args


def compressor(method: str, density: float, order):
  """The transform `method` (or a dlgs-train variant) stands for, on one worker."""
  from dlgs_jax.compress.methods import base_method, known, method_config

  if not known(method) or base_method(method) not in SUPPORTED:
    raise SystemExit(f"--methods: {method!r} is not {', '.join(SUPPORTED)} or a variant of them")
  return method_config(method, density=density).compressor(order=order)


def train_one(args, method: str):
  """Loss per step and, per leaf (flatten order), the mean fraction of values sent."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from dlgs_jax.workload import losses as model_losses
  from dlgs_jax.workload import data
  from dlgs_jax.workload import models
  from dlgs_jax.training.plans import backward_order_of

  train_set, _ = data.load_embedded_cifar10()
  model, shape = models.create_model(args.model, num_classes=train_set.num_classes)
  variables = model.init(jax.random.key(args.seed), jnp.zeros((1,) + shape), train=False)
  params, batch_stats = variables["params"], variables.get("batch_stats", {})
  order = backward_order_of(model, params, batch_stats, (1,) + shape)
  comp = compressor(method, args.density, order)
  tx = optax.chain(comp, optax.add_decayed_weights(5e-4), optax.sgd(args.lr, momentum=0.9))
  opt_state = tx.init(params)

  def loss_fn(p, stats, images, labels):
    logits, updates = model_losses.apply_for_training(model, p, stats, images)
    return model_losses.cross_entropy(logits, labels), updates

  @jax.jit
  def step(p, stats, state, images, labels):
    (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, stats, images, labels)
    # What the compressor sent this step (its own state is the chain's first).
    sent, _ = comp.update(grads, state[0], p)
    new_updates, state = tx.update(grads, state, p)
    fractions = jnp.stack([jnp.mean(s != 0) for s in jax.tree_util.tree_leaves(sent)])
    return (optax.apply_updates(p, new_updates), updates.get("batch_stats", stats), state,
            loss, fractions)

  rng = np.random.default_rng(args.seed)
  count = len(train_set.labels)
  losses, fractions = [], []
  indices = rng.permutation(count)
  for i in range(args.steps):
    start = (i * args.batch_size) % (count - args.batch_size + 1)
    batch = indices[start:start + args.batch_size]
    images = data.normalize(jnp.asarray(train_set.images[batch]), train_set.mean, train_set.std)
    params, batch_stats, opt_state, loss, fraction = step(
        params, batch_stats, opt_state, images, jnp.asarray(train_set.labels[batch]))
    losses.append(float(loss))
    fractions.append(np.asarray(fraction))
  from dlgs_jax.compress import grouping
  paths = grouping.leaf_paths(params)
  sizes = [int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params)]
  return losses, dict(zip(paths, np.mean(fractions, axis=0).tolist())), dict(zip(paths, sizes)), order


def main(argv=None) -> int:
  args = parse_args(argv)
  out = Path(args.out_dir)
  out.mkdir(parents=True, exist_ok=True)
  methods = args.methods.split(",")
  runs, order, sizes, share = {}, None, None, None
  for method in methods:
    started = time.time()
    losses, fractions, sizes, order = train_one(args, method)
    tail = losses[-min(20, len(losses)):]
    runs[method] = {"losses": losses, "last20_mean_loss": sum(tail) / len(tail),
                    "fractions": fractions, "seconds": time.time() - started}
    print(f"{method}: mean loss of the last {len(tail)} steps {runs[method]['last20_mean_loss']:.3f}"
          f" ({runs[method]['seconds']:.0f} s)", flush=True)
    if method == "topk":
      share = fractions
  command = "python experiments/budget_share.py " + " ".join(
      sys.argv[1:] if argv is None else argv)
  result = {"command": command, "model": args.model, "density": args.density,
            "steps": args.steps, "batch_size": args.batch_size, "lr": args.lr,
            "order": order, "sizes": sizes, "runs": runs}
  (out / "budget_share.json").write_text(json.dumps(result, indent=1))
  lines = [f"`{command}`", "",
           "| method | mean loss, last 20 steps |", "|---|---|"]
  lines += [f"| {m} | {r['last20_mean_loss']:.3f} |" for m, r in runs.items()]
  if share is not None:
    lines += ["", "| leaf (backward order) | values | sent by global Top-k | layer-wise |",
              "|---|---|---|---|"]
    lines += [f"| {p} | {sizes[p]} | {share[p]:.3f} | {args.density:g} |" for p in order]
    plot(order, sizes, share, args, out / "budget_share.png")
  table = "\n".join(lines)
  (out / "budget_share.md").write_text(table + "\n")
  print(table)
  return 0


def plot(order, sizes, share, args, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from dlgs_jax.profiling import figures

  fig, ax = plt.subplots(figsize=(12, 4))
  ax.bar(range(len(order)), [share[p] for p in order], color="tab:blue",
         label="global Top-k: fraction of the leaf sent (mean over steps)")
  ax.axhline(args.density, color="tab:red", label=f"layer-wise: {args.density:g} of every leaf")
  ax.set_xticks(range(len(order)))
  ax.set_xticklabels([f"{p} ({sizes[p]})" for p in order], rotation=90, fontsize=6)
  ax.set_ylabel("fraction sent")
  figures.finish(fig, ax, path, f"{args.model}, density {args.density:g}, one worker, "
                 f"{args.steps} steps (leaves in backward order: the head first)", legend_size=8)


if __name__ == "__main__":
  sys.exit(main())
