"""Where a run starts: the newest checkpoint that verifies, also from another worker count or node shape."""

from __future__ import annotations

from typing import Optional

from dlgs_jax.training.run import Run, RunError


def restore_or_start(run: Run, ckpt) -> int:
  """The step the run starts from: the latest checkpoint's with ``resume``, else 0.

  Raises:
    RunError: for a workdir holding checkpoints without ``resume``, or a
      checkpoint of another run.
  """
  from dlgs_jax.training.persistence import checkpoint
  from dlgs_jax.workload import fsdp

  directory = run.workdir / "checkpoints"
  if ckpt.latest_step() is None:
    if run.config.checkpoint.resume:
      run.log(f"--resume: no checkpoint in {directory}, starting from step 0")
    return 0
  if not run.config.checkpoint.resume:
    raise RunError(f"{directory} already holds checkpoints (latest step {ckpt.latest_step()}); "
                   "pass --resume to continue, or use another --workdir")
  try:
    try:
      run.state, record = ckpt.restore_latest_good(run.state, allow=EXTENDABLE)
      _check_extension(run, record)
    except checkpoint.CheckpointMismatch as e:
      if "state_layout" in e.differences:
        record = _restore_per_leaf(run, ckpt, e.differences)
      elif not set(e.differences) <= RESHARDABLE or not {"workers", "exchange"} & set(
          e.differences):
        raise
      elif "sliced" in str(e.differences.get("exchange", ("",))[0]) or isinstance(
          run.state.params, fsdp.ShardedParams):
        record = _restore_sliced(run, ckpt, e.differences)
      else:
        record = _restore_on_other_workers(run, ckpt, e.differences)
  except checkpoint.CheckpointMismatch as e:
    raise RunError(f"refusing to resume: {e}") from None
  except checkpoint.CheckpointCorrupt as e:
    raise RunError(str(e)) from None
  start = int(record["step"])
  run.log(f"resumed from step {start} (epoch {start // run.steps_per_epoch}, batch "
          f"{start % run.steps_per_epoch} of {run.steps_per_epoch})")
  return start


# What may differ when a run is extended (or shortened) on resume: its length and
# the learning-rate drops still ahead; `_check_extension` keeps the steps taken.
EXTENDABLE = frozenset({"schedule.epochs", "schedule.steps", "schedule.lr_decay_epochs",
                        "total_steps"})


def _check_extension(run: Run, record: dict) -> None:
  """Refuses a new length unless every step already taken keeps its learning rate.

  Raises:
    RunError: naming why (`extension_refusal`).
  """
  saved = record.get("identity", {})
  old_total = saved.get("total_steps", run.total_steps)
  if old_total == run.total_steps:
    return
  why = extension_refusal(saved, int(record["step"]), run.config.schedule,
                          run.steps_per_epoch, run.total_steps)
  if why:
    raise RunError(f"refusing to resume: {why}")
  drops = run.config.schedule.decay_boundaries(run.steps_per_epoch, run.total_steps)
  run.log(f"extending the run from {old_total} to {run.total_steps} steps; the learning "
          f"rate drops at steps {drops or 'none'}")


def extension_refusal(saved: dict, step: int, schedule, steps_per_epoch: int,
                      total_steps: int) -> Optional[str]:
  """Why `schedule` may not continue a checkpoint at `step` of a run of another length.

  Args:
    saved: the checkpoint's identity (its ``schedule.*`` options and ``total_steps``).
    step: the checkpoint's step.
    schedule: the new run's `ScheduleConfig`.
    steps_per_epoch: steps in an epoch (the same for both runs).
    total_steps: the new run's length.

  Returns:
    None when every one of the `step` steps taken keeps its learning rate and
    steps remain; else the reason, with the ``--lr-decay-epochs`` that fix it.
  """
  from dlgs_jax.training.config import ScheduleConfig

  if step >= total_steps:
    return (f"the checkpoint is at step {step}, and this run has {total_steps} steps; give "
            "more --epochs or --steps to extend it")
  old = ScheduleConfig(epochs=saved["schedule.epochs"], steps=saved["schedule.steps"],
                       lr_decay_epochs=saved["schedule.lr_decay_epochs"])
  taken = [b for b in old.decay_boundaries(steps_per_epoch, saved["total_steps"]) if b < step]
  now = schedule.decay_boundaries(steps_per_epoch, total_steps)
  if taken == [b for b in now if b < step]:
    return None
  keep = ",".join(_epochs_of(b, steps_per_epoch) for b in taken)
  fix = (f"keep them with --lr-decay-epochs {keep},<the drops still to come>" if taken else
         f"give --lr-decay-epochs with drops after epoch {_epochs_of(step, steps_per_epoch)}")
  return (f"{total_steps} steps move the learning-rate drops of the {step} steps taken (they "
          f"dropped at steps {taken or 'none'}, this run drops at {now or 'none'}); {fix}")


def _epochs_of(step: int, steps_per_epoch: int) -> str:
  """The shortest decimal epoch that rounds back to `step`."""
  for digits in range(7):
    text = f"{step / steps_per_epoch:.{digits}f}"
    if int(round(float(text) * steps_per_epoch)) == step:
      return text.rstrip("0").rstrip(".") if "." in text else text
  return repr(step / steps_per_epoch)


# What may differ when a run resumes on another number of workers or node shape:
# the count, the exchange (flat, two-level NxL), and the steps an epoch-long
# schedule has with the new global batch.
RESHARDABLE = frozenset({"workers", "total_steps", "exchange"})


def _host(x, rows=None):
  """Zeros of `x`'s shape and dtype on the host; `rows`: a leading axis of that length added."""
  import numpy as np

  shape = tuple(x.shape) if rows is None else (rows,) + tuple(x.shape)
  return np.zeros(shape, x.dtype)


def _restore_on_other_workers(run: Run, ckpt, differences: dict) -> dict:
  """Restores a checkpoint of another worker count or exchange onto this run's, mass kept."""
  import jax

  from dlgs_jax.training.persistence import reshard
  from dlgs_jax.workload import parallel

  exchange = reshard.exchange_name(run.mesh)
  saved_exchange = differences.get("exchange", (exchange,))[0]
  saved_workers = int(differences.get("workers", (run.workers,))[0])
  old_fast = (reshard.nodes_of(saved_exchange) or (0, 1))[1]
  new_fast = parallel.devices_per_node(run.mesh)
  state = run.state
  saved_opt = jax.eval_shape(run.optimizer_for(old_fast if old_fast > 1 else None).init,
                             state.params)
  target = state._replace(
      params=jax.tree_util.tree_map(_host, state.params),
      model_state=jax.tree_util.tree_map(_host, state.model_state),
      opt_state=parallel.map_state(lambda x: _host(x, saved_workers),
                                   lambda node: jax.tree_util.tree_map(_host, node), saved_opt),
      step=_host(state.step))
  restored, record = ckpt.restore_latest_good(target, allow=RESHARDABLE)
  opt_state = reshard.change_exchange(restored.opt_state,
                                      jax.tree_util.tree_map(_host, state.opt_state),
                                      restored.params, old_fast, new_fast)
  run.state = state._replace(
      params=parallel.replicate(restored.params, run.mesh),
      model_state=parallel.replicate(restored.model_state, run.mesh),
      opt_state=parallel.place_rows(opt_state, run.mesh, run.workers),
      step=parallel.replicate(restored.step, run.mesh))
  shapes = ("" if exchange == saved_exchange == "flat"
            else f" ({saved_exchange} -> {exchange})")
  run.log(f"the checkpoint was written by {saved_workers} workers, this run has "
          f"{run.workers}{shapes}: residuals redistributed with their sum kept"
          + (f"; the schedule now has {run.total_steps} steps (it had "
             f"{differences['total_steps'][0]})" if "total_steps" in differences else ""))
  return record


def _restore_sliced(run: Run, ckpt, differences: dict) -> dict:
  """Restores a checkpoint of parameters sliced over another node shape (`reshard.change_fsdp`).

  Raises:
    RunError: when one of the two runs slices its parameters and the other does not.
  """
  import jax
  import numpy as np

  from dlgs_jax.training.persistence import reshard
  from dlgs_jax.workload import fsdp, parallel, sharded_step

  exchange = reshard.exchange_name(run.mesh)
  saved_exchange = differences["exchange"][0] if "exchange" in differences else exchange
  if not (saved_exchange.startswith("sliced") and exchange.startswith("sliced")):
    raise RunError(f"refusing to resume: the checkpoint's exchange is {saved_exchange}, this "
                   f"run's {exchange}; sliced parameters (--fsdp) resume only as sliced ones")
  nodes, local = reshard.nodes_of(saved_exchange)
  axes = tuple(run.mesh.axis_names)
  whole = fsdp.whole(parallel.fetch(run.state.params))
  sliced, opt_state = fsdp.initial(run.optimizer_for(None), whole, {axes[0]: nodes,
                                                                     axes[1]: local}, axes[1])
  host = lambda tree: jax.tree_util.tree_map(_host, tree)  # noqa: E731
  target = run.state._replace(params=host(sliced), model_state=host(run.state.model_state),
                              opt_state=host(opt_state), step=_host(run.state.step))
  restored, record = ckpt.restore_latest_good(target, allow=RESHARDABLE)
  moved = reshard.change_fsdp(jax.tree_util.tree_map(np.asarray, restored),
                              parallel.fetch(run.state))
  run.state = sharded_step.place_sliced(moved, run.mesh, axes[1])
  run.log(f"the checkpoint was written on {saved_exchange} devices, this run has {exchange}: "
          "the slices cut again, the residuals' sum kept")
  return record


def _restore_per_leaf(run: Run, ckpt, differences: dict) -> dict:
  """Restores a checkpoint whose residuals are kept leaf by leaf, converted to flat buffers.

  Runs before flat buffers (`compress.state.LAYOUT`) saved each sparse
  transform's residuals as a tree shaped like the parameters and its
  thresholds as one scalar per leaf, and named no layout in their identity.
  The same values are laid out in the new buffers, so the run continues as it
  would have.

  Raises:
    RunError: for any other layout, or a checkpoint that also differs in what
      a conversion does not carry (its workers, exchange or other settings).
  """
  import jax

  from dlgs_jax.compress import state as states
  from dlgs_jax.training.persistence import checkpoint
  from dlgs_jax.workload import parallel

  saved_layout = differences["state_layout"][0]
  others = sorted(set(differences) - {"state_layout"} - EXTENDABLE)
  if saved_layout is not None or others:
    what = ("its residuals leaf by leaf" if saved_layout is None
            else f"its residuals as {saved_layout!r}")
    raise RunError(
        f"refusing to resume: the checkpoint keeps {what}, this version keeps "
        f"{states.LAYOUT!r}" + (f", and it differs in {others}" if others else "") +
        ("; resume it once with its own settings to convert it, then change them" if
         saved_layout is None else "; resume it with the version that wrote it"))
  state = run.state
  target = state._replace(
      params=jax.tree_util.tree_map(_host, state.params),
      model_state=jax.tree_util.tree_map(_host, state.model_state),
      opt_state=_per_leaf_shapes(state.opt_state, state.params),
      step=_host(state.step))
  try:
    restored, record = ckpt.restore_latest_good(target, allow=EXTENDABLE | {"state_layout"})
  except checkpoint.CheckpointCorrupt as e:
    raise RunError(f"refusing to resume: the checkpoint's residuals kept leaf by leaf could "
                   f"not be read for this run's transforms ({e})") from None
  opt_state = _to_flat(restored.opt_state, jax.tree_util.tree_map(_host, state.opt_state))
  run.state = state._replace(
      params=parallel.replicate(restored.params, run.mesh),
      model_state=parallel.replicate(restored.model_state, run.mesh),
      opt_state=parallel.place_rows(opt_state, run.mesh, run.workers),
      step=parallel.replicate(restored.step, run.mesh))
  _check_extension(run, record)
  run.log("the checkpoint kept its residuals leaf by leaf: laid out in flat buffers, values "
          "unchanged")
  return record


def _flat_states(tree) -> list:
  import jax

  from dlgs_jax.compress.state import DLGSState, SparseState

  kinds = (DLGSState, SparseState)
  return [n for n in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, kinds))
          if isinstance(n, kinds)]


def _per_leaf_shapes(opt_state, params):
  """Host zeros of `opt_state` with each flat-buffer state as the per-leaf one it replaced.

  The old residuals: a tree like the parameters the transform saw (passive
  leaves empty), each leaf with the worker axis; the thresholds: a scalar per
  leaf and worker.
  """
  import jax

  from dlgs_jax.compress import common, grouping
  from dlgs_jax.compress.state import DLGSState, SparseState, is_per_worker

  kinds = (DLGSState, SparseState)
  seen = jax.tree_util.tree_map(lambda x: None if common.is_passive(x) else x, params)
  paths = grouping.leaf_paths(seen)
  structure = jax.tree_util.tree_structure(seen)

  def convert(node):
    if not isinstance(node, kinds):
      return jax.tree_util.tree_map(_host, node)
    groups = node.stats.groups
    shapes = {p: s for ps, ss in zip(groups.paths, groups.shapes) for p, s in zip(ps, ss)}
    workers, dtype = node.residuals[0].shape[0], node.residuals[0].dtype
    residuals = jax.tree_util.tree_unflatten(
        structure, [_host(jax.ShapeDtypeStruct(shapes[p], dtype), workers) for p in paths])
    old = jax.tree_util.tree_map(_host, node)._replace(residuals=residuals)
    if isinstance(node, DLGSState):
      old = old._replace(thresholds=jax.tree_util.tree_unflatten(
          structure, [_host(jax.ShapeDtypeStruct((), node.thresholds[0].dtype), workers)
                      for _ in paths]))
    return old

  return jax.tree_util.tree_map(convert, opt_state,
                                is_leaf=lambda x: isinstance(x, kinds) or (
                                    is_per_worker(x) and not isinstance(x, kinds)))


def _to_flat(saved, target):
  """`saved` with every per-leaf transform state laid out as `target`'s (host zeros) is."""
  import jax
  import numpy as np

  from dlgs_jax.compress import grouping
  from dlgs_jax.compress.state import DLGSState, SparseState, with_leaf_residuals

  kinds = (DLGSState, SparseState)
  targets = iter(_flat_states(target))

  def convert(old):
    if not isinstance(old, kinds):
      return old
    node = next(targets)
    by_path = dict(zip(grouping.leaf_paths(old.residuals),
                       jax.tree_util.tree_leaves(old.residuals)))
    new = with_leaf_residuals(old._replace(residuals=node.residuals, stats=node.stats),
                              by_path)
    if isinstance(node, DLGSState):
      thresholds = dict(zip(grouping.leaf_paths(old.thresholds),
                            jax.tree_util.tree_leaves(old.thresholds)))
      new = new._replace(thresholds=tuple(
          np.stack([np.asarray(thresholds[p]) for p in paths], axis=-1).astype(t.dtype)
          for paths, t in zip(node.stats.groups.paths, node.thresholds)))
    return new._replace(stats=jax.tree_util.tree_map(
        lambda o, n: np.asarray(o).astype(n.dtype), old.stats, node.stats))

  return jax.tree_util.tree_map(convert, saved, is_leaf=lambda x: isinstance(x, kinds))
