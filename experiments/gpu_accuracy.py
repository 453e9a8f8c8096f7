"""Accuracy on one GPU: ResNet-20, 4 workers simulated on the device, dense against DLGS.

The device machine receives a copy of the working tree, at most 64 MiB in all:
full CIFAR-10 (184 MB) cannot travel, so `pack` writes a slice of it in the
official binary format (every train batch's first rows, the test batch's first
rows) into a folder git ignores, and the device command trains on that slice:

    python experiments/gpu_accuracy.py pack --source ../shared/data/cifar-10-batches-bin
    # on the device (carry device_data/cifar10); the runs' metrics come back even if
    # the call runs out of time, the table only at the end:
    python experiments/gpu_accuracy.py run --epochs 140 --out-dir $OUT/accuracy_gpu \
        --runs-dir $OUT/runs

The slice (10,000 train / 2,000 test images, 35 MiB) is a fifth of the training set,
so 140 epochs of it are 10,920 steps of 128 images, 28 of the paper's 140 epochs in
steps; no GPU has timed it yet, so whether 140 fit 8 minutes is not known.

`run` is `accuracy.py --simulate` (one process, `dlgs-train --simulate-workers`)
with the paper's step schedule over --epochs (lr / 10 at 4/7 and 6/7 of them),
dense and the DLGS default at --density; it writes results.json, results.md and
curves.png, and a run.json with the device and the seconds it took.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from dlgs_jax.workload import data

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SLICE_DIR = ROOT / "device_data" / "cifar10" / data.CIFAR10_BIN_DIR
ROW = data.CIFAR10_BIN_ROW  # a binary CIFAR-10 row: the label byte, then the pixels
TRAIN_FILES = list(data.CIFAR10_BIN_TRAIN_FILES)
TEST_FILE = data.CIFAR10_BIN_TEST_FILE
# What may travel beside the repository's own files (the device's limit is 64 MiB).
SLICE_LIMIT_BYTES = 36 * 2**20


def pack(source: Path, out: Path, train: int, test: int) -> int:
  """Writes `train` training rows (a fifth from each batch) and `test` test rows to `out`.

  Returns:
    The bytes written.

  Raises:
    SystemExit: for a source that lacks a batch or holds too few rows, counts
      that do not split over the five batches, or a slice over
      `SLICE_LIMIT_BYTES`.
  """
  if train < 5 or train % 5 or test < 1:
    raise SystemExit(f"--train {train} must be a positive multiple of 5 (a fifth from each "
                     f"batch) and --test {test} positive")
  size = (train + test) * ROW
  if size > SLICE_LIMIT_BYTES:
    raise SystemExit(f"--train {train} --test {test} make {size / 2**20:.1f} MiB, over the "
                     f"{SLICE_LIMIT_BYTES / 2**20:.0f} MiB that can travel to the device "
                     f"beside the repository: take fewer rows")
  out.mkdir(parents=True, exist_ok=True)
  for name, rows in [(f, train // 5) for f in TRAIN_FILES] + [(TEST_FILE, test)]:
    path = source / name
    if not path.is_file():
      raise SystemExit(f"{path} is missing: give --source the cifar-10-batches-bin folder")
    have = path.stat().st_size // ROW
    if have < rows:
      raise SystemExit(f"{path} holds {have} rows, fewer than the {rows} asked for")
    with open(path, "rb") as f:
      (out / name).write_bytes(f.read(rows * ROW))
  return size


def run(args) -> int:
  """Trains dense and DLGS on the slice (`accuracy.py --simulate`) and records the device."""
  import jax

  if not (Path(args.data_dir) / TRAIN_FILES[0]).is_file():
    raise SystemExit(f"no CIFAR-10 slice in {args.data_dir}: run `python "
                     f"experiments/gpu_accuracy.py pack` first and carry device_data/cifar10")
  out = Path(args.out_dir)
  started = time.time()
  # accuracy.py in its own process, as any experiment runs another: no script imports one.
  status = subprocess.call([
      sys.executable, str(HERE / "accuracy.py"), "--model", args.model, "--methods", "dense,dlgs", "--densities", str(args.density),
      "--workers", str(args.workers), "--simulate", "--epochs", str(args.epochs),
      "--batch-size", str(args.batch_size), "--lr", str(args.lr), "--data-dir",
      str(args.data_dir), "--out-dir", str(out), "--runs-dir", str(args.runs_dir), "--rerun"])
  device = jax.devices()[0]
  (out / "run.json").write_text(json.dumps({
      "device": getattr(device, "device_kind", device.platform), "platform": device.platform,
      "jax": jax.__version__, "seconds": round(time.time() - started, 1),
      "epochs": args.epochs, "data": str(args.data_dir)}, indent=2) + "\n")
  return status


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  commands = parser.add_subparsers(dest="command", required=True)
  packing = commands.add_parser("pack", help="write the slice of CIFAR-10 that can travel")
  packing.add_argument("--source", default=str(ROOT.parent / "shared" / "data" /
                                               "cifar-10-batches-bin"))
  packing.add_argument("--out", default=str(SLICE_DIR))
  packing.add_argument("--train", type=int, default=10_000)
  packing.add_argument("--test", type=int, default=2_000)
  running = commands.add_parser("run", help="train dense and DLGS on the slice")
  running.add_argument("--data-dir", default=str(SLICE_DIR))
  running.add_argument("--model", default="resnet20")
  running.add_argument("--workers", type=int, default=4)
  running.add_argument("--batch-size", type=int, default=32, help="per worker")
  running.add_argument("--lr", type=float, default=0.1)
  running.add_argument("--density", type=float, default=0.01)
  running.add_argument("--epochs", type=int, default=140)
  running.add_argument("--out-dir", default=str(HERE / "results" / "accuracy_gpu"))
  running.add_argument("--runs-dir", default=str(ROOT / "runs" / "accuracy_gpu"))
  args = parser.parse_args(argv)
  if args.command == "pack":
    size = pack(Path(args.source), Path(args.out), args.train, args.test)
    print(f"wrote {args.train} train and {args.test} test images ({size / 2**20:.1f} MiB) to "
          f"{args.out}")
    return 0
  return run(args)


if __name__ == "__main__":
  sys.exit(main())
