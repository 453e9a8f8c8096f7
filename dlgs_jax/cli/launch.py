"""``dlgs-launch --nproc N -- <dlgs-train args>``: N local processes of one job.

Each process gets the `jax.distributed` settings (coordinator on localhost,
process count, its id, simulated CPU devices) in its environment and runs
``python -m dlgs_jax.cli.train <args>`` (or ``--module``); see
`dlgs_jax.cluster.launch`. Output is streamed with a ``[rank]`` prefix; if any
process fails the others are stopped.

    dlgs-launch --nproc 4 -- --model resnet20 --method dlgs --epochs 1
    dlgs-launch --nproc 2 --local-devices 2 -- --model smallcnn --steps 50

CPU only (gloo collectives); on GPU clusters use ``scripts/cluster/``.
"""

from __future__ import annotations

import argparse
import sys

from dlgs_jax.cluster.launch import launch


# dlgs-train flags each launched process gets from the launcher, through its environment.
LAUNCHER_SETS = ("--coordinator", "--num-processes", "--process-id", "--local-devices")


def parse_args(argv=None):
  argv = list(sys.argv[1:] if argv is None else argv)
  if "--" in argv:
    split = argv.index("--")
    own, child = argv[:split], argv[split + 1:]
  else:
    own, child = argv, []
  parser = argparse.ArgumentParser(prog="dlgs-launch", description=__doc__.splitlines()[0])
  parser.add_argument("--nproc", type=int, required=True, help="processes to start")
  parser.add_argument("--local-devices", type=int, default=1,
                      help="simulated CPU devices per process (workers per process)")
  parser.add_argument("--port", type=int, default=0, help="coordinator port (default: a free one)")
  parser.add_argument("--module", default="dlgs_jax.cli.train", help="python module each process runs")
  parser.add_argument("--grace", type=float, default=10.0,
                      help="seconds between SIGTERM and SIGKILL when stopping processes")
  args = parser.parse_args(own)
  if args.nproc < 1:
    parser.error(f"--nproc must be >= 1, got {args.nproc}")
  if args.local_devices < 1:
    parser.error(f"--local-devices must be >= 1, got {args.local_devices}")
  if not 0 <= args.port < 65536:
    parser.error(f"--port must be in [0, 65536), got {args.port}")
  for i, word in enumerate(child):
    flag = word.split("=", 1)[0]
    if flag in LAUNCHER_SETS:
      value = word.split("=", 1)[1] if "=" in word else " ".join(child[i + 1:i + 2])
      parser.error(f"{flag} {value} after '--': the launcher sets every process's "
                   f"{', '.join(LAUNCHER_SETS)} itself (--nproc {args.nproc}, --local-devices "
                   f"{args.local_devices}); drop it, or change --nproc / --local-devices")
  return args, child


def main(argv=None) -> int:
  args, child = parse_args(argv)
  return launch(args.nproc, child, local_devices=args.local_devices, port=args.port,
                module=args.module, grace=args.grace)


if __name__ == "__main__":
  sys.exit(main())
