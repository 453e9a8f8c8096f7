#!/usr/bin/env bash
# One node of a multi-node run (GPU cluster without SLURM, or any set of hosts).
# Start it on every node with the same dlgs-train arguments; the node's process
# drives all of its local accelerators, and jax.distributed joins the nodes.
#
# Required environment:
#   DLGS_COORDINATOR_ADDRESS  host:port of node 0, reachable from every node
#   DLGS_NUM_NODES            number of nodes (processes)
#   DLGS_NODE_RANK            this node's rank, 0 .. DLGS_NUM_NODES-1
# Optional:
#   DLGS_PYTHON               interpreter with dlgs_jax installed
#                             (default: the checkout's .venv/bin/python)
#   JAX_PLATFORMS             e.g. cpu to run on CPUs (then gloo collectives)
#   DLGS_LOCAL_DEVICES        simulated CPU devices per node (CPU only)
#
# Example, two nodes (run the second line on node1):
#   DLGS_COORDINATOR_ADDRESS=node0:12355 DLGS_NUM_NODES=2 DLGS_NODE_RANK=0 \
#     scripts/cluster/run_node.sh --model vgg16 --method dlgs --density 0.01 --workdir /shared/run1
#   DLGS_COORDINATOR_ADDRESS=node0:12355 DLGS_NUM_NODES=2 DLGS_NODE_RANK=1 \
#     scripts/cluster/run_node.sh --model vgg16 --method dlgs --density 0.01 --workdir /shared/run1
# --workdir must be on a file system every node sees (checkpoints are written
# jointly). If one node fails, stop the others (they would wait in a collective).
set -euo pipefail
here="$(cd "$(dirname "$0")/../.." && pwd)"

missing=()
for name in DLGS_COORDINATOR_ADDRESS DLGS_NUM_NODES DLGS_NODE_RANK; do
  [ -n "${!name:-}" ] || missing+=("$name")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "run_node.sh: set ${missing[*]} (see the comment at the top of $0)" >&2
  exit 2
fi
if ! [[ "$DLGS_NUM_NODES" =~ ^[1-9][0-9]*$ ]]; then
  echo "run_node.sh: DLGS_NUM_NODES must be a positive integer, got '$DLGS_NUM_NODES'" >&2
  exit 2
fi
if ! [[ "$DLGS_NODE_RANK" =~ ^[0-9]+$ ]] || [ "$DLGS_NODE_RANK" -ge "$DLGS_NUM_NODES" ]; then
  echo "run_node.sh: DLGS_NODE_RANK must be in [0, $DLGS_NUM_NODES), got '$DLGS_NODE_RANK'" >&2
  exit 2
fi
if ! [[ "$DLGS_COORDINATOR_ADDRESS" =~ ^[^:]+:[0-9]+$ ]]; then
  echo "run_node.sh: DLGS_COORDINATOR_ADDRESS must be host:port, got '$DLGS_COORDINATOR_ADDRESS'" >&2
  exit 2
fi

python="${DLGS_PYTHON:-$here/.venv/bin/python}"
export DLGS_NUM_PROCESSES="$DLGS_NUM_NODES"
export DLGS_PROCESS_ID="$DLGS_NODE_RANK"
exec "$python" -m dlgs_jax.cli.train "$@"
