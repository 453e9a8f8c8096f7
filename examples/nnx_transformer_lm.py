"""A small Flax NNX Transformer language model trained with DLGS on tiny-shakespeare.

A decoder-only model (causal self-attention, two blocks) learns to predict the
next character of Shakespeare (tiny-shakespeare, public domain, shipped
gzipped in examples/data). Each worker takes its own windows of text; DLGS
sends 1% of each layer's gradient (with everything not sent kept in float32
residuals), against a dense float32 all-reduce.

With ``--fsdp L`` the model is sliced over the L devices of each node, as a
model too big for one device would be (HSDP: ``data_parallel(fsdp_axis=...)``):
each device holds a slice of every leaf, of Adam's moments and of DLGS's
residuals, and DLGS exchanges the slices between nodes only.

    python examples/nnx_transformer_lm.py --steps 100
    python examples/nnx_transformer_lm.py --devices 8 --fsdp 4 --steps 100    # 2 nodes x 4
    python examples/nnx_transformer_lm.py --devices 8 --fsdp 4 --method dense  # the same, dense
"""
import argparse
import gzip
import os
import sys
from pathlib import Path


def _devices(argv) -> str:
  """--devices N from the command line, read before JAX starts (it fixes the CPU count)."""
  for i, arg in enumerate(argv):
    if arg == "--devices" and i + 1 < len(argv):
      return argv[i + 1]
    if arg.startswith("--devices="):
      return arg.split("=", 1)[1]
  return "4"


if "device_count" not in os.environ.get("XLA_FLAGS", ""):  # on CPU: N devices as N workers
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + f" --xla_force_host_platform_device_count={_devices(sys.argv)}")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import dlgs_jax  # noqa: E402

TEXT = gzip.decompress((Path(__file__).resolve().parent / "data" / "tiny_shakespeare.txt.gz")
                       .read_bytes()).decode()


class Block(nnx.Module):
  def __init__(self, dim: int, heads: int, rngs: nnx.Rngs):
    self.norm1, self.norm2 = nnx.LayerNorm(dim, rngs=rngs), nnx.LayerNorm(dim, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(heads, dim, decode=False, rngs=rngs)
    self.mlp_in, self.mlp_out = nnx.Linear(dim, 4 * dim, rngs=rngs), nnx.Linear(4 * dim, dim, rngs=rngs)

  def __call__(self, x, mask):
    x = x + self.attention(self.norm1(x), mask=mask)
    return x + self.mlp_out(nnx.gelu(self.mlp_in(self.norm2(x))))


class LanguageModel(nnx.Module):
  def __init__(self, vocab: int, length: int, rngs: nnx.Rngs, dim: int = 64, depth: int = 2):
    self.tokens = nnx.Embed(vocab, dim, rngs=rngs)
    self.positions = nnx.Embed(length, dim, rngs=rngs)
    self.blocks = nnx.List([Block(dim, 4, rngs) for _ in range(depth)])
    self.norm, self.head = nnx.LayerNorm(dim, rngs=rngs), nnx.Linear(dim, vocab, rngs=rngs)

  def __call__(self, ids):
    x = self.tokens(ids) + self.positions(jnp.arange(ids.shape[-1]))
    mask = nnx.make_causal_mask(ids)
    for block in self.blocks:
      x = block(x, mask)
    return self.head(self.norm(x))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=100)
  parser.add_argument("--length", type=int, default=64)
  parser.add_argument("--batch-per-worker", type=int, default=16)
  parser.add_argument("--density", type=float, default=0.01)
  parser.add_argument("--method", choices=("dlgs", "dense"), default="dlgs")
  parser.add_argument("--devices", type=int, default=4, help="CPU devices (on CPU only)")
  parser.add_argument("--fsdp", type=int, default=None,
                      help="slice the model over this many devices of a node (HSDP)")
  args = parser.parse_args()

  vocab = sorted(set(TEXT))
  ids = np.asarray([vocab.index(c) for c in TEXT], np.int32)
  if args.fsdp:
    devices = jax.devices()
    if len(devices) % args.fsdp:
      parser.error(f"--fsdp {args.fsdp} does not divide the {len(devices)} devices")
    mesh = jax.make_mesh((len(devices) // args.fsdp, args.fsdp), ("data", "fsdp"))
  else:
    mesh = dlgs_jax.data_mesh()
  workers = mesh.devices.size
  graphdef, params = nnx.split(LanguageModel(len(vocab), args.length, nnx.Rngs(0)), nnx.Param)

  def loss_fn(params, windows):
    logits = nnx.merge(graphdef, params, copy=True)(windows[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:]).mean()

  lr = optax.warmup_cosine_decay_schedule(0.0, 3e-3, args.steps // 10, args.steps)
  compressor = (dlgs_jax.dlgs(args.density, axis_name="data") if args.method == "dlgs"
                else dlgs_jax.dense(axis_name="data"))
  tx = optax.chain(compressor, optax.adam(lr))
  dp = dlgs_jax.data_parallel(loss_fn, tx, mesh, fsdp_axis="fsdp" if args.fsdp else None)
  state = dp.init(params)
  if args.fsdp:
    print(f"{mesh.shape['data']} nodes x {args.fsdp} devices, each holding 1/{args.fsdp} of "
          f"the model; {args.method} between nodes")

  num_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
  # What a dense float32 all-reduce would send on the same link: with slices, a
  # device's slice between the nodes.
  dense_bytes = (dlgs_jax.compress.wire.allreduce_bytes(-(-num_params // args.fsdp),
                                                        mesh.shape["data"])
                 if args.fsdp else dlgs_jax.compress.wire.allreduce_bytes(num_params, workers))
  rng = np.random.default_rng(0)
  print(f"{num_params} parameters, {len(vocab)} characters, uniform loss {np.log(len(vocab)):.2f}")
  for step in range(1, args.steps + 1):
    starts = rng.integers(0, len(ids) - args.length - 1, workers * args.batch_per_worker)
    windows = np.stack([ids[s:s + args.length + 1] for s in starts])
    state, metrics = dp.step(state, jax.device_put(windows, dp.batch_sharding))
    if step == 1 or step % 20 == 0 or step == args.steps:
      sent = float(metrics["bytes_sent"])
      print(f"step {step:4d}  loss {float(metrics['loss']):.3f}  sent {sent / 1e3:7.1f} kB per "
            f"worker  (dense fp32: {dense_bytes / 1e3:.1f} kB, {dense_bytes / max(sent, 1):.0f}x more)")


if __name__ == "__main__":
  main()
