"""The device profile script: step times on CPU, and the kernel table of a trace."""

import json
import os

import pytest

from tests.experiments.test_experiments import load


def test_kernel_table_sums_kernels_by_name_and_counts_the_waits_between_them():
  profile = load("gpu_profile")
  us = 1_000.0  # ns
  lines = {
      # Two streams; the second kernel overlaps the first, so no gap between them.
      "Stream #1(Compute)": [("a", 0.0, 10 * us), ("b", 5 * us, 10 * us),
                             ("a", 300 * us, 20 * us)],
      "Stream #2(Compute)": [("c", 15 * us + 50 * us, 5 * us)],
      "XLA Modules": [("jit_update", 0.0, 320 * us)],  # a summary, not a kernel
  }
  table = profile.kernel_table(lines, top=2)
  # Gaps: b ends at 15 us, c starts at 65 (50 us: no wait), ends at 70; a starts at 300.
  assert table["launches"] == 4 and table["busy_ms"] == pytest.approx(0.045)
  assert table["span_ms"] == pytest.approx(0.32)
  assert (table["waits"], table["wait_ms"]) == (1, pytest.approx(0.23))
  assert table["kernels"] == [("a", pytest.approx(0.03), 2), ("b", pytest.approx(0.01), 1)]
  assert profile.kernel_table({"XLA Modules": lines["XLA Modules"]}, top=2) == {}


@pytest.mark.slow
def test_gpu_profile_times_each_step_of_a_period_and_traces_the_dlgs_rules(tmp_path, capsys):
  profile = load("gpu_profile")
  assert profile.main(["--models", "smallcnn", "--methods", "topk", "dlgs-paper",
                       "--density", "0.1", "--reuse-every", "2", "--rounds", "1",
                       "--out-dir", str(tmp_path)]) == 0
  result = json.loads((tmp_path / "profile.json").read_text())
  rows = {r["method"]: r for r in result["rows"]}
  assert set(rows) == {"topk", "dlgs-paper"} and result["machine"]["backend"] == "cpu"
  assert result["machine"]["xla_flags"] == os.environ.get("XLA_FLAGS", "")
  paper = rows["dlgs-paper"]
  # The paper's schedule: every leaf exact on the period's first step, none on the other.
  assert [s["exact_leaves"] for s in paper["steps"]] == [paper["steps"][0]["exact_leaves"], 0]
  assert paper["steps"][0]["exact_leaves"] > 0 and paper["conditionals"] >= 1
  assert all(s["ms"] > 0 for r in rows.values() for s in r["steps"])
  assert paper["trace"] and (tmp_path / "smallcnn_dlgs-paper.xplane.pb").stat().st_size > 0
  assert "HloModule" in (tmp_path / "smallcnn_dlgs-paper.hlo.txt").read_text()[:200]
  assert "trace" not in rows["topk"] and "smallcnn dlgs-paper step 0" in capsys.readouterr().out


@pytest.mark.parametrize("flags, message", [
    (["--density", "0", "--out-dir", "x"], "--density 0.0 is invalid"),
    (["--reuse-every", "1", "--out-dir", "x"], "--reuse-every 1 / --rounds 5 is invalid"),
    ([], "give --out-dir (to measure) or --read"),
])
def test_gpu_profile_refuses_bad_flags_before_any_work(flags, message, capsys):
  profile = load("gpu_profile")
  with pytest.raises(SystemExit):
    profile.parse_args(flags)
  assert message in capsys.readouterr().err


def test_gpu_profile_read_names_a_folder_without_traces(tmp_path, capsys):
  assert load("gpu_profile").main(["--read", str(tmp_path)]) == 1
  assert f"no *.xplane.pb in {tmp_path}" in capsys.readouterr().out


def test_gpu_profile_read_without_xprof_says_how_to_get_it(tmp_path, capsys, monkeypatch):
  profile = load("gpu_profile")
  (tmp_path / "m_dlgs.xplane.pb").write_bytes(b"")
  monkeypatch.setattr(profile.importlib.util, "find_spec", lambda name: None)
  assert profile.main(["--read", str(tmp_path)]) == 1
  assert "--read needs the xprof package to parse traces: pip install xprof" in \
      capsys.readouterr().out
