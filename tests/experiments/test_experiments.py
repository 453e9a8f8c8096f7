"""The experiment entry points: result merging, tables, and a real (tiny) accuracy run."""

import argparse
import importlib.util
import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import child_env, write_cifar_bin_dir, write_cifar_dir

ROOT = Path(__file__).resolve().parents[2]


def load(name):
  # As `python experiments/NAME.py` runs it: beside the scripts it imports.
  if str(ROOT / "experiments") not in sys.path:
    sys.path.insert(0, str(ROOT / "experiments"))
  spec = importlib.util.spec_from_file_location(name, ROOT / "experiments" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def fake_result(model, method, density, step):
  return {"model": model, "method": method, "density": density, "median": {"step": step},
          "breakdown": {"compute": step / 2, "sparsify": 0.0, "comm_exposed": step / 2,
                        "comm_alone": step / 2},
          "predicted": {"t_iter": step * 1.1}, "plan_groups": None, "steps": 20,
          "image_shape": [32, 32, 3], "batch_size": 8, "bytes_sent": 1e6}


def test_bench_cluster_merge_replaces_remeasured_configurations_and_keeps_the_rest(tmp_path):
  bench = load("bench_cluster")
  args = argparse.Namespace(workers=4, bandwidth="1gbit")
  old = [fake_result("vgg16", "dense", 0.01, 4.0), fake_result("vgg16", "dlgs", 0.01, 2.0),
         fake_result("resnet20", "dense", 0.01, 0.09), fake_result("resnet20", "dlgs", 0.01, 0.08)]
  path = tmp_path / "results.json"
  path.write_text(json.dumps({"meta": {"workers": 4, "bandwidth": "1gbit"}, "results": old}))
  # Dense does not depend on the density: measured again at 0.1 it replaces the 0.01 entry.
  new = [fake_result("resnet20", "dense", 0.1, 0.1), fake_result("resnet20", "dlgs", 0.1, 0.07),
         fake_result("resnet20", "dlgs", 0.01, 0.05)]
  merged = bench.merge(path, new, args)
  keys = [(r["model"], r["method"], r["density"], r["median"]["step"]) for r in merged]
  assert keys == [("resnet20", "dense", 0.1, 0.1), ("resnet20", "dlgs", 0.1, 0.07),
                  ("resnet20", "dlgs", 0.01, 0.05), ("vgg16", "dense", 0.01, 4.0),
                  ("vgg16", "dlgs", 0.01, 2.0)]
  with pytest.raises(SystemExit, match="P=4 at 1gbit, not P=4 at 100mbit"):
    bench.merge(path, new, argparse.Namespace(workers=4, bandwidth="100mbit"))
  for r in merged:
    r["speedup_vs_dense"] = 1.0 if r["method"] == "dense" else 2.0
  merged[1].update(exact_leaves=2.0, leaves=8)  # resnet20 dlgs 0.1
  table = bench.markdown(merged).splitlines()
  assert len(table) == 2 + len(merged)
  assert "| resnet20 | 32x32, b8 | dense | - |" in table[2]
  assert "| 0.07 |" not in table[3] and "| dlgs | 0.1 |" in table[3]
  assert table[3].endswith("| 1.00 | 25% | 2.00x | 77.0 | +10% |")
  assert "| 1.00 |  | 2.00x |" in table[4]  # no count recorded: empty cell


def test_compare_cluster_refuses_a_profile_without_a_compared_methods_update(tmp_path):
  from dlgs_jax.planning.timeline import LinearCost, Profile
  compare = load("compare_cluster")
  path = tmp_path / "profile.json"
  Profile(model="resnet20", paths=["conv/kernel"], sizes=[2304], t_forward=0.0,
          t_backward=[0.0], workers=4, comm={},
          sparsify={"dense": LinearCost(1e-3, 0.0)}).save(path)
  # Before any cluster is built: the message names the method and the profile.
  with pytest.raises(SystemExit) as exc:
    compare.main(["--profile", str(path), "--methods", "dense,gtopk",
                  "--out-dir", str(tmp_path / "out")])
  assert "no update cost for 'gtopk'" in str(exc.value.code)
  assert str(path) in str(exc.value.code)
  assert not (tmp_path / "out").exists()


def test_bench_cluster_refit_needs_kept_profiles():
  bench = load("bench_cluster")
  with pytest.raises(SystemExit, match="give --keep-profiles too"):
    bench.main(["--refit-profiles", "--out-dir", "unused"])


@pytest.mark.slow
def test_accuracy_runs_train_every_method_and_reuse_finished_runs(tmp_path):
  # Full CIFAR-10's format through --data-dir, in miniature (320 train / 64 test
  # images: 5 steps an epoch), so that four trainings stay quick.
  cifar, _ = write_cifar_dir(tmp_path / "cifar", per_batch=64)
  command = [sys.executable, str(ROOT / "experiments" / "accuracy.py"), "--model", "smallcnn",
             "--methods", "dense,dlgs", "--densities", "0.1", "--epochs", "1", "--workers", "2",
             "--batch-size", "32", "--out-dir", str(tmp_path / "out"),
             "--runs-dir", str(tmp_path / "runs"), "--data-dir", str(cifar)]
  first = subprocess.run(command, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                         timeout=600)
  assert first.returncode == 0, first.stderr[-3000:]
  assert first.stdout.count("(320 train / 64 test), 2 workers") == 2, first.stdout[-3000:]
  assert first.stdout.count("1 epochs x 5 steps = 5 steps") == 2
  results = json.loads((tmp_path / "out" / "results.json").read_text())
  assert results["meta"]["data"] == str(cifar)
  assert [(r["method"], r["density"]) for r in results["results"]] == [("dense", None),
                                                                      ("dlgs", 0.1)]
  head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                        text=True).stdout.strip() or "unknown"
  for r in results["results"]:
    assert len(r["epochs"]) == 1
    assert 0.0 <= r["epochs"][0]["test_accuracy"] <= 1.0
    assert r["summary"]["workers"] == 2
    # The code each run trained with ("+changes": dlgs_jax/ differed from the commit).
    assert len(r["code"]) == 1 and r["code"][0].removesuffix("+changes") == head
  dense, dlgs = (r["summary"] for r in results["results"])
  # DLGS at density 0.1 sends far less than the dense all-reduce of the same model.
  dense_sent = dense["bytes_sent_per_step"] or dense["dense_bytes_per_step"]
  assert 0 < dlgs["bytes_sent_per_step"] < 0.5 * dense_sent
  table, thresholds = (tmp_path / "out" / "results.md").read_text().strip().split("\n\n")
  table = table.splitlines()
  assert len(table) == 4 and table[2].startswith("| dense | - |")
  # DLGS's thresholds: the first of 5 steps is exact, and no worker sends more than k.
  stats = dlgs["threshold_stats"]
  assert 0.2 <= stats["exact_share"] <= 1 and 0 < stats["sent_over_k_mean"] <= 1
  assert thresholds.splitlines()[2].startswith("| dlgs | 0.1 | 1 | ")
  assert (tmp_path / "out" / "curves.png").stat().st_size > 10_000
  second = subprocess.run(command, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=600)
  assert second.returncode == 0, second.stderr[-3000:]
  assert second.stdout.count("reusing") == 2
  assert json.loads((tmp_path / "out" / "results.json").read_text())["results"] == \
      results["results"]
  # A run stopped after its last checkpoint but before its summary is resumed, not retrained.
  dense_dir = tmp_path / "runs" / "smallcnn_dense"
  (dense_dir / "summary.json").unlink()
  resumed = subprocess.run(command, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                           timeout=600)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "== dense: resuming" in resumed.stdout and resumed.stdout.count("reusing") == 1
  assert "resumed from step 5" in resumed.stdout, resumed.stdout[-3000:]
  again = json.loads((dense_dir / "summary.json").read_text())
  assert again["params_sha256"] == dense["params_sha256"]
  # Resumed on the same code, the run still names one version of it.
  assert json.loads((dense_dir / "code.json").read_text()) == results["results"][0]["code"]
  # So is one a signal stopped early: its summary says so, and it is not taken as finished.
  (dense_dir / "summary.json").write_text(json.dumps(dict(again, stopped_early=True,
                                                          stopped_by="SIGTERM")))
  resumed = subprocess.run(command, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                           timeout=600)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "== dense: resuming" in resumed.stdout, resumed.stdout[-3000:]
  assert not json.loads((dense_dir / "summary.json").read_text())["stopped_early"]
  # Dense does not depend on the density: another density reuses its run.
  other = [*command[:command.index("--methods")], "--methods", "dense", "--densities", "0.05",
           *command[command.index("--epochs"):]]
  third = subprocess.run(other, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                         timeout=600)
  assert third.returncode == 0, third.stderr[-3000:]
  assert third.stdout.count("reusing") == 1 and "dlgs_jax.cli.train" not in third.stdout
  # A second seed trains only the new runs, in their own directory, and the table averages.
  seeds = [*other[:other.index("--epochs")], "--seeds", "0,1", *other[other.index("--epochs"):]]
  fourth = subprocess.run(seeds, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=600)
  assert fourth.returncode == 0, fourth.stderr[-3000:]
  assert fourth.stdout.count("reusing") == 1 and fourth.stdout.count("--seed 1 ") == 1
  assert (tmp_path / "runs" / "seed1" / "smallcnn_dense" / "summary.json").exists()
  averaged = json.loads((tmp_path / "out" / "results.json").read_text())
  assert [r["seed"] for r in averaged["results"]] == [0, 1]
  assert "| dense | - | 0,1 |" in (tmp_path / "out" / "results.md").read_text()
  # A finished run made by another command is not deleted unless --rerun says so.
  changed = [*seeds[:seeds.index("--batch-size")], "--batch-size", "16",
             *seeds[seeds.index("--batch-size") + 2:]]
  refused = subprocess.run(changed, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                           timeout=120)
  assert refused.returncode == 1 and "--rerun" in refused.stderr, refused.stderr[-3000:]
  assert "smallcnn_dense holds a finished run" in refused.stderr
  assert "dlgs_jax.cli.train" not in refused.stdout
  assert (tmp_path / "runs" / "smallcnn_dense" / "summary.json").exists()
  bad = subprocess.run([*seeds[:seeds.index("--seeds")], "--seeds", "0,x"], cwd=ROOT,
                       env=child_env(), capture_output=True, text=True, timeout=60)
  assert bad.returncode == 2 and "'0,x'" in bad.stderr


def test_accuracy_writes_no_table_for_a_run_a_stop_ends_early(tmp_path, monkeypatch):
  # The trainer's own stop (--stop-after, the path a signal takes) ends with
  # status 0 and a checkpoint; its two steps must not become a table row.
  accuracy = load("accuracy")
  for key, value in child_env().items():
    monkeypatch.setenv(key, value)
  real = accuracy.train_command
  monkeypatch.setattr(accuracy, "train_command",
                      lambda *args: real(*args) + ["--stop-after", "2"])
  cifar, _ = write_cifar_dir(tmp_path / "cifar", per_batch=64)
  out, runs = tmp_path / "out", tmp_path / "runs"
  with pytest.raises(SystemExit, match=r"dense stopped before its last step; .*smallcnn_dense: "
                                       r"run the same command to resume it"):
    accuracy.main(["--model", "smallcnn", "--methods", "dense", "--epochs", "2",
                   "--workers", "2", "--out-dir", str(out), "--runs-dir", str(runs),
                   "--data-dir", str(cifar)])
  summary = json.loads((runs / "smallcnn_dense" / "summary.json").read_text())
  assert summary["stopped_early"] and summary["steps"] == 2
  assert (runs / "smallcnn_dense" / "checkpoints").is_dir()
  assert not (out / "results.json").exists() and not (out / "results.md").exists()


def test_accuracy_table_over_seeds_gives_mean_spread_and_paired_gap():
  report = load("accuracy_report")

  def run(method, density, seed, final):
    return {"method": method, "density": density, "seed": seed,
            "epochs": [{"epoch": 0, "test_accuracy": 0.1, "test_loss": 2.0, "train_loss": 2.0},
                       {"epoch": 1, "test_accuracy": final, "test_loss": 1.0,
                        "train_loss": 0.5 + seed}],
            "summary": {"bytes_sent_per_step": 1e6 * (seed + 1), "seconds": 60.0,
                        "median_step_time": (0.4, 0.5, 0.9)[seed]}}

  dense, sparse = [0.70, 0.74, 0.72], [0.69, 0.71, 0.73]
  results = ([run("dense", None, seed, a) for seed, a in enumerate(dense)]
             + [run("dlgs", 0.1, seed, a) for seed, a in enumerate(sparse)])
  rows = report.markdown(results).splitlines()
  assert len(rows) == 4
  gaps = np.subtract(sparse, dense) * 100
  cells = [c.strip() for c in rows[3].strip("|").split("|")]
  assert cells[:3] == ["dlgs", "0.1", "0,1,2"]
  assert cells[3] == f"{np.mean(sparse) * 100:.1f} ± {np.std(np.multiply(sparse, 100), ddof=1):.1f}%"
  assert cells[4] == "69.0 / 71.0 / 73.0"
  assert cells[5] == f"{gaps.mean():+.1f} ± {gaps.std(ddof=1):.1f}"
  assert cells[7] == "1.500" and cells[8] == "2.000"
  assert cells[9] == f"{np.mean([0.4, 0.5, 0.9]):.3f}"  # the median step times' mean
  # A configuration with a seed dense lacks: its value alone where one seed, and the
  # gap over the seeds dense ran, named.
  rows = report.markdown(results[:1] + results[3:]).splitlines()
  cells = [c.strip() for c in rows[2].strip("|").split("|")]
  assert cells[:4] == ["dense", "-", "0", "70.0%"]
  cells = [c.strip() for c in rows[3].strip("|").split("|")]
  assert cells[3] == f"{np.mean(sparse) * 100:.1f} ± {np.std(np.multiply(sparse, 100), ddof=1):.1f}%"
  assert cells[5] == f"{gaps[0]:+.1f} (seed 0 only)"
  # One seed keeps the per-run table.
  assert "seeds" not in report.markdown([results[0], results[3]]).splitlines()[0]


def test_accuracy_versus_pairs_two_methods_by_seed_and_density(tmp_path):
  accuracy, report = load("accuracy"), load("accuracy_report")
  rng = np.random.default_rng(1)
  curves = {}

  def run(method, density, seed):
    curves[method, density, seed] = rng.uniform(0.5, 0.9, 10) * 100
    return {"method": method, "density": density, "seed": seed,
            "epochs": [{"epoch": e, "test_accuracy": a / 100, "test_loss": 1.0}
                       for e, a in enumerate(curves[method, density, seed])],
            "summary": {"bytes_sent_per_step": 1e6, "seconds": 60.0, "median_step_time": 0.5}}

  # dlgs at two densities: each dlgs-paper run pairs with dlgs of its own density.
  results = [run(m, d, seed) for seed in (0, 1) for m, d in
             (("dense", None), ("dlgs", 0.1), ("dlgs", 0.01), ("dlgs-paper", 0.1))]
  table = report.markdown_paired_gaps(results, base="dlgs", only=("dlgs-paper",))
  rows = table.splitlines()[2:]
  assert len(rows) == 3 and all(r.startswith("| dlgs-paper − dlgs | 0.1 |") for r in rows)
  gaps = [curves["dlgs-paper", 0.1, s][-1] - curves["dlgs", 0.1, s][-1] for s in (0, 1)]
  assert (f"| final test accuracy | {gaps[0]:+.2f} / {gaps[1]:+.2f} | "
          f"{np.mean(gaps):+.2f} ± {np.std(gaps, ddof=1):.2f} |") in rows[0]
  tail = [curves["dlgs-paper", 0.1, s][-1:].mean() - curves["dlgs", 0.1, s][-1:].mean()
          for s in (0, 1)]
  assert f"{tail[0]:+.2f} / {tail[1]:+.2f}" in rows[1]
  # One seed: the gap without a spread.
  one = report.markdown_paired_gaps(results[:4], base="dlgs", only=("dlgs-paper",))
  assert one.splitlines()[2].endswith(f"| {gaps[0]:+.2f} | {gaps[0]:+.2f} (one seed) |")

  meta = {"model": "resnet20", "workers": 4, "epochs": 10, "batch_size": 32, "lr": 0.1,
          "data": "embedded"}
  paths = []
  for seed in (0, 1):
    path = tmp_path / f"s{seed}" / "results.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"meta": dict(meta, seeds=[seed]),
                                "results": [r for r in results if r["seed"] == seed]}))
    paths.append(str(path))
  out = tmp_path / "merged"
  assert accuracy.main(["--merge", ",".join(paths), "--out-dir", str(out),
                        "--versus", "dlgs-paper:dlgs"]) == 0
  assert rows[0] in (out / "results.md").read_text()
  with pytest.raises(SystemExit, match="--versus topk:dlgs: no run of topk here; the runs are "
                     "of dense, dlgs, dlgs-paper"):
    accuracy.main(["--merge", ",".join(paths), "--out-dir", str(tmp_path / "x"),
                   "--versus", "topk:dlgs"])
  assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("flags, message", [
    (["--versus", "dlgs"], "--versus 'dlgs' is invalid: give two different methods as A:B"),
    (["--versus", "dlgs:dlgs"], "--versus 'dlgs:dlgs' is invalid: give two different"),
    (["--methods", "dense,dlgs", "--versus", "dlgs-paper:dlgs"],
     "--versus 'dlgs-paper:dlgs' is invalid: dlgs-paper is not among --methods dense,dlgs"),
])
def test_accuracy_refuses_a_bad_versus_before_training(flags, message, capsys):
  accuracy = load("accuracy")
  with pytest.raises(SystemExit):
    accuracy.parse_args(flags)
  assert message in capsys.readouterr().err


def test_accuracy_merge_joins_seeds_from_separate_files_and_refuses_other_settings(tmp_path):
  accuracy = load("accuracy")
  rng = np.random.default_rng(0)
  curves = {}

  def run(method, density, seed):
    curve = rng.uniform(0.3, 0.8, 20)
    curves[method, seed] = curve * 100
    summary = {"bytes_sent_per_step": 1e6, "seconds": 60.0}
    if method == "dlgs":  # its values sent against k, per epoch: a third row of curves
      steps = [{"selected": 1000 * (1 + e % 2), "exact": 59 * (e % 2), "epoch": e // 2}
               for e in range(40)]
      summary["threshold_stats"] = accuracy.threshold_stats(steps, "resnet20", 0.1)
    return {"method": method, "density": density, "seed": seed,
            "epochs": [{"epoch": e, "test_accuracy": float(a), "test_loss": 1.0,
                        "train_loss": 0.5} for e, a in enumerate(curve)],
            "summary": summary}

  meta = {"model": "resnet20", "workers": 4, "epochs": 20, "batch_size": 32, "lr": 0.1,
          "data": "embedded"}

  def write(name, runs, **changed):
    path = tmp_path / name / "results.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"meta": dict(meta, seeds=sorted({r["seed"] for r in runs}),
                                             command="x", **changed), "results": runs}))
    return str(path)

  # One job trained seeds 2 and 0, another seed 1 with DLGS before dense.
  first = write("a", [run("dense", None, 2), run("dlgs", 0.1, 2), run("dense", None, 0),
                      run("dlgs", 0.1, 0)])
  second = write("b", [run("dlgs", 0.1, 1), run("dense", None, 1)])
  out = tmp_path / "merged"
  assert accuracy.main(["--merge", f"{first},{second}", "--out-dir", str(out)]) == 0
  merged = json.loads((out / "results.json").read_text())
  assert [(r["method"], r["seed"]) for r in merged["results"]] == [
      ("dense", 0), ("dlgs", 0), ("dlgs", 1), ("dense", 1), ("dense", 2), ("dlgs", 2)]
  assert merged["meta"]["seeds"] == [0, 1, 2] and merged["meta"]["merged"] == [first, second]
  assert merged["meta"]["epochs"] == 20 and merged["meta"]["command"].endswith(str(out))
  # Accuracy, train loss and DLGS's values sent / k: three rows of 3.5 inches at 110 dpi.
  width, height = struct.unpack(">II", (out / "curves.png").read_bytes()[16:24])  # PNG's IHDR
  assert height == 3 * 385 and width == 550
  table = (out / "results.md").read_text()
  assert "| dlgs | 0.1 | 0,1,2 |" in table
  # The paired gaps under each measure, against NumPy on the same curves.
  gaps = {name: [measure(curves["dlgs", seed]) - measure(curves["dense", seed])
                 for seed in range(3)]
          for name, measure in (("final test accuracy", lambda c: c[-1]),
                                ("mean of the last 2 epochs", lambda c: c[-2:].mean()),
                                ("best test accuracy", np.max))}
  for name, values in gaps.items():
    row = (f"| dlgs | 0.1 | {name} | {' / '.join(f'{v:+.2f}' for v in values)} | "
           f"{np.mean(values):+.2f} ± {np.std(values, ddof=1):.2f} |")
    assert row in table, (row, table)

  other = write("c", [run("dense", None, 3)], epochs=40)
  with pytest.raises(SystemExit, match=r"c/results.json has epochs=40, .* has 20"):
    accuracy.main(["--merge", f"{first},{other}", "--out-dir", str(tmp_path / "x")])
  again = write("d", [run("dlgs", 0.1, 0)])
  with pytest.raises(SystemExit, match=r"dlgs density 0.1 seed 0 is in both .*a/results.json"):
    accuracy.main(["--merge", f"{first},{again}", "--out-dir", str(tmp_path / "x")])
  stopped = run("dense", None, 4)
  stopped["summary"]["stopped_early"] = True
  stopped = write("e", [stopped])
  with pytest.raises(SystemExit, match=r"e/results.json holds dense density None seed 4 stopped "
                                       r"before its last step"):
    accuracy.main(["--merge", f"{first},{stopped}", "--out-dir", str(tmp_path / "x")])
  with pytest.raises(SystemExit, match="at least two"):
    accuracy.main(["--merge", first, "--out-dir", str(tmp_path / "x")])
  with pytest.raises(SystemExit, match="no such file .*nowhere.json"):
    accuracy.main(["--merge", f"{first},{tmp_path / 'nowhere.json'}", "--out-dir",
                   str(tmp_path / "x")])
  assert not (tmp_path / "x").exists()


def test_accuracy_trains_with_the_planned_groups_where_a_plan_exists(tmp_path):
  # A plan named for the model, method and density goes to the training command;
  # a configuration without one keeps one group per leaf.
  accuracy = load("accuracy")
  (tmp_path / "plan_resnet20_dlgs_0.01.json").write_text("{}")
  args = accuracy.parse_args(["--plan-dir", str(tmp_path)])
  planned = accuracy.train_command(args, "dlgs", 0.01, 0, tmp_path / "run")
  assert planned[planned.index("--plan") + 1] == str(tmp_path / "plan_resnet20_dlgs_0.01.json")
  assert "--plan" not in accuracy.train_command(args, "dlgs", 0.1, 0, tmp_path / "run")
  assert "--plan" not in accuracy.train_command(accuracy.parse_args([]), "dlgs", 0.01, 0,
                                                tmp_path / "run")
  # A variant without a plan of its own groups as its base method; one with its own takes it.
  layer = accuracy.train_command(args, "dlgs-layer", 0.01, 0, tmp_path / "run")
  assert layer[layer.index("--plan") + 1] == str(tmp_path / "plan_resnet20_dlgs_0.01.json")
  assert "--budget" in layer
  (tmp_path / "plan_resnet20_dlgs-spend_0.01.json").write_text("{}")
  spend = accuracy.train_command(args, "dlgs-spend", 0.01, 0, tmp_path / "run")
  assert spend[spend.index("--plan") + 1] == str(tmp_path / "plan_resnet20_dlgs-spend_0.01.json")
  assert "--plan" not in accuracy.train_command(args, "topk", 0.01, 0, tmp_path / "run")


def test_accuracy_trains_a_name_with_2l_in_two_levels_and_counts_its_slices_k(tmp_path):
  # dlgs@2l: the same method with --node-size; its k per step is that of its slices.
  accuracy = load("accuracy")
  args = accuracy.parse_args(["--node-size", "2"])
  two = accuracy.train_command(args, "dlgs@2l", 0.1, 0, tmp_path / "run")
  flat = accuracy.train_command(args, "dlgs", 0.1, 0, tmp_path / "run")
  assert two[two.index("--node-size") + 1] == "2" and "--node-size" not in flat
  assert [f for f in two if f not in ("--node-size", "2")] == flat
  assert accuracy.free("dense@2l") and not accuracy.free("dlgs@2l")
  assert [c for c, _ in accuracy.configurations(
      ["dense@2l", "dlgs@2l"], [0.1, 0.01], base=lambda n: accuracy.exchange_of(n)[0])] == [
          "dense@2l", "dlgs@2l", "dlgs@2l"]
  sizes = [int(np.prod(x.shape)) for x in
           accuracy.jax.tree_util.tree_leaves(accuracy.models.param_shapes("resnet20"))]
  k_slices = sum(accuracy.num_to_keep(0.1, -(-n // 2)) for n in sizes)
  steps = [{"selected": k_slices, "exact": len(sizes)}, {"selected": k_slices // 2, "exact": 0}]
  stats = accuracy.threshold_stats(steps, "resnet20", 0.1, fast_size=2)
  assert stats["sent_over_k_mean"] == pytest.approx(0.75, abs=1e-3)
  assert stats["sent_over_k_by_epoch"] == pytest.approx([0.75], abs=1e-3)
  by_epoch = accuracy.threshold_stats([dict(s, epoch=e) for e, s in enumerate(steps)],
                                      "resnet20", 0.1, fast_size=2)["sent_over_k_by_epoch"]
  assert by_epoch == pytest.approx([1.0, 0.5], abs=1e-3)
  assert stats["exact_share"] == 0.5
  assert accuracy.threshold_stats(steps, "resnet20", 0.1)["sent_over_k_mean"] < 0.6
  assert stats["exact_values_share"] is None
  # One group at density 0.01, adapted: the leaves of k < 16 are exact on
  # every step; a step that counts only them has recomputed their values only.
  ks = [accuracy.num_to_keep(0.01, n) for n in sizes]
  few = [k < accuracy.AdaptedReuse().exact_below_k for k in ks]
  steps = [{"selected": 1, "exact": len(sizes)}, {"selected": 1, "exact": sum(few)}]
  one = accuracy.threshold_stats(steps, "resnet20", 0.01, one_group=True, few_exact=True)
  few_values = sum(n for n, f in zip(sizes, few) if f) / sum(sizes)
  assert 0 < few_values < 0.02 and sum(few) == 41
  assert one["exact_values_share"] == pytest.approx((1 + few_values) / 2)
  assert one["exact_share"] == pytest.approx((len(sizes) + 41) / (2 * len(sizes)))


def test_the_full_cifar_table_pairs_the_head_run_once_it_has_landed(tmp_path, monkeypatch):
  suite = load("run_suite")
  monkeypatch.setattr(suite, "ROOT", tmp_path)
  folder = tmp_path / "experiments" / "results" / "accuracy_full"

  def table_versus():
    command = dict(suite.full_steps())["accuracy_full_table"]
    return command[command.index("--versus") + 1], command[command.index("--merge") + 1]

  for name in ("dense_seed0", "dlgs-paper_seed0", "dlgs-layer_seed0"):
    (folder / name).mkdir(parents=True)
    (folder / name / "results.json").write_text("{}")
  versus, merged = table_versus()
  assert versus == "dlgs-paper:dlgs-layer" and merged.count("results.json") == 3
  (folder / "dlgs-paper-head_seed0").mkdir()
  (folder / "dlgs-paper-head_seed0" / "results.json").write_text("{}")
  versus, merged = table_versus()
  assert versus == "dlgs-paper:dlgs-layer,dlgs-paper-head:dlgs-paper" and "head_seed0" in merged
  (folder / "dlgs-message_0.01_seed0").mkdir()
  (folder / "dlgs-message_0.01_seed0" / "results.json").write_text("{}")
  versus, merged = table_versus()
  assert versus.endswith(",dlgs-message:dlgs-layer,dlgs-message:topk") and "message_0.01" in merged


def test_every_suite_step_names_a_section_the_report_has(tmp_path):
  import re
  suite = load("run_suite")
  headings = {int(n): title for n, title in re.findall(
      r"^## (\d+)\. (.+)$", (ROOT / "experiments" / "README.md").read_text(), re.M)}
  names = [n for n, _ in suite.full_steps()] + [n for n, _ in suite.steps(False, tmp_path)]
  sections = {name: suite.section_of(name) for name in names}
  assert set(sections.values()) <= set(headings)
  assert sections["accuracy_nodes"] == 6 and sections["accuracy_full_table"] == 2
  assert sections["gpu_check"] == 4 and sections["cluster"] == 3
  with pytest.raises(KeyError, match="feeds no section"):
    suite.section_of("bogus")


@pytest.mark.slow
def test_suite_runs_the_chosen_steps_and_names_unknown_ones(tmp_path):
  command = [sys.executable, str(ROOT / "experiments" / "run_suite.py"), "--out-dir",
             str(tmp_path)]
  bad = subprocess.run(command + ["--only", "scaling,bogus"], cwd=ROOT, env=child_env(),
                       capture_output=True, text=True, timeout=60)
  assert bad.returncode == 2 and "'bogus'" in bad.stderr
  done = subprocess.run(command + ["--only", "scaling,ring"], cwd=ROOT, env=child_env(),
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  assert "| scaling | ok |" in done.stdout and "| ring | ok |" in done.stdout
  assert "| sparsify |" not in done.stdout
  assert "== ring (report section 8): python -m dlgs_jax.sim.ring" in done.stdout
  assert (tmp_path / "scaling" / "scaling_density0.01.json").exists()
  assert any((tmp_path / "ring").iterdir())


@pytest.mark.slow
def test_budget_share_measures_where_global_topk_sends_and_the_head_variant(tmp_path):
  share = load("budget_share")
  assert share.main(["--model", "smallcnn", "--density", "0.1", "--steps", "3",
                     "--batch-size", "16", "--methods", "topk,lags-head,dense",
                     "--out-dir", str(tmp_path)]) == 0
  result = json.loads((tmp_path / "budget_share.json").read_text())
  sizes, order, runs = result["sizes"], result["order"], result["runs"]
  assert order[0].startswith("Dense_1/") and sorted(order) == sorted(sizes)
  # Global Top-k sends exactly k = ceil(0.1 * n) values per step, spread over the leaves.
  k = math.ceil(0.1 * sum(sizes.values()))
  sent = sum(runs["topk"]["fractions"][p] * sizes[p] for p in order)
  assert sent == pytest.approx(k, rel=1e-3)
  # lags-head: every other leaf gets at most its k_l; the head far more.
  head = {"Dense_1/bias", "Dense_1/kernel"}
  for path in order:
    fraction = runs["lags-head"]["fractions"][path]
    if path in head:
      assert fraction > 0.5
    else:
      assert fraction <= math.ceil(0.1 * sizes[path]) / sizes[path] + 1e-6
  for run in runs.values():
    assert len(run["losses"]) == 3 and all(math.isfinite(x) for x in run["losses"])
  table = (tmp_path / "budget_share.md").read_text()
  assert "| topk |" in table and f"| {order[0]} | {sizes[order[0]]} |" in table
  assert (tmp_path / "budget_share.png").stat().st_size > 10_000
  with pytest.raises(SystemExit, match="gtopk"):
    share.compressor("gtopk", 0.1, order)


def test_overlap_probe_tables_and_plots_what_the_workers_measured(tmp_path):
  probe = load("overlap_probe")
  result = {"seconds": {"compute": 0.1374, "collectives": 0.1934, "independent": 0.3412,
                        "chained": 0.4224},
            "schedule": [["other", 97], ["all-gather", 32], ["other", 33]],
            "rounds": 1, "size": 200000, "leaves": 32}
  result["hidden"] = (0.1374 + 0.1934 - 0.3412) / 0.1374
  payload = {"results": [result], "workers": 4, "bandwidth": "1gbit", "backend": "cpu"}
  lines = probe.markdown(payload).splitlines()
  assert len(lines) == 3
  cells = [c.strip() for c in lines[2].strip("|").split("|")]
  assert cells[1:5] == ["137.4", "193.4", "330.8", "341.2"]
  assert cells[5] == "422.4" and cells[6] == "-0.08"
  assert cells[7] == "other x97, all-gather x32, other x33"
  probe.plot(payload, tmp_path / "overlap.png")
  assert (tmp_path / "overlap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_latency_probe_rows_are_the_profiles_marginal_latency(capsys):
  probe = load("latency_probe")
  latency = {"allreduce": {"bytes": 16384, "lone": 0.010, "chained": 0.080, "chain": 8},
             "allgather": {"bytes": 4920, "lone": 0.004, "chained": 0.053, "chain": 8},
             "gtopk": {"bytes": 8000, "lone": 0.015, "chained": 0.113, "chain": 8}}
  rows = probe.latency_rows(latency, 1)
  assert [(r["kind"], r["chain"], r["pass"]) for r in rows] == [
      ("allreduce", 8, 1), ("allgather", 8, 1), ("gtopk", 8, 1)]
  assert [r["marginal"] for r in rows] == pytest.approx([0.010, 0.007, 0.014])
  rows += probe.latency_rows({k: dict(v, chain=32, chained=v["lone"] + 31 * 0.005)
                              for k, v in latency.items()}, 0)
  lines = probe.markdown(rows, [8, 32]).splitlines()
  assert len(lines) == 4
  assert [c.strip() for c in lines[2].strip("|").split("|")] == [
      "8", "10.00", "7.00", "14.00", "10.00", "4.00", "15.00"]
  assert [c.strip() for c in lines[3].strip("|").split("|")][:4] == ["32", "5.00", "5.00", "5.00"]
  for bad, named in ((["--chains", "8,x"], "'8,x'"), (["--chains", "1,8"], "'1,8'"),
                     (["--passes", "0"], ", 0")):
    with pytest.raises(SystemExit):
      probe.parse_args(bad)
    assert named in capsys.readouterr().err


def test_compare_cluster_pairs_each_round_with_the_reference(tmp_path):
  compare = load("compare_cluster")
  # Three rounds; the machine slows down in round 2 for every method alike.
  rounds = {"dense": [0.100, 0.150, 0.100], "topk": [0.095, 0.140, 0.105],
            "dlgs": [0.080, 0.130, 0.090]}
  payload = {"model": "resnet20", "density": 0.01, "workers": 4, "bandwidth": "1gbit",
             "rounds": 3, "steps": 2,
             "methods": {name: {"grouping": "one message", "groups": 1, "round_medians": r,
                                "median": float(np.median(r)), "bytes_sent": 1e5}
                         for name, r in rounds.items()}}
  rows = {r["method"]: r for r in compare.summarize(payload)}
  assert rows["dense"]["speedup"] == pytest.approx(1.0)
  # Paired per round: 100/95, 150/140, 100/105 -> median 100/95.
  assert rows["topk"]["speedup"] == pytest.approx(100 / 95)
  assert rows["topk"]["speedup_min"] == pytest.approx(100 / 105)
  assert rows["topk"]["speedup_max"] == pytest.approx(150 / 140)
  assert rows["topk"]["faster_than_reference"] == 2
  assert rows["dlgs"]["speedup"] == pytest.approx(150 / 130)
  assert rows["dlgs"]["faster_than_reference"] == 3
  assert (rows["dlgs"]["round_min"], rows["dlgs"]["round_max"]) == (0.080, 0.130)
  wins = compare.wins(payload)
  assert wins["dlgs"] == {"dense": 3, "topk": 3} and wins["topk"] == {"dense": 2, "dlgs": 0}
  # Bytes that left a node: the model's figure and the interfaces' counters.
  payload["methods"]["topk"].update(model_bytes_per_process=1.0e5,
                                    interface_bytes_per_process=1.1e5)
  lines = compare.markdown(payload).splitlines()
  cells = [c.strip() for c in lines[3].strip("|").split("|")]
  # Two rounds faster, one slower: a split that even as a coin gives with p = 1.
  assert cells == ["topk", "one message (1 group)", "105.0", "95.0-140.0", "1.05x (0.95-1.07)",
                   "2 / 3", "1", "0.10", "0.10 / 0.11"]
  assert lines[2].endswith("| 0.10 | - |")  # dense: measured without the counters
  assert rows["dlgs"]["p_value"] == pytest.approx(0.25)  # 3 of 3: 2 * 1/8
  assert compare.sign_test(9, 1) == pytest.approx(2 * 11 / 1024)
  assert compare.sign_test(0, 0) == 1.0
  assert lines[-1] == "| dlgs | 3 | 3 | - |"
  compare.plot(payload, tmp_path / "compare.png")
  assert (tmp_path / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_cluster_predicts_each_method_as_the_comparison_ran_it(tmp_path):
  compare = load("compare_cluster")
  from dlgs_jax.planning import planner
  from dlgs_jax.planning.timeline import LinearCost, Profile, simulate

  paths = ["head/kernel", "head/bias", "conv/kernel"]  # backward order
  shapes = {"head/kernel": (64, 10), "head/bias": (10,), "conv/kernel": (3, 3, 3, 64)}
  profile = Profile(model="m", paths=paths, sizes=[640, 10, 1728], t_forward=0.01,
                    t_backward=[0.002, 0.0, 0.004], workers=4, overlap=False,
                    sparsify={m: LinearCost(1e-4, 1e-8) for m in ("dense", "dlgs", "lags")},
                    comm={"allreduce": LinearCost(5e-3, 1e-8),
                          "allgather": LinearCost(4e-3, 1e-8)})
  payload = {"density": 0.1, "methods": {name: {} for name in
                                         ("dense", "dlgs-paper", "lags", "dlgs-fancy")}}
  plan = planner.make_plan(profile, "dense", 1.0, "wfbp")
  predicted = compare.predictions(payload, profile, shapes, {"dense": plan})
  # A method the model does not know gets no prediction.
  assert set(predicted) == {"dense", "dlgs-paper", "lags"}
  from dlgs_jax.planning.pricing import method_costs
  costs = {name: method_costs(name, 0.1, profile, shapes) for name in predicted}
  # Dense ran its plan (one message per leaf here); DLGS without one sent one
  # message; LAGS one message per leaf.
  assert predicted["dense"]["t_iter"] == pytest.approx(
      simulate(profile, [[0], [1], [2]], costs["dense"]).t_iter)
  assert predicted["dlgs-paper"]["t_iter"] == pytest.approx(
      simulate(profile, [[0, 1, 2]], costs["dlgs-paper"]).t_iter)
  assert predicted["lags"]["t_iter"] == pytest.approx(
      simulate(profile, [[0], [1], [2]], costs["lags"]).t_iter)
  assert predicted["dense"]["t_iter"] > predicted["dlgs-paper"]["t_iter"]

  rounds = {"dense": [0.05, 0.06], "dlgs-paper": [0.04, 0.05]}
  table = {"model": "m", "density": 0.1, "workers": 4, "rounds": 2, "steps": 2,
           "methods": {name: {"grouping": "one message", "groups": 1, "round_medians": r,
                              "median": float(np.median(r)), "bytes_sent": 1e5}
                       for name, r in rounds.items()},
           "predicted": {"dense": {"t_iter": 0.0605}}}
  rows = {r["method"]: r for r in compare.summarize(table)}
  assert rows["dense"]["prediction_error"] == pytest.approx(0.0605 / 0.055 - 1)
  assert rows["dlgs-paper"]["predicted"] is None
  lines = compare.markdown(table).splitlines()
  assert lines[0].endswith("| predicted ms | error |")
  assert lines[2].endswith("| 60.5 | +10% |") and lines[3].endswith("| - | - |")


@pytest.mark.parametrize("flags, message", [
    (["--measure-profile"], "--measure-profile writes the profile to --profile"),
    (["--profile", "/nonexistent/profile.json"], "no such file (add --measure-profile"),
])
def test_compare_cluster_rejects_a_profile_it_cannot_use(flags, message):
  compare = load("compare_cluster")
  with pytest.raises(SystemExit) as exc:
    compare.main(flags)
  assert message in str(exc.value.code)


@pytest.mark.slow
def test_the_default_grouping_keeps_an_updates_program_as_leaves_grow():
  # One bucket of small leaves at 4 and 16 leaves; one group per leaf: one
  # conditional for the whole update either way (the next thresholds, settled
  # for every group at once), but a group's passes each. (LAGS sorts nothing
  # either way; bucketing merges its messages.)
  rows = load("bench_sparsify").grouping_counts((4, 16))
  by = {(r["leaves"], r["transform"]): r for r in rows}
  assert by[4, "dlgs"]["groups"] == by[16, "dlgs"]["groups"] == 1
  assert by[4, "dlgs"]["conditionals"] == by[16, "dlgs"]["conditionals"] == 1
  assert by[16, "dlgs per leaf"]["groups"] == 16
  assert by[16, "dlgs per leaf"]["conditionals"] == 1
  assert by[16, "dlgs per leaf"]["kernels"] > 3 * by[16, "dlgs"]["kernels"]
  assert (by[16, "lags"]["groups"], by[16, "lags per leaf"]["groups"]) == (1, 16)
  assert by[16, "lags"]["top_k"] == by[16, "lags per leaf"]["top_k"] == 0



@pytest.mark.slow
def test_gpu_accuracy_packs_what_can_travel_and_trains_simulated_workers_on_it(tmp_path):
  """The GPU accuracy run at toy size, on CPU: a slice packed in CIFAR-10's binary format,
  then dense and DLGS with 2 workers simulated on one device."""
  gpu_accuracy = load("gpu_accuracy")
  source, _ = write_cifar_bin_dir(tmp_path / "cifar", per_batch=64)
  sliced = tmp_path / "slice"
  for train, test, message in ((101, 10, "--train 101 must be a positive multiple of 5"),
                               (400, 10, "holds 64 rows, fewer than the 80 asked for"),
                               (20_000, 5_000, "over the 36 MiB that can travel")):
    with pytest.raises(SystemExit, match=message):
      gpu_accuracy.pack(source, tmp_path / "refused", train, test)
  assert gpu_accuracy.pack(source, sliced, 100, 40) == 140 * gpu_accuracy.ROW
  assert (sliced / "data_batch_5.bin").stat().st_size == 20 * gpu_accuracy.ROW
  out = tmp_path / "out"
  result = subprocess.run(
      [sys.executable, str(ROOT / "experiments" / "gpu_accuracy.py"), "run", "--data-dir",
       str(sliced), "--model", "smallcnn", "--workers", "2", "--batch-size", "8", "--epochs",
       "1", "--density", "0.1", "--out-dir", str(out), "--runs-dir", str(tmp_path / "runs")],
      cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.count("(100 train / 40 test), 2 workers (simulated on one device)") == 2
  results = json.loads((out / "results.json").read_text())
  assert results["meta"]["simulated"] is True
  assert [(r["method"], r["density"]) for r in results["results"]] == [("dense", None),
                                                                      ("dlgs", 0.1)]
  assert all(r["summary"]["workers"] == 2 for r in results["results"])
  run = json.loads((out / "run.json").read_text())
  assert run["platform"] == "cpu" and run["epochs"] == 1 and run["seconds"] > 0
  assert (out / "curves.png").stat().st_size > 10_000
