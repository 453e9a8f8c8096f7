"""A Flax Linen CNN with BatchNorm on the embedded CIFAR-10 subset, trained with DLGS.

Four CPU devices stand in for four workers (on GPUs, each GPU is a worker).
Prints the loss falling and the bytes each worker sends per step, next to a
dense float32 all-reduce of the same gradients.

    python examples/linen_cnn.py --steps 60
"""
import argparse
import os

if "device_count" not in os.environ.get("XLA_FLAGS", ""):  # on CPU: 4 devices as 4 workers
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import dlgs_jax  # noqa: E402
from dlgs_jax.workload import data  # noqa: E402


class CNN(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool):
    for features in (32, 64):
      x = nn.Conv(features, (3, 3), use_bias=False)(x)
      x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
      x = nn.max_pool(nn.relu(x), (2, 2), (2, 2))
    x = nn.relu(nn.Dense(128)(x.reshape(x.shape[0], -1)))
    return nn.Dense(10)(x)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=60)
  parser.add_argument("--batch-per-worker", type=int, default=32)
  parser.add_argument("--density", type=float, default=0.01)
  parser.add_argument("--lr", type=float, default=0.05)
  args = parser.parse_args()

  mesh = dlgs_jax.data_mesh()  # every device is a worker, one axis "data"
  workers = mesh.devices.size
  model = CNN()
  train, _ = data.load_embedded_cifar10()
  variables = model.init(jax.random.key(0), jnp.zeros((1, 32, 32, 3)), train=False)

  def loss_fn(params, batch_stats, batch):
    images, labels = batch
    logits, updates = model.apply({"params": params, "batch_stats": batch_stats},
                                  data.normalize(images), train=True, mutable=["batch_stats"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, updates["batch_stats"]

  lr = optax.warmup_cosine_decay_schedule(0.0, args.lr, args.steps // 5, args.steps)
  tx = optax.chain(dlgs_jax.dlgs(args.density, axis_name="data"), optax.sgd(lr, momentum=0.9))
  dp = dlgs_jax.data_parallel(loss_fn, tx, mesh, model_state=True)
  state = dp.init(variables["params"], variables["batch_stats"])

  num_params = sum(x.size for x in jax.tree_util.tree_leaves(variables["params"]))
  dense_bytes = dlgs_jax.compress.wire.allreduce_bytes(num_params, workers)
  rng = np.random.default_rng(0)
  global_batch = workers * args.batch_per_worker
  for step in range(1, args.steps + 1):
    rows = rng.choice(len(train.labels), global_batch, replace=False)
    batch = jax.device_put((train.images[rows], train.labels[rows]), dp.batch_sharding)
    state, metrics = dp.step(state, batch)
    if step == 1 or step % 10 == 0 or step == args.steps:
      sent = float(metrics["bytes_sent"])
      print(f"step {step:4d}  loss {float(metrics['loss']):.3f}  sent {sent / 1e3:8.1f} kB per "
            f"worker  (dense fp32: {dense_bytes / 1e3:.1f} kB, {dense_bytes / max(sent, 1):.0f}x more)")


if __name__ == "__main__":
  main()
