import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from dlgs_jax.workload import parallel
from dlgs_jax.compress import wire
from dlgs_jax.compress import ternary as tg
from tests.helpers import random_grads, run_steps

PARAMS = {"w": jnp.zeros((6, 7)), "b": jnp.zeros((5,))}
W = 8


@pytest.mark.parametrize("size", [1, 4, 5, 33, 1000])
def test_pack_unpack_round_trip(size):
  rng = np.random.default_rng(size)
  values = rng.integers(-1, 2, size).astype(np.int8)
  packed = jax.jit(tg.pack_ternary)(values)
  assert packed.dtype == jnp.uint8 and packed.shape == (wire.ternary_bytes(size),)
  np.testing.assert_array_equal(jax.jit(tg.unpack_ternary, static_argnums=1)(packed, size), values)


def test_values_are_ternary_times_the_scaler_and_clipped():
  tx = tg.terngrad(clip=None, seed=3)
  g = {"w": jnp.asarray(np.random.default_rng(0).standard_normal((6, 7)), jnp.float32),
       "b": jnp.asarray([0.5, -2.0, 0.0, 1.0, 0.25], jnp.float32)}
  update, _ = jax.jit(tx.update)(g, tx.init(PARAMS))
  for name in g:
    s = float(jnp.max(jnp.abs(g[name])))
    values = set(np.unique(np.asarray(update[name])).tolist())
    assert values <= {-s, 0.0, s}, (name, values)
    # signs agree with the gradient wherever a value was kept
    kept = np.asarray(update[name]) != 0
    assert np.all(np.sign(np.asarray(update[name]))[kept] == np.sign(np.asarray(g[name]))[kept])
  assert float(update["b"][2]) == 0.0  # a zero is never sent as +-s
  # With clipping at 2.5 std an outlier no longer sets the scaler.
  outlier = {"w": jnp.zeros((6, 7)).at[0, 0].set(100.0).at[1].set(1.0), "b": g["b"]}
  clipped, _ = jax.jit(tg.terngrad(clip=2.5).update)(outlier, tg.terngrad().init(PARAMS))
  bound = 2.5 * float(jnp.std(outlier["w"]))
  magnitudes = np.unique(np.abs(np.asarray(clipped["w"])))
  assert magnitudes[0] == 0.0 and len(magnitudes) == 2
  assert magnitudes[1] == pytest.approx(bound, rel=1e-5) and bound < 100 / 2


def test_unbiased_over_many_draws():
  tx = tg.terngrad(clip=None, seed=0)
  rng = np.random.default_rng(1)
  g = {"w": jnp.asarray(rng.standard_normal((6, 7)), jnp.float32),
       "b": jnp.asarray(rng.standard_normal(5), jnp.float32)}
  draws = 4000

  @jax.jit
  def mean_update(state):
    def body(carry, _):
      total, state = carry
      update, state = tx.update(g, state)
      return (jax.tree_util.tree_map(jnp.add, total, update), state), None
    zeros = jax.tree_util.tree_map(jnp.zeros_like, g)
    (total, _), _ = jax.lax.scan(body, (zeros, state), None, length=draws)
    return jax.tree_util.tree_map(lambda t: t / draws, total)

  mean = mean_update(tx.init(PARAMS))
  for name in g:
    x = np.asarray(g[name], np.float64)
    s = np.abs(x).max()
    std_of_mean = np.sqrt(np.maximum(s * np.abs(x) - x ** 2, 0) / draws)
    # 5 standard deviations per element, plus the rounding of a float32 sum of 4000 draws
    assert np.all(np.abs(np.asarray(mean[name]) - x) <= 5 * std_of_mean + 1e-3), name


def test_workers_share_the_scaler_and_draw_independently():
  rng = np.random.default_rng(2)
  grads = random_grads(PARAMS, W, rng)
  same = {k: np.broadcast_to(v[:1], v.shape).copy() for k, v in grads.items()}
  tx = tg.terngrad(axis_name="data", clip=None)
  updates, state, states = run_steps(tx, PARAMS, [grads, same, same], W)
  for name in PARAMS:
    s = np.abs(grads[name]).max()  # max over workers too
    levels = updates[0][name][0] * W / s
    np.testing.assert_allclose(levels, np.round(levels), atol=1e-4)  # sum of ternaries
    assert np.abs(levels).max() <= W + 1e-4
    for w in range(1, W):
      np.testing.assert_array_equal(updates[0][name][w], updates[0][name][0])
  # Identical gradients on every worker still give different draws per worker
  # (the mean is not a multiple of s) and per step.
  w_levels = updates[1]["w"][0] * W / np.abs(same["w"]).max()
  assert np.any(np.abs(w_levels - np.sign(w_levels) * W) > 0.5)
  assert not np.array_equal(updates[1]["w"], updates[2]["w"])
  assert np.all(states[-1].count == 3)


def test_bytes_on_the_wire_are_one_sixteenth_of_float32_plus_scalers():
  params = {"a": jnp.zeros((64, 8)), "b": jnp.zeros((16,))}
  tx = tg.terngrad(axis_name="data", groups=[["b", "a"]])
  grads = random_grads(params, W, np.random.default_rng(3))
  _, state, _ = run_steps(tx, params, [grads], W)
  n = 64 * 8 + 16
  packed = wire.ternary_bytes(n)
  assert packed * 16 == n * 4  # 2 bits instead of 32 per value
  scalers = wire.allreduce_bytes(2, W)
  assert state.stats.bytes_sent[0] == pytest.approx((W - 1) * packed + scalers)
  # The collective really carries uint8[n / 4]: inspect the jaxpr.
  mesh = parallel.data_mesh(W)
  fn = jax.shard_map(lambda g, s: tx.update(parallel.squeeze(g), parallel.squeeze(s))[0],
                     mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P(),
                     check_vma=False)
  jaxpr = str(jax.make_jaxpr(fn)(grads, jax.tree_util.tree_map(np.asarray, state)))
  assert "all_gather" in jaxpr and f"u8[{packed}]" in jaxpr


def test_nonfinite_gradient_skips_and_bad_clip():
  grads = random_grads(PARAMS, W, np.random.default_rng(4))
  grads["w"][3, 0, 0] = np.nan
  updates, state, _ = run_steps(tg.terngrad(axis_name="data"), PARAMS, [grads], W)
  assert np.all(updates[0]["w"] == 0) and np.all(state.stats.skipped == 1)
  assert np.all(state.count == 0)
  with pytest.raises(ValueError, match="clip"):
    tg.terngrad(clip=-1.0)
