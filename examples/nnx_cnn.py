"""The Linen example's CNN written in Flax NNX, trained with DLGS on the embedded CIFAR-10 subset.

NNX keeps state inside the model; `nnx.split` separates the parameters (what the
gradient and the compressor see) from the rest (BatchNorm statistics, averaged
over workers each step), and the loss rebuilds the model with `nnx.merge`.

    python examples/nnx_cnn.py --steps 60
"""
import argparse
import os

if "device_count" not in os.environ.get("XLA_FLAGS", ""):  # on CPU: 4 devices as 4 workers
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import dlgs_jax  # noqa: E402
from dlgs_jax.workload import data  # noqa: E402


class CNN(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.convs = nnx.List([nnx.Conv(3, 32, (3, 3), use_bias=False, rngs=rngs),
                           nnx.Conv(32, 64, (3, 3), use_bias=False, rngs=rngs)])
    self.norms = nnx.List([nnx.BatchNorm(32, momentum=0.9, rngs=rngs),
                           nnx.BatchNorm(64, momentum=0.9, rngs=rngs)])
    self.hidden = nnx.Linear(8 * 8 * 64, 128, rngs=rngs)
    self.head = nnx.Linear(128, 10, rngs=rngs)

  def __call__(self, x):
    for conv, norm in zip(self.convs, self.norms):
      x = nnx.max_pool(nnx.relu(norm(conv(x))), (2, 2), (2, 2))
    return self.head(nnx.relu(self.hidden(x.reshape(x.shape[0], -1))))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=60)
  parser.add_argument("--batch-per-worker", type=int, default=32)
  parser.add_argument("--density", type=float, default=0.01)
  parser.add_argument("--lr", type=float, default=0.05)
  args = parser.parse_args()

  mesh = dlgs_jax.data_mesh()
  workers = mesh.devices.size
  train, _ = data.load_embedded_cifar10()
  graphdef, params, rest = nnx.split(CNN(nnx.Rngs(0)), nnx.Param, ...)

  def loss_fn(params, rest, batch):
    images, labels = batch
    model = nnx.merge(graphdef, params, rest, copy=True)  # fresh variables for this trace
    logits = model(data.normalize(images))
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, nnx.split(model, nnx.Param, ...)[2]  # the updated statistics

  lr = optax.warmup_cosine_decay_schedule(0.0, args.lr, args.steps // 5, args.steps)
  tx = optax.chain(dlgs_jax.dlgs(args.density, axis_name="data"), optax.sgd(lr, momentum=0.9))
  dp = dlgs_jax.data_parallel(loss_fn, tx, mesh, model_state=True)
  state = dp.init(params, rest)

  num_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
  dense_bytes = dlgs_jax.compress.wire.allreduce_bytes(num_params, workers)
  rng = np.random.default_rng(0)
  for step in range(1, args.steps + 1):
    rows = rng.choice(len(train.labels), workers * args.batch_per_worker, replace=False)
    batch = jax.device_put((train.images[rows], train.labels[rows]), dp.batch_sharding)
    state, metrics = dp.step(state, batch)
    if step == 1 or step % 10 == 0 or step == args.steps:
      sent = float(metrics["bytes_sent"])
      print(f"step {step:4d}  loss {float(metrics['loss']):.3f}  sent {sent / 1e3:8.1f} kB per "
            f"worker  (dense fp32: {dense_bytes / 1e3:.1f} kB, {dense_bytes / max(sent, 1):.0f}x more)")
  model = nnx.merge(graphdef, *dlgs_jax.fetch((state.params, state.model_state)))
  model.eval()  # the trained model, running statistics averaged over the workers
  print(f"trained model: {type(model).__name__} with {num_params} parameters")


if __name__ == "__main__":
  main()
