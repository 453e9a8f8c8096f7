import dataclasses
import math

import numpy as np
import pytest

from dlgs_jax.compress import wire
from dlgs_jax.planning.timeline import LinearCost, MethodCosts, Profile, simulate


def make_profile(t_b=(1.0, 2.0, 3.0), sizes=(100, 200, 300), workers=4, **kw):
  defaults = dict(
      model="toy", paths=[f"l{i}" for i in range(len(sizes))], sizes=sizes, t_forward=5.0,
      t_backward=t_b, workers=workers,
      sparsify={"dlgs": LinearCost(0.5, 0.0)},
      comm={"allgather": LinearCost(1.0, 0.0), "allreduce": LinearCost(2.0, 0.0),
            "gtopk": LinearCost(1.0, 0.0)})
  defaults.update(kw)
  return Profile(**defaults)


def test_simulate_follows_the_paper_equations_by_hand():
  # t_f=5; layer0: back 5..6, sparsify 6..6.5, comm 6.5..7.5;
  # layer1: back 6.5..8.5, sparsify ..9, comm 9..10; layer2: back 9..12, sp ..12.5, comm ..13.5
  tl = simulate(make_profile(), [[0], [1], [2]], MethodCosts("dlgs", 0.1))
  assert tl.backward_start == [5.0, 6.5, 9.0]
  assert tl.comm_start == [6.5, 9.0, 12.5]
  assert tl.t_iter == pytest.approx(13.5)
  assert tl.compute == 11.0 and tl.sparsify == 1.5
  assert tl.comm_exposed == pytest.approx(1.0)


def test_merged_layers_skip_sparsify_and_comm():
  # Eq. 6: layers 0 and 1 merged: backward 5..8, one sparsify 8..8.5, comm 8.5..9.5;
  # layer2: back 8.5..11.5, sparsify ..12, comm 12..13.
  tl = simulate(make_profile(), [[0, 1], [2]], MethodCosts("dlgs", 0.1))
  assert tl.backward_start == [5.0, 6.0, 8.5]
  assert tl.t_iter == pytest.approx(13.0)
  assert tl.sparsify_time == [0.5, 0.5]


def test_comm_waits_for_previous_message():
  profile = make_profile(t_b=(0.1, 0.1, 0.1), comm={"allgather": LinearCost(4.0, 0.0)})
  tl = simulate(profile, [[0], [1], [2]], MethodCosts("dlgs", 0.1))
  assert np.all(np.diff(tl.comm_start) == pytest.approx(4.0))
  assert tl.t_iter == pytest.approx(tl.comm_start[0] + 12.0)


def test_comm_bytes_follow_wire_model():
  profile = make_profile(sizes=(1000, 10, 10), workers=8)
  assert MethodCosts("dense", 1.0).comm_bytes(profile, 1000) == wire.allreduce_bytes(1000, 8)
  assert MethodCosts("dlgs", 0.01).comm_bytes(profile, 1000) == wire.allgather_bytes(10, 8)
  assert MethodCosts("gtopk", 0.01).comm_bytes(profile, 1000) == wire.gtopk_bytes(10, 8)[0]
  one = make_profile(workers=1)
  assert MethodCosts("dense", 1.0).comm_time(one, 10) == 0.0
  # A method that takes a collective is priced by the one it is given.
  owners = MethodCosts("dlgs", 0.01, collective="owners")
  assert owners.comm_bytes(profile, 1000) == wire.owners_bytes(10, 10, 8)
  assert MethodCosts("topk", 0.01, collective="owners").kind == "owners"
  assert (MethodCosts("lags", 0.01, collective="gtopk").comm_bytes(profile, 1000)
          == wire.gtopk_bytes(10, 8)[0])
  # The owners' bytes stay flat as P grows; the all-gather's do not.
  many = [make_profile(sizes=(100_000, 10, 10), workers=p) for p in (16, 256)]
  flat = [owners.comm_bytes(prof, 100_000) for prof in many]
  assert max(flat) / min(flat) < 1.1


@pytest.mark.parametrize("kwargs,match", [
    ({"paths": [], "sizes": [], "t_b": []}, "no layers"),
    ({"t_b": (1.0, -2.0, 3.0)}, "-2.0"),
    ({"t_b": (1.0, math.nan, 3.0)}, "nan"),
    ({"t_b": (1.0, 2.0)}, "lengths"),
    ({"sizes": (100, 0, 300)}, "size 0"),
    ({"t_forward": math.inf}, "inf"),
    ({"workers": 0}, "workers"),
    ({"dlgs_exact_fraction": 2.0}, "2.0"),
])
def test_bad_profiles_raise(kwargs, match):
  if "t_b" in kwargs:
    t_b = kwargs.pop("t_b")
    if "paths" in kwargs:
      with pytest.raises(ValueError, match=match):
        Profile(model="m", t_backward=t_b, t_forward=1.0, workers=2, sparsify={}, comm={},
                **kwargs)
      return
    kwargs["t_b"] = t_b
  with pytest.raises(ValueError, match=match):
    make_profile(**kwargs)


def test_linear_cost_rejects_negative_and_nonfinite():
  with pytest.raises(ValueError, match="-1"):
    LinearCost(-1.0, 0.0)
  with pytest.raises(ValueError, match="nan"):
    LinearCost(0.0, math.nan)


def test_profile_json_round_trip(tmp_path):
  profile = make_profile()
  profile.save(tmp_path / "p.json")
  assert Profile.load(tmp_path / "p.json") == profile
  with pytest.raises(ValueError, match="not a valid profile"):
    Profile.from_dict({"model": "x"})


def test_bad_groups_raise():
  with pytest.raises(ValueError, match="contiguous"):
    simulate(make_profile(), [[0, 2], [1]], MethodCosts("dlgs", 0.1))
  with pytest.raises(ValueError, match="contiguous"):
    simulate(make_profile(), [[0, 1]], MethodCosts("dlgs", 0.1))


def test_without_overlap_the_iteration_is_the_sum_of_everything():
  profile = Profile(model="m", paths=["a", "b", "c"], sizes=[1000, 10, 5000], t_forward=0.01,
                    t_backward=[0.02, 0.001, 0.03], workers=4,
                    sparsify={"dlgs": LinearCost(1e-3, 1e-8)},
                    comm={"allgather": LinearCost(2e-3, 1e-7), "allreduce": LinearCost(3e-3, 0.0)},
                    overlap=False)
  costs = MethodCosts("dlgs", 0.1)
  groups = [[0], [1, 2]]
  tl = simulate(profile, groups, costs)
  total = (0.01 + 0.051 + sum(costs.sparsify_time(profile, s) for s in (1000, 5010))
           + sum(costs.comm_time(profile, s) for s in (1000, 5010)))
  assert tl.t_iter == pytest.approx(total)
  overlapped = simulate(dataclasses.replace(profile, overlap=True), groups, costs)
  assert overlapped.t_iter < tl.t_iter
  # two fixed small all-reduces per iteration cost their latency
  fixed = simulate(profile, groups, MethodCosts("dlgs", 0.1, fixed_collectives=2))
  assert fixed.t_iter == pytest.approx(total + 2 * 3e-3)
  assert Profile.from_dict(profile.to_dict()).overlap is False


def test_dlgs_exact_fraction_interpolates_the_measured_step_kinds():
  exact, reuse = LinearCost(1e-3, 2e-8), LinearCost(1e-4, 1e-9)
  profile = make_profile(sparsify={"dlgs": LinearCost(0.5, 0.0), "dlgs_exact": exact,
                                   "dlgs_reuse": reuse})
  for f in (0.0, 0.1, 0.64, 1.0):
    costs = MethodCosts("dlgs", 0.1, exact_fraction=f)
    assert costs.sparsify_time(profile, 5000) == pytest.approx(
        f * exact(5000) + (1 - f) * reuse(5000))
  # None: the profile's cost amortised over the fixed schedule.
  assert MethodCosts("dlgs", 0.1).sparsify_time(profile, 5000) == 0.5
  old = make_profile()  # no dlgs_exact / dlgs_reuse
  with pytest.raises(ValueError, match="dlgs_exact"):
    MethodCosts("dlgs", 0.1, exact_fraction=0.5).sparsify_time(old, 100)
  profile = make_profile(dlgs_exact_fraction=0.64)
  assert Profile.from_dict(profile.to_dict()).dlgs_exact_fraction == 0.64


def test_dgc_sends_buffers_per_leaf_and_small_leaves_in_one_allreduce():
  # Layers 0 and 2 are "1-D": one fused all-reduce at the end; layer 1 sparse.
  sizes = (100, 20000, 50)
  profile = make_profile(sizes=sizes, workers=4, overlap=False,
                         sparsify={"dgc": LinearCost(1e-3, 1e-7), "dense": LinearCost(2e-4, 0.0)},
                         comm={"allgather": LinearCost(1e-3, 1e-8),
                               "allreduce": LinearCost(2e-3, 1e-8)})
  costs = MethodCosts("dgc", 0.01, whole_layers={0, 2})
  tl = simulate(profile, [[0], [1], [2]], costs)
  pairs = math.ceil(1.3 * 200)
  sparse = 1e-3 + 1e-8 * wire.allgather_bytes(pairs, 4)
  fused = 2e-3 + 1e-8 * wire.allreduce_bytes(150, 4)
  assert costs.comm_bytes(profile, 20000) == wire.allgather_bytes(pairs, 4)
  assert tl.comm_time == [0.0, pytest.approx(sparse), 0.0, pytest.approx(fused)]
  assert tl.sparsify_time == [0.0, pytest.approx(1e-3 + 1e-7 * 20000), 0.0, 2e-4]
  assert tl.t_iter == pytest.approx(5.0 + 6.0 + sum(tl.sparsify_time) + sparse + fused)
  with pytest.raises(ValueError, match="only, not 'topk'"):
    MethodCosts("topk", 0.01, whole_layers={0})


@pytest.mark.parametrize("method", ["lags", "dlgs"])
def test_layerwise_whole_layers_ride_in_their_groups_message(method):
  # Layer 0 (the head) whole: group [0, 1] carries 100 values + k(200) = 2 pairs.
  profile = make_profile(sizes=(100, 200, 300), workers=4, overlap=False,
                         sparsify={method: LinearCost(1.0, 1e-3)},
                         comm={"allgather": LinearCost(2.0, 1e-4)})
  costs = MethodCosts(method, 0.01, whole_layers={0})
  tl = simulate(profile, [[0, 1], [2]], costs)
  assert costs.comm_bytes(profile, 200, 100) == wire.allgather_bytes(102, 4)
  assert costs.comm_bytes(profile, 0, 100) == wire.allgather_bytes(100, 4)
  assert tl.comm_time == pytest.approx([2.0 + 1e-4 * 3 * 8 * 102, 2.0 + 1e-4 * 3 * 8 * 3])
  # The update passes over the whole layer too.
  assert tl.sparsify_time == pytest.approx([1.3, 1.3])
  assert len(tl.comm_start) == 2  # no extra message, unlike DGC
  assert tl.t_iter == pytest.approx(5.0 + 6.0 + sum(tl.sparsify_time) + sum(tl.comm_time))
  with pytest.raises(ValueError, match="no whole layers"):
    MethodCosts("topk", 0.01).comm_bytes(profile, 200, 100)


def test_terngrad_sends_two_bits_per_value_and_pays_its_scaler_allreduce():
  profile = make_profile(sizes=(1000, 2001, 10), workers=4, overlap=False,
                         sparsify={"terngrad": LinearCost(1e-4, 0.0)},
                         comm={"allgather": LinearCost(1e-3, 1e-8),
                               "allreduce": LinearCost(2e-3, 0.0)})
  costs = MethodCosts("terngrad", 1.0, fixed_collectives=2)
  assert costs.comm_bytes(profile, 2001) == 3 * 501  # ceil(2001 / 4) bytes to P-1 workers
  tl = simulate(profile, [[0], [1], [2]], costs)
  comm = sum(1e-3 + 1e-8 * 3 * math.ceil(n / 4) for n in (1000, 2001, 10))
  assert tl.t_iter == pytest.approx(11.0 + 3e-4 + comm + 3 * 2e-3)  # 2 fixed + the scalers' max


@pytest.mark.parametrize("kwargs,match", [
    ({"method": "sgd"}, "sgd"),
    ({"density": 0.0}, "0.0"),
    ({"exact_fraction": 1.5}, "1.5"),
    ({"method": "lags", "exact_fraction": 0.5}, "dlgs only"),
    ({"method": "dense", "collective": "owners"}, "collective applies to"),
    ({"method": "topk", "collective": "gtopk"}, "not topk: for a global top-k of the sum, run gtopk"),
    ({"method": "dlgs", "collective": "ring"}, "'ring'"),
])
def test_bad_method_costs_raise(kwargs, match):
  args = {"method": "dlgs", "density": 0.1, **kwargs}
  with pytest.raises(ValueError, match=match):
    MethodCosts(**args)


def test_layers_below_ndim_follow_the_profile_order():
  from dlgs_jax.planning.timeline import layers_below_ndim
  profile = make_profile()
  shapes = {"l0": (3, 3, 4, 8), "l1": (8,), "l2": (8, 10)}
  assert layers_below_ndim(profile, shapes, 2) == {1}
  with pytest.raises(ValueError, match="l2"):
    layers_below_ndim(profile, {"l0": (1, 1), "l1": (1,)}, 2)
