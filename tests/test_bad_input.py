"""Bad input across the public API and the command lines: each refused in one line.

Every row is a bad input and the words its message must contain (the value
and the fix). The Python rows run in this process; a subprocess is started
only where the process itself could die (a multi-process start whose peer
never comes). Below the table: the inputs that are not refused but must give
the right result (float16 past its range, ``overflow=inf``, gTop-k under vmap
over any worker count, a module in eval mode).
"""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
import warnings

import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import dlgs_jax
from dlgs_jax.cli import launch as launch_cli
from dlgs_jax.cli import train as train_cli
from dlgs_jax.compress import rules
from dlgs_jax.compress.state import leaf_residuals
from tests import helpers

PARAMS = {"w": jnp.zeros((8, 4)), "b": jnp.zeros((4,))}


class MLP(nnx.Module):
  def __init__(self, rngs, dropout_rngs=None):
    self.hidden = nnx.Linear(4, 8, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=dropout_rngs)
    self.out = nnx.Linear(8, 3, rngs=rngs)

  def __call__(self, x, rngs=None):
    return self.out(self.drop(nnx.relu(self.hidden(x)), rngs=rngs))


def _xent(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _loss(model, batch):
  return _xent(model(batch[0], rngs=nnx.Rngs(0)), batch[1])


BATCH = (np.ones((8, 4), np.float32), np.zeros((8,), np.int32))
TX = optax.chain(dlgs_jax.dlgs(0.5, axis_name="data"), optax.sgd(0.1))


def _step(loss_fn, model=None, tx=TX, batch=BATCH, place=True, **kwargs):
  """Builds data_parallel over all devices, inits it with `model` and takes one step.

  `place`: put the batch on the workers first (jax.device_put refuses, in its own
  words, a batch that does not split; `step` refuses it too, in ours).
  """
  dp = dlgs_jax.data_parallel(loss_fn, tx, dlgs_jax.data_mesh(), **kwargs)
  state = dp.init(MLP(nnx.Rngs(0)) if model is None else model)
  dp.step(state, jax.device_put(batch, dp.batch_sharding) if place else batch)


_CLOSED_RNGS = nnx.Rngs(5)


def _update(tx, state=None, grads=PARAMS, axis=None):
  """`tx`'s update on one worker (under vmap over a 1-long `axis`, where given)."""
  state = tx.init(PARAMS) if state is None else state
  if axis is None:
    return tx.update(grads, state)
  add = lambda t: jax.tree_util.tree_map(lambda x: x[None], t)  # noqa: E731
  return jax.vmap(tx.update, axis_name=axis)(add(grads), add(state))


# (id, a call that must raise ValueError, words its message must contain)
API_CASES = [
    ("density-zero", lambda: dlgs_jax.dlgs(0.0), ["density", "(0, 1]"]),
    ("density-string", lambda: dlgs_jax.topk("0.1"), ["density", "'0.1'"]),
    ("density-array", lambda: dlgs_jax.lags(jnp.asarray(0.1)), ["Python number", "static_args"]),
    ("capacity-inf", lambda: dlgs_jax.dlgs(0.1, capacity_factor=math.inf),
     ["capacity_factor", "finite", "inf"]),
    ("capacity-below-one", lambda: dlgs_jax.dlgs(0.1, capacity_factor=0.5),
     ["capacity_factor", ">= 1", "0.5"]),
    ("residual-dtype-name", lambda: dlgs_jax.dlgs(0.1, residual_dtype="fp32"),
     ["residual_dtype", "'fp32'", "float32"]),
    ("residual-dtype-int", lambda: dlgs_jax.topk(0.1, residual_dtype="int32"),
     ["residual_dtype", "floating"]),
    ("wire-dtype", lambda: dlgs_jax.dlgs(0.1, wire_dtype="float16"), ["wire_dtype", "float16"]),
    ("wire-bf16-gtopk", lambda: dlgs_jax.dlgs(0.1, wire_dtype="bfloat16", collective="gtopk"),
     ["bfloat16", "all-gather"]),
    ("dense-wire-dtype", lambda: dlgs_jax.dense(wire_dtype="int8"), ["wire_dtype", "int8"]),
    ("collective", lambda: dlgs_jax.dlgs(0.1, collective="ring"), ["collective", "'ring'"]),
    ("rule-string", lambda: dlgs_jax.dlgs(0.1, thresholds="fixed"),
     ["thresholds='fixed'", "FixedReuse()"]),
    ("rule-every", lambda: dlgs_jax.FixedReuse(every=0), ["every=0", ">= 1"]),
    ("rule-below", lambda: dlgs_jax.RefreshReuse(below=2.0), ["below=2.0", "[0, 1]"]),
    ("rule-overflow", lambda: dlgs_jax.AdaptedReuse(overflow=0.5), ["overflow=0.5", ">= 1"]),
    ("rule-overflow-nan", lambda: dlgs_jax.AdaptedReuse(overflow=math.nan), ["overflow=nan"]),
    ("rule-candidates", lambda: dlgs_jax.AdaptedReuse(candidates=1),
     ["candidates=1", "[2, 16]", "RefreshReuse"]),
    ("axis-name-number", lambda: dlgs_jax.dlgs(0.1, axis_name=3), ["axis_name", "3"]),
    ("send-whole-string", lambda: dlgs_jax.dlgs(0.1, send_whole="head", budget="layer"),
     ["send_whole='head'", "['head']"]),
    ("groups-string", lambda: dlgs_jax.lags(0.1, groups="w"), ["groups", "list of lists"]),
    ("two-level-transform", lambda: dlgs_jax.two_level(
        dlgs_jax.dlgs(0.1), fast_axis="local", slow_axis="node", fast_size=2),
     ["two_level's make", "built GradientTransformation", "lambda axis"]),
    ("two-level-returns", lambda: dlgs_jax.two_level(
        lambda axis: None, fast_axis="local", slow_axis="node", fast_size=2),
     ["must return an optax.GradientTransformation", "NoneType"]),
    ("schedule-transform", lambda: dlgs_jax.density_schedule(dlgs_jax.dlgs(0.1), {0: 0.1}),
     ["density_schedule's factory", "lambda d"]),
    ("schedule-no-step-0", lambda: dlgs_jax.density_schedule(dlgs_jax.dlgs, {5: 0.1}),
     ["step 0"]),
    ("update-other-state", lambda: _update(dlgs_jax.dlgs(0.1), dlgs_jax.lags(0.1).init(PARAMS)),
     ["dlgs's update", "SparseState", "DLGSState", "its own init"]),
    ("update-chain-state", lambda: _update(
        dlgs_jax.topk(0.1), optax.chain(dlgs_jax.topk(0.1), optax.sgd(1.0)).init(PARAMS)),
     ["topk's update", "tuple", "optax chain's state"]),
    ("update-dense-state", lambda: _update(dlgs_jax.dense(), dlgs_jax.topk(0.1).init(PARAMS)),
     ["dense's update", "SparseState"]),
    ("update-wrong-tree", lambda: _update(dlgs_jax.dlgs(0.1), grads={"w": jnp.zeros((8, 4))}),
     ["do not match the optimizer state", "'b'"]),
    ("update-unmapped", lambda: _update(dlgs_jax.dlgs(0.1, axis_name="data")),
     ["outside any mapped axis", "axis_name=None"]),
    ("update-forgotten-axis", lambda: _update(dlgs_jax.dlgs(0.1), axis="data"),
     ["never communicate", "axis_name='data'"]),
    ("update-other-axis", lambda: _update(dlgs_jax.dlgs(0.1, axis_name="batch"), axis="data"),
     ["'batch' is not an axis", "axis_name='data'"]),
    ("dp-axis", lambda: dlgs_jax.data_parallel(_loss, TX, dlgs_jax.data_mesh(), axis_name="x"),
     ["'x' is not an axis of the mesh"]),
    ("dp-simulate", lambda: dlgs_jax.data_parallel(_loss, TX, dlgs_jax.data_mesh(2),
                                                   simulate_workers=4),
     ["simulate_workers=4 runs every worker on one device", "data_mesh(1)"]),
    ("dp-micro-batches", lambda: dlgs_jax.data_parallel(_loss, TX, dlgs_jax.data_mesh(),
                                                        micro_batches=0),
     ["micro_batches", "0"]),
    ("dp-loss", lambda: dlgs_jax.data_parallel("loss", TX, dlgs_jax.data_mesh()),
     ["loss_fn must be callable"]),
    ("dp-loss-signature", lambda: dlgs_jax.data_parallel(lambda m: 0.0, TX, dlgs_jax.data_mesh()),
     ["must take (params, batch)"]),
    ("dp-seed", lambda: dlgs_jax.data_parallel(_loss, TX, dlgs_jax.data_mesh(), seed="0"),
     ["seed must be an integer"]),
    ("dp-init-class", lambda: _step(_loss, model=MLP), ["the class MLP", "MLP(nnx.Rngs(0))"]),
    ("dp-init-linen-module", lambda: _step(_loss, model=linen.Dense(4)),
     ["Linen module Dense", "variables['params']"]),
    ("dp-init-rng-stream", lambda: _step(_loss, model=MLP(nnx.Rngs(0), nnx.Rngs(1))),
     ["PRNG stream", "seed=0", "rngs=nnx.Rngs(dropout=key)"]),
    ("dp-aux-logits", lambda: _step(
        lambda m, b: (_loss(m, b), {"logits": m(b[0], rngs=nnx.Rngs(0))}),
        has_aux=True),
     ["metric 'logits'", "(1, 3)", "dp.module(state)"]),
    ("dp-aux-not-dict", lambda: _step(
        lambda m, b: (_loss(m, b), jnp.zeros((3,))), has_aux=True),
     ["dict of scalars", "an array of shape (3,)"]),
    ("dp-closed-rngs", lambda: _step(
        lambda m, b: _xent(m(b[0], rngs=_CLOSED_RNGS), b[1])),
     ["nnx.Rngs it closes over", "seed=0", "key"]),
    ("dp-masked", lambda: _step(_loss, tx=optax.chain(
        optax.masked(dlgs_jax.dlgs(0.5, axis_name="data"),
                     lambda p: jax.tree_util.tree_map(lambda x: x.ndim > 1, p)),
        optax.sgd(0.1))),
     ["does not see this leaf", "optax.masked", "dlgs_jax.dense(axis_name='data')"]),
    ("dp-adam-first", lambda: _step(_loss, tx=optax.chain(
        optax.adam(1e-3), dlgs_jax.dlgs(0.5, axis_name="data"))),
     ["differs between workers", "put one first"]),
    ("dp-batch-split", lambda: _step(_loss, batch=(np.ones((6, 4), np.float32),
                                                   np.zeros((6,), np.int32)), place=False),
     ["(6, 4)", "does not split over the 8 workers"]),
    ("dp-loss-not-scalar", lambda: _step(
        lambda m, b: optax.softmax_cross_entropy_with_integer_labels(
            m(b[0], rngs=nnx.Rngs(0)), b[1])),
     ["scalar loss", "(1,)"]),
    ("dp-linen-variables", lambda: dlgs_jax.data_parallel(
        lambda p, b: 0.0, TX, dlgs_jax.data_mesh()).init(
            {"params": {"w": jnp.zeros(2)}, "batch_stats": {"m": jnp.zeros(2)}}),
     ["batch_stats", "model_state=True"]),
]


@pytest.mark.parametrize("call,words", [c[1:] for c in API_CASES], ids=[c[0] for c in API_CASES])
def test_api_refuses_in_one_line(call, words):
  with pytest.raises(ValueError) as error:
    call()
  message = str(error.value)
  assert "\n" not in message, message
  for word in words:
    assert word in message, (word, message)


def _refused_in_one_line(argv, words) -> None:
  """dlgs-train's flags `argv` end in one line holding every one of `words`."""
  with pytest.raises(SystemExit) as error:
    train_cli.config_from_args(argv)
  message = str(error.value.code)
  assert message.startswith("dlgs-train: ") and "\n" not in message, message
  for word in words:
    assert word in message, (word, message)


def _config_file(tmp_path, content: str) -> str:
  path = tmp_path / "config.json"
  path.write_text(content)
  return str(path)


# (id, dlgs-train flags; "{tmp}" is a fresh directory, "{file}" a file in it, words)
CLI_CASES = [
    ("topk-collective", "--method topk --collective gtopk", ["--collective", "not topk"]),
    ("lags-reuse-every", "--method lags --reuse-every 5", ["--reuse-every 5", "not lags"]),
    ("topk-refresh-below", "--method topk --refresh-below 0.3", ["--refresh-below", "not topk"]),
    ("lags-candidates", "--method lags --candidates 3", ["--candidates 3", "not lags"]),
    ("dlgs-dgc-warmup", "--method dlgs --dgc-warmup-epochs 2", ["--dgc-warmup-epochs",
                                                               "applies to dgc"]),
    ("dlgs-terngrad-clip", "--method dlgs --terngrad-clip 1", ["--terngrad-clip",
                                                              "applies to terngrad"]),
    ("bandwidth-no-planner", "--bandwidth 1gbit", ["--bandwidth '1gbit'", "--planner"]),
    ("profile-no-planner", "--profile {file}", ["--profile", "--planner"]),
    ("latency-no-planner", "--latency 0.001", ["--latency 0.001", "--planner"]),
    ("latency-no-bandwidth", "--planner optimal --latency 0.001", ["--latency", "--bandwidth"]),
    ("unknown-method", "--method sgd", ["--method 'sgd'", "dlgs"]),
    ("density-zero", "--density 0", ["--density 0.0", "(0, 1]"]),
    ("density-text", "--density high", ["--density 'high'", "float"]),
    ("epochs-zero", "--epochs 0", ["--epochs 0", "[1,"]),
    ("init-timeout-zero", "--init-timeout 0", ["--init-timeout 0", "[1,"]),
    ("refresh-below", "--refresh-below 2", ["--refresh-below '2'", "[0, 1]"]),
    ("lr", "--lr -1", ["--lr -1.0", "positive"]),
    ("momentum", "--momentum 1.5", ["--momentum 1.5", "[0, 1)"]),
    ("lr-decay", "--lr-decay-epochs a,b", ["--lr-decay-epochs 'a,b'", "comma-separated"]),
    ("flat-and-node-size", "--flat --node-size 2", ["--node-size 2", "--flat"]),
    ("plan-and-planner", "--plan {file} --planner optimal", ["--plan", "not both"]),
    ("plan-missing", "--plan {tmp}/none.json", ["--plan", "no such file"]),
    ("topk-planner", "--method topk --planner optimal", ["planning applies", "not topk"]),
    ("topk-send-whole", "--method topk --send-whole head", ["--send-whole 'head'", "not topk"]),
    ("wire-dtype", "--method dlgs --wire-dtype float16", ["--wire-dtype 'float16'",
                                                          "bfloat16"]),
    ("data-dir-file", "--data-dir {file}", ["--data-dir", "is a file, not a directory"]),
    ("config-missing", "--config {tmp}/none.json", ["--config", "no such file"]),
    ("config-not-json", "--config {file}", ["--config", "not JSON"]),
]
CONFIG_CASES = [
    ("config-string-for-list", '{"method": {"send_whole": "head"}}',
     ["method.send_whole 'head'", "list of strings", '["head"]']),
    ("config-section-string", '{"method": "dlgs"}',
     ["method 'dlgs'", "object of options", '{"method": {"name"']),
    ("config-quoted-number", '{"method": {"density": "0.1"}}',
     ["method.density '0.1'", "a number"]),
    ("config-typo", '{"method": {"densty": 0.1}}', ["densty", "did you mean 'density'"]),
    ("config-unknown-section", '{"model_name": "vgg16"}', ["model_name", "unknown section"]),
    ("config-unused-option", '{"method": {"name": "topk", "collective": "gtopk"}}',
     ["collective", "not topk"]),
    ("config-not-object", "[1, 2]", ["object of sections"]),
]


@pytest.mark.parametrize("flags,words", [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_train_flags_refused_in_one_line(flags, words, tmp_path):
  file = tmp_path / "file.txt"
  file.write_text("not a plan")
  argv = flags.format(tmp=tmp_path, file=file).split() + ["--workdir", str(tmp_path / "run")]
  _refused_in_one_line(argv, words)


@pytest.mark.parametrize("content,words", [c[1:] for c in CONFIG_CASES],
                         ids=[c[0] for c in CONFIG_CASES])
def test_config_files_refused_in_one_line(content, words, tmp_path):
  _refused_in_one_line(["--config", _config_file(tmp_path, content)], words)


def test_config_file_of_the_right_types_is_read(tmp_path):
  path = _config_file(tmp_path, json.dumps({
      "method": {"name": "dlgs", "send_whole": ["head"], "refresh_below": None, "budget": "layer"},
      "schedule": {"lr_decay_epochs": [1, 2.5]}}))
  config = train_cli.config_from_args(["--config", path])
  assert config.method.send_whole == ("head",) and config.method.refresh_below is None
  assert config.schedule.lr_decay_epochs == (1, 2.5)


LAUNCH_CASES = [
    ("child-num-processes", "--nproc 2 -- --num-processes 3",
     ["--num-processes 3", "launcher sets", "--nproc 2"]),
    ("child-process-id", "--nproc 2 -- --steps 3 --process-id=1", ["--process-id 1"]),
    ("child-coordinator", "--nproc 2 -- --coordinator h:1", ["--coordinator h:1"]),
    ("nproc-zero", "--nproc 0", ["--nproc must be >= 1"]),
    ("port", "--nproc 2 --port 70000", ["--port", "[0, 65536)"]),
]


@pytest.mark.parametrize("args,words", [c[1:] for c in LAUNCH_CASES],
                         ids=[c[0] for c in LAUNCH_CASES])
def test_launch_refuses_in_one_line(args, words, capsys):
  with pytest.raises(SystemExit) as error:
    launch_cli.parse_args(args.split())
  assert error.value.code == 2
  message = capsys.readouterr().err.strip().splitlines()[-1]
  assert message.startswith("dlgs-launch: error: "), message
  for word in words:
    assert word in message, (word, message)


def test_train_without_its_extra_refuses_before_building(monkeypatch):
  monkeypatch.setattr(train_cli, "TRAIN_EXTRA", ("tqdm", "dlgs_jax_absent_module.sub"))
  with pytest.raises(SystemExit) as error:
    train_cli.check_train_extra()
  assert str(error.value.code) == ("dlgs-train: needs the 'train' extra (missing "
                                   "dlgs_jax_absent_module.sub): pip install 'dlgs_jax[train]'")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_missing_process_ends_in_one_line_not_an_abort(tmp_path):
  """The one row whose failure was a C++ abort: it runs in a child process."""
  port = _free_port()
  result = subprocess.run(
      [sys.executable, "-m", "dlgs_jax.cli.train", "--num-processes", "2", "--coordinator",
       f"127.0.0.1:{port}", "--process-id", "0", "--init-timeout", "3", "--steps", "1",
       "--workdir", str(tmp_path / "run")],
      capture_output=True, text=True, timeout=120, env=helpers.child_env())
  lines = result.stderr.strip().splitlines()
  assert result.returncode == 1, result.stderr
  assert lines[0] == (f"process 0 of 2 waiting for 1 more at 127.0.0.1:{port}, timeout 3 s "
                      f"(--init-timeout)"), result.stderr
  assert lines[-1].startswith(f"process 0 of 2 at 127.0.0.1:{port}: gave up after 3 s: "
                              f"not every process joined: waited for process ids 1 "), lines
  assert "Check failure" not in result.stderr and len(lines) == 2, result.stderr


# ------------------------------------------------ right results, no error ---

def test_float16_past_its_range_is_clipped_and_kept_in_the_residual():
  """topk over 4 vmapped workers, float16 gradients of 4e4: the mean passes 65504."""
  workers, tx = 4, dlgs_jax.topk(0.1, axis_name="w")
  params = {"a": jnp.zeros((40,), jnp.float16)}
  state = jax.vmap(lambda _: tx.init(params), axis_name="w")(jnp.arange(workers))
  grads = {"a": jnp.full((workers, 40), 4e4, jnp.float16)}
  update_fn = jax.jit(jax.vmap(tx.update, axis_name="w"))  # one program, not op by op
  for step in range(3):
    old = np.asarray(leaf_residuals(state)["a"], np.float64)
    updates, state = update_fn(grads, state)
    update = np.asarray(updates["a"], np.float64)
    residual = np.asarray(leaf_residuals(state)["a"], np.float64)
    assert np.isfinite(update).all() and np.isfinite(residual).all(), step
    assert np.abs(update).max() <= 65504 and int(state.stats.skipped[0]) == 0
    np.testing.assert_allclose(workers * update[0] + residual.sum(0),
                               (old + np.asarray(grads["a"], np.float64)).sum(0), rtol=1e-6)
  assert np.abs(update).max() == 65504  # the clipped mean was sent


def test_dense_float16_mean_does_not_overflow_in_its_sum():
  workers, tx = 4, dlgs_jax.dense(axis_name="w")
  params = {"a": jnp.zeros((5,), jnp.float16)}
  state = jax.vmap(lambda _: tx.init(params), axis_name="w")(jnp.arange(workers))
  grads = {"a": jnp.full((workers, 5), 4e4, jnp.float16)}
  updates, state = jax.vmap(tx.update, axis_name="w")(grads, state)
  np.testing.assert_array_equal(np.asarray(updates["a"]), 4e4)
  assert int(state.stats.skipped[0]) == 0


def test_overflow_inf_never_recomputes_for_overflow():
  passed, ks, capacities = jnp.asarray([1000, 10]), [10, 10], [10, 10]
  sparse, live = [True, True], jnp.asarray([True, True])
  never = rules.AdaptedReuse(overflow=math.inf)
  assert not bool(never.drifted(passed, ks, capacities, sparse, live))
  assert bool(rules.AdaptedReuse(overflow=2.0).drifted(passed, ks, capacities, sparse, live))
  # Sending too little still recomputes.
  assert bool(never.drifted(jnp.asarray([1, 1]), ks, capacities, sparse, live))


@pytest.mark.parametrize("workers", [3, 5, 6])
def test_gtopk_under_vmap_over_any_worker_count_matches_shard_map(workers):
  tx = dlgs_jax.gtopk(0.2, axis_name="data")
  rng = np.random.default_rng(workers)
  steps = [helpers.random_grads(PARAMS, workers, rng) for _ in range(2)]
  expected, expected_state, _ = helpers.run_steps(tx, PARAMS, steps, workers)
  state = jax.vmap(lambda _: tx.init(PARAMS), axis_name="data")(jnp.arange(workers))
  update = jax.jit(jax.vmap(tx.update, axis_name="data"))  # one program, not op by op
  for grads in steps:
    got, state = update(grads, state)
  for name in PARAMS:
    np.testing.assert_allclose(np.asarray(got[name]), expected[-1][name], atol=1e-6)
  for got_e, want_e in zip(state.residuals, expected_state.residuals):
    np.testing.assert_allclose(np.asarray(got_e), want_e, atol=1e-6)


def test_init_warns_when_the_module_is_in_eval_mode():
  model = MLP(nnx.Rngs(0))
  model.eval()
  dp = dlgs_jax.data_parallel(_loss, TX, dlgs_jax.data_mesh())
  with pytest.warns(UserWarning, match=r"eval mode \(drop \(Dropout\).*model\.train\(\)"):
    dp.init(model)
  model.train()
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    dp.init(model)
