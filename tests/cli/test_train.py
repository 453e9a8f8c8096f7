"""The training CLI, run as users run it: separate processes on CPU devices."""

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from dlgs_jax.compress import grouping
from dlgs_jax.workload import models
from dlgs_jax.planning import planner
from dlgs_jax.cli import train
from dlgs_jax.compress.methods import MethodConfig
from dlgs_jax.training.config import SECTIONS, load_config
from dlgs_jax.planning.timeline import Profile
from tests.helpers import child_env, inherited_xla_flags, smallcnn_plan, wait_for_step

SMALL = ["--model", "smallcnn", "--batch-size", "8", "--lr", "0.05"]
# A run's plumbing (locks, signals, checkpoints, schedules, failures) is tested on dense:
# its step compiles and runs fastest. DLGS's state through a resume: the kill-and-resume,
# worker-count and node-shape tests.
PLUMBING = [*SMALL, "--method", "dense"]


def run_cli(args, timeout=400):
  return subprocess.run([sys.executable, "-m", "dlgs_jax.cli.train", *args], env=child_env(),
                        capture_output=True, text=True, timeout=timeout)


def records(workdir):
  return [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]


def sha_of(workdir):
  """The final parameters' SHA-256 of a one-process run (its summary.json)."""
  return json.loads((Path(workdir) / "summary.json").read_text())["params_sha256"]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["dlgs", "lags", "topk", "gtopk", "dense", "dgc", "terngrad"])
def test_every_method_trains_and_logs(tmp_path, method):
  result = run_cli([*SMALL, "--method", method, "--density", "0.05", "--local-devices", "4",
                    "--steps", "4", "--check-every", "2", "--workdir", str(tmp_path)])
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
  steps = [r for r in records(tmp_path) if "loss" in r]
  assert [r["step"] for r in steps] == [1, 2, 3, 4]
  for r in steps:
    assert r["bytes_sent"] > 0 and r["step_time"] > 0
    if method != "terngrad":  # TernGrad sends every value; its "passed" are the nonzero ones
      assert r["passed"] >= r["selected"]
  if method == "dlgs":  # thresholds start at 0: everything passes, the buffer holds k
    assert steps[0]["passed"] > steps[0]["selected"] > 0
  # lr / 10 after round(4/7 * 4) = 2 and round(6/7 * 4) = 3 steps.
  assert [r["lr"] for r in steps] == pytest.approx([0.05, 0.05, 0.005, 0.0005])
  epoch = [r for r in records(tmp_path) if r.get("event") == "epoch_end"]
  assert len(epoch) == 1 and 0.0 <= epoch[0]["test_accuracy"] <= 1.0
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["workers"] == 4 and summary["steps"] == 4 and summary["method"] == method
  dense_bytes = summary["dense_bytes_per_step"]
  if method == "dense":
    assert summary["bytes_sent_per_step"] == pytest.approx(dense_bytes)
  elif method == "terngrad":  # all-gather of 2-bit values: (P-1)/4 bytes per value
    assert steps[-1]["bytes_sent"] == pytest.approx(dense_bytes * (3 / 4) / 6, rel=0.01)
  else:  # density 0.05 (DGC after its one warm-up step): far below a dense all-reduce
    assert steps[-1]["bytes_sent"] < 0.5 * dense_bytes
  assert "epoch   1/1" in result.stdout and "finished: 4 steps" in result.stdout
  # One process: the hashes live in summary.json, not on the screen.
  assert "sha256" not in result.stdout and len(summary["params_sha256"]) == 64
  assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_auto_trains_by_the_exchange_its_network_prices_fastest(tmp_path):
  """Four workers on 100 Mbit/s links with 1 ms latency: the owners' four latency steps a
  message cost more than their bytes save, and DLGS sends by the all-gather. The config
  keeps "auto" (a rerun prices the same network alike); the checkpoint's identity, what
  a resume must match, records the choice."""
  result = run_cli([*SMALL, "--method", "dlgs", "--density", "0.05", "--collective", "auto",
                    "--bandwidth", "100mbit", "--latency", "0.001", "--local-devices", "4",
                    "--steps", "2", "--check-every", "0", "--workdir", str(tmp_path)])
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
  line = next(x for x in result.stdout.splitlines() if x.startswith("--collective auto:"))
  assert "owners" in line and line.endswith("dlgs sends by allgather")
  config = json.loads((tmp_path / "config.json").read_text())
  assert config["method"]["collective"] == "auto"
  record = json.loads((tmp_path / "checkpoints" / "2" / "record" / "metadata").read_text())
  assert record["identity"]["method.collective"] == "allgather"


@pytest.mark.slow
def test_sliced_parameters_train_and_resume_on_another_node_size(tmp_path):
  """--fsdp 4 on 8 devices (2 nodes x 4), stopped after 2 steps, resumed as 4 nodes x 2:
  the slices cut again, the parameters' replicas checked identical on every check."""
  common = [*SMALL, "--method", "dlgs", "--density", "0.05", "--local-devices", "8",
            "--steps", "4", "--check-every", "1", "--workdir", str(tmp_path)]
  first = run_cli([*common, "--fsdp", "4", "--stop-after", "2"])
  assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
  assert "parameters sliced over 2 nodes x 4 devices: each device holds 1/4" in first.stdout
  second = run_cli([*common, "--fsdp", "2", "--resume"])
  assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-3000:]
  assert ("the checkpoint was written on sliced 2x4 devices, this run has sliced 4x2"
          in second.stdout)
  steps = [r for r in records(tmp_path) if "loss" in r]
  assert [r["step"] for r in steps] == [1, 2, 3, 4]
  assert all(np.isfinite(r["loss"]) and r["bytes_sent"] > 0 for r in steps)
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["steps"] == 4 and 0.0 <= summary["final_test_accuracy"] <= 1.0


@pytest.mark.slow
def test_killed_or_stopped_runs_resume_bit_identical_to_an_uninterrupted_one(tmp_path):
  """Killed outright (resumed from the last periodic checkpoint) or stopped by SIGTERM
  (which saves a checkpoint of its own), a DLGS run resumed ends where an uninterrupted
  one does: its residuals and thresholds resume exactly."""
  steps = ["--local-devices", "2", "--steps", "40", "--density", "0.05", "--reuse-every", "3",
           "--check-every", "10"]
  args = [*SMALL, *steps, "--checkpoint-every", "4"]
  whole = run_cli([*args, "--workdir", str(tmp_path / "whole")])
  assert whole.returncode == 0, whole.stderr[-3000:]

  # SIGTERM: no checkpoint is due (every 100 steps, which changes nothing computed), so
  # the one it resumes from is the stop's own.
  stopping = [*SMALL, *steps, "--checkpoint-every", "100"]
  step = _stop_by_signal(stopping, tmp_path / "stopped", signal.SIGTERM, 40)
  resumed = run_cli([*stopping, "--workdir", str(tmp_path / "stopped"), "--resume"])
  assert resumed.returncode == 0 and f"resumed from step {step}" in resumed.stdout
  assert sha_of(tmp_path / "stopped") == sha_of(tmp_path / "whole")

  workdir = tmp_path / "killed"
  proc = subprocess.Popen([sys.executable, "-m", "dlgs_jax.cli.train", *args, "--workdir",
                           str(workdir)], env=child_env(), stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  wait_for_step(proc, workdir, 10)
  assert proc.poll() is None, "the run ended before it could be killed"
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  saved = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
  assert saved and max(saved) < 40  # really interrupted, after some checkpoint

  resumed = run_cli([*args, "--workdir", str(workdir), "--resume"])
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert f"resumed from step {max(saved)}" in resumed.stdout
  assert sha_of(workdir) == sha_of(tmp_path / "whole")
  a = json.loads((tmp_path / "whole" / "summary.json").read_text())
  b = json.loads((workdir / "summary.json").read_text())
  assert a["opt_state_sha256_process0"] == b["opt_state_sha256_process0"]
  assert a["final_test_loss"] == b["final_test_loss"]
  # The metrics log holds every step once: records past the checkpoint were replaced.
  steps = [r["step"] for r in records(workdir) if "loss" in r]
  assert steps == list(range(1, 41))
  losses = {r["step"]: r["loss"] for r in records(tmp_path / "whole") if "loss" in r}
  assert all(losses[r["step"]] == r["loss"] for r in records(workdir) if "loss" in r)

  # Checkpoints of another configuration are refused, never misread: every setting
  # that changes what the state means or what the run computes is named. (Another
  # worker count is resumed onto: see the test of that.)
  # (lags takes no --reuse-every: that alone would be refused, before the checkpoint is read)
  at = args.index("--reuse-every")
  lags_args = args[:at] + args[at + 2:]
  for run_args, extra, messages in (
      (lags_args, ["--method", "lags"], ["method.name: checkpoint 'dlgs', this run 'lags'"]),
      (args, ["--batch-size", "16", "--min-ndim", "2", "--refresh-below", "none",
              "--send-whole", "head", "--budget", "layer", "--sync-bn", "--nesterov",
              "--momentum", "0"],
       ["data.batch_size: checkpoint 8, this run 16",
        "method.budget: checkpoint 'message', this run 'layer'",
        "method.min_ndim: checkpoint 0, this run 2",
        "method.refresh_below: checkpoint 0.5, this run None",
        "method.send_whole: checkpoint [], this run ['head']",
        "model.sync_bn: checkpoint False, this run True",
        "optimizer.nesterov: checkpoint False, this run True",
        "optimizer.momentum: checkpoint 0.9, this run 0.0"])):
    refused = run_cli([*run_args, *extra, "--workdir", str(workdir), "--resume"])
    assert refused.returncode != 0, refused.stdout[-2000:]
    assert refused.stderr.count("\n") == 1, refused.stderr  # one line, every difference
    for message in messages:
      assert message in refused.stderr, (message, refused.stderr[-2000:])
  # Settings that change neither may differ.
  free = run_cli([*args, "--check-every", "7", "--keep", "2", "--workdir", str(workdir),
                  "--resume"])
  assert free.returncode == 0 and "resumed from step 40" in free.stdout, free.stderr[-2000:]
  again = run_cli([*args, "--workdir", str(workdir)])
  assert again.returncode != 0 and "pass --resume" in again.stderr


@pytest.mark.slow
def test_one_run_per_workdir_and_a_dead_runs_lock_is_recovered(tmp_path):
  args = [*PLUMBING, "--local-devices", "2", "--steps", "200",
          "--checkpoint-every", "2", "--check-every", "0", "--workdir", str(tmp_path)]
  first = subprocess.Popen([sys.executable, "-m", "dlgs_jax.cli.train", *args],
                           env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    wait_for_step(first, tmp_path, 4)
    assert first.poll() is None, "the first run ended before the second started"
    for extra in ([], ["--resume"]):
      second = run_cli([*args, *extra])
      assert second.returncode != 0, second.stdout[-2000:]
      assert f"in use by a live run (process {first.pid} on" in second.stderr, second.stderr
      assert second.stderr.count("\n") == 1  # one line, no traceback
  finally:
    first.send_signal(signal.SIGKILL)
    first.wait()
  # The dead run's lock file is still there; the kernel dropped the lock itself.
  assert (tmp_path / ".lock").exists()
  resumed = run_cli([*args, "--resume", "--stop-after", "2"])
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  assert "resumed from step" in resumed.stdout and "after 2 steps at step" in resumed.stdout


@pytest.mark.slow
def test_plan_file_is_used_and_checked(tmp_path):
  plan = smallcnn_plan(workers=2)
  assert 1 < len(plan.groups) < len(plan.order)
  plan.save(tmp_path / "plan.json")
  args = [*SMALL, "--density", "0.05", "--steps", "2", "--plan", str(tmp_path / "plan.json")]
  ok = run_cli([*args, "--local-devices", "2", "--workdir", str(tmp_path / "a")])
  assert ok.returncode == 0, ok.stderr[-3000:]
  summary = json.loads((tmp_path / "a" / "summary.json").read_text())
  assert summary["plan_groups"] == len(plan.groups)
  # The run wrote the config it resolved from its flags.
  assert load_config(str(tmp_path / "a" / "config.json")) == train.config_from_args(
      [*args, "--local-devices", "2", "--workdir", str(tmp_path / "a")])
  assert planner.Plan.load(tmp_path / "a" / "plan.json") == plan
  wrong_p = run_cli([*args, "--local-devices", "4", "--workdir", str(tmp_path / "b")])
  assert wrong_p.returncode != 0 and "made for 2 workers, this run has 4" in wrong_p.stderr
  wrong_model = run_cli([*args, "--model", "resnet20", "--local-devices", "2",
                         "--workdir", str(tmp_path / "c")])
  assert wrong_model.returncode != 0 and "does not match these parameters" in wrong_model.stderr


@pytest.mark.slow
def test_nodes_of_devices_train_with_a_plan_of_slices_and_refuse_another_layout(tmp_path):
  """4 devices of one process as 2 nodes x 2 (--node-size): a two-level plan runs; a flat
  plan, the same plan on a flat run, and sizes that do not cut the devices are named."""
  two_level, flat = smallcnn_plan(workers=2, fast_size=2), smallcnn_plan(workers=4)
  two_level.save(tmp_path / "nodes.json")
  flat.save(tmp_path / "flat.json")
  args = [*SMALL, "--density", "0.05", "--steps", "2", "--local-devices", "4"]
  ok = run_cli([*args, "--node-size", "2", "--plan", str(tmp_path / "nodes.json"),
                "--workdir", str(tmp_path / "a")])
  assert ok.returncode == 0, ok.stderr[-3000:]
  assert "two-level exchange: 2 nodes x 2 devices" in ok.stdout
  summary = json.loads((tmp_path / "a" / "summary.json").read_text())
  assert summary["plan_groups"] == len(two_level.groups) and summary["workers"] == 4
  refused = {
      "flat plan": (["--node-size", "2", "--plan", str(tmp_path / "flat.json")],
                    "plan was made for 4 workers, this run has 2 nodes x 2 devices (two-level"),
      "flat run": (["--plan", str(tmp_path / "nodes.json")],
                   "plan was made for 2 nodes x 2 devices (two-level, slices of 1/2), this run "
                   "has 4 workers"),
      "size 3": (["--node-size", "3"], "--node-size: node_size 3 does not cut 1 processes of 4 "
                 "devices into whole nodes"),
      "few workers": (["--node-size", "2", "--workers", "2"], "--node-size 2: the two-level "
                      "exchange uses every device (4), not --workers 2")}
  for name, (flags, message) in refused.items():
    result = run_cli([*args, *flags, "--workdir", str(tmp_path / name)])
    assert result.returncode != 0 and message in result.stderr, (name, result.stderr[-2000:])
  one = run_cli([*args, "--node-size", "1", "--workdir", str(tmp_path / "one")])
  assert one.returncode == 0, one.stderr[-3000:]
  assert one.stdout.count("--node-size 1: one device per node, so the exchange is flat") == 1
  assert "two-level" not in one.stdout


@pytest.mark.slow
def test_the_planner_profiles_and_plans_slices_between_nodes_on_the_fly(tmp_path):
  """One profile on the fly serves both claims: the planner prices DLGS at the refresh
  rate measured on real steps, and between nodes it models the shared link."""
  result = run_cli([*SMALL, "--local-devices", "4", "--node-size", "2", "--steps", "2",
                    "--planner", "optimal", "--bandwidth", "1gbit", "--workdir", str(tmp_path)])
  assert result.returncode == 0, result.stderr[-3000:]
  plan = planner.Plan.load(tmp_path / "plan.json")
  assert plan.planner == "optimal" and plan.method == "dlgs"
  assert (plan.workers, plan.fast_size) == (2, 2) and plan.fast_link["beta"] > 0
  assert "timing the all-reduce inside a node (2 devices)" in result.stdout
  assert "planned groups (optimal)" in result.stdout
  # Each phase of the profile is named; collectives a modelled network replaces are not timed.
  assert "  timing the local update of dlgs ..." in result.stdout
  assert "timing collectives" not in result.stdout
  profile = Profile.from_dict(plan.profile)
  assert "1gbit" in profile.source and profile.t_forward > 0
  # Between nodes the modelled link is shared by a node's 2 devices: 1 Gbit/s / 2 each.
  assert profile.workers == 2 and "shared by 2 devices" in profile.source
  assert profile.comm["allgather"].beta == pytest.approx(8 / 0.5e9)
  # DLGS with the refresh rule is planned at the refresh rate measured on real steps.
  assert 0.0 < profile.dlgs_exact_fraction <= 1.0
  assert f"{profile.dlgs_exact_fraction:.0%} of thresholds computed exactly" in result.stdout


@pytest.mark.parametrize("flags,message", [
    (["--density", "0"], "--density 0.0 is invalid"),
    (["--method", "sgd"], "--method 'sgd' is invalid"),
    (["--epochs", "0"], "--epochs 0 is invalid"),
    (["--planner", "magic"], "--planner 'magic' is invalid"),
    (["--method", "topk", "--planner", "optimal"], "planning applies to dense, lags and dlgs, not topk"),
    (["--lr", "-1"], "--lr -1.0 is invalid"),
    (["--refresh-below", "1.5"], "--refresh-below '1.5' is invalid"),
    (["--refresh-below", "half"], "--refresh-below 'half' is invalid"),
    (["--min-ndim", "-1"], "--min-ndim -1 is invalid"),
    (["--method", "topk", "--min-ndim", "2"], "applies to lags and dlgs, not topk"),
    (["--method", "dgc", "--send-whole", "head"], "--send-whole 'head' is invalid: applies to "
     "lags and dlgs, not dgc"),
    (["--lr-decay-epochs", "a,b"], "--lr-decay-epochs 'a,b' is invalid"),
    (["--lr-decay-epochs", "-5"], "--lr-decay-epochs '-5.0' is invalid: give epochs >= 0"),
    (["--lr-decay-epochs", "nan"], "--lr-decay-epochs 'nan' is invalid"),
    (["--seed", "-1"], "--seed -1 is invalid: must be an integer in"),
    (["--reuse-every", "1e11"], "--reuse-every '1e11' is invalid: must be int"),
    (["--reuse-every", "100000000000"], "--reuse-every 100000000000 is invalid"),
    (["--epochs", "1000000000000"], "--epochs 1000000000000 is invalid"),
    (["--steps", "0"], "--steps 0 is invalid"),
    (["--terngrad-clip", "nan"], "--terngrad-clip nan is invalid"),
    (["--dgc-warmup-epochs", "nan"], "--dgc-warmup-epochs nan is invalid"),
    (["--latency", "nan"], "--latency nan is invalid"),
    (["--image-size", "0"], "--image-size 0 is invalid: must be an integer in [8,"),
    (["--local-devices", "5000"], "--local-devices 5000 is invalid"),
    (["--node-size", "0"], "--node-size 0 is invalid: must be an integer in [1,"),
    (["--flat", "--node-size", "2"], "--node-size 2 is invalid: a flat exchange has no nodes"),
    (["--bandwidth", "foo"], "--bandwidth 'foo' is invalid: bandwidth must look like"),
    (["--plan", "/nonexistent/plan.json"], "--plan '/nonexistent/plan.json' is invalid: no such"),
    (["--nonfinite-limit", "0"], "--nonfinite-limit 0 is invalid"),
    (["--wire-dtype", "float16"], "--wire-dtype 'float16' is invalid: choose from"),
    (["--candidates", "0"], "--candidates 0 is invalid: must be an integer in [1, 16]"),
    (["--aim", "2.5"], "--aim 2.5 is invalid: must be in (0, 2]"),
    (["--candidates", "1", "--aim", "1"], "--aim 1.0 is invalid: re-aims the adapted rule's"),
    (["--refresh-below", "none", "--candidates", "3"],
     "--candidates 3 is invalid: candidates apply only with refresh_below set"),
    (["--simulate-workers", "0"], "--simulate-workers 0 is invalid: must be an integer in [1,"),
    (["--simulate-workers", "4", "--workers", "2"], "--simulate-workers 4 is invalid: runs every "
     "worker on one device of one process: drop workers 2"),
    (["--simulate-workers", "4", "--planner", "greedy"], "--simulate-workers 4 is invalid: has "
     "no network the planner 'greedy' could measure"),
    (["--method", "gtopk", "--wire-dtype", "bfloat16"],
     "--wire-dtype 'bfloat16' is invalid: applies to dense, topk, lags, dlgs, not gtopk"),
    (["--collective", "gtopk", "--wire-dtype", "bfloat16"],
     "--wire-dtype 'bfloat16' is invalid: needs the all-gather"),
    (["--fsdp", "4", "--node-size", "2"], "--fsdp 4 is invalid: slices the model over the "
     "devices of a node, its nodes every fsdp consecutive devices of the run: drop --node-size"),
    (["--fsdp", "2", "--planner", "optimal"], "--fsdp 2 is invalid: runs each leaf's slice as "
     "its own message"),
    (["--fsdp", "0"], "--fsdp 0 is invalid"),
    (["--collective", "auto"], "--collective 'auto' is invalid: prices the exchanges on a "
     "modelled network: give --bandwidth"),
    (["--method", "dense", "--collective", "auto", "--bandwidth", "1gbit"],
     "--collective 'auto' is invalid: applies to topk, lags, dlgs, not dense"),
    (["--budget", "global"], "--budget 'global' is invalid: choose from ('layer', 'message')"),
    (["--budget", "message", "--send-whole", "head", "--planner", "single"],
     "--send-whole 'head' is invalid: sends leaves whole, which needs a threshold per layer: "
     "add budget 'layer' (--budget layer)"),
    (["--min-ndim", "2"], "--min-ndim 2 is invalid: sends leaves whole, which needs a threshold "
     "per layer: add budget 'layer' (--budget layer)"),
    (["--method", "lags", "--budget", "message"], "--budget 'message' is invalid: applies to "
     "dlgs, not lags"),
])
def test_bad_flags_are_named(flags, message):
  with pytest.raises(SystemExit, match=re.escape(message)):
    train.config_from_args(flags)


@pytest.mark.slow
def test_bfloat16_on_the_wire_cuts_the_bytes_it_says(tmp_path):
  """DLGS with the head sent whole: a quarter less (int32 index, bfloat16 value), and at
  float32 exactly the pairs the density and the head make. (Dense's half: the same
  --wire-dtype field, test_transforms.py::test_dense_in_bfloat16_halves_the_bytes.)"""
  density, workers = 0.05, 2
  shapes = models.param_shapes("smallcnn")
  paths = grouping.leaf_paths(shapes)
  sizes = {p: int(np.prod(x.shape)) for p, x in zip(paths, jax.tree_util.tree_leaves(shapes))}
  head = {"Dense_1/bias", "Dense_1/kernel"}  # SmallCNN's head: 128x10 + 10
  pairs = sum(n if p in head else max(1, int(np.ceil(density * n))) for p, n in sizes.items())
  assert train.config_from_args(["--method", "dense", "--wire-dtype", "bfloat16"]
                                ).method.wire_dtype == "bfloat16"
  for method, extra, scale in (("dlgs", ["--send-whole", "head", "--budget", "layer",
                                         "--density", str(density)], 0.75),):
    sent = {}
    for dtype in ("float32", "bfloat16"):
      workdir = tmp_path / method / dtype
      result = run_cli([*SMALL, "--method", method, *extra, "--local-devices", str(workers),
                        "--steps", "2", "--wire-dtype", dtype, "--workdir", str(workdir)])
      assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
      summary = json.loads((workdir / "summary.json").read_text())
      assert summary["method"] == method
      sent[dtype] = summary["bytes_sent_per_step"]
      if method == "dlgs" and dtype == "float32":
        steps = [r for r in records(workdir) if "loss" in r]
        assert steps[-1]["bytes_sent"] == pytest.approx((workers - 1) * 8 * pairs)
    assert sent["bfloat16"] == pytest.approx(scale * sent["float32"])


def test_flags_become_the_config_and_name_a_variant():
  config = train.config_from_args(["--method", "dlgs", "--density", "0.05", "--send-whole",
                                   "head", "--budget", "layer", "--refresh-below", "none",
                                   "--no-augment", "--lr-decay-epochs", "1,2.5", "--seed", "3"])
  assert config.method == MethodConfig("dlgs", density=0.05, send_whole=("head",),
                                       refresh_below=None, budget="layer")
  assert not config.data.augment and config.seed == 3
  assert config.schedule.lr_decay_epochs == (1.0, 2.5)
  assert config.schedule.decay_boundaries(10, 1400) == [10, 25]
  assert train.method_flags("dlgs-paper") == ["--method", "dlgs", "--refresh-below", "none",
                                             "--budget", "layer"]
  assert train.method_flags("lags-head") == ["--method", "lags", "--send-whole", "head"]
  assert train.config_from_args(["--candidates", "5"]).method.candidates == 5
  assert train.method_flags("dense") == ["--method", "dense"]
  # The flags that set a config give that config back.
  again = train.config_from_args(train.config_flags(config, sections=[s for s in SECTIONS]))
  assert again.method == config.method and again.schedule == config.schedule


def test_a_config_file_is_overridden_by_flags_and_written_to_the_workdir(tmp_path):
  base = train.config_from_args(["--model", "smallcnn", "--density", "0.05"])
  (tmp_path / "c.json").write_text(json.dumps(base.to_dict()))
  (tmp_path / "c.py").write_text("def get_config():\n  raise SystemExit('ran')\n")
  config = train.config_from_args(["--config", str(tmp_path / "c.json"), "--density", "0.1"])
  assert config.model.name == "smallcnn" and config.method.density == 0.1
  with pytest.raises(SystemExit, match="c.py' is invalid: a config file is JSON"):
    train.config_from_args(["--config", str(tmp_path / "c.py")])
  (tmp_path / "bad.json").write_text('{"method": {"densty": 0.1}}')
  with pytest.raises(SystemExit, match=r"unknown options \('densty': did you mean 'density'\?\)"):
    train.config_from_args(["--config", str(tmp_path / "bad.json")])
  with pytest.raises(SystemExit, match="no such file"):
    train.config_from_args(["--config", str(tmp_path / "none.json")])


def test_demo_preset_yields_to_given_flags():
  from dlgs_jax.cli import demo
  parsed = train.config_from_args(["--epochs", "2", "--workdir=/tmp/x"], base=demo.preset())
  assert parsed.schedule.epochs == 2 and parsed.checkpoint.workdir == "/tmp/x"
  assert (parsed.model.name, parsed.method.name, parsed.processes.local_devices) == (
      "smallcnn", "dlgs", 4)
  assert parsed.method.density == 0.01
  fresh = train.config_from_args([], base=demo.preset())
  assert fresh.checkpoint.workdir.startswith("runs/demo-") and fresh.schedule.epochs == 10


@pytest.mark.slow
def test_trains_on_an_image_folder_with_sync_batchnorm(tmp_path):
  from PIL import Image
  rng = np.random.default_rng(0)
  for split, count in (("train", 6), ("val", 2)):
    for name in ("apple", "pear", "plum"):
      folder = tmp_path / "images" / split / name
      folder.mkdir(parents=True)
      for i in range(count):
        pixels = rng.integers(0, 256, (20 + i, 24, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"{i}.{'png' if i % 2 else 'jpg'}")
  result = run_cli(["--model", "smallcnn", "--dataset", "imagefolder", "--data-dir",
                    str(tmp_path / "images"), "--image-size", "16", "--batch-size", "2",
                    "--local-devices", "2", "--steps", "3", "--sync-bn", "--method", "dense",
                    "--workdir", str(tmp_path / "run")])
  assert result.returncode == 0, result.stderr[-3000:]
  assert "imagefolder:" in result.stdout and "(18 train / 6 test)" in result.stdout
  epoch = [r for r in records(tmp_path / "run") if r.get("event") == "epoch_end"]
  assert epoch and 0.0 <= epoch[0]["test_accuracy"] <= 1.0
  missing = run_cli(["--model", "resnet50", "--local-devices", "2", "--workdir",
                     str(tmp_path / "r50")])
  assert missing.returncode != 0 and "resnet50 needs --data-dir" in missing.stderr




@pytest.mark.slow
def test_runs_that_cannot_train_stop_in_one_line_without_saving_nan(tmp_path):
  big = run_cli([*SMALL, "--batch-size", "100000", "--local-devices", "2",
                 "--workdir", str(tmp_path / "big")])
  assert big.returncode != 0 and "--batch-size 100000: 3805 examples cannot fill" in big.stderr
  assert big.stderr.count("\n") == 1, big.stderr
  long = run_cli([*SMALL, "--epochs", "2000000000", "--local-devices", "2",
                  "--workdir", str(tmp_path / "long")])
  assert long.returncode != 0 and "do not fit the int32 step counter" in long.stderr
  nan = run_cli([*PLUMBING, "--lr", "1e30", "--local-devices", "2", "--steps", "30",
                 "--checkpoint-every", "3", "--nonfinite-limit", "4",
                 "--workdir", str(tmp_path / "nan")])
  assert nan.returncode != 0 and "non-finite for 4 steps in a row" in nan.stderr, nan.stderr
  assert nan.stderr.count("\n") == 1, nan.stderr
  assert "no checkpoint at step 3" in nan.stdout
  saved = [p.name for p in (tmp_path / "nan" / "checkpoints").iterdir() if p.name.isdigit()]
  assert saved == [] and "no checkpoint was saved" in nan.stderr


def _start_and_wait_for_step(args, workdir, step):
  """A dlgs-train process, once its metrics reach `step`."""
  proc = subprocess.Popen([sys.executable, "-m", "dlgs_jax.cli.train", *args, "--workdir",
                           str(workdir)], env=child_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  return wait_for_step(proc, workdir, step)


def _stop_by_signal(args, workdir, signum, total) -> int:
  """Sends `signum` to a run past step 5; checks it stopped soon, saving a checkpoint of
  its own (the only one: none may be due before `total`); returns the step it stopped at."""
  proc = _start_and_wait_for_step(args, workdir, 5)
  proc.send_signal(signum)
  started = time.monotonic()
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == 0, err[-3000:]
  assert time.monotonic() - started < 30
  name = signal.Signals(signum).name
  stopped = re.search(rf"stopped by {name} after \d+ steps at step (\d+) of {total}", out)
  assert stopped, out[-2000:]
  step = int(stopped.group(1))
  assert 5 <= step < total
  saved = sorted(int(p.name) for p in (Path(workdir) / "checkpoints").iterdir()
                 if p.name.isdigit())
  assert saved == [step]
  return step


@pytest.mark.slow
def test_sigint_saves_a_checkpoint_and_resume_continues_bit_for_bit(tmp_path):
  """SIGINT stops a run at a step with a checkpoint of its own. (SIGTERM: the kill-and-resume
  test; DGC's state through a checkpoint: tests/training/persistence/test_checkpoint.py.)"""
  args = [*PLUMBING, "--local-devices", "2", "--steps", "30", "--checkpoint-every", "100",
          "--check-every", "0"]
  step = _stop_by_signal(args, tmp_path / "stopped", signal.SIGINT, 30)
  whole = run_cli([*args, "--workdir", str(tmp_path / "whole")])
  resumed = run_cli([*args, "--workdir", str(tmp_path / "stopped"), "--resume"])
  assert whole.returncode == 0 and resumed.returncode == 0, resumed.stderr[-3000:]
  assert f"resumed from step {step}" in resumed.stdout
  assert sha_of(tmp_path / "stopped") == sha_of(tmp_path / "whole")


@pytest.mark.slow
def test_a_full_or_read_only_disk_is_one_line_and_leaves_no_partial_checkpoint(tmp_path):
  small, readonly = tmp_path / "small", tmp_path / "readonly"
  small.mkdir()
  readonly.mkdir()
  mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(small)],
                           capture_output=True)
  if mounted.returncode != 0:
    pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
  try:
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(readonly)],
                   check=True)
    # Dense: its checkpoint (4.4 MB) overfills the 3 MB disk too.
    args = [*PLUMBING, "--local-devices", "2", "--steps", "6", "--checkpoint-every", "2"]
    full = run_cli([*args, "--workdir", str(small / "run")])
    assert full.returncode != 0 and full.stderr.count("\n") == 1, full.stderr[-3000:]
    assert "not enough space to save step 2 in" in full.stderr
    assert list((small / "run" / "checkpoints").iterdir()) == []
    refused = run_cli([*args, "--workdir", str(readonly / "run")])
    assert refused.returncode != 0 and refused.stderr.count("\n") == 1, refused.stderr[-3000:]
    assert "Read-only file system" in refused.stderr
  finally:
    subprocess.run(["umount", str(small)], capture_output=True)
    subprocess.run(["umount", str(readonly)], capture_output=True)


@pytest.mark.slow
def test_a_run_resumes_on_another_worker_count_with_its_residuals_redistributed(tmp_path):
  """2 workers simulated on one device, then 4 devices: the checkpoint of simulated
  workers is that of as many devices (their numerics: tests/workload/test_sharded_step)."""
  args = [*SMALL, "--density", "0.05", "--steps", "8", "--check-every", "2",
          "--workdir", str(tmp_path)]
  first = run_cli([*args, "--simulate-workers", "2", "--stop-after", "4"])
  assert first.returncode == 0, first.stderr[-3000:]
  assert "2 workers (simulated on one device)" in first.stdout
  more = run_cli([*args, "--local-devices", "4", "--resume"])
  assert more.returncode == 0, more.stderr[-3000:]
  assert ("the checkpoint was written by 2 workers, this run has 4: residuals redistributed "
          "with their sum kept") in more.stdout
  assert "resumed from step 4" in more.stdout and "4 workers (1 processes)" in more.stdout
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["steps"] == 8 and summary["workers"] == 4
  # Anything else that differs is still refused, each setting named.
  other = run_cli([*args, "--local-devices", "2", "--resume", "--momentum", "0.5"])
  assert other.returncode != 0 and "optimizer.momentum: checkpoint 0.9" in other.stderr
  assert "workers: checkpoint 4, this run 2" in other.stderr


@pytest.mark.slow
def test_a_run_resumes_onto_another_node_shape_with_its_residuals_dealt_again(tmp_path):
  """2 nodes x 2 devices -> 4 flat workers -> 2 x 2 again, on 4 devices (reshard's tests
  check the mass; here the runs go on, every worker's parameters checked identical)."""
  args = [*SMALL, "--density", "0.05", "--steps", "9", "--check-every", "1",
          "--local-devices", "4", "--workdir", str(tmp_path)]
  first = run_cli([*args, "--node-size", "2", "--stop-after", "3"])
  assert first.returncode == 0, first.stderr[-3000:]
  flat = run_cli([*args, "--resume", "--stop-after", "3"])
  assert flat.returncode == 0, flat.stderr[-3000:]
  assert ("the checkpoint was written by 4 workers, this run has 4 (two-level 2x2 -> flat): "
          "residuals redistributed with their sum kept") in flat.stdout
  assert "resumed from step 3" in flat.stdout and "two-level" not in flat.stdout.split(
      "residuals redistributed")[1]
  back = run_cli([*args, "--node-size", "2", "--resume"])
  assert back.returncode == 0, back.stderr[-3000:]
  assert "(flat -> two-level 2x2)" in back.stdout and "resumed from step 6" in back.stdout
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["steps"] == 9 and np.isfinite(summary["final_test_loss"])
  # A change of exchange together with another setting is still refused, both named.
  other = run_cli([*args, "--resume", "--momentum", "0.5"])
  assert other.returncode != 0 and "optimizer.momentum: checkpoint 0.9" in other.stderr
  assert "exchange: checkpoint 'two-level 2x2', this run 'flat'" in other.stderr


@pytest.mark.slow
def test_a_checkpoint_of_residuals_kept_leaf_by_leaf_is_converted_or_refused(tmp_path):
  """A checkpoint written before flat residual buffers resumes, laid out anew, bit for bit
  with a run that never stopped; with another worker count too, it is refused in one
  line naming the layout and the fix."""
  # Runs before flat buffers selected a threshold per layer and named no budget.
  args = [*SMALL, "--method", "dlgs", "--budget", "layer", "--density", "0.05",
          "--local-devices", "2", "--steps", "6", "--checkpoint-every", "3", "--check-every", "0"]
  whole = run_cli([*args, "--workdir", str(tmp_path / "whole")])
  assert whole.returncode == 0, whole.stderr[-3000:]
  parts = [*args, "--workdir", str(tmp_path / "parts")]
  first = run_cli([*parts, "--stop-after", "3"])
  assert first.returncode == 0, first.stderr[-3000:]
  rewrite = subprocess.run(
      [sys.executable, "-m", "tests.per_leaf_checkpoint", *parts], capture_output=True,
      text=True, timeout=300,
      env=child_env(XLA_FLAGS=" ".join([inherited_xla_flags(),
                                       "--xla_force_host_platform_device_count=2"])))
  assert rewrite.returncode == 0, rewrite.stderr[-3000:]
  moved = run_cli([*parts, "--resume", "--local-devices", "4"])
  assert moved.returncode != 0
  line = moved.stderr.strip().splitlines()[-1]
  assert ("the checkpoint keeps its residuals leaf by leaf, this version keeps 'flat buffers "
          "per group', and it differs in ['workers']; resume it once with its own settings "
          "to convert it, then change them") in line, moved.stderr[-2000:]
  resumed = run_cli([*parts, "--resume"])
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "the checkpoint kept its residuals leaf by leaf: laid out in flat buffers" in (
      resumed.stdout)
  assert "resumed from step 3" in resumed.stdout
  assert sha_of(tmp_path / "parts") == sha_of(tmp_path / "whole")


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_resumes_from_the_one_before_bit_for_bit(tmp_path):
  args = [*PLUMBING, "--local-devices", "2", "--steps", "10", "--checkpoint-every", "2",
          "--check-every", "0"]
  whole = run_cli([*args, "--workdir", str(tmp_path / "whole")])
  assert whole.returncode == 0, whole.stderr[-3000:]
  parts = run_cli([*args, "--workdir", str(tmp_path / "parts"), "--stop-after", "6"])
  assert parts.returncode == 0, parts.stderr[-3000:]
  files = [p for p in (tmp_path / "parts" / "checkpoints" / "6" / "state").rglob("*")
           if p.is_file() and p.parent.name == "d"]
  largest = max(files, key=lambda p: p.stat().st_size)
  data = bytearray(largest.read_bytes())
  data[len(data) // 2] ^= 0x01  # one flipped bit in the newest checkpoint
  largest.write_bytes(bytes(data))
  resumed = run_cli([*args, "--workdir", str(tmp_path / "parts"), "--resume"])
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "warning: checkpoint step 6 in" in resumed.stdout and "trying step 4" in resumed.stdout
  assert "resumed from step 4" in resumed.stdout
  assert sha_of(tmp_path / "parts") == sha_of(tmp_path / "whole")


@pytest.mark.slow
def test_a_finished_run_extended_equals_one_planned_that_long(tmp_path):
  # 237 steps an epoch at 2 x 8: drops at steps 4 (4/7 of 7) and 6, and later at 12.
  args = [*PLUMBING, "--local-devices", "2", "--check-every", "0"]
  short, whole = tmp_path / "short", tmp_path / "whole"
  assert run_cli([*args, "--steps", "7", "--workdir", str(short)]).returncode == 0
  # The default drops move with the length: refused, naming the epochs that keep them.
  moved = run_cli([*args, "--steps", "14", "--workdir", str(short), "--resume"])
  assert moved.returncode != 0 and len(moved.stderr.strip().splitlines()) == 1
  assert "dropped at steps [4, 6], this run drops at [8, 12]" in moved.stderr
  keep = re.search(r"--lr-decay-epochs ([0-9.]+),([0-9.]+),<", moved.stderr)
  drops = f"{keep.group(1)},{keep.group(2)},{12 / 237:.4f}"
  shorter = run_cli([*args, "--steps", "5", "--workdir", str(short), "--resume"])
  assert "the checkpoint is at step 7, and this run has 5 steps" in shorter.stderr

  extended = run_cli([*args, "--steps", "14", "--lr-decay-epochs", drops, "--workdir",
                      str(short), "--resume"])
  assert extended.returncode == 0, extended.stderr[-3000:]
  assert "extending the run from 7 to 14 steps; the learning rate drops at steps " \
         "[4, 6, 12]" in extended.stdout
  planned = run_cli([*args, "--steps", "14", "--lr-decay-epochs", drops, "--workdir",
                     str(whole)])
  assert planned.returncode == 0, planned.stderr[-3000:]
  assert sha_of(short) == sha_of(whole)
  assert [r["lr"] for r in records(short) if "loss" in r] == \
         [r["lr"] for r in records(whole) if "loss" in r]
  assert json.loads((short / "config.json").read_text())["schedule"]["steps"] == 14
