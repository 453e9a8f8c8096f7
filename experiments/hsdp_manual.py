"""Full-manual or partial-manual shard_map for the compressor on sliced parameters.

HSDP's compressor could run in a shard_map manual over the node axis only
(``axis_names={"data"}``), leaving the slices' axis to XLA inside the body, or
manual over both axes on each device's own slice (what `data_parallel` does).
This compiles DLGS's update both ways on 2 x 4 CPU devices, its gradient
sliced over the 4 devices of a node, and counts in the compiled HLO the
collectives over the node's devices that XLA inserted (all-gathers,
all-to-alls, collective permutes, all-reduces beyond the exchange's own), the
program's size and its temporaries.

    python experiments/hsdp_manual.py --out experiments/results/hsdp/manual.json
"""

from __future__ import annotations

import os

if "device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import dlgs_jax  # noqa: E402
from dlgs_jax.profiling import records  # noqa: E402
from dlgs_jax.workload import losses, models  # noqa: E402

NODES, LOCAL = 2, 4
KINDS = ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter")


def counts(text: str) -> dict:
  """Collective instructions of each kind in compiled HLO text (start ops of async pairs once)."""
  return {kind: len(re.findall(rf"= [^=]*? {kind}(?:-start)?\(", text)) for kind in KINDS}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="resnet20")
  parser.add_argument("--density", type=float, default=0.01)
  parser.add_argument("--out", required=True)
  args = parser.parse_args(argv)
  model, _ = models.create_model(args.model)
  params = losses.init_variables(model, np.zeros((1, 32, 32, 3), np.uint8), 0)["params"]
  # Auto axes: inside the partial-manual body XLA's partitioner places the slices.
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:NODES * LOCAL]).reshape(NODES, LOCAL),
                           ("data", "fsdp"))
  tx = dlgs_jax.dlgs(args.density, axis_name="data")
  rng = np.random.default_rng(0)
  out = {}

  # Partial-manual: each node's gradient is whole leaves (flattened), sliced over
  # "fsdp" by XLA; the body is manual over "data" only.
  named = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(params)}
  # Each leaf flat and padded to a multiple of L (the slices' cut), in both variants.
  flat = {k: rng.standard_normal((NODES, -(-int(np.prod(v.shape)) // LOCAL) * LOCAL))
          .astype(np.float32) for k, v in named.items()}
  whole = {k: jnp.zeros(v.shape[1:], jnp.float32) for k, v in flat.items()}
  state = tx.init(whole)
  stack = lambda x: np.broadcast_to(np.asarray(x), (NODES,) + np.shape(x)).copy()  # noqa: E731
  states = jax.tree_util.tree_map(stack, state)

  def body(g, s):
    g = jax.tree_util.tree_map(lambda x: x[0], g)
    s = jax.tree_util.tree_map(lambda x: x[0], s)
    u, s = tx.update(g, s)
    return (jax.tree_util.tree_map(lambda x: x[None], u),
            jax.tree_util.tree_map(lambda x: x[None], s))

  grad_sharding = NamedSharding(mesh, P("data", "fsdp"))
  grads = {k: jax.device_put(v, grad_sharding) for k, v in flat.items()}
  placed = jax.device_put(states, NamedSharding(mesh, P("data")))
  partial = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P("data")),
                                  out_specs=(P("data"), P("data")), axis_names={"data"},
                                  check_vma=False))
  out["partial_manual"] = _describe(partial.lower(grads, placed).compile())

  # Full-manual: each device updates its own slice (as data_parallel(fsdp_axis=...)).
  width = {k: -(-v.shape[1] // LOCAL) for k, v in flat.items()}
  sliced = {k: v.reshape(NODES * LOCAL, width[k]) for k, v in flat.items()}
  slice_state = tx.init({k: jnp.zeros((w,), jnp.float32) for k, w in width.items()})
  rows = lambda x: np.broadcast_to(np.asarray(x), (NODES * LOCAL,) + np.shape(x)).copy()  # noqa: E731
  both = NamedSharding(mesh, P(("data", "fsdp")))
  full = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(("data", "fsdp")),) * 2,
                               out_specs=(P(("data", "fsdp")),) * 2, check_vma=False))
  out["full_manual"] = _describe(full.lower(
      {k: jax.device_put(v, both) for k, v in sliced.items()},
      jax.device_put(jax.tree_util.tree_map(rows, slice_state), both)).compile())
  for name, row in out.items():
    print(f"{name}: {row['collectives']}, {row['instructions']} instructions, "
          f"temporaries {row['temporaries'] / 1e6:.2f} MB")
  records.write_json(args.out, {
      "what": f"DLGS's update ({args.model}, density {args.density:g}) on 2 nodes x 4 devices, "
              "the gradient sliced over a node's devices: collectives in the compiled HLO",
      "machine": records.machine(),
      "command": "python experiments/hsdp_manual.py --out " + args.out, **out})
  return 0


def _describe(compiled) -> dict:
  text = compiled.as_text()
  analysis = compiled.memory_analysis()
  return {"collectives": counts(text), "instructions": text.count("\n  "),
          "temporaries": int(analysis.temp_size_in_bytes)}


if __name__ == "__main__":
  raise SystemExit(main())
