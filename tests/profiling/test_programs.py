"""Counting what a compiled program is made of: conditionals, sorts, top-k calls, loops, kernels."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import dlgs_jax
from dlgs_jax.profiling import programs

X = jnp.linspace(-1.0, 1.0, 4096)


def test_each_construct_is_counted_where_it_is():
  def fn(x, p):
    sorted_or_doubled = lax.cond(p, lambda: jnp.sort(x), lambda: x * 2)
    top = lax.top_k(x, 64)[0]
    looped = lax.fori_loop(0, 3, lambda i, y: y * 1.5 + i, x)
    return sorted_or_doubled.sum() + top.sum() + looped.sum()

  counts = programs.program_counts(fn, X, True)
  assert counts["conditionals"] == 1
  assert counts["sorts"] == 1  # inside a branch: found there
  assert counts["top_k"] == 1
  assert counts["loops"] == 1
  assert counts["kernels"] >= 3


def test_a_conditional_returning_a_long_tuple_is_counted():
  # XLA writes /*index=5*/ into a type of six or more elements: the "=" inside must
  # not hide the instruction's opcode.
  def fn(x, p):
    parts = lax.cond(p, lambda: tuple(jnp.sort(x * i) for i in range(7)),
                     lambda: tuple(x + i for i in range(7)))
    return sum(part.sum() for part in parts)

  text = jax.jit(fn).lower(X, True).compile().as_text()
  assert "/*index=5*/" in text
  assert programs.count_hlo(text)["conditionals"] == 1


def test_a_plain_program_has_no_conditionals_sorts_or_loops():
  counts = programs.program_counts(lambda x: jnp.exp(x).sum() * 2, X)
  assert counts == {"conditionals": 0, "sorts": 0, "top_k": 0, "loops": 0,
                    "kernels": counts["kernels"]}
  assert counts["kernels"] >= 1


@pytest.mark.slow
def test_dlgs_has_one_conditional_for_any_groups_and_lags_no_top_k():
  """What bench_sparsify reports for the transforms today (one worker, no collectives)."""
  def params(leaves):
    return {f"w{i}": jnp.ones((64, 64)) for i in range(leaves)}

  counts, bucketed = {}, {}
  for leaves in (2, 4):
    per_leaf = dlgs_jax.dlgs(0.01, groups=[[f"w{i}"] for i in range(leaves)])
    counts[leaves] = programs.program_counts(per_leaf.update, params(leaves),
                                             per_leaf.init(params(leaves)))
    default = dlgs_jax.dlgs(0.01)  # one bucket
    bucketed[leaves] = programs.program_counts(default.update, params(leaves),
                                               default.init(params(leaves)))
  # The next thresholds of every group are settled in one conditional.
  assert counts[4]["conditionals"] == counts[2]["conditionals"] == 1
  assert bucketed[4]["conditionals"] == bucketed[2]["conditionals"] == 1
  assert counts[4]["kernels"] > bucketed[4]["kernels"]  # each group its own passes
  # LAGS's top-k per leaf is an exact threshold and a compaction: no sort, no top-k call.
  lags = programs.program_counts(dlgs_jax.lags(0.01).update, params(4),
                                 dlgs_jax.lags(0.01).init(params(4)))
  assert lags["top_k"] == lags["sorts"] == 0, lags


N = 1 << 18


def passes(fn, *args, **jit_args) -> float:
  """`memory_passes` of the compiled `fn` over N float32 values."""
  return programs.memory_passes(jax.jit(fn, **jit_args).lower(*args).compile().as_text(), N)


def test_memory_traffic_counts_reads_and_writes_of_each_kernel():
  x, y = jnp.ones(N), jnp.ones(N)
  assert passes(lambda a, b: a + b, x, y) == 3.0           # two reads, one write
  assert passes(lambda a, b: jnp.concatenate([a, b]), x, y) == 4.0
  assert passes(lambda a: a[:N // 2] * 2, x) == 1.0         # half read, half written
  assert passes(lambda a: a.sum(), x) == pytest.approx(1.0, abs=1e-5)


def test_memory_traffic_counts_what_a_scatter_or_gather_touches():
  x, at = jnp.ones(N), jnp.arange(64)
  # In place into a donated buffer: the 64 values and their indices, not the buffer.
  assert passes(lambda a, i: a.at[i].set(0.0), x, at, donate_argnums=0) < 1e-2
  # Into zeros: the zeros written once.
  assert passes(lambda i: jnp.zeros(N).at[i].add(1.0), at) == pytest.approx(1.0, abs=1e-2)
  assert passes(lambda a, i: a[i], x, at) < 1e-2


def test_traffic_by_kernel_itemizes_the_total():
  hlo = jax.jit(lambda a, b: (jnp.concatenate([a, b]) * 2).sum()).lower(
      jnp.ones(N), jnp.ones(N)).compile().as_text()
  items = programs.traffic_by_kernel(hlo)
  assert sum(moved for _, _, moved in items) == programs.memory_traffic(hlo)
  assert all(op not in ("parameter", "constant", "tuple") for _, op, _ in items)


def test_a_dlgs_reuse_step_sums_residual_and_gradient_inside_the_passes_that_read_them():
  """No buffer holds g = residual + gradient, and none chooses the old residual over the new.

  The paper's rule over 16 leaves in one group: laying out 2, selecting with the
  non-finite flag 2 (the residual and the gradient read once), the residual's write 3,
  the mean's buffer and its cut 3. Writing g out and selecting between the residuals
  made 14.2; a copy of the donated residual would add 2.
  """
  params = {f"w{i:02d}": jnp.ones((N // 16,)) for i in range(16)}
  tx = dlgs_jax.dlgs(0.01, thresholds=dlgs_jax.FixedReuse(10), budget="layer",
                     groups=[list(params)])
  hlo = jax.jit(tx.update, donate_argnums=1).lower(params, tx.init(params)).compile().as_text()
  assert programs.memory_passes(hlo, N) < 11.5
  assert not [name for name, op, moved in programs.traffic_by_kernel(hlo)
              if op == "copy" and moved >= 4 * N], "the donated residual was copied"
