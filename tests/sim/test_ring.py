import json
import math

import numpy as np
import pytest

from dlgs_jax.sim import ring

T, T_TRANS = 3e-6, 5e-6 + 8192 * 8 / 100e9  # the seed's study: 3 us, 5 us + 8 KB at 100 Gb/s


@pytest.mark.parametrize("nodes", [2, 3, 4, 8])
def test_plain_ring_takes_p_minus_one_steps(nodes):
  result = ring.simulate_reduce_scatter(nodes, T, T_TRANS)
  expected = (nodes - 1) * (T + T_TRANS)
  assert result.total == pytest.approx(expected, rel=1e-12)
  np.testing.assert_allclose(result.chunk_done, expected, rtol=1e-12)
  assert len(result.ops) == nodes * (nodes - 1) and result.skips == 0
  # every chunk is reduced once by every node except its origin
  for chunk in range(nodes):
    assert sorted(n for n, c, _, _ in result.ops if c == chunk) == sorted(
        set(range(nodes)) - {chunk})


def test_a_slow_operation_delays_the_plain_ring_by_delta():
  slow = ring.simulate_reduce_scatter(4, T, T_TRANS, 7e-6)
  assert slow.total == pytest.approx(3 * (T + T_TRANS) + 7e-6, rel=1e-12)


def off_boundary(delta, alpha):
  """Grid points away from the regime boundaries (where float rounding picks a side)."""
  return min(abs(T + delta - alpha * T), abs(T + delta - alpha * T - T_TRANS)) > 1e-9


@pytest.mark.parametrize("alpha", [1.2, 1.5, 2.0, 2.5, 3.0])
def test_saved_time_matches_the_closed_forms(alpha):
  """Four nodes, the seed's case: exactly eqs. (1)-(2)."""
  deltas = [float(d) for d in np.linspace(0, 40e-6, 81) if off_boundary(float(d), alpha)]
  for delta in deltas:
    base, strategy = ring.late_chunk_saving(4, T, T_TRANS, delta, alpha)
    want = ring.saved_time_closed_form(T, T_TRANS, delta, alpha)
    assert base - strategy == pytest.approx(want, abs=1e-12), (delta, alpha)
  # all three regimes are visited on this grid
  kinds = {(ring.saved_time_closed_form(T, T_TRANS, d, alpha) == T + T_TRANS,
            ring.saved_time_closed_form(T, T_TRANS, d, alpha) == 0.0) for d in deltas}
  assert kinds == {(True, False), (False, True), (False, False)}


@pytest.mark.parametrize("alpha", [1.2, 2.0])
def test_longer_rings_save_at_least_the_closed_form(alpha):
  # With more nodes after the slow one, the next ones may also give up waiting
  # (each saves another T), so the closed form is a lower bound there.
  for nodes in (5, 6, 8):
    for delta in np.linspace(0, 40e-6, 41):
      if not off_boundary(float(delta), alpha):
        continue
      base, strategy = ring.late_chunk_saving(nodes, T, T_TRANS, float(delta), alpha)
      assert base - strategy >= ring.saved_time_closed_form(T, T_TRANS, float(delta), alpha) - 1e-12


def test_closed_form_regimes():
  alpha = 1.5
  assert ring.saved_time_closed_form(T, T_TRANS, 1e-6, alpha) == 0.0  # T + dT <= alpha T
  mid = 4e-6  # alpha T < T + dT <= alpha T + T_trans
  assert ring.saved_time_closed_form(T, T_TRANS, mid, alpha) == pytest.approx(
      mid + (2 - alpha) * T)
  assert ring.saved_time_closed_form(T, T_TRANS, 30e-6, alpha) == pytest.approx(T + T_TRANS)


@pytest.mark.parametrize("slow_ops", ["first", "all"])
def test_strategy_never_slower_than_the_ring(slow_ops):
  for nodes in (4, 5, 8):
    for alpha in (1.2, 2.0, 3.0):
      for delta in np.linspace(0, 40e-6, 17):
        base = ring.simulate_reduce_scatter(nodes, T, T_TRANS, float(delta), slow_ops=slow_ops)
        strat = ring.simulate_reduce_scatter(nodes, T, T_TRANS, float(delta), alpha=alpha,
                                             slow_ops=slow_ops)
        assert strat.total <= base.total + 1e-15
        if strat.skips == 0:  # nobody gave up waiting: exactly the plain ring
          assert strat.total == base.total


def test_a_persistently_slow_node_gains_nothing_overall():
  # The late chunk still gains the closed form, but the slow node's own chain of
  # P-1 slow operations sets the reduce-scatter time.
  delta, alpha = 20e-6, 1.5
  base = ring.simulate_reduce_scatter(4, T, T_TRANS, delta, slow_ops="all")
  strat = ring.simulate_reduce_scatter(4, T, T_TRANS, delta, alpha=alpha, slow_ops="all")
  assert base.chunk_done[0] - strat.chunk_done[0] == pytest.approx(T + T_TRANS)
  assert strat.total == pytest.approx(base.total)
  assert base.total == pytest.approx(T_TRANS + 3 * (T + delta), rel=1e-12)


@pytest.mark.parametrize("kwargs,match", [
    (dict(nodes=1), "nodes"), (dict(alpha=1.0), "alpha"), (dict(delta=-1.0), "delta"),
    (dict(slow_node=4), "slow_node"), (dict(slow_ops="some"), "slow_ops"),
    (dict(T=math.nan), "T ")])
def test_bad_arguments(kwargs, match):
  args = dict(nodes=4, T=T, T_trans=T_TRANS)
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    ring.simulate_reduce_scatter(**args)


def test_cli_reproduces_the_study(tmp_path, capsys):
  assert ring.main(["--points", "21", "--alphas", "1.2,2", "--out-dir", str(tmp_path)]) == 0
  out = capsys.readouterr().out
  assert "T_trans = 5.655 us" in out and "largest saving:" in out
  data = json.loads((tmp_path / "ring_study.json").read_text())
  assert len(data["rows"]) == 42 and data["best"]["saving"] > 0.1
  for row in data["rows"]:
    if off_boundary(row["delta"], row["alpha"]):
      assert row["late_chunk_saved"] == pytest.approx(row["closed_form"], abs=1e-12)
  for name in ("ring_time_vs_delta.png", "ring_saving.png"):
    assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
