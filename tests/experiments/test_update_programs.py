"""The compiled-update census, on SmallCNN's leaf shapes."""

from tests.experiments.test_experiments import load


def test_laid_out_dlgs_has_one_conditional_no_sort_and_fewer_kernels():
  census = load("update_programs")
  rows = {r["method"]: r for r in census.measure(
      "smallcnn", only=["dense", "dlgs paper, one group"])}
  assert set(rows) == {"dense", "dlgs paper, one group, laid out",
                       "dlgs paper, one group, leaf by leaf"}
  laid = rows["dlgs paper, one group, laid out"]
  leafwise = rows["dlgs paper, one group, leaf by leaf"]
  # Laid out, the exact step's select needs no fallback: its one conditional is the schedule's.
  assert laid["conditionals"] == 1 and laid["sorts"] == 0 and laid["top_k"] == 0, laid
  assert leafwise["sorts"] == 0 and leafwise["top_k"] == 0, leafwise
  assert laid["kernels"] < leafwise["kernels"], (laid, leafwise)
  assert rows["dense"]["conditionals"] == 0
  table = census.table(list(rows.values()))
  assert f"| {laid['kernels']} | {laid['kernels'] - rows['dense']['kernels']} |" in table
