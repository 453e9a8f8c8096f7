"""The parameters' SHA-256 after short reference runs of `dlgs-train`, one per method and variant.

A refactor that must not change results runs this before and after and
compares the JSON files; a difference names the method whose training changed.

    python scripts/reference_hashes.py --out /tmp/after.json
    PYTHONPATH=/path/to/old/checkout python scripts/reference_hashes.py --out /tmp/before.json
    python scripts/reference_hashes.py --compare /tmp/before.json /tmp/after.json

Every run: SmallCNN on the embedded CIFAR-10 subset, 4 simulated workers,
density 0.1, 25 steps (two exact threshold steps and the reuse steps between
them), seed 0, one process.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from dlgs_jax.cli.train import method_flags
from dlgs_jax.compress.methods import METHODS, VARIANTS

STEPS = 25


def run_hash(name: str, workdir: Path) -> str:
  """Trains `name` for `STEPS` steps in `workdir`; its final parameters' SHA-256."""
  command = [sys.executable, "-m", "dlgs_jax.cli.train", *method_flags(name), "--model",
             "smallcnn", "--density", "0.1", "--steps", str(STEPS), "--batch-size", "16",
             "--local-devices", "4", "--workers", "4", "--seed", "0", "--check-every", "0",
             "--workdir", str(workdir)]
  # Run outside the checkout: `python -m` puts the working directory first on
  # sys.path, ahead of PYTHONPATH, which chooses the code compared.
  out = subprocess.run(command, capture_output=True, text=True, check=False,
                       cwd=workdir.parent)
  summary = workdir / "summary.json"
  if out.returncode or not summary.exists():
    raise SystemExit(f"{name}: dlgs-train failed ({out.returncode}): "
                     f"{(out.stderr or out.stdout).strip().splitlines()[-1:]}")
  return json.loads(summary.read_text())["params_sha256"]


def compare(before: dict, after: dict) -> list[str]:
  """Names whose hash differs or is missing on one side."""
  return sorted(name for name in set(before) | set(after) if before.get(name) != after.get(name))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", help="write {method: params SHA-256} here")
  parser.add_argument("--methods", default=",".join([*METHODS, *VARIANTS]),
                      help="comma-separated methods and variants (default: all)")
  parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"),
                      help="compare two files written by --out instead of training")
  args = parser.parse_args(argv)
  if args.compare:
    before, after = (json.loads(Path(p).read_text()) for p in args.compare)
    changed = compare(before, after)
    print("identical" if not changed else f"changed: {', '.join(changed)}")
    return 1 if changed else 0
  if not args.out:
    parser.error("--out is required unless --compare is given")
  hashes = {}
  with tempfile.TemporaryDirectory() as tmp:
    for name in args.methods.split(","):
      hashes[name] = run_hash(name, (Path(tmp) / name).absolute())
      print(f"{name:14s} {hashes[name]}", flush=True)
  Path(args.out).write_text(json.dumps(hashes, indent=1) + "\n")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
