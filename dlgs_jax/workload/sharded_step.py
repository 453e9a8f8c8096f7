"""One data-parallel training step for any model: `data_parallel`.

From a loss function, an optax chain holding a dlgs_jax transform and a mesh,
`data_parallel` builds ``init`` and ``step``, run as ``jax.jit(jax.shard_map(...))``
with shard_map's replication checks on:

* each worker takes the gradient of its own slice of the batch at parameters
  cast to varying (``lax.pcast``), so JAX adds no all-reduce of its own and the
  transform's collective is the only gradient traffic;
* the transform's update comes out typed replicated, so the parameters stay
  replicated (``P()``) and JAX proves it;
* this library's transform states are per worker (`parallel.place_state`), every
  other part of the optimizer state replicated;
* mutable model state (BatchNorm statistics, NNX's non-parameter state) is
  averaged over the workers, together with the metrics, in one all-reduce;
* ``micro_batches`` accumulates gradients over slices of each worker's batch and
  communicates once.

It serves plain pytrees, Flax Linen (``batch_stats``) and Flax NNX
(``nnx.split`` into parameters and the rest, ``nnx.merge`` inside the loss): see
``examples/``.
"""

from __future__ import annotations

import functools
import inspect
import numbers
import warnings
from collections.abc import Mapping
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from dlgs_jax.compress import collectives, common, exchange
from dlgs_jax.compress.state import comm_stats_by_path
from dlgs_jax.workload import parallel


class StepState(NamedTuple):
  """Everything a data-parallel step carries (placed by ``DataParallel.init``)."""
  params: Any       # replicated parameter tree
  model_state: Any  # replicated mutable model state ({} without one)
  opt_state: Any    # the optimizer state: this library's states per worker, the rest replicated
  step: jax.Array   # int32[], replicated: steps taken


class DataParallel(NamedTuple):
  """What `data_parallel` returns."""
  init: Callable     # init(params, model_state=None) -> StepState on the mesh
  step: Callable     # step(state, batch) -> (state, metrics); `state` is donated
  axis_name: Any     # the data axis or axes the step runs over
  batch_sharding: Any  # NamedSharding for a batch leaf (leading axis split over workers)
  # compile(state, batch): compiles `step` for these inputs without running it
  # (nothing is exchanged), so processes can compile when they choose.
  compile: Callable
  # On CPU `step` waits for every this many steps' results (None: never): see CPU_SYNC_EVERY.
  sync_every: Optional[int] = None
  # module(state): the trained nnx.Module, where `init` was given one.
  module: Optional[Callable] = None


# XLA:CPU's in-process collectives abort the whole process when a participant
# reaches one more than 40 s after the first: with hundreds of steps dispatched
# and none awaited, the devices' queues drift that far apart (gTop-k's
# collective permutes did so after ~200 steps). Waiting for a step's results
# now and then keeps them together, at the cost of one host sync per this many.
CPU_SYNC_EVERY = 16


def data_parallel(
    loss_fn: Callable,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    *,
    axis_name=None,
    model_state: bool = False,
    has_aux: bool = False,
    seed: Optional[int] = None,
    micro_batches: int = 1,
    simulate_workers: Optional[int] = None,
) -> DataParallel:
  """Builds a data-parallel training step with gradient communication by `tx`.

  With Flax NNX, give ``init`` the module itself and write the loss on it,
  ``loss_fn(model, batch) -> loss``: the step splits the module into its
  ``nnx.Param`` leaves (what the gradient and `tx` see) and the rest (BatchNorm
  statistics, averaged over the workers after each step), rebuilds it inside
  the loss, and ``module(state)`` gives back the trained module. An
  ``nnx.Optimizer`` owns its update, so it has no place here: put its optax
  transformation after the compressor in `tx` (e.g.
  ``optax.chain(dlgs_jax.dlgs(0.01, axis_name="data"), optax.adamw(1e-3))``)::

    model = MLP(nnx.Rngs(0))
    dp = dlgs_jax.data_parallel(lambda m, b: loss(m(b[0]), b[1]), tx, mesh)
    state = dp.init(model)
    for batch in batches:
      state, metrics = dp.step(state, jax.device_put(batch, dp.batch_sharding))
    model = dp.module(state)

  Args:
    loss_fn: ``loss_fn(params, batch) -> loss`` (an NNX module: ``loss_fn(model,
      batch)``, see above); with `model_state`,
      ``loss_fn(params, model_state, batch) -> (loss, new_model_state)``; with
      `has_aux`, the loss comes with a dict of scalar metrics (``(loss, aux)``,
      or ``(loss, (new_model_state, aux))``); with a `seed`, a last argument
      ``key`` is a PRNG key different for every step and worker. `batch` is one
      worker's slice of the batch (or of one micro-batch).
    tx: the optimizer, containing a dlgs_jax transform whose ``axis_name`` is
      the data axis (or axes).
    mesh: the device mesh; all its axes are data axes unless `axis_name` says.
    axis_name: the data axis or axes (default: every axis of `mesh`).
    model_state: whether the loss takes and returns mutable model state.
    has_aux: whether the loss returns metrics (averaged over workers).
    seed: gives the loss a per-step, per-worker ``key`` from this seed.
    micro_batches: slices of each worker's batch whose gradients are summed
      before one communication (gradient accumulation; the compressor runs once).
    simulate_workers: run this many workers on the mesh's one device, under
      ``jax.vmap`` over the data axis instead of `jax.shard_map` (the transforms'
      collectives run over the vmapped axis): P workers' numerics and state on
      one accelerator, e.g. to study a worker count no cluster at hand has.
      Per-worker states and batches keep their leading axis of P rows, so a
      checkpoint moves between simulated and real workers. None: one worker
      per device.

  Returns:
    A `DataParallel`. ``step(state, batch)``: `batch` is any pytree of arrays
    whose leading axis is split over the workers (place it with
    ``batch_sharding``); metrics are replicated scalars: ``loss``, the aux
    metrics, and from the transforms' statistics ``bytes_sent`` (per worker,
    all transforms of the chain), ``selected``, ``skipped`` and ``exact``.
    On CPU meshes ``step`` waits for every `CPU_SYNC_EVERY`-th step's results,
    which keeps XLA:CPU's collectives from aborting the process.

  Raises:
    ValueError: for a bad argument, naming it; ``init`` and ``step`` name, before
      any work, Linen variables given whole, a batch that does not split over
      the workers, a loss of the wrong shape, and a transform that sees each
      worker's own gradient (the optimizer ahead of the compressor).
  """
  axis_name = common.check_axis_name(parallel.data_axes(mesh, axis_name))
  if not set(common.axes_of(axis_name)) <= set(mesh.axis_names):
    raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh {mesh.axis_names}")
  workers = _check_simulated(simulate_workers, mesh, axis_name)
  # Simulated workers exchange inside one program on one device: no collective to drift.
  sync_every = (CPU_SYNC_EVERY if mesh.devices.flat[0].platform == "cpu"
                and simulate_workers is None else None)
  if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
    raise ValueError(f"micro_batches must be an integer >= 1, got {micro_batches!r}")
  if not callable(loss_fn):
    raise ValueError(f"loss_fn must be callable, got {loss_fn!r}")
  loss = _Loss(loss_fn, model_state, has_aux, seed)
  nnx_graph = []  # the module's graph, once `init` is given an nnx.Module

  def init(params, state=None) -> StepState:
    nonlocal loss
    _check_not_module(params)
    if _is_nnx_module(params):
      graph, params, state = _split_module(params, model_state or state is not None)
      nnx_graph[:] = [graph]
      loss = _Loss(_nnx_loss(loss_fn, graph, has_aux, seed), True, has_aux, seed)
    return initial_state(tx, params, state, mesh, workers)

  def module(state: StepState):
    if not nnx_graph:
      raise ValueError("module(state) needs a state that init made from an nnx.Module; this "
                       "one was made from a parameter tree")
    from flax import nnx  # pylint: disable=g-import-not-at-top

    return nnx.merge(nnx_graph[0], *parallel.fetch((state.params, state.model_state)))

  def local_step(state: StepState, batch):
    key = None
    if seed is not None:
      key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), state.step),
                               lax.axis_index(axis_name))
    # Under vmap the gradient of unmapped parameters is already each worker's own.
    varying = (state.params if simulate_workers else
               lax.pcast(state.params, common.axes_of(axis_name), to="varying"))
    grads, value, new_model_state, aux = _accumulate(loss, varying, state.model_state, batch,
                                                     key, micro_batches, axis_name)
    updates, opt_state = tx.update(grads, parallel.squeeze_state(state.opt_state), state.params)
    _check_replicated(updates, opt_state, axis_name)
    params = optax.apply_updates(state.params, updates)
    metrics = {"loss": value, **aux, **_comm_metrics(opt_state)}
    new_model_state, metrics = _average(new_model_state, metrics, axis_name)
    new_state = StepState(params, new_model_state, parallel.unsqueeze_state(opt_state),
                          state.step + 1)
    return new_state, metrics

  jitted = {}

  def program(state: StepState):
    specs = StepState(PartitionSpec(), PartitionSpec(),
                      parallel.state_specs(state.opt_state, axis_name), PartitionSpec())
    key = jax.tree_util.tree_structure(specs)
    if key not in jitted:
      mapped = (_vmapped(local_step, specs, workers, axis_name) if simulate_workers else
                jax.shard_map(local_step, mesh=mesh, in_specs=(specs, PartitionSpec(axis_name)),
                              out_specs=(specs, PartitionSpec())))
      jitted[key] = jax.jit(_batch_checked(mapped, workers), donate_argnums=0)
    return jitted[key]

  dispatched = [0]

  def step(state: StepState, batch):
    new_state, metrics = program(state)(state, batch)
    dispatched[0] += 1
    if sync_every and dispatched[0] % sync_every == 0:
      jax.block_until_ready(metrics)
    return new_state, metrics

  def compile_step(state: StepState, batch) -> None:
    # jit keeps what it compiled ahead of time: the step then runs it.
    program(state).lower(state, batch).compile()

  return DataParallel(init, step, axis_name,
                      jax.sharding.NamedSharding(mesh, PartitionSpec(axis_name)), compile_step,
                      sync_every, module)


def _check_simulated(simulate_workers, mesh: Mesh, axis_name) -> int:
  """The step's worker count: the mesh's devices, or the workers simulated on its one device.

  Raises:
    ValueError: for a count that is not an integer >= 1, or a mesh of several
      devices or axes (simulated workers share one device).
  """
  if simulate_workers is None:
    return int(np.prod([mesh.shape[a] for a in common.axes_of(axis_name)]))
  if (isinstance(simulate_workers, bool) or not isinstance(simulate_workers, numbers.Integral)
      or simulate_workers < 1):
    raise ValueError(f"simulate_workers must be an integer >= 1, got {simulate_workers!r}")
  if mesh.devices.size != 1 or len(mesh.axis_names) != 1:
    raise ValueError(f"simulate_workers={simulate_workers} runs every worker on one device, but "
                     f"the mesh has {mesh.devices.size} devices on axes {mesh.axis_names}: give "
                     f"parallel.data_mesh(1), or drop simulate_workers to use the devices")
  return int(simulate_workers)


def _vmapped(local_step: Callable, specs: StepState, workers: int, axis_name) -> Callable:
  """`local_step` for `workers` workers under ``jax.vmap(axis_name=...)`` on one device.

  Each worker sees what shard_map would give it: its rows of every per-worker
  leaf (a leading axis of one for the transforms' states) and of the batch.
  The replicated results are the same for every worker; worker 0's are kept.
  """
  per_worker = lambda spec: spec != PartitionSpec()
  rows = lambda x: jnp.reshape(x, (workers, x.shape[0] // workers) + x.shape[1:])
  unrows = lambda x: jnp.reshape(x, (x.shape[0] * x.shape[1],) + x.shape[2:])

  # `specs` is a prefix of the state: each spec covers a subtree.
  spec_leaves, treedef = jax.tree_util.tree_flatten(
      specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
  axes = [0 if per_worker(spec) else None for spec in spec_leaves]
  tree_map = jax.tree_util.tree_map

  def mapped(state: StepState, batch):
    inputs = [tree_map(rows, part) if per_worker(spec) else part
              for part, spec in zip(treedef.flatten_up_to(state), spec_leaves)]

    def one(inputs, batch):
      return local_step(treedef.unflatten(inputs), batch)

    new_state, metrics = jax.vmap(one, in_axes=(axes, 0), axis_name=axis_name)(
        inputs, tree_map(rows, batch))
    outputs = [tree_map(unrows if per_worker(spec) else (lambda x: x[0]), part)
               for part, spec in zip(treedef.flatten_up_to(new_state), spec_leaves)]
    return treedef.unflatten(outputs), tree_map(lambda x: x[0], metrics)

  return mapped


def _is_nnx_module(x) -> bool:
  try:
    from flax import nnx  # pylint: disable=g-import-not-at-top
  except ImportError:
    return False
  return isinstance(x, nnx.Module)


def _split_module(model, stateful: bool):
  """(graph, parameters, the rest) of an nnx.Module, refusing what the step cannot train."""
  if stateful:
    raise ValueError(
        "data_parallel: with an nnx.Module, leave model_state=False and pass no state to "
        "init: its non-parameter state is split off and carried for you")
  from flax import nnx  # pylint: disable=g-import-not-at-top

  _warn_if_eval_mode(model)
  graph, params, rest = nnx.split(model, nnx.Param, ...)
  _check_no_rng_streams(rest)
  return graph, params, rest


def _check_not_module(params) -> None:
  """Refuses a model class, or a Linen module, where `init` takes a module or parameters."""
  if isinstance(params, type):
    raise ValueError(
        f"init got the class {params.__name__}, not a model: give it an instance (an "
        f"nnx.Module such as {params.__name__}(nnx.Rngs(0))) or a parameter tree")
  try:
    from flax import linen  # pylint: disable=g-import-not-at-top
  except ImportError:
    return
  if isinstance(params, linen.Module):
    raise ValueError(
        f"init got the Linen module {type(params).__name__}, not its parameters: give it "
        f"variables['params'] from variables = module.init(key, x), with a loss that "
        f"applies them (module.apply({{'params': params}}, x))")


def _check_no_rng_streams(rest) -> None:
  """Refuses a module holding PRNG streams (``nnx.Dropout(rate, rngs=rngs)``).

  A stream's key would be the same on every worker and could not be averaged
  with the rest of the model state; the step's own key differs per step and worker.
  """
  path = _first_prng_key(rest)
  if path is not None:
    raise ValueError(
        f"the module holds a PRNG stream at {path} (an nnx.Rngs given to a layer, e.g. "
        f"nnx.Dropout(rate, rngs=rngs)): build the layer without rngs, give data_parallel "
        f"seed=0, and let the loss take the per-step, per-worker key: "
        f"loss_fn(model, batch, key) calling model(x, rngs=nnx.Rngs(dropout=key))")


def _first_prng_key(tree):
  """The path of `tree`'s first PRNG-key leaf (which no mean over workers can take), or None."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if jnp.issubdtype(jnp.result_type(leaf), jax.dtypes.prng_key):
      return jax.tree_util.keystr(path)
  return None


def _warn_if_eval_mode(model) -> None:
  """Warns when `model` is in eval mode: the step would train it in that mode."""
  from flax import nnx  # pylint: disable=g-import-not-at-top

  frozen = [f"{'/'.join(map(str, path)) or type(module).__name__} ({type(module).__name__})"
            for path, module in nnx.iter_modules(model)
            if getattr(module, "deterministic", None) is True
            or getattr(module, "use_running_average", None) is True]
  if frozen:
    warnings.warn(
        f"data_parallel.init: the module is in eval mode ({', '.join(frozen[:3])}"
        f"{' ...' if len(frozen) > 3 else ''} deterministic or using running averages), and "
        f"the step trains it in the mode it has now: call model.train() before "
        f"dp.init(model), and model.eval() on dp.module(state) to evaluate", stacklevel=4)


def _nnx_loss(loss_fn: Callable, graph, has_aux: bool, seed) -> Callable:
  """``loss_fn(model, batch[, key])`` as a loss of (params, rest, batch[, key]) returning the rest."""
  from flax import nnx  # pylint: disable=g-import-not-at-top

  def loss(params, rest, batch, *key):
    model = nnx.merge(graph, params, rest, copy=True)  # fresh variables for this trace
    value, aux = _loss_and_aux(loss_fn(model, batch, *key), has_aux, loss_fn)
    new_rest = nnx.split(model, nnx.Param, ...)[2]
    return (value, (new_rest, aux)) if has_aux else (value, new_rest)

  return loss if seed is not None else (lambda params, rest, batch: loss(params, rest, batch))


def initial_state(tx: optax.GradientTransformation, params, model_state, mesh: Mesh,
                  workers: Optional[int] = None) -> StepState:
  """The `StepState` at step 0 on `mesh`: `tx`'s state placed per worker where it is one.

  Args:
    tx: the optimizer.
    params: the parameters, the same in every process.
    model_state: mutable model state, or None for none.
    mesh: the device mesh.
    workers: workers simulated on the mesh's device (None: one per device).

  Raises:
    ValueError: for Linen's whole variables, statistics included, as `params`.
  """
  if isinstance(params, dict) and "batch_stats" in params and "params" in params:
    # The statistics would get zero gradients, never an update.
    raise ValueError(
        "init got Linen variables holding 'batch_stats' as the parameters: give "
        "data_parallel model_state=True and init(variables['params'], "
        "variables['batch_stats']), the loss returning (loss, new batch_stats)")
  return StepState(parallel.replicate(params, mesh),
                   parallel.replicate({} if model_state is None else model_state, mesh),
                   parallel.place_state(tx.init(params), mesh, workers),
                   parallel.replicate(np.zeros((), np.int32), mesh))


class _Loss:
  """The user's loss behind one calling convention: ``(loss, model_state, aux)``."""

  def __init__(self, fn, with_state: bool, has_aux: bool, seed):
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
      raise ValueError(f"seed must be an integer or None, got {seed!r}")
    self.fn, self.with_state, self.has_aux, self.seed = fn, with_state, has_aux, seed
    try:
      wanted = 2 + with_state + (seed is not None)
      inspect.signature(fn).bind(*range(wanted))
    except TypeError:
      raise ValueError(
          f"loss_fn {getattr(fn, '__name__', fn)!r} must take (params"
          f"{', model_state' if with_state else ''}, batch{', key' if seed is not None else ''})"
          f" for model_state={with_state}, seed={seed!r}") from None
    except ValueError:  # builtins without a signature: called as they are
      pass

  def __call__(self, params, model_state, batch, key):
    args = (params, model_state, batch) if self.with_state else (params, batch)
    try:
      out = self.fn(*args, key) if self.seed is not None else self.fn(*args)
    except Exception as e:  # pylint: disable=broad-except
      if type(e).__name__ != "TraceContextError":
        raise
      raise ValueError(
          "the loss changes an NNX object created outside the step (typically an nnx.Rngs "
          "it closes over, for dropout): give data_parallel seed=0 and let the loss take "
          "the per-step, per-worker key, loss_fn(model, batch, key), calling "
          "model(x, rngs=nnx.Rngs(dropout=key))") from None
    value, rest = _loss_and_aux(out, self.with_state or self.has_aux, self.fn,
                                "new_model_state" if self.with_state else "metrics",
                                "model_state=True" if self.with_state else "has_aux=True")
    if self.with_state:
      new_state, aux = rest if self.has_aux else (rest, {})
    else:
      new_state, aux = model_state, (rest if self.has_aux else {})
    return value, (new_state, _scalar_metrics(aux))


def _scalar_metrics(aux) -> dict:
  """The loss's metrics as a dict, refusing anything but named scalars (averaged over workers).

  Raises:
    ValueError: for metrics that are not a dict, or a metric that is not a scalar.
  """
  if not isinstance(aux, Mapping):
    got = (f"an array of shape {tuple(jnp.shape(aux))}" if hasattr(aux, "shape")
           else f"a {type(aux).__name__}")
    raise ValueError(f"with has_aux=True the loss returns (loss, metrics), metrics a dict of "
                     f"scalars, got {got}: return e.g. (loss, {{'accuracy': accuracy}})")
  for name, value in aux.items():
    if jnp.ndim(value) != 0:
      raise ValueError(
          f"the metric {name!r} has shape {tuple(jnp.shape(value))}, but metrics are scalars "
          f"averaged over the workers: reduce it in the loss (e.g. accuracy as "
          f"jnp.mean(logits.argmax(-1) == labels)); per-example outputs such as logits for "
          f"nnx.metrics belong in an evaluation pass on dp.module(state)")
  return dict(aux)


def _check_replicated(updates, opt_state, axis_name) -> None:
  """Refuses updates, or optimizer state outside this library's, that differ between workers.

  Each worker's gradient differs; the compressor's output is the workers' mean.
  A transform that sees the gradient first (``optax.chain(optax.adam(...),
  dlgs(...))``, or a chain without a compressor) keeps per-worker state where
  the step keeps one for all: found from shard_map's types, named with the fix
  before compiling.
  """
  axes = set(common.axes_of(axis_name))
  axis = sorted(axes, key=str)[0]
  shared = parallel.map_state(lambda _: None, lambda node: node, opt_state)
  compressed = bool(comm_stats_by_path(opt_state))
  for what, tree in (("update", updates), ("optimizer state", shared)):
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
      if not axes & collectives.varying_axes(leaf):
        continue
      if what == "update" and compressed:
        # A compressor is in the chain, but this leaf went around it.
        raise ValueError(
            f"the update at {jax.tree_util.keystr(path)} differs between workers: the chain's "
            f"dlgs_jax transform does not see this leaf (an optax.masked or optax.partition "
            f"leaves it out); give every leaf a compressor, e.g. optax.partition with "
            f"dlgs_jax.dense(axis_name={axis!r}) for the others, or send leaves whole with "
            f"dlgs's send_whole")
      raise ValueError(
          f"the {what} at {jax.tree_util.keystr(path)} differs between workers: no "
          f"dlgs_jax transform averaged the gradients before it; put one first in the "
          f"chain, e.g. optax.chain(dlgs_jax.dlgs(0.01, axis_name={axis!r}), "
          f"optax.adamw(1e-3))")


def _loss_and_aux(out, paired: bool, fn, second: str = "metrics", why: str = "has_aux=True"
                  ) -> tuple:
  """``(loss, second)`` of what a loss returned (``(out, None)`` unless `paired`).

  Raises:
    ValueError: in one line, for a pair where none was asked for or the
      reverse, or a loss that is not a scalar.
  """
  name = getattr(fn, "__name__", "loss_fn")
  if paired and not (isinstance(out, (tuple, list)) and len(out) == 2):
    got = (f"a tuple of {len(out)}" if isinstance(out, (tuple, list)) else
           f"one {jnp.result_type(out)}{list(jnp.shape(out))} value" if hasattr(out, "shape")
           else f"a {type(out).__name__}")
    raise ValueError(f"{name} must return (loss, {second}) with {why}, got {got}")
  if not paired and isinstance(out, (tuple, list)):
    raise ValueError(f"{name} returned a tuple of {len(out)}: return the scalar loss, or give "
                     f"data_parallel has_aux=True for (loss, metrics)")
  value, rest = out if paired else (out, None)
  if jnp.ndim(value) != 0:
    raise ValueError(f"{name} must return a scalar loss, got shape {tuple(jnp.shape(value))}: "
                     f"take its mean over the worker's batch")
  return value, rest


def _accumulate(loss: _Loss, params, model_state, batch, key, micro_batches: int, axis_name):
  """(summed-mean gradients, mean loss, model state after the last slice, mean aux)."""
  grad_fn = jax.value_and_grad(loss, has_aux=True)
  if micro_batches == 1:
    (value, (model_state, aux)), grads = grad_fn(params, model_state, batch, key)
    return grads, value, model_state, aux
  parts = jax.tree_util.tree_map(lambda x: _split_rows(x, micro_batches), batch)
  keys = None if key is None else jax.random.split(key, micro_batches)

  def one(carry, xs):
    grads, model_state = carry
    part, part_key = xs
    (value, (model_state, aux)), g = grad_fn(params, model_state, part, part_key)
    grads = jax.tree_util.tree_map(lambda a, b: a + b / micro_batches, grads, g)
    return (grads, model_state), (value, aux)

  zeros = jax.tree_util.tree_map(lambda p: jnp.zeros(jnp.shape(p), jnp.result_type(p)), params)
  zeros = common.as_varying(zeros, axis_name)
  (grads, model_state), (values, aux) = lax.scan(one, (zeros, model_state), (parts, keys))
  mean = lambda x: jnp.mean(x, axis=0)
  return grads, mean(values), model_state, jax.tree_util.tree_map(mean, aux)


def _batch_checked(mapped: Callable, workers: int) -> Callable:
  """`mapped(state, batch)`, first refusing a batch that does not split over the workers.

  shard_map's own error runs to many lines. Under `jax.jit` the check runs while
  tracing: once per batch shape, not on every step. The wrapper keeps the step's
  name, which compile logs and profiles show.
  """
  @functools.wraps(mapped)
  def checked(state, batch):
    for leaf in jax.tree_util.tree_leaves(batch):
      rows = jnp.shape(leaf)[0] if jnp.ndim(leaf) else None
      if rows is None or rows % workers:
        raise ValueError(
            f"a batch leaf of shape {tuple(jnp.shape(leaf))} does not split over the {workers} "
            f"workers: give every leaf a leading (batch) axis of a multiple of {workers}, "
            f"e.g. {max(workers, (rows or 0) // workers * workers)}")
    return mapped(state, batch)

  return checked


def _split_rows(x, parts: int):
  rows = jnp.shape(x)[0] if jnp.ndim(x) else 0
  if rows % parts:
    raise ValueError(f"micro_batches={parts} does not divide a worker's batch of {rows} rows "
                     f"(leaf of shape {jnp.shape(x)})")
  return jnp.reshape(x, (parts, rows // parts) + tuple(jnp.shape(x)[1:]))


def _comm_metrics(opt_state) -> dict:
  """This worker's traffic this step, over every transform of the chain."""
  found = comm_stats_by_path(opt_state)
  if not found:
    return {}
  stats = list(found.values())
  total = lambda field: sum(jnp.sum(getattr(s, field)).astype(jnp.float32) for s in stats)
  return {"bytes_sent": total("bytes_sent"), "selected": total("selected"),
          "skipped": total("skipped"), "exact": total("exact")}


def _average(model_state, metrics: dict, axis_name):
  """Model state and metrics as every worker's mean (one all-reduce), typed replicated."""
  leaves, treedef = jax.tree_util.tree_flatten(model_state)
  path = _first_prng_key(model_state)
  if path is not None:
    raise ValueError(f"the model state holds a PRNG key at {path}: keys cannot be "
                     f"averaged over workers; keep them out of the model state (give "
                     f"data_parallel a seed: the loss gets a key per step and worker)")
  floating = [jnp.issubdtype(jnp.result_type(x), jnp.inexact) for x in leaves]
  means, metrics = exchange.fused_mean(
      ([x for x, f in zip(leaves, floating) if f], metrics), axis_name=axis_name)
  # Integer state (counters) is the same on every worker; the maximum types it replicated.
  others = [lax.pmax(x, axis_name) for x, f in zip(leaves, floating) if not f]
  means, others = iter(means), iter(others)
  merged = [next(means) if f else next(others) for f in floating]
  return jax.tree_util.tree_unflatten(treedef, merged), metrics
