import json
import re
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import child_env, inherited_xla_flags


@pytest.mark.multiprocess
def test_benchmark_on_two_processes_writes_a_consistent_breakdown(tmp_path):
  out = tmp_path / "run.json"
  done = subprocess.run(
      [sys.executable, "-m", "dlgs_jax.cli.launch", "--nproc", "2", "--module", "dlgs_jax.cli.benchmark",
       "--", "--model", "smallcnn", "--method", "dlgs", "--density", "0.1", "--steps", "3",
       "--warmup", "1", "--batches", "2", "--batch-size", "4", "--out", str(out)],
      env=child_env(JAX_LOG_COMPILES="1"), capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
  # One warm-up call compiles each program; a timed repetition never does (an
  # uncommitted initial state once made compress compile again inside the first).
  log = done.stdout + done.stderr
  for rank in (0, 1):
    for program in ("compress_fn", "update_fn"):
      assert log.count(f"[{rank}] Compiling jit({program})") == 1, (rank, program)
  result = json.loads(out.read_text())
  assert result["workers"] == 2 and result["method"] == "dlgs"
  assert len(result["per_process_median"]) == 2
  assert result["per_process_programs"] == ["compute", "compress", "exchange", "update", "step"]
  for program in result["per_process_programs"]:
    assert len(result["raw"][program]) == 3 and all(t > 0 for t in result["raw"][program])
  med, parts = result["median"], result["breakdown"]
  # Process 0's row of the gathered medians is its own medians, in the named order.
  assert result["per_process_median"][0] == pytest.approx(
      [med[k] for k in result["per_process_programs"]], rel=1e-6)
  # The collectives alone: the exchange program minus the same update without them.
  assert parts["comm_alone"] == pytest.approx(max(med["exchange"] - med["update"], 0.0))
  assert parts["update"] == med["update"]
  assert parts["sparsify"] == pytest.approx(max(med["compress"] - med["compute"], 0.0))
  assert parts["comm_exposed"] == pytest.approx(max(med["step"] - med["compress"], 0.0))
  assert parts["overlap"] == pytest.approx(parts["comm_alone"] - parts["comm_exposed"])
  assert result["bytes_sent"] > 0 and 0 < result["selected"]
  # Step 0 of DLGS computes every threshold; the mean over timed steps is a fraction of that.
  assert 0 <= result["exact_leaves"] <= result["leaves"] == 16


@pytest.mark.slow
def test_benchmark_checks_training_flags_it_passes_on():
  done = subprocess.run([sys.executable, "-m", "dlgs_jax.cli.benchmark", "--model", "smallcnn",
                         "--refresh-below", "bogus", "--steps", "1"],
                        env=child_env(), capture_output=True, text=True, timeout=300)
  assert done.returncode != 0 and "--refresh-below 'bogus' is invalid" in done.stderr


@pytest.mark.multiprocess
def test_benchmark_measures_overlap_on_two_processes(tmp_path):
  out = tmp_path / "overlap.json"
  done = subprocess.run(
      [sys.executable, "-m", "dlgs_jax.cli.launch", "--nproc", "2", "--module", "dlgs_jax.cli.benchmark",
       "--", "--overlap-out", str(out), "--overlap-rounds", "1,2", "--overlap-leaves", "2",
       "--overlap-size", "4096", "--steps", "2"],
      env=child_env(), capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
  result = json.loads(out.read_text())
  assert result["processes"] == 2 and [r["rounds"] for r in result["results"]] == [1, 2]
  for r in result["results"]:
    assert r["workers"] == 2 and r["leaves"] == 2 and r["size"] == 4096
    assert all(len(s) == 2 for s in r["samples"].values())
    s = r["seconds"]
    assert r["hidden"] == pytest.approx(
        (s["compute"] + s["collectives"] - s["independent"]) / min(s["compute"], s["collectives"]))
  assert "hidden" in done.stdout


@pytest.mark.parametrize("flags, message", [
    (["--overlap-rounds", "0"], "--overlap-rounds must be >= 1 (got '0')"),
    (["--overlap-rounds", "one"], "--overlap-rounds must be comma-separated integers, got 'one'"),
    (["--overlap-size", "100"], "--overlap-size >= 2000 (got 100)"),
])
def test_benchmark_rejects_bad_overlap_settings(tmp_path, flags, message):
  from dlgs_jax.cli import benchmark

  with pytest.raises(SystemExit) as exc:
    benchmark.main(["--overlap-out", str(tmp_path / "o.json"), *flags])
  assert message in str(exc.value.code)
  assert not (tmp_path / "o.json").exists()


@pytest.mark.slow
def test_benchmark_compares_methods_in_interleaved_rounds(tmp_path):
  # One process with two devices: the rounds, not the transport, are under test here.
  out = tmp_path / "compare.json"
  done = subprocess.run(
      [sys.executable, "-m", "dlgs_jax.cli.benchmark", "--model", "smallcnn", "--density", "0.1",
       "--compare", "dense,dlgs-paper,topk", "--rounds", "3", "--steps", "2", "--warmup", "1",
       "--batches", "2", "--batch-size", "4", "--out", str(out)],
      env=child_env(XLA_FLAGS=inherited_xla_flags() + " --xla_force_host_platform_device_count=2"),
      capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
  result = json.loads(out.read_text())
  assert result["workers"] == 2 and result["rounds"] == 3 and result["steps"] == 2
  methods = ["dense", "dlgs-paper", "topk"]
  assert list(result["methods"]) == methods
  # Every round times every method once, and the first to run changes each round.
  assert [order[0] for order in result["round_orders"]] == methods
  assert all(sorted(order) == sorted(methods) for order in result["round_orders"])
  for name, m in result["methods"].items():
    assert len(m["raw"]) == 3 and all(len(t) == 2 and min(t) > 0 for t in m["raw"])
    assert m["round_medians"] == pytest.approx([np.median(t) for t in m["raw"]])
    assert m["median"] == pytest.approx(np.median(np.concatenate(m["raw"])))
  assert result["methods"]["dense"]["groups"] == result["methods"]["dlgs-paper"]["groups"] == 1
  assert result["methods"]["topk"]["groups"] is None
  # DLGS's budget is recorded (the report names a per-layer run by it); Top-k has none.
  assert result["methods"]["dlgs-paper"]["budget"] == "layer"
  assert result["methods"]["topk"]["budget"] is None
  # Density 0.1: the sparse methods send (index, value) pairs of a tenth of the values.
  dense_bytes = result["methods"]["dense"]["bytes_sent"]
  assert 0 < result["methods"]["topk"]["bytes_sent"] < 0.5 * dense_bytes
  assert 0 < result["methods"]["dlgs-paper"]["bytes_sent"] < 0.5 * dense_bytes
  assert "round 3/3" in done.stdout


@pytest.mark.parametrize("flags, message", [
    (["--batches", "0"], "--batches must be >= 1, got 0"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--compare", "dense,dense"], "--compare needs distinct method names, got 'dense,dense'"),
    (["--compare", "dense,fast"], "--compare: unknown methods ['fast']"),
    (["--compare", "dense,topk", "--rounds", "0"], "--rounds must be >= 1, got 0"),
    (["--compare", "dense,topk", "--plans", "dlgs=p.json"],
     "--plans names methods not in --compare: ['dlgs']"),
    (["--compare", "dense,topk", "--plans", "topk=p.json"],
     "--plans: ['topk'] send a fixed message layout and take no plan"),
    (["--compare", "dense,topk", "--plans", "topk"],
     "--plans entries are METHOD=PLAN.json, got 'topk'"),
    (["--plans", "dense=p.json"], "--plans is for --compare"),
    (["--compile-slots", "2"], "--compile-slots is for --compare; got --compile-slots 2"),
    (["--compare", "dense,topk", "--compile-slots", "0"],
     "--compile-slots must be an integer >= 1, got 0"),
    (["--compare", "dense,dlgs", "--plan", "p.json"],
     "--compare takes its plans as --plans METHOD=PLAN.json, got --plan 'p.json'"),
    (["--profile-methods", "dense"], "--profile-methods is for --profile-out"),
    (["--profile-out", "p.json", "--profile-methods", "dense,fast"],
     "--profile-methods 'dense,fast': give distinct methods of"),
    (["--profile-out", "p.json", "--profile-methods", "lags,lags"],
     "--profile-methods 'lags,lags': give distinct methods of"),
])
def test_benchmark_rejects_bad_counts_compare_and_profile_settings(flags, message):
  from dlgs_jax.cli import benchmark

  # Checked before JAX's distributed runtime starts, so in this process.
  with pytest.raises(SystemExit) as exc:
    benchmark.main(flags)
  assert message in str(exc.value.code)


def test_compare_applies_the_shared_settings_and_lets_a_variant_override_them():
  from dlgs_jax.cli import benchmark

  config = benchmark.benchmark_config(benchmark.parse_args([
      "--compare", "dlgs-layer,dlgs-paper,topk", "--refresh-below", "0.25", "--min-ndim", "2",
      "--reuse-every", "5", "--density", "0.05"]))
  dlgs = config.compared_method("dlgs-layer")
  assert (dlgs.name, dlgs.refresh_below, dlgs.min_ndim, dlgs.reuse_every, dlgs.density,
          dlgs.budget) == ("dlgs", 0.25, 2, 5, 0.05, "layer")
  paper = config.compared_method("dlgs-paper")
  assert (paper.name, paper.refresh_below, paper.min_ndim) == ("dlgs", None, 2)
  topk = config.compared_method("topk")
  assert topk.name == "topk" and topk.min_ndim == 0

@pytest.mark.multiprocess
def test_compare_compiles_one_process_at_a_time_and_steps_without_compiling_again(tmp_path):
  out = tmp_path / "compare.json"
  done = subprocess.run(
      [sys.executable, "-m", "dlgs_jax.cli.launch", "--nproc", "2", "--module",
       "dlgs_jax.cli.benchmark", "--", "--model", "smallcnn", "--density", "0.1",
       "--compare", "dense,dlgs", "--rounds", "1", "--steps", "2", "--warmup", "1",
       "--batches", "2", "--batch-size", "4", "--compile-slots", "1", "--out", str(out)],
      env=child_env(JAX_LOG_COMPILES="1"), capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
  log = done.stdout + done.stderr
  spans = {}
  for rank in (0, 1):
    found = re.search(rf"\[{rank}\] process {rank} compiled 2 steps from ([\d.]+) to ([\d.]+)",
                      log)
    assert found, log[-4000:]
    spans[rank] = (float(found[1]), float(found[2]))
    # Each method's step compiled once, in its turn: the warm-up and the timed
    # steps run the compiled program.
    assert log.count(f"[{rank}] Compiling jit(local_step)") == 2, log[-4000:]
  assert spans[0][1] <= spans[1][0], spans
  assert set(json.loads(out.read_text())["methods"]) == {"dense", "dlgs"}
