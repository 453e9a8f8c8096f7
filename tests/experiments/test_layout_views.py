"""The two views' timing, on a small tree of three leaves."""

import jax
import jax.numpy as jnp

from dlgs_jax.compress import segmented
from tests.experiments.test_experiments import load


def test_both_views_and_the_choice_are_timed_for_each_rule_and_step():
  views = load("layout_views")
  grads = {"a": jax.random.normal(jax.random.key(0), (64, 40)), "b": jnp.ones((7,)),
           "c": jax.random.normal(jax.random.key(1), (300, 13))}
  rows = views.measure_tree("tiny", grads, rounds=1)
  assert [(r["rule"], r["step"]) for r in rows] == [
      ("paper", "reuse"), ("paper", "exact"), ("default", "reuse"), ("default", "exact")]
  for r in rows:
    assert r["values"] == 64 * 40 + 7 + 300 * 13
    assert min(r["laid_out_ms"], r["leaf_by_leaf_ms"], r["chosen_ms"]) > 0
    assert r["laid_over_leaf"] > 0 and r["chosen_over_best"] > 0
    assert min(r["laid_out_compile_s"], r["leaf_by_leaf_compile_s"], r["chosen_compile_s"]) > 0
  assert segmented.lay_out_by_default(rows[0]["values"])  # this tree is laid out on CPU
  table = views.table(rows).splitlines()
  assert len(table) == 2 + 4 and table[2].startswith("| tiny | 6,467 | paper | reuse |")
