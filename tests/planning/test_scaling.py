import json

import pytest

from dlgs_jax.planning import planner
from dlgs_jax.planning import network
from dlgs_jax.planning import scaling
from dlgs_jax.compress import selection
from dlgs_jax.compress import wire
from dlgs_jax.planning.timeline import LinearCost, MethodCosts, Profile, simulate
from tests.experiments.test_experiments import load


def predict_scaling(capsys, *args) -> str:
  """`experiments/predict_scaling.py` run with `args` in this process; what it printed."""
  assert load("predict_scaling").main(list(args)) == 0
  return capsys.readouterr().out


def small_profile():
  sizes = [10, 5000, 64, 200_000, 16, 1_000_000]
  return Profile(
      model="toy", paths=[f"l{i}" for i in range(6)], sizes=sizes, t_forward=2e-3,
      t_backward=[1e-4, 5e-4, 1e-4, 2e-3, 1e-4, 4e-3], workers=1,
      sparsify={m: LinearCost(5e-5, 1e-10) for m in ("dlgs", "lags", "topk", "gtopk")},
      comm={}, source="hand-made")


def by_key(predictions):
  return {(p.bandwidth_bits, p.workers, p.method): p for p in predictions}


def test_predictions_follow_the_timeline_model_and_the_wire_formulas():
  profile = small_profile()
  preds = by_key(scaling.predict(profile, workers=[2, 8, 13], bandwidths=[1e9, 25e9],
                                 density=0.01, latency=1e-5))
  assert len(preds) == 2 * 3 * 5
  for bits in (1e9, 25e9):
    for p in (2, 8, 13):
      net = profile.with_comm(network.network_comm(p, bits, 1e-5), p, "test")
      dense = simulate(net, planner.optimal(net, MethodCosts("dense", 1.0)),
                       MethodCosts("dense", 1.0)).t_iter
      assert preds[bits, p, "dense"].t_iter == pytest.approx(dense)
      assert preds[bits, p, "dense"].speedup_vs_dense == pytest.approx(1.0)
      # lags sends every layer alone, topk/gtopk everything at once.
      assert preds[bits, p, "lags"].groups == 6
      assert preds[bits, p, "topk"].groups == preds[bits, p, "gtopk"].groups == 1
      k_total = selection.num_to_keep(0.01, sum(profile.sizes))
      assert preds[bits, p, "topk"].bytes_sent == wire.allgather_bytes(k_total, p)
      assert preds[bits, p, "gtopk"].bytes_sent == wire.gtopk_bytes(k_total, p)[0]
      assert preds[bits, p, "lags"].bytes_sent == sum(
          wire.allgather_bytes(selection.num_to_keep(0.01, s), p) for s in profile.sizes)
      assert preds[bits, p, "dense"].bytes_sent == pytest.approx(
          wire.allreduce_bytes(sum(profile.sizes), p))
      for method in ("dense", "topk", "lags", "gtopk", "dlgs"):
        pred = preds[bits, p, method]
        assert pred.speedup_vs_dense == pytest.approx(dense / pred.t_iter)
        assert pred.t_iter >= pred.compute + pred.sparsify - 1e-12
        assert pred.compute == pytest.approx(2e-3 + sum(profile.t_backward))
      # DLGS is planned optimally over the same costs LAGS-style grouping would use.
      dlgs_wfbp = simulate(net, planner.wfbp(net, MethodCosts("dlgs", 0.01)),
                           MethodCosts("dlgs", 0.01)).t_iter
      assert preds[bits, p, "dlgs"].t_iter <= dlgs_wfbp + 1e-15


def test_faster_links_never_slow_anything_down_and_dense_grows_with_p():
  preds = by_key(scaling.predict(small_profile(), workers=[2, 4, 16, 64],
                                 bandwidths=[1e9, 10e9, 25e9], density=0.1))
  for p in (2, 4, 16, 64):
    for method in ("dense", "topk", "lags", "gtopk", "dlgs"):
      times = [preds[b, p, method].t_iter for b in (1e9, 10e9, 25e9)]
      assert times[0] >= times[1] >= times[2], (p, method, times)
  dense = [preds[1e9, p, "dense"].t_iter for p in (2, 4, 16, 64)]
  assert dense == sorted(dense)
  # All-gather bytes grow linearly in P, gTop-k's only with log P.
  assert (preds[1e9, 64, "topk"].bytes_sent / preds[1e9, 2, "topk"].bytes_sent
          == pytest.approx(63.0))
  assert preds[1e9, 64, "gtopk"].bytes_sent / preds[1e9, 2, "gtopk"].bytes_sent < 10


@pytest.mark.parametrize("kwargs,match", [
    (dict(workers=[1]), "worker counts"),
    (dict(workers=[4], methods=["dgc9"]), "dgc9"),
    (dict(workers=[4], density=0.0), "density"),
    (dict(workers=[4], bandwidths=[-1.0]), "bandwidth"),
])
def test_bad_input(kwargs, match):
  args = dict(workers=[4], bandwidths=[1e9], density=0.01)
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    scaling.predict(small_profile(), **args)


def test_cli_writes_table_json_and_plot(tmp_path, capsys):
  profile_path = tmp_path / "toy.json"
  small_profile().save(profile_path)
  stdout = predict_scaling(capsys, "--profiles", str(profile_path), "--workers", "2,4",
                           "--bandwidths", "1gbit,10gbit", "--out-dir", str(tmp_path / "out"))
  assert "Measured (per worker)" in stdout and "Predicted" in stdout
  assert "| toy | 1 Gb/s | 4 |" in stdout
  data = json.loads((tmp_path / "out" / "scaling_density0.01.json").read_text())
  assert data["command"] == (f"python experiments/predict_scaling.py --profiles {profile_path} "
                             f"--workers 2,4 --bandwidths 1gbit,10gbit --out-dir "
                             f"{tmp_path / 'out'}")
  assert len(data["predictions"]) == 2 * 2 * len(scaling.PREDICTABLE)
  assert data["measured"]["toy"]["source"] == "hand-made"
  png = (tmp_path / "out" / "scaling_density0.01.png").read_bytes()
  assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_two_level_costs_price_a_slice_between_nodes_and_the_whole_inside():
  fast = LinearCost(1e-6, 1e-11)
  costs = MethodCosts("dlgs", 0.01, fast_size=4, fast_link=fast)
  net = small_profile().with_comm(network.network_comm(3, 1e9, 1e-5), 3, "nodes")
  size = 1_000_001
  part = -(-size // 4)
  assert costs.comm_bytes(net, size) == wire.allgather_bytes(
      selection.num_to_keep(0.01, part), 3)
  slow = net.comm["allgather"](costs.comm_bytes(net, size))
  assert costs.comm_time(net, size) == pytest.approx(slow + fast(wire.allreduce_bytes(size, 4)))
  assert costs.sparsify_time(net, size) == net.sparsify["dlgs"](part)
  with pytest.raises(ValueError, match="needs its fast_link"):
    MethodCosts("dlgs", 0.01, fast_size=4)


def test_node_predictions_compare_flat_and_two_level_exchanges():
  profile = small_profile()
  n_values = sum(profile.sizes)
  preds = {(p.workers, p.method): p for p in scaling.predict_nodes(
      profile, nodes=[2, 4], local=4, bandwidths=[10e9], fast_bandwidth=300e9, density=0.01)}
  assert {m for _, m in preds} == {label for label, *_ in scaling.NODE_CONFIGS}
  for nodes in (2, 4):
    p = nodes * 4
    assert preds[p, "dense flat"].bytes_sent == pytest.approx(wire.allreduce_bytes(n_values, p))
    assert preds[p, "dense flat"].speedup_vs_dense == 1.0
    # The slices of every group add up to about 1/L of the values (each group rounds up).
    two = preds[p, "dense two-level"].bytes_sent
    assert wire.allreduce_bytes(n_values / 4, nodes) <= two
    assert two <= wire.allreduce_bytes(n_values / 4 + 6, nodes)
    assert preds[p, "dense two-level bf16"].bytes_sent == pytest.approx(two / 2, rel=1e-3)
    # Each node sends one sparse message, not L: about L times fewer bytes between nodes.
    assert preds[p, "dlgs two-level"].bytes_sent < preds[p, "dlgs flat"].bytes_sent / 3
  with pytest.raises(ValueError, match="local .devices per node. must be an integer >= 2"):
    scaling.predict_nodes(profile, nodes=[2], local=1, bandwidths=[1e9], fast_bandwidth=1e9,
                          density=0.01)


def test_node_cli_writes_table_json_and_plot(tmp_path, capsys):
  profile_path = tmp_path / "toy.json"
  small_profile().save(profile_path)
  stdout = predict_scaling(capsys, "--profiles", str(profile_path), "--nodes", "2,4",
                           "--local", "4", "--bandwidths", "10gbit", "--out-dir",
                           str(tmp_path / "out"))
  assert "Measured (per GPU)" in stdout and "| toy | 10 Gb/s | 4 x 4 |" in stdout
  data = json.loads((tmp_path / "out" / "nodes_local4_density0.01.json").read_text())
  assert len(data["predictions"]) == 2 * len(scaling.NODE_CONFIGS)
  assert data["measured"]["toy"]["source"] == "hand-made"
  assert (tmp_path / "out" / "nodes_local4_density0.01.png").read_bytes()[:4] == b"\x89PNG"


def test_profiles_load_with_what_each_measured(tmp_path):
  small_profile().save(tmp_path / "toy.json")
  profiles, measured = scaling.load_profiles([tmp_path / "toy.json"])
  assert [p.model for p in profiles] == ["toy"]
  assert measured["toy"]["t_backward"] == pytest.approx(sum(small_profile().t_backward))
  lines = scaling.measured_lines(measured, "GPU", ", fitted")
  assert lines[0] == "Measured (per GPU):"
  assert lines[1] == "  toy: forward 2.00 ms, backward 6.80 ms, fitted; hand-made"


def test_the_owners_variant_is_priced_as_dlgs_with_flat_bytes():
  profile = small_profile()
  rows = by_key(scaling.predict(profile, workers=[16, 64], bandwidths=[1e9], density=0.01,
                                methods=["dlgs", "dlgs-owners"]))
  owners = [rows[(1e9, p, "dlgs-owners")].bytes_sent for p in (16, 64)]
  allgather = [rows[(1e9, p, "dlgs")].bytes_sent for p in (16, 64)]
  assert max(owners) / min(owners) < 1.1 and allgather[1] / allgather[0] == pytest.approx(63 / 15, rel=1e-2)
  # Its update is priced as DLGS's (the owners' own work is not in a profile).
  owners_costs = scaling.method_costs("dlgs-owners", 0.01)
  assert owners_costs.kind == "owners" and owners_costs.method == "dlgs"
  assert (owners_costs.sparsify_time(profile, 5000)
          == MethodCosts("dlgs", 0.01).sparsify_time(profile, 5000))
  with pytest.raises(ValueError, match="unknown method 'dlgs-head'"):
    scaling.predict(profile, workers=[4], bandwidths=[1e9], density=0.01, methods=["dlgs-head"])
