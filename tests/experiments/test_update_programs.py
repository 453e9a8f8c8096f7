"""The compiled-update census, on SmallCNN's leaf shapes."""

from tests.experiments.test_experiments import load


def test_dlgs_has_one_conditional_and_no_sort():
  census = load("update_programs")
  rows = {r["method"]: r for r in census.measure(
      "smallcnn", only=["dense", "dlgs paper, buckets"])}
  assert set(rows) == {"dense", "dlgs paper, buckets"}
  dlgs = rows["dlgs paper, buckets"]
  # One conditional for the whole update: the thresholds of the next step.
  assert dlgs["conditionals"] == 1 and dlgs["sorts"] == 0 and dlgs["top_k"] == 0, dlgs
  assert rows["dense"]["conditionals"] == 0
  table = census.table(list(rows.values()))
  assert f"| {dlgs['kernels']} | {dlgs['kernels'] - rows['dense']['kernels']} |" in table
