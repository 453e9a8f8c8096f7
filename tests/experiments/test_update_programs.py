"""The compiled-update census, on SmallCNN's leaf shapes."""

from tests.experiments.test_experiments import load


def test_dlgs_has_one_conditional_and_no_sort():
  census = load("update_programs")
  rows = {r["method"]: r for r in census.measure(
      "smallcnn", only=["dense", "dlgs-paper"])}
  assert set(rows) == {"dense", "dlgs-paper, one group", "dlgs-paper, buckets",
                       "dlgs-paper-message, buckets"}
  dlgs = rows["dlgs-paper, buckets"]
  # One conditional for the whole update: the thresholds of the next step.
  for row in (dlgs, rows["dlgs-paper-message, buckets"]):
    assert row["conditionals"] == 1 and row["sorts"] == 0 and row["top_k"] == 0, row
  assert rows["dense"]["conditionals"] == 0
  # Passes over the model's values: dense reads the gradient and writes the mean
  # (and lays them out); DLGS adds the residual's read and write at least.
  assert rows["dense"]["passes"] >= 2
  assert dlgs["passes"] >= rows["dense"]["passes"] + 2
  table = census.table(list(rows.values()))
  assert f"| {dlgs['kernels']} | {dlgs['kernels'] - rows['dense']['kernels']} |" in table
