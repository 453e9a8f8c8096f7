"""Timing an update over one period of its schedule, and where measurements are written."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dlgs_jax
from dlgs_jax.profiling import periods, records


@pytest.mark.slow
def test_a_period_is_timed_from_a_warmed_state_on_fresh_gradients():
  params = {"w": jax.ShapeDtypeStruct((64, 64), jnp.float32),
            "b": jax.ShapeDtypeStruct((64,), jnp.float32)}
  period = periods.step_gradients(params, 4)
  assert len(period) == 4
  assert not np.array_equal(np.asarray(period[0]["w"]), np.asarray(period[1]["w"]))
  for rule in (dlgs_jax.FixedReuse(4), dlgs_jax.AdaptedReuse(4)):
    tx = dlgs_jax.dlgs(0.1, thresholds=rule, budget="layer")  # exact counts per leaf
    run, exact = periods.schedule_period(tx, period, warm_periods=2)
    # The same state and gradients by hand: two periods, then the timed one.
    state, update = tx.init(period[0]), None
    for grads in period * 3:
      update, state = tx.update(grads, state)
    np.testing.assert_allclose(np.asarray(run()["w"]), np.asarray(update["w"]), rtol=1e-6)
    if isinstance(rule, dlgs_jax.FixedReuse):
      assert exact == 2 / 4  # both leaves exact on the period's first step only
    else:
      # b (k = 7) is exact on every step, w at least on the schedule's step.
      assert 1 + 1 / 4 <= exact <= 2


def test_the_compiled_update_is_the_transforms_and_its_program_is_counted():
  params = {"w": jnp.ones((32, 32)), "b": jnp.ones((32,))}
  tx = dlgs_jax.topk(0.1)
  grads = periods.step_gradients(params, 1)[0]
  update, counts, hlo = periods.compiled_update(tx, grads)
  got, _ = update(grads, tx.init(grads), params)
  want, _ = jax.jit(tx.update)(grads, tx.init(grads))
  np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(want["w"]))
  assert counts["kernels"] > 0 and "ENTRY" in hlo


def test_the_checked_updates_come_most_important_first_one_of_each():
  params = {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32)}
  listed = periods.checked_updates(0.1, 4, params)
  assert [(m, g) for m, g, _ in listed][:3] == [("dense", "-"), ("topk", "-"), ("gtopk", "-")]
  assert len({(m, g) for m, g, _ in listed}) == len(listed) == 11


def test_a_result_is_written_whole_and_names_its_machine(tmp_path):
  out = tmp_path / "deep" / "r.json"
  records.write_json(out, {"machine": records.machine(), "rows": [1]})
  saved = json.loads(out.read_text())
  assert saved["rows"] == [1] and saved["machine"]["backend"] == jax.default_backend()
  assert not list(out.parent.glob("*.tmp"))


def test_a_result_names_the_allocator_settings_it_ran_under(tmp_path, monkeypatch):
  # On CPU an update's time is mostly first touches of fresh pages: the
  # record names the huge page mode and glibc's settings from the environment.
  monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
  monkeypatch.setenv("MALLOC_MMAP_MAX_", "0")
  found = records.machine()
  assert found["allocator_env"] == {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1",
                                    "MALLOC_MMAP_MAX_": "0"}
  assert found["cores"] >= 1
  modes = tmp_path / "enabled"
  modes.write_text("always [madvise] never\n")
  assert records.huge_page_mode(str(modes)) == "madvise"
  modes.write_text("[always] madvise never\n")
  assert records.huge_page_mode(str(modes)) == "always"
  assert records.huge_page_mode(str(tmp_path / "missing")) is None
  assert found["transparent_hugepages"] == records.huge_page_mode()
