"""Choosing the exchange: the α-β costs and the bytes the timeline model prices with."""

import pytest

from dlgs_jax.compress import selection, wire
from dlgs_jax.planning import choice
from dlgs_jax.planning.network import network_comm

VGG16 = 14_728_266


def test_each_exchange_is_its_collectives_cost_of_its_bytes():
  comm = network_comm(64, 10e9, 25e-6)
  k = selection.num_to_keep(0.01, VGG16)
  seconds = choice.exchange_seconds(VGG16, 0.01, 64, comm)
  assert list(seconds) == list(choice.CHOICES)
  assert seconds["allgather"] == comm["allgather"](wire.allgather_bytes(k, 64))
  assert seconds["owners"] == comm["owners"](wire.owners_bytes(k, k, 64))
  assert seconds["dense-bf16"] == comm["allreduce"](wire.allreduce_bytes(VGG16, 64, 2))
  # The owners' latency: an all-to-all, an all-gather and an all-reduce.
  assert comm["owners"].alpha == pytest.approx(4 * 63 * 25e-6)


def test_the_fastest_is_chosen_and_the_crossovers_fall_where_the_bytes_say():
  at = lambda p, bits, latency=25e-6: choice.choose(  # noqa: E731
      VGG16, 0.01, p, network_comm(p, bits, latency))
  # Many workers: the all-gather's (P-1)·8k bytes lose to the owners' flat ones...
  assert at(64, 10e9) == at(256, 10e9, 0.0) == "owners"
  # ...until their 4(P-1) latency steps cost more than gTop-k's log2 P rounds save.
  assert at(256, 10e9) == "gtopk"
  # Past a sixth of the values, 2 bytes a value beat the owners' ~24 bytes a selected one.
  assert choice.choose(VGG16, 0.3, 64, network_comm(64, 10e9)) == "dense-bf16"
  # Two workers, negligible latency: the all-gather sends the fewest bytes.
  assert choice.choose(VGG16, 0.01, 2, network_comm(2, 10e9, 0.0)) == "allgather"


def test_only_the_exchanges_a_profile_prices_are_compared():
  comm = network_comm(16, 1e9)
  measured = {kind: comm[kind] for kind in ("allgather", "allreduce")}
  assert set(choice.exchange_seconds(VGG16, 0.01, 16, measured)) == {"allgather", "dense-bf16"}
  with pytest.raises(ValueError, match="no exchange is priced: the costs hold none"):
    choice.choose(VGG16, 0.01, 16, {})


def test_the_crossover_table_bolds_each_rows_fastest():
  table = choice.crossover_table(VGG16, 0.01, (4, 256), (10e9,))
  lines = table.splitlines()
  assert lines[0] == "| link | P | allgather | gtopk | owners | dense-bf16 |"
  assert len(lines) == 4 and all(line.count("**") == 2 for line in lines[2:])
