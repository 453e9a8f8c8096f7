"""What a device holds and sends with the model sliced over its node (HSDP), against replicas.

On 8 CPU devices, for nodes of L = 2, 4 and 8 devices (8/L nodes): DLGS's step
with the model replicated on every device (a flat exchange over the 8), with
two_level (replicated, dense inside a node, slices between nodes) and with the
model sliced over each node (`data_parallel(fsdp_axis=...)`). Per device: the
bytes of the step's state from XLA's memory analysis of the compiled program,
and the bytes it sends between nodes after one step, against flat DLGS among
the nodes (one device a node holding the whole model).

    python experiments/hsdp_memory.py --out experiments/results/hsdp/resnet20_memory.json
"""

from __future__ import annotations

import os

if "device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8")

import argparse  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import dlgs_jax  # noqa: E402
from dlgs_jax.profiling import records  # noqa: E402
from dlgs_jax.workload import losses, models  # noqa: E402

DEVICES = 8


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="resnet20")
  parser.add_argument("--density", type=float, default=0.01)
  parser.add_argument("--batch-per-device", type=int, default=8)
  parser.add_argument("--out", required=True)
  args = parser.parse_args(argv)

  model, _ = models.create_model(args.model)
  sample = np.zeros((1, 32, 32, 3), np.uint8)
  variables = losses.init_variables(model, sample, 0)
  params, stats = variables["params"], variables.get("batch_stats", {})
  rng = np.random.default_rng(0)
  rows = DEVICES * args.batch_per_device
  batch = (rng.standard_normal((rows, 32, 32, 3)).astype(np.float32),
           rng.integers(0, 10, rows).astype(np.int32))

  def loss(p, s, b):
    logits, new = losses.apply_for_training(model, p, s, b[0])
    return losses.cross_entropy(logits, b[1]), new.get("batch_stats", s)

  def chain(compressor):
    return optax.chain(compressor, optax.sgd(0.1, momentum=0.9))

  def measure(dp, nodes_batch=batch):
    state = dp.init(params, stats)
    placed = jax.device_put(nodes_batch, dp.batch_sharding)
    memory = dp.memory(state, placed)
    _, metrics = dp.step(state, placed)
    return {**memory, "bytes_sent": float(metrics["bytes_sent"])}

  devices = jax.devices()[:DEVICES]
  flat = measure(dlgs_jax.data_parallel(
      loss, chain(dlgs_jax.dlgs(args.density, axis_name="data")),
      jax.make_mesh((DEVICES,), ("data",), devices=devices), model_state=True))
  print(f"{args.model}, DLGS {args.density:g}, replicated on {DEVICES} devices: state "
        f"{flat['state'] / 1e6:.2f} MB a device")
  rows_out = []
  for local in (2, 4, 8):
    nodes = DEVICES // local
    two = measure(dlgs_jax.data_parallel(
        loss, chain(dlgs_jax.two_level(lambda a: dlgs_jax.dlgs(args.density, axis_name=a),
                                       fast_axis="local", slow_axis="node", fast_size=local)),
        jax.make_mesh((nodes, local), ("node", "local"), devices=devices), model_state=True))
    sliced = measure(dlgs_jax.data_parallel(
        loss, chain(dlgs_jax.dlgs(args.density, axis_name="data")),
        jax.make_mesh((nodes, local), ("data", "fsdp"), devices=devices), model_state=True,
        fsdp_axis="fsdp"))
    # Flat DLGS among the nodes: one device a node, the whole model each.
    among = (measure(dlgs_jax.data_parallel(
        loss, chain(dlgs_jax.dlgs(args.density, axis_name="data")),
        jax.make_mesh((nodes,), ("data",), devices=devices[:nodes]), model_state=True),
        (batch[0][:nodes * args.batch_per_device], batch[1][:nodes * args.batch_per_device]))
             if nodes > 1 else None)
    row = {"fsdp": local, "nodes": nodes, "replicated": flat, "two_level": two,
           "sliced": sliced, "flat_among_nodes": among,
           "state_share": sliced["state"] / flat["state"],
           "bytes_share": (sliced["bytes_sent"] / among["bytes_sent"]) if among else None}
    rows_out.append(row)
    print(f"fsdp {local} ({nodes} nodes): state a device {sliced['state'] / 1e6:.2f} MB sliced, "
          f"{two['state'] / 1e6:.2f} MB two-level ({row['state_share']:.3f} of replicated); "
          + (f"sent between nodes {sliced['bytes_sent'] / 1e3:.1f} kB a device, flat DLGS "
             f"among the nodes {among['bytes_sent'] / 1e3:.1f} kB ({row['bytes_share']:.3f})"
             if among else "one node: nothing between nodes"))
  records.write_json(args.out, {
      "what": f"{args.model}, DLGS density {args.density:g}, SGD with momentum, "
              f"{args.batch_per_device} images a device; per-device bytes from XLA's memory "
              "analysis of the compiled step",
      "machine": records.machine(), "command": "python experiments/hsdp_memory.py --out "
                                               + args.out, "rows": rows_out})
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
