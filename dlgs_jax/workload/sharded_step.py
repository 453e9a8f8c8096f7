"""One data-parallel training step for any model: `data_parallel`.

From a loss function, an optax chain holding a dlgs_jax transform and a mesh,
`data_parallel` builds a frozen `DataParallel` whose ``init`` and ``step`` run as
``jax.jit(jax.shard_map(...))`` with shard_map's replication checks on:

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
(``nnx.split`` into the `wrt` variables and the rest, ``nnx.merge`` inside the
loss; `user_loss`): see ``examples/``.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from dlgs_jax.compress import collectives, common, exchange
from dlgs_jax.compress.state import comm_stats_by_path
from dlgs_jax.workload import fsdp, parallel, user_loss
from dlgs_jax.workload.user_loss import ModuleState


class StepState(NamedTuple):
  """Everything a data-parallel step carries (placed by ``DataParallel.init``)."""
  params: Any       # replicated parameter tree; with an fsdp axis, `fsdp.ShardedParams` (slices over a node)
  model_state: Any  # replicated mutable model state: {} without one, a `ModuleState` for NNX
  opt_state: Any    # the optimizer state: this library's states per worker, the rest replicated
  step: jax.Array   # int32[], replicated: steps taken


@dataclasses.dataclass(frozen=True, eq=False)
class DataParallel:
  """A data-parallel training step over a mesh: what `data_parallel` builds.

  Every field is declared and none is rebound: the loss and the optimizer stay
  as given, the NNX graph travels in the state `init` returns (`ModuleState`),
  and the compiled programs and the steps dispatched are visible attributes.
  Call ``init``, then ``step`` (see `data_parallel`).
  """
  loss_fn: Callable                # the loss as given (see `data_parallel`)
  tx: optax.GradientTransformation
  mesh: Mesh
  axis_name: Any                   # the data axis or axes the step runs over
  model_state: bool                # whether the loss takes and returns model state
  has_aux: bool                    # whether the loss returns metrics too
  seed: Optional[int]              # the loss gets a per-step, per-worker key from it
  micro_batches: int               # slices of a worker's batch, one communication
  simulate_workers: Optional[int]  # workers vmapped on one device; None: one per device
  wrt: Any                         # NNX filter of what the gradient and `tx` see
  workers: int                     # workers the step runs
  sync_every: Optional[int]        # CPU meshes: wait for every this many steps (CPU_SYNC_EVERY)
  fsdp_axis: Optional[str] = None  # the mesh axis of a node's devices, parameters sliced over it (HSDP); None: replicated
  # The jitted step for each structure of the state (and NNX graph): jit's cache.
  programs: dict = dataclasses.field(default_factory=dict, repr=False)
  # Steps dispatched so far: the CPU sync counts them.
  dispatched: list = dataclasses.field(default_factory=lambda: [0], repr=False)

  @property
  def batch_axes(self) -> tuple:
    """The mesh axes a batch splits over: the data axes, and the fsdp axis (HSDP)."""
    return common.axes_of(self.axis_name) + ((self.fsdp_axis,) if self.fsdp_axis else ())

  @property
  def batch_sharding(self) -> jax.sharding.NamedSharding:
    """Where a batch leaf goes: its leading axis split over the workers."""
    return jax.sharding.NamedSharding(self.mesh, PartitionSpec(self.batch_axes))

  def whole_params(self, state: StepState):
    """The parameters of `state` on the host, whole (with an fsdp axis: gathered from slices)."""
    params = parallel.fetch(state.params)
    return fsdp.whole(params) if self.fsdp_axis else params

  def init(self, params, model_state=None) -> StepState:
    """The `StepState` at step 0 on the mesh, from parameters or an ``nnx.Module``.

    Args:
      params: a parameter tree, or an ``nnx.Module`` (split into its `wrt`
        variables and the rest, which the state carries with the graph).
      model_state: the initial mutable model state (with ``model_state=True``).
    """
    user_loss.check_not_module(params)
    if user_loss.is_nnx_module(params):
      if self.model_state or model_state is not None:
        raise ValueError(
            "data_parallel: with an nnx.Module, leave model_state=False and pass no state to "
            "init: its non-parameter state is split off and carried for you")
      graph, params, rest = user_loss.split_module(params, self.wrt)
      model_state = ModuleState(rest, graph)
    if self.fsdp_axis:
      return sharded_initial_state(self.tx, params, model_state, self.mesh, self.fsdp_axis)
    return initial_state(self.tx, params, model_state, self.mesh, self.workers)

  def step(self, state: StepState, batch):
    """One step: ``(new state, metrics)``; `state` is donated."""
    new_state, metrics = self._program(state)(state, batch)
    self.dispatched[0] += 1
    if self.sync_every and self.dispatched[0] % self.sync_every == 0:
      jax.block_until_ready(metrics)
    return new_state, metrics

  def compile(self, state: StepState, batch) -> None:
    """Compiles `step` for these inputs without running it (nothing is exchanged)."""
    # jit keeps what it compiled ahead of time: the step then runs it.
    self._program(state).lower(state, batch).compile()

  def memory(self, state: StepState, batch) -> dict:
    """Bytes one device holds for `step`, from XLA's memory analysis of the compiled program.

    Returns:
      ``{"state": the step state's arguments, "batch": one device's rows of
      `batch`, "temporaries": what the program allocates while it runs,
      "outputs": what it returns}``.
    """
    analysis = self._program(state).lower(state, batch).compile().memory_analysis()
    rows = sum(int(np.prod(np.shape(x))) * jnp.dtype(jnp.result_type(x)).itemsize
               for x in jax.tree_util.tree_leaves(batch)) // self.workers
    return {"state": int(analysis.argument_size_in_bytes) - rows, "batch": rows,
            "temporaries": int(analysis.temp_size_in_bytes),
            "outputs": int(analysis.output_size_in_bytes)}

  def module(self, state: StepState):
    """The trained ``nnx.Module`` of a state that `init` made from one."""
    if not isinstance(state.model_state, ModuleState):
      raise ValueError("module(state) needs a state that init made from an nnx.Module; this "
                       "one was made from a parameter tree")
    from flax import nnx  # pylint: disable=g-import-not-at-top

    params, rest = self.whole_params(state), parallel.fetch(state.model_state.rest)
    return nnx.merge(state.model_state.graph, params, rest)

  def _loss(self, model_state) -> user_loss.Loss:
    if isinstance(model_state, ModuleState):
      nnx_loss = user_loss.nnx_loss(self.loss_fn, self.has_aux, self.seed, self.wrt)
      return user_loss.Loss(nnx_loss, True, self.has_aux, self.seed)
    return user_loss.Loss(self.loss_fn, self.model_state, self.has_aux, self.seed)

  def local_step(self, state: StepState, batch):
    """One worker's step inside the mapped program (its name is the compiled program's)."""
    axis_name, batch_axes = self.axis_name, self.batch_axes
    key = None
    if self.seed is not None:
      key = jax.random.fold_in(jax.random.fold_in(jax.random.key(self.seed), state.step),
                               lax.axis_index(batch_axes))
    loss = self._loss(state.model_state)
    params, opt_state = state.params, parallel.squeeze_state(state.opt_state)
    if self.fsdp_axis:
      sharded = params
      params, loss = fsdp.rows(sharded.slices), fsdp.on_slices(loss, sharded, self.fsdp_axis)
      # The optimizer's own state is a slice's too: one row a device of the node.
      opt_state = parallel.map_state(lambda x: x, fsdp.rows, opt_state)
    # Under vmap the gradient of unmapped parameters is already each worker's own.
    varying = (params if self.simulate_workers else
               lax.pcast(params, common.axes_of(axis_name), to="varying"))
    grads, value, new_model_state, aux = _accumulate(
        loss, varying, state.model_state, batch, key, self.micro_batches, axis_name)
    if self.fsdp_axis:
      # The gather's transpose summed the node's gradients: their mean, as two_level's.
      size = sharded.size
      grads = jax.tree_util.tree_map(lambda g: g / size, grads)
    updates, opt_state = self.tx.update(grads, opt_state, params)
    _check_replicated(updates, opt_state, axis_name)
    params = optax.apply_updates(params, updates)
    if self.fsdp_axis:
      params = fsdp.ShardedParams(fsdp.unrows(params), sharded.shapes, sharded.size)
      opt_state = parallel.map_state(lambda x: x, fsdp.unrows, opt_state)
    metrics = {"loss": value, **aux, **_comm_metrics(opt_state)}
    new_model_state, metrics = _average(new_model_state, metrics, batch_axes)
    new_state = StepState(params, new_model_state, parallel.unsqueeze_state(opt_state),
                          state.step + 1)
    return new_state, metrics

  def _program(self, state: StepState) -> Callable:
    """The jitted step for `state`'s structure (compiled on its first call)."""
    if self.fsdp_axis:
      sliced = PartitionSpec(self.fsdp_axis)
      specs = StepState(sliced, PartitionSpec(), parallel.map_state(
          lambda _: PartitionSpec(self.batch_axes), lambda _: sliced, state.opt_state),
                        PartitionSpec())
    else:
      specs = StepState(PartitionSpec(), PartitionSpec(),
                        parallel.state_specs(state.opt_state, self.axis_name), PartitionSpec())
    key = (jax.tree_util.tree_structure(specs),
           jax.tree_util.tree_structure(state.model_state),
           jax.tree_util.tree_structure(state.params))
    if key not in self.programs:
      mapped = (_vmapped(self.local_step, specs, self.workers, self.axis_name)
                if self.simulate_workers else
                jax.shard_map(self.local_step, mesh=self.mesh,
                              in_specs=(specs, PartitionSpec(self.batch_axes)),
                              out_specs=(specs, PartitionSpec())))
      self.programs[key] = jax.jit(_batch_checked(mapped, self.workers), donate_argnums=0)
    return self.programs[key]


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
    wrt: Any = None,
    fsdp_axis: Optional[str] = None,
) -> DataParallel:
  """Builds a data-parallel training step with gradient communication by `tx`.

  With Flax NNX, give ``init`` the module itself and write the loss on it,
  ``loss_fn(model, batch) -> loss``: the step splits the module into its
  `wrt` variables (``nnx.Param`` by default: what the gradient and `tx` see) and the rest (BatchNorm
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
    wrt: with an ``nnx.Module``, the NNX filter of the variables the gradient
      and `tx` see, as ``nnx.Optimizer``'s (default ``nnx.Param``); the rest
      is model state, averaged over the workers after each step.
    fsdp_axis: a mesh axis of the devices of a node, for models that do not
      fit replicated (HSDP, `fsdp`): each of its devices holds a slice of
      every leaf, of its gradient and of the optimizer's state; the forward
      pass gathers the leaves over it, the backward pass reduce-scatters the
      gradient over it (dense), and `tx` exchanges each device's slices over
      `axis_name` only (default: the other axes), so its transforms take
      ``axis_name`` the node axis. Per-layer thresholds become per slice of a
      layer. The batch splits over every device. None: parameters replicated.

  Returns:
    A `DataParallel`. ``step(state, batch)``: `batch` is any pytree of arrays
    whose leading axis is split over the workers (place it with
    ``batch_sharding``); metrics are replicated scalars: ``loss``, the aux
    metrics, and from the transforms' statistics ``bytes_sent`` (per worker,
    all transforms of the chain), ``selected``, ``passed`` (more than
    ``selected`` where a buffer overflowed), ``skipped`` and ``exact``.
    On CPU meshes ``step`` waits for every `CPU_SYNC_EVERY`-th step's results,
    which keeps XLA:CPU's collectives from aborting the process.

  Raises:
    ValueError: for a bad argument, naming it; ``init`` and ``step`` name, before
      any work, Linen variables given whole, a batch that does not split over
      the workers, a loss of the wrong shape, and a transform that sees each
      worker's own gradient (the optimizer ahead of the compressor).
  """
  if fsdp_axis is not None:
    fsdp.check_axis(fsdp_axis, mesh, axis_name, simulate_workers)
    if axis_name is None:
      others = [a for a in mesh.axis_names if a != fsdp_axis]
      axis_name = others[0] if len(others) == 1 else others
  axis_name = common.check_axis_name(parallel.data_axes(mesh, axis_name))
  if not set(common.axes_of(axis_name)) <= set(mesh.axis_names):
    raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh {mesh.axis_names}")
  workers = _check_simulated(simulate_workers, mesh, axis_name)
  if fsdp_axis is not None:
    workers *= mesh.shape[fsdp_axis]
  if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
    raise ValueError(f"micro_batches must be an integer >= 1, got {micro_batches!r}")
  if not callable(loss_fn):
    raise ValueError(f"loss_fn must be callable, got {loss_fn!r}")
  user_loss.Loss(loss_fn, model_state, has_aux, seed)  # its signature and seed, checked now
  # Simulated workers exchange inside one program on one device: no collective to drift.
  sync_every = (CPU_SYNC_EVERY if mesh.devices.flat[0].platform == "cpu"
                and simulate_workers is None else None)
  return DataParallel(loss_fn=loss_fn, tx=tx, mesh=mesh, axis_name=axis_name,
                      model_state=model_state, has_aux=has_aux, seed=seed,
                      micro_batches=micro_batches, simulate_workers=simulate_workers,
                      wrt=_param_filter() if wrt is None else wrt, workers=workers,
                      sync_every=sync_every, fsdp_axis=fsdp_axis)


def _param_filter():
  """``nnx.Param``, where flax is installed (the filter matters only for NNX modules)."""
  try:
    from flax import nnx  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  return nnx.Param


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


def sharded_initial_state(tx: optax.GradientTransformation, params, model_state, mesh: Mesh,
                          fsdp_axis: str) -> StepState:
  """The `StepState` at step 0 with parameters sliced over `fsdp_axis` (HSDP, `fsdp.initial`)."""
  if isinstance(params, dict) and "batch_stats" in params and "params" in params:
    return initial_state(tx, params, model_state, mesh)  # its error, named there
  sharded, opt_state = fsdp.initial(tx, params, dict(mesh.shape), fsdp_axis)
  return place_sliced(StepState(sharded, {} if model_state is None else model_state, opt_state,
                                np.zeros((), np.int32)), mesh, fsdp_axis)


def place_sliced(state: StepState, mesh: Mesh, fsdp_axis: str) -> StepState:
  """A host `StepState` of sliced parameters placed on `mesh` (`fsdp.place`); the rest replicated."""
  params, opt_state = fsdp.place(state.params, state.opt_state, mesh, fsdp_axis)
  return StepState(params, parallel.replicate(state.model_state, mesh), opt_state,
                   parallel.replicate(state.step, mesh))


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


def _accumulate(loss: user_loss.Loss, params, model_state, batch, key, micro_batches: int,
                axis_name):
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
          "passed": total("passed"), "skipped": total("skipped"), "exact": total("exact")}


def _average(model_state, metrics: dict, axis_name):
  """Model state and metrics as every worker's mean (one all-reduce), typed replicated."""
  leaves, treedef = jax.tree_util.tree_flatten(model_state)
  path = user_loss.first_prng_key(model_state)
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
