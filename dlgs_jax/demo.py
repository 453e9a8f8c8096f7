"""Short real DLGS training run: the package's main job until the full train CLI.

Trains `models.SmallCNN` on the real CIFAR-10 images embedded in the package,
with P simulated workers on CPU devices (one process), DLGS at density 0.01,
SGD with momentum; prints loss/accuracy per epoch and the traffic DLGS saved
against a dense all-reduce.

    python -m dlgs_jax.demo --workers 4 --steps 300
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workers", type=int, default=4, help="simulated data-parallel workers")
  parser.add_argument("--steps", type=int, default=300, help="training steps (rounded to epochs)")
  parser.add_argument("--batch-size", type=int, default=32, help="examples per worker per step")
  parser.add_argument("--density", type=float, default=0.01)
  parser.add_argument("--reuse-every", type=int, default=10)
  parser.add_argument("--lr", type=float, default=0.05)
  parser.add_argument("--seed", type=int, default=0)
  return parser.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.workers < 1:
    raise SystemExit(f"--workers must be >= 1, got {args.workers}")
  # Simulated workers are CPU devices; this must happen before JAX starts.
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax
  jax.config.update("jax_num_cpu_devices", args.workers)

  import numpy as np
  import optax
  from tqdm import tqdm

  import dlgs_jax
  from dlgs_jax import data, models, parallel, training

  train, test = data.load_embedded_cifar10()
  mesh = parallel.data_mesh(args.workers)
  steps_per_epoch = data.steps_per_epoch(len(train.labels), args.workers, args.batch_size)
  epochs = max(1, round(args.steps / steps_per_epoch))
  model = models.SmallCNN(num_classes=train.num_classes)
  tx = optax.chain(
      dlgs_jax.dlgs(args.density, axis_name="data", reuse_every=args.reuse_every),
      optax.add_decayed_weights(5e-4),
      optax.sgd(args.lr, momentum=0.9))
  state = training.init_train_state(model, tx, train.images[:1], mesh, args.seed)
  step_fn = training.make_train_step(model, tx, mesh, seed=args.seed)
  evaluate = training.make_eval_fn(model)
  num_params = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
  print(f"SmallCNN ({num_params:,} parameters) on {len(train.labels):,} real CIFAR-10 images, "
        f"{args.workers} workers x batch {args.batch_size}, DLGS density {args.density}, "
        f"reuse every {args.reuse_every}; {epochs} epochs x {steps_per_epoch} steps")
  dense_bytes = dlgs_jax.wire.allreduce_bytes(num_params, args.workers)
  local = list(range(args.workers))
  start = time.perf_counter()
  for epoch in range(epochs):
    losses, accuracies, sent = [], [], []
    batches = data.epoch_indices(len(train.labels), args.workers, args.batch_size, epoch,
                                 args.seed, local)
    for idx in tqdm(batches, total=steps_per_epoch, desc=f"epoch {epoch + 1}/{epochs}",
                    leave=False, file=sys.stdout, disable=None):
      images, labels = parallel.shard_batch((train.images[idx], train.labels[idx]), mesh)
      state, metrics = step_fn(state, images, labels)
      losses.append(metrics["loss"])
      accuracies.append(metrics["accuracy"])
      sent.append(dlgs_jax.comm_stats(state.opt_state).bytes_sent)
    result = training.evaluate_dataset(evaluate, state.params, state.batch_stats, test)
    bytes_per_step = float(np.mean([np.mean(np.asarray(s)) for s in sent]))
    print(f"epoch {epoch + 1:3d}  train loss {np.mean(losses):.4f}  "
          f"train acc {np.mean(accuracies):.3f}  test loss {result['test_loss']:.4f}  "
          f"test acc {result['test_accuracy']:.3f}  "
          f"sent/worker/step {bytes_per_step / 1e3:.1f} kB (dense {dense_bytes / 1e3:.1f} kB)",
          flush=True)
  elapsed = time.perf_counter() - start
  print(f"done: {epochs * steps_per_epoch} steps in {elapsed:.1f} s; final test accuracy "
        f"{result['test_accuracy']:.3f}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
