"""The tables shared by the README, the docs and the report are their JSONs, rendered."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments"))

import render  # noqa: E402  pylint: disable=g-import-not-at-top
import tables_accuracy  # noqa: E402  pylint: disable=g-import-not-at-top
import tables_cluster  # noqa: E402  pylint: disable=g-import-not-at-top
import tables_common  # noqa: E402  pylint: disable=g-import-not-at-top


def test_every_rendered_table_matches_its_json(capsys):
  assert render.main(["--check"]) == 0, capsys.readouterr().err


def test_every_table_is_rendered_somewhere():
  used = {name for path in render.FILES
          for _, name, _, _ in render.BLOCK.findall((ROOT / path).read_text())}
  assert used == set(render.TABLES)


def test_a_number_edited_by_hand_is_found_and_rendered_back():
  text = (ROOT / "README.md").read_text()
  block = render.BLOCK.search(text)
  rendered = render.TABLES[block.group(2)]()
  # The first row's first speedup (a method not run in that job shows "-").
  cell = next(c for c in rendered.split("\n")[2].split(" | ")[2:] if c.endswith("x"))
  edited = text.replace(cell, "9.99x", 1)
  assert edited != text
  again, changed = render.render(edited, "README.md")
  assert changed == [block.group(2)]
  assert again == text


def test_the_cluster_cells_come_from_the_summary_of_the_run():
  main, _ = tables_cluster.cluster_runs("vgg16", "100mbit")
  # The per-layer DLGS of a job that ran it as "dlgs", named as it is now.
  speedup = next(row["speedup"] for row in main["summary"] if row["method"] == "dlgs-layer")
  row = next(line for line in tables_cluster.speedups().split("\n")
             if line.startswith("| VGG16 | 100 Mbit/s"))
  column = [name for _, name in tables_cluster.SPARSE].index("DLGS per layer")
  assert f"{speedup:.2f}x" == row.split(" | ")[2 + column].strip("*")


def test_the_topk_pair_counts_each_dlgs_rules_rounds_against_topk_and_tests_the_split(
    monkeypatch):
  """Wins come from the job's matrix in the DLGS-over-Top-k direction; p is the sign test's."""
  run = {"summary": [{"method": m, "median": t, "speedup": 0.3 / t}
                     for m, t in (("dense", 0.3), ("topk", 0.2), ("dlgs", 0.19),
                                  ("dlgs-paper", 0.21))],
         "round_orders": [None] * 10, "methods": {"dlgs": {"budget": "message"}},
         "wins": {"topk": {"dlgs": 1, "dlgs-paper": 8}, "dlgs": {"topk": 9},
                  "dlgs-paper": {"topk": 2}}}
  monkeypatch.setattr(tables_cluster, "load", lambda path: run)
  rows = tables_cluster.topk_pair().split("\n")[2:]
  assert rows[1] == "| Top-k | 200.0 ms | 1.50x |  |  |"
  # 9 of 10: p = 2 (1 + 10) / 2^10 = 0.021; 2 of 10: 2 (1 + 10 + 45) / 2^10 = 0.11.
  assert rows[2] == "| DLGS, default | 190.0 ms | 1.58x | 9 of 10 | 0.02 |"
  assert rows[3] == "| DLGS, paper's rule | 210.0 ms | 1.43x | 2 of 10 | 0.1 |"


def test_a_block_naming_no_table_is_refused_in_one_line():
  with pytest.raises(ValueError, match=r"'<!-- table: nope -->' names no table; choose one of"):
    render.render("<!-- table: nope -->\n| x |\n<!-- end table -->\n", "page.md")


def test_the_owners_gap_names_the_code_of_each_run_when_they_differ(monkeypatch):
  def summary(acc):
    return {"final_test_accuracy": acc, "bytes_sent_per_step": 6.0e5}

  def table(owners_code, dlgs_code):
    rows = [{"method": "dlgs-owners", "density": 0.1, "seed": 0, "summary": summary(0.89)},
            {"method": "dlgs-layer", "density": 0.1, "seed": 0, "summary": summary(0.894)}]
    for row, code in zip(rows, (owners_code, dlgs_code)):
      if code:
        row["code"] = code
    return {"results": rows}

  def rendered(owners_code, dlgs_code):
    def load(path):
      return ({"runs": []} if path.name == "demo_accuracy.json"
              else table(owners_code, dlgs_code))
    monkeypatch.setattr(tables_accuracy, "load", load)
    return tables_accuracy.owners_accuracy().split("\n")[-1]

  same = rendered(["abc1234"], ["abc1234"])
  assert "paired gap -0.40 points) | 89.00%" in same and "trained at" not in same
  mixed = rendered(None, ["abc1234"])
  assert ("paired gap -0.40 points; dlgs-layer trained at abc1234, dlgs-owners at a commit before "
          "runs recorded theirs)") in mixed


def test_a_cluster_job_names_its_per_layer_dlgs_by_the_budget_it_recorded():
  def job(budget):
    record = {} if budget is None else {"budget": budget}
    return {"methods": {"dlgs": {"median": 1.0, **record}, "topk": {"median": 2.0}},
            "summary": [{"method": "dlgs"}, {"method": "topk"}],
            "wins": {"dlgs": {"topk": 3}, "topk": {"dlgs": 1}}}

  for budget in (None, "layer"):  # jobs before budgets were recorded ran a threshold per layer
    named = tables_common.budget_named(job(budget))
    assert set(named["methods"]) == {"dlgs-layer", "topk"}
    assert [row["method"] for row in named["summary"]] == ["dlgs-layer", "topk"]
    assert named["wins"] == {"dlgs-layer": {"topk": 3}, "topk": {"dlgs-layer": 1}}
  assert tables_common.budget_named(job("message")) == job("message")
