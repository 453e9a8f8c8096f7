"""Data-parallel training: ``dlgs-train`` (also ``python -m dlgs_jax.train``).

One process or many (`jax.distributed`; see `dlgs_jax.distributed` and
``dlgs-launch``), any number of devices each; every device is one worker.

    dlgs-train --model resnet20 --method dlgs --density 0.01 --epochs 2
    dlgs-train --model resnet20 --method dlgs --planner optimal --bandwidth 1gbit
    dlgs-train --model vgg16 --data-dir ~/data/cifar-10-batches-py --epochs 140 --lr 0.1
    dlgs-train --model resnet50 --data-dir ~/imagenet --batch-size 64 --weight-decay 1e-4
    dlgs-launch --nproc 2 -- --model resnet20 --local-devices 2 --epochs 1

Optimizer: the chosen compressor (which averages gradients across workers),
then weight decay (added after the exchange, so it costs no traffic and never
enters the residuals), then SGD with momentum. DGC is the exception, as in its
paper: weight decay, then DGC (which holds the momentum), then plain SGD. The learning rate is divided by
10 after 4/7 and 6/7 of the steps (the paper's 80 and 120 of 140 epochs) unless
``--lr-decay-epochs`` says otherwise.

Writes to ``--workdir``: ``metrics.jsonl`` (one record per step, one per epoch
with test accuracy), ``summary.json``, ``plan.json`` (when planned) and
``checkpoints/`` (orbax; ``--resume`` continues from the latest).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path

METHODS = ("dense", "topk", "lags", "gtopk", "dlgs", "dgc", "terngrad")
PLANNERS = ("none", "wfbp", "single", "greedy", "optimal")
CIFAR_MODELS = ("smallcnn", "resnet20", "vgg16")
# Methods whose --density changes nothing: experiments run them once.
DENSITY_FREE = ("dense", "terngrad")


# Named variants experiments compare: name -> (method, extra flags). The flags
# mean the same to dlgs-train and to `dlgs_jax.benchmark`.
VARIANTS = {
    # The paper's fixed threshold schedule (no refresh rule).
    "dlgs-paper": ("dlgs", ["--refresh-below", "none"]),
    # Biases and BatchNorm parameters sent whole (DGC's choice).
    "dlgs-whole1d": ("dlgs", ["--min-ndim", "2"]),
    "lags-whole1d": ("lags", ["--min-ndim", "2"]),
    # The classifier head sent whole (a per-layer budget starves it).
    "dlgs-head": ("dlgs", ["--send-whole", "head"]),
    "lags-head": ("lags", ["--send-whole", "head"]),
}


def variant(name: str) -> tuple[str, list[str]]:
  """(method, extra flags) of a method or a named variant (`VARIANTS`)."""
  method, flags = VARIANTS.get(name, (name, []))
  return method, list(flags)


def configurations(methods, densities) -> list[tuple[str, float]]:
  """(method, density) pairs an experiment runs: density-free methods once (first density)."""
  return [(method, density) for density in densities for method in methods
          if method not in DENSITY_FREE or density == densities[0]]


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      prog="dlgs-train", description=__doc__.splitlines()[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  add = parser.add_argument
  add("--model", default="resnet20", help="smallcnn, resnet20, vgg16 or resnet50")
  add("--method", default="dlgs", help=f"one of {METHODS}")
  add("--density", type=float, default=0.01, help="fraction of values sent (sparse methods)")
  add("--reuse-every", type=int, default=10, help="DLGS: exact threshold every this many steps")
  add("--refresh-below", default="0.5",
      help="DLGS: recompute a reused threshold early when it passes fewer than this fraction "
           "of k (or overflows the buffer); 'none': the paper's fixed schedule")
  add("--min-ndim", type=int, default=0,
      help="lags/dlgs: leaves with fewer dimensions (biases, BatchNorm) are sent whole; "
           "0: every leaf is sparsified (the paper)")
  add("--send-whole", default="",
      help="lags/dlgs: leaves sent whole, comma-separated leaf paths, or 'head' for the "
           "output layer (found from the backward order); '': none (the paper)")
  add("--collective", default="allgather", help="lags/dlgs collective: allgather or gtopk")
  add("--dgc-warmup-epochs", type=float, default=4.0,
      help="DGC: epochs of exponential density warm-up from 0.25 (capped at a quarter of the run)")
  add("--terngrad-clip", type=float, default=2.5,
      help="TernGrad: clip at this many standard deviations (0: no clipping)")
  add("--planner", default="none",
      help=f"layer merging for dense/lags/dlgs, one of {PLANNERS}; 'none': dense fuses "
           "everything into one message, lags/dlgs send each leaf alone")
  add("--plan", help="use this plan JSON (from `python -m dlgs_jax.plan`) instead of planning")
  add("--profile", help="plan from this profile JSON instead of measuring one")
  add("--bandwidth", help="plan for a modelled network of this link bandwidth (e.g. 1gbit)")
  add("--latency", type=float, default=25e-6, help="per-step latency with --bandwidth, seconds")
  add("--epochs", type=int, default=2)
  add("--steps", type=int, help="stop after this many steps in all (default: all epochs)")
  add("--batch-size", type=int, default=32, help="examples per worker per step")
  add("--lr", type=float, default=0.1)
  add("--lr-decay-epochs", help="comma-separated epochs after which lr is divided by 10 "
      "(default: 4/7 and 6/7 of the run)")
  add("--momentum", type=float, default=0.9)
  add("--nesterov", action="store_true")
  add("--weight-decay", type=float, default=5e-4)
  add("--sync-bn", action="store_true", help="synchronise BatchNorm statistics across workers")
  add("--no-augment", action="store_true", help="no random crop/flip")
  add("--dataset", default="auto",
      help="auto (CIFAR models: cifar10; resnet50: imagefolder), cifar10, imagefolder, synthetic")
  add("--data-dir", help="cifar-10-batches-py/ or an image folder with train/ and val/; "
      "default for CIFAR: the real subset embedded in the package")
  add("--image-size", type=int, help="input side (imagefolder/synthetic; default: the model's)")
  add("--synthetic-examples", type=int, default=2048, help="training examples with synthetic data")
  add("--workers", type=int, help="use the first N devices of all processes (default: all)")
  add("--workdir", default="runs/train")
  add("--resume", action="store_true", help="continue from the latest checkpoint in --workdir")
  add("--checkpoint-every", type=int, default=0,
      help="save every N steps (0: at the end of every epoch)")
  add("--keep", type=int, default=3, help="checkpoints kept")
  add("--stop-after", type=int, default=0,
      help="leave after this many steps of this run with a checkpoint (time-limited jobs; "
           "continue with --resume); 0: run to the end")
  add("--check-every", type=int, default=100,
      help="verify every N steps that all workers hold identical parameters (0: only at the "
           "start and end)")
  add("--eval-batch-size", type=int, default=500)
  add("--seed", type=int, default=0)
  add("--coordinator", help="multi-process: host:port of process 0 (or DLGS_COORDINATOR_ADDRESS)")
  add("--num-processes", type=int, help="multi-process: process count (or DLGS_NUM_PROCESSES)")
  add("--process-id", type=int, help="multi-process: this process's id (or DLGS_PROCESS_ID)")
  add("--local-devices", type=int,
      help="simulated CPU devices in this process (CPU only; or DLGS_LOCAL_DEVICES)")
  return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
  """Rejects bad flags before anything starts, naming the bad value."""
  def bad(flag, value, rule):
    raise SystemExit(f"dlgs-train: {flag} {value!r} is invalid: {rule}")

  if args.method not in METHODS:
    bad("--method", args.method, f"choose from {METHODS}")
  if args.planner not in PLANNERS:
    bad("--planner", args.planner, f"choose from {PLANNERS}")
  if args.collective not in ("allgather", "gtopk"):
    bad("--collective", args.collective, "choose allgather or gtopk")
  if args.dataset not in ("auto", "cifar10", "imagefolder", "synthetic"):
    bad("--dataset", args.dataset, "choose auto, cifar10, imagefolder or synthetic")
  if not 0.0 < args.density <= 1.0:
    bad("--density", args.density, "must be in (0, 1]")
  for flag, value, low in (("--epochs", args.epochs, 1), ("--batch-size", args.batch_size, 1),
                           ("--reuse-every", args.reuse_every, 1), ("--keep", args.keep, 1),
                           ("--checkpoint-every", args.checkpoint_every, 0),
                           ("--stop-after", args.stop_after, 0),
                           ("--check-every", args.check_every, 0),
                           ("--eval-batch-size", args.eval_batch_size, 1),
                           ("--synthetic-examples", args.synthetic_examples, 1)):
    if value < low:
      bad(flag, value, f"must be >= {low}")
  if args.steps is not None and args.steps < 1:
    bad("--steps", args.steps, "must be >= 1")
  if not (args.lr > 0 and math.isfinite(args.lr)):
    bad("--lr", args.lr, "must be a positive number")
  if not 0 <= args.momentum < 1:
    bad("--momentum", args.momentum, "must be in [0, 1)")
  if not (args.weight_decay >= 0 and math.isfinite(args.weight_decay)):
    bad("--weight-decay", args.weight_decay, "must be >= 0")
  if args.dgc_warmup_epochs < 0:
    bad("--dgc-warmup-epochs", args.dgc_warmup_epochs, "must be >= 0")
  if args.terngrad_clip < 0:
    bad("--terngrad-clip", args.terngrad_clip, "must be >= 0")
  if args.min_ndim < 0:
    bad("--min-ndim", args.min_ndim, "must be >= 0")
  if args.min_ndim and args.method not in ("lags", "dlgs"):
    bad("--min-ndim", args.min_ndim, f"applies to lags and dlgs, not {args.method}")
  if args.send_whole and args.method not in ("lags", "dlgs"):
    bad("--send-whole", args.send_whole, f"applies to lags and dlgs, not {args.method}")
  try:
    parse_refresh_below(args.refresh_below)
  except ValueError:
    bad("--refresh-below", args.refresh_below, "must be a number in [0, 1] or 'none'")
  if args.method in ("topk", "gtopk", "dgc", "terngrad") and (args.planner != "none" or args.plan):
    bad("--planner/--plan", args.plan or args.planner,
        f"planning applies to dense, lags and dlgs, not {args.method}")
  if args.plan and args.planner != "none":
    bad("--plan", args.plan, "give either --plan or --planner, not both")


def decay_boundaries(args, steps_per_epoch: int, total_steps: int) -> list[int]:
  """Steps after which the learning rate is divided by 10."""
  if args.lr_decay_epochs:
    try:
      epochs = [float(e) for e in args.lr_decay_epochs.split(",") if e.strip()]
    except ValueError:
      raise SystemExit(f"dlgs-train: --lr-decay-epochs {args.lr_decay_epochs!r} is invalid: "
                       "give comma-separated numbers") from None
    return sorted(int(round(e * steps_per_epoch)) for e in epochs)
  return [int(round(total_steps * 4 / 7)), int(round(total_steps * 6 / 7))]


def parse_refresh_below(text: str) -> "float | None":
  """``--refresh-below``: a fraction of k in [0, 1], or None for 'none' (the paper's schedule).

  Raises:
    ValueError: naming `text` when it is neither.
  """
  if text == "none":
    return None
  try:
    value = float(text)
  except ValueError:
    value = math.nan
  if not 0.0 <= value <= 1.0:
    raise ValueError(f"--refresh-below must be a number in [0, 1] or 'none', got {text!r}")
  return value


def send_whole_paths(text: str, order) -> list[str]:
  """``--send-whole``: leaf paths (comma-separated), or 'head' for the output layer.

  Args:
    text: the flag's value; '' gives no path.
    order: every leaf path in backward order (names the output layer, and
      checks the paths).

  Raises:
    SystemExit: naming a path the model does not have.
  """
  from dlgs_jax import grouping

  names = [name.strip() for name in text.split(",") if name.strip()]
  paths = []
  for name in names:
    found = grouping.output_layer(order) if name == "head" else [name]
    for path in found:
      if path not in order:
        raise SystemExit(f"dlgs-train: --send-whole {text!r}: the model has no leaf {path!r} "
                         f"(its leaves: {', '.join(sorted(order))}; or 'head')")
      if path not in paths:
        paths.append(path)
  return paths


def whole_layers(args, order, shapes) -> frozenset:
  """Positions in `order` of the leaves lags/dlgs send whole (``--min-ndim``, ``--send-whole``).

  For `timeline.MethodCosts.whole_layers`: the planner and the benchmark's
  prediction price those leaves at full size in their group's message.

  Args:
    args: checked flags.
    order: every leaf path in backward order (a profile's ``paths``).
    shapes: leaf path -> shape.
  """
  if args.method not in ("lags", "dlgs"):
    return frozenset()
  named = set(send_whole_paths(args.send_whole, order))
  return frozenset(i for i, path in enumerate(order)
                   if path in named or len(shapes[path]) < args.min_ndim)


def refresh_below(args) -> "float | None":
  """DLGS's refresh rule from the checked flags: the fraction of k, or None (the paper's)."""
  return parse_refresh_below(args.refresh_below)


def dgc_warmup_steps(args, steps_per_epoch: int, total_steps: int) -> int:
  return min(int(round(args.dgc_warmup_epochs * steps_per_epoch)), total_steps // 4)


def build_compressor(args, axis: "str | None", groups, order):
  """The gradient compressor `args.method` names, configured from the checked flags.

  Args:
    args: checked ``dlgs-train`` flags (`check_args`).
    axis: the data-parallel mesh axis, or None for one worker outside ``shard_map``.
    groups: layer groups (lists of parameter paths) for dense, lags and dlgs, or None for
      one group per leaf (dense: one message).
    order: parameter paths in the order their gradients become ready.

  Returns:
    The compressing ``optax.GradientTransformation``. DGC is not built here: it holds the
    momentum, so `build_optimizer` composes its chain differently.
  """
  import dlgs_jax

  if args.method == "terngrad":
    return dlgs_jax.terngrad(axis_name=axis, clip=args.terngrad_clip or None, seed=args.seed)
  if args.method == "dense":
    return dlgs_jax.dense(axis_name=axis, groups=groups or [list(order)], order=order)
  if args.method == "topk":
    return dlgs_jax.topk(args.density, axis_name=axis)
  if args.method == "gtopk":
    return dlgs_jax.gtopk(args.density, axis_name=axis)
  if args.method == "lags":
    return dlgs_jax.lags(args.density, axis_name=axis, groups=groups, order=order,
                         collective=args.collective, min_ndim=args.min_ndim,
                         send_whole=send_whole_paths(args.send_whole, order))
  if args.method == "dlgs":
    return dlgs_jax.dlgs(args.density, axis_name=axis, reuse_every=args.reuse_every,
                         groups=groups, order=order, collective=args.collective,
                         refresh_below=refresh_below(args), min_ndim=args.min_ndim,
                         send_whole=send_whole_paths(args.send_whole, order))
  raise ValueError(f"build_compressor: method {args.method!r} has no stand-alone compressor "
                   f"(one of {', '.join(m for m in METHODS if m != 'dgc')})")


def build_optimizer(args, axis: "str | None", schedule, groups, order, *, warmup_steps: int = 0):
  """The whole optimizer: compressor, weight decay, SGD (DGC: decay, DGC, plain SGD).

  Args:
    args, axis, groups, order: as for `build_compressor`.
    schedule: learning rate, a number or an optax schedule.
    warmup_steps: DGC's density warm-up (`dgc_warmup_steps`); ignored by other methods.

  Returns:
    An ``optax.GradientTransformation`` whose updates are added to the parameters.
  """
  import optax
  import dlgs_jax

  if args.method == "dgc":
    # Momentum lives inside DGC (momentum correction), and weight decay goes in
    # before it, as in the paper; the optimizer after it is plain SGD.
    return optax.chain(
        optax.add_decayed_weights(args.weight_decay),
        dlgs_jax.dgc(args.density, axis_name=axis, momentum=args.momentum,
                     warmup_steps=warmup_steps, seed=args.seed),
        optax.sgd(schedule))
  return optax.chain(
      build_compressor(args, axis, groups, order),
      optax.add_decayed_weights(args.weight_decay),
      optax.sgd(schedule, momentum=args.momentum or None, nesterov=args.nesterov))


def load_data(args, model_name: str, model_shape):
  from dlgs_jax import data

  kind = args.dataset
  if kind == "auto":
    kind = "cifar10" if model_name in CIFAR_MODELS else "imagefolder"
  if kind == "cifar10":
    if args.data_dir:
      train, test = data.load_cifar10(args.data_dir)
      name = f"cifar10:{os.path.abspath(args.data_dir)}"
    else:
      train, test = data.load_embedded_cifar10()
      name = "cifar10:embedded"
    return train, test, name, 4
  size = args.image_size or model_shape[0]
  if kind == "imagefolder":
    if not args.data_dir:
      raise SystemExit(f"dlgs-train: {model_name} needs --data-dir (an image folder with "
                       "train/ and val/), or --dataset synthetic")
    train, test = data.load_image_folder(args.data_dir, size)
    return train, test, f"imagefolder:{os.path.abspath(args.data_dir)}", max(1, size // 8)
  shape = (size, size, model_shape[2])
  classes = 10 if model_name in CIFAR_MODELS else 1000
  train = data.synthetic(args.synthetic_examples, shape, classes, seed=args.seed)
  test = data.synthetic(max(args.eval_batch_size, 256), shape, classes, seed=args.seed + 1)
  return train, test, f"synthetic:{args.synthetic_examples}x{shape}", max(1, size // 8)


def backward_order_of(model, params, batch_stats, sample_shape):
  import jax.numpy as jnp
  from dlgs_jax import grouping, training

  def loss_fn(p, x):
    return jnp.sum(training.apply_for_training(model, p, batch_stats, x)[0])

  return grouping.backward_order(loss_fn, params, jnp.zeros(sample_shape, jnp.float32))


def make_or_load_plan(args, mesh, paths, workers, log):
  """The plan every process uses (made on process 0 and broadcast), or None."""
  from dlgs_jax import models, planner, profiler
  from dlgs_jax.timeline import Profile

  if args.plan:
    plan = planner.Plan.load(args.plan)
  elif args.planner == "none":
    return None
  else:
    if args.profile:
      profile = Profile.load(args.profile)
      if profile.model != args.model:
        raise SystemExit(f"dlgs-train: --profile {args.profile} is for model "
                         f"{profile.model!r}, not {args.model!r}")
    else:
      log(f"profiling {args.model} for the planner (every process measures; process 0's "
          "profile is used) ...")
      profile, _ = profiler.profile_model(
          args.model, density=args.density, batch_size=args.batch_size,
          image_size=args.image_size, mesh=mesh, reuse_every=args.reuse_every, seed=args.seed,
          refresh_below=refresh_below(args) if args.method == "dlgs" else None,
          methods=(args.method,))
    if args.bandwidth:
      profile = profile.with_comm(
          profiler.network_comm(workers, profiler.parse_bandwidth(args.bandwidth), args.latency),
          workers, f"network modelled: {args.bandwidth} links")
    plan = None
    import jax
    if jax.process_index() == 0:
      # With the refresh rule, DLGS recomputes thresholds as often as the
      # profile measured (None: the fixed schedule's cost).
      fraction = planner.dlgs_exact_fraction(profile, args.method, refresh_below(args))
      if fraction is not None:
        log(f"DLGS refresh rule: {fraction:.0%} of thresholds computed exactly per step "
            "(measured); the planner prices DLGS at that rate")
      shapes = models.leaf_shapes(args.model, image_size=args.image_size)
      plan = planner.make_plan(profile, args.method, args.density, args.planner,
                               exact_fraction=fraction,
                               whole_layers=whole_layers(args, profile.paths, shapes))
    plan = planner.broadcast_plan(plan)
  if plan.method != args.method:
    raise SystemExit(f"dlgs-train: the plan was made for method {plan.method!r}, "
                     f"this run uses {args.method!r}")
  try:
    plan.check_compatible(paths=paths, workers=workers)
  except ValueError as e:
    raise SystemExit(f"dlgs-train: {e}") from None
  return plan


def tree_sha256(tree) -> str:
  """SHA-256 over the raw bytes, shapes and dtypes of a tree of host arrays."""
  import jax
  import numpy as np

  digest = hashlib.sha256()
  for leaf in jax.tree_util.tree_leaves(tree):
    leaf = np.ascontiguousarray(np.asarray(leaf))
    digest.update(f"{leaf.dtype}{leaf.shape}".encode())
    digest.update(leaf.tobytes())
  return digest.hexdigest()


class MetricsLog:
  """JSONL metrics on process 0; on resume, records past the checkpoint are dropped."""

  def __init__(self, path: Path, enabled: bool, resume_step: int):
    self.path = path
    self.enabled = enabled
    self.file = None
    if not enabled:
      return
    kept = []
    if resume_step > 0 and path.exists():
      for line in path.read_text().splitlines():
        try:
          record = json.loads(line)
        except json.JSONDecodeError:
          continue  # a line cut short by a kill
        if record.get("step", 0) <= resume_step:
          kept.append(line)
    path.write_text("".join(line + "\n" for line in kept))
    self.file = open(path, "a")

  def write(self, record: dict) -> None:
    if self.file:
      self.file.write(json.dumps(record) + "\n")
      self.file.flush()

  def close(self) -> None:
    if self.file:
      self.file.close()


def main(argv=None) -> int:
  args = parse_args(argv)
  check_args(args)
  from dlgs_jax import distributed
  try:
    distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                           local_cpu_devices=args.local_devices)
  except ValueError as e:
    raise SystemExit(f"dlgs-train: {e}") from None
  return train(args)


def train(args) -> int:
  import jax
  import numpy as np
  import optax
  from tqdm import tqdm

  import dlgs_jax
  from dlgs_jax import checkpoint, data, grouping, models, parallel, training

  leader = jax.process_index() == 0

  def log(message):
    if leader:
      print(message, flush=True)

  workdir = Path(args.workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  try:
    model_probe, model_shape = models.create_model(args.model)
  except ValueError as e:
    raise SystemExit(f"dlgs-train: --model: {e}") from None
  del model_probe
  try:
    train_set, test_set, dataset_name, pad = load_data(args, args.model, model_shape)
  except ValueError as e:
    raise SystemExit(f"dlgs-train: data: {e}") from None

  try:
    mesh = parallel.data_mesh(args.workers)
  except ValueError as e:
    raise SystemExit(f"dlgs-train: --workers: {e}") from None
  axis = mesh.axis_names[0]
  workers = int(mesh.devices.size)
  local_workers = [i for i, d in enumerate(mesh.devices.flat) if d.process_index == jax.process_index()]
  model, _ = models.create_model(args.model, num_classes=train_set.num_classes,
                                 bn_axis_name=axis if args.sync_bn else None)
  spe = data.steps_per_epoch(len(train_set.labels), workers, args.batch_size)
  total_steps = args.epochs * spe if args.steps is None else args.steps
  epochs = math.ceil(total_steps / spe)
  schedule = optax.piecewise_constant_schedule(
      args.lr, {b: 0.1 for b in decay_boundaries(args, spe, total_steps) if 0 < b < total_steps})

  sample = np.zeros((1,) + train_set.image_shape, np.uint8)
  variables = training.init_variables(model, sample, args.seed)
  paths = grouping.leaf_paths(variables["params"])
  # Traced outside shard_map, so without the SyncBN axis (same parameters).
  order = backward_order_of(model.clone(bn_axis_name=None), variables["params"],
                            variables.get("batch_stats", {}), sample.shape)
  plan = make_or_load_plan(args, mesh, paths, workers, log)
  groups = plan.groups if plan is not None else None
  warmup = dgc_warmup_steps(args, spe, total_steps) if args.method == "dgc" else 0
  tx = build_optimizer(args, axis, schedule, groups, order, warmup_steps=warmup)
  state = training.train_state_from_variables(variables, tx, mesh)
  del variables
  step_fn = training.make_train_step(model, tx, mesh, augment=not args.no_augment, pad=pad,
                                     mean=train_set.mean, std=train_set.std, seed=args.seed)
  evaluate = training.make_eval_fn(model, train_set.mean, train_set.std)
  fingerprint = training.make_fingerprint_fn(mesh)

  plan_json = plan.to_json() if plan is not None else None
  run = {
      "model": args.model, "method": args.method,
      "density": None if args.method in ("dense", "terngrad") else args.density,
      "reuse_every": args.reuse_every if args.method == "dlgs" else None,
      "collective": args.collective if args.method in ("lags", "dlgs") else None,
      "min_ndim": args.min_ndim if args.method in ("lags", "dlgs") else None,
      "send_whole": (send_whole_paths(args.send_whole, order)
                     if args.method in ("lags", "dlgs") else None),
      "dgc_warmup_steps": warmup if args.method == "dgc" else None,
      "terngrad_clip": args.terngrad_clip if args.method == "terngrad" else None,
      "workers": workers, "batch_size": args.batch_size,
      "plan_id": (hashlib.sha256(json.dumps(plan.groups).encode()).hexdigest()[:16]
                  if plan is not None else f"default:{args.planner}"),
      "dataset": dataset_name, "num_examples": int(len(train_set.labels)),
      "image_shape": list(train_set.image_shape), "num_classes": train_set.num_classes,
      "seed": args.seed, "processes": jax.process_count(),
      "total_steps": total_steps, "lr": args.lr,
  }
  ckpt = checkpoint.Checkpointer(workdir / "checkpoints", run, max_to_keep=args.keep)
  start_step = 0
  if ckpt.latest_step() is not None:
    if not args.resume:
      raise SystemExit(
          f"dlgs-train: {workdir / 'checkpoints'} already holds checkpoints (latest step "
          f"{ckpt.latest_step()}); pass --resume to continue, or use another --workdir")
    try:
      state, record = ckpt.restore(state)
    except checkpoint.CheckpointMismatch as e:
      raise SystemExit(f"dlgs-train: refusing to resume: {e}") from None
    start_step = int(record["step"])
    log(f"resumed from step {start_step} (epoch {record['data']['epoch']}, "
        f"batch {record['data']['batch']} of {spe})")
  elif args.resume:
    log(f"--resume: no checkpoint in {workdir / 'checkpoints'}, starting from step 0")
  if leader and plan is not None:
    plan.save(workdir / "plan.json")
  training.check_replicas_identical(fingerprint, state, start_step)

  num_params = sum(int(x.size) for x in jax.tree_util.tree_leaves(state.params))
  dense_bytes = dlgs_jax.wire.allreduce_bytes(num_params, workers)
  log(f"{args.model} ({num_params:,} parameters), {dataset_name} "
      f"({len(train_set.labels):,} train / {len(test_set.labels):,} test), {workers} workers "
      f"({jax.process_count()} processes) x batch {args.batch_size}; {args.method}"
      + (f" density {args.density:g}" if run["density"] is not None else "")
      + (f" (warm-up {warmup} steps)" if warmup else "")
      + (f", {len(plan.groups)} planned groups ({plan.planner})" if plan else "")
      + f"; {epochs} epochs x {spe} steps = {total_steps} steps")

  metrics_log = MetricsLog(workdir / "metrics.jsonl", leader, start_step)
  step = start_step
  history = []
  run_start = time.perf_counter()
  pending = None  # (step, metrics, epoch): resolved after the next step is dispatched
  last_done = time.perf_counter()
  result = None
  stopped = False  # by --stop-after

  def resolve(item, bar):
    nonlocal last_done
    done_step, metrics, epoch = item
    loss, accuracy = float(metrics["loss"]), float(metrics["accuracy"])
    now = time.perf_counter()
    step_time, last_done = now - last_done, now
    if not math.isfinite(loss):
      log(f"warning: non-finite loss at step {done_step}")
    record = {"step": done_step, "epoch": epoch, "loss": loss, "accuracy": accuracy,
              "lr": float(schedule(done_step - 1)), "step_time": step_time,
              "images_per_s": workers * args.batch_size / step_time}
    for key in ("bytes_sent", "selected", "skipped", "exact"):
      if key in metrics:
        record[key] = float(metrics[key])
    metrics_log.write(record)
    history.append(record)
    if bar is not None:
      bar.set_postfix(loss=f"{loss:.3f}", acc=f"{accuracy:.3f}",
                      img_s=f"{record['images_per_s']:.0f}", refresh=False)
      bar.update(1)

  try:
    for epoch in range(start_step // spe, epochs):
      skip = start_step - epoch * spe if epoch == start_step // spe else 0
      batches = data.epoch_indices(len(train_set.labels), workers, args.batch_size, epoch,
                                   args.seed, local_workers)
      steps_this_epoch = min(spe, total_steps - epoch * spe)
      bar = tqdm(total=steps_this_epoch, initial=skip, desc=f"epoch {epoch + 1}/{epochs}",
                 file=sys.stdout, leave=False, disable=None) if leader else None
      for batch_index, idx in enumerate(batches):
        if batch_index < skip:
          continue
        if batch_index >= steps_this_epoch:
          break
        images, labels = parallel.shard_batch(
            (train_set.images[idx], train_set.labels[idx]), mesh)
        state, metrics = step_fn(state, images, labels)
        step += 1
        if pending is not None:
          resolve(pending, bar)
        pending = (step, metrics, epoch)
        if args.check_every and step % args.check_every == 0:
          training.check_replicas_identical(fingerprint, state, step)
        end_of_epoch = batch_index + 1 == steps_this_epoch
        if (args.checkpoint_every and step % args.checkpoint_every == 0) or (
            not args.checkpoint_every and end_of_epoch):
          position = {"epoch": step // spe, "batch": step % spe, "steps_per_epoch": spe}
          ckpt.save(step, state, data_position=position, plan_json=plan_json)
        if args.stop_after and step - start_step >= args.stop_after:
          stopped = True
          break
      if pending is not None:
        resolve(pending, bar)
        pending = None
      if bar is not None:
        bar.close()
      if stopped and step < epoch * spe + steps_this_epoch:
        break  # mid-epoch: its evaluation happens when the run resumes
      result = training.evaluate_dataset(evaluate, state.params, state.batch_stats, test_set,
                                         args.eval_batch_size)
      epoch_records = [r for r in history if r["epoch"] == epoch]
      record = {"step": step, "epoch": epoch, "event": "epoch_end", **result}
      if epoch_records:
        record.update(
            train_loss=float(np.mean([r["loss"] for r in epoch_records])),
            train_accuracy=float(np.mean([r["accuracy"] for r in epoch_records])),
            images_per_s=float(np.median([r["images_per_s"] for r in epoch_records])))
      metrics_log.write(record)
      log(f"epoch {epoch + 1:3d}/{epochs}  step {step}  "
          + (f"train loss {record['train_loss']:.4f}  train acc {record['train_accuracy']:.3f}  "
             f"{record['images_per_s']:.0f} img/s  " if epoch_records else "")
          + f"test loss {result['test_loss']:.4f}  test acc {result['test_accuracy']:.3f}")
      if stopped:
        break
    training.check_replicas_identical(fingerprint, state, step)
    if ckpt.latest_step() != step:
      ckpt.save(step, state, data_position={"epoch": step // spe, "batch": step % spe,
                                            "steps_per_epoch": spe},
                plan_json=plan_json, force=True)
    ckpt.wait()
  finally:
    metrics_log.close()
    ckpt.close()

  elapsed = time.perf_counter() - run_start
  params_sha = tree_sha256(parallel.fetch((state.params, state.batch_stats)))
  opt_sha = tree_sha256(parallel.fetch(state.opt_state))
  # Every process reports its own copy, so runs can be compared across processes.
  print(f"process {jax.process_index()}: params_sha256 {params_sha} "
        f"local_opt_state_sha256 {opt_sha}", flush=True)
  times = [r["step_time"] for r in history[1:]] or [r["step_time"] for r in history]
  sent = [r["bytes_sent"] for r in history if "bytes_sent" in r]
  summary = {
      "model": args.model, "method": args.method, "density": run["density"],
      "workers": workers, "processes": jax.process_count(), "steps": step,
      "steps_this_run": step - start_step, "seconds": elapsed,
      "median_step_time": float(np.median(times)) if times else None,
      "images_per_s": (workers * args.batch_size / float(np.median(times))) if times else None,
      "bytes_sent_per_step": float(np.mean(sent)) if sent else None,
      "dense_bytes_per_step": dense_bytes,
      "final_test_loss": result["test_loss"] if result else None,
      "final_test_accuracy": result["test_accuracy"] if result else None,
      "plan_groups": len(plan.groups) if plan else None,
      "stopped_early": stopped,
      "params_sha256": params_sha, "opt_state_sha256_process0": opt_sha,
  }
  if leader and stopped:
    print(f"stopped after {step - start_step} steps at step {step} of {total_steps} "
          "(--stop-after); continue with --resume", flush=True)
  if leader:
    (workdir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print("summary: " + ", ".join(
        f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items()),
        flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
