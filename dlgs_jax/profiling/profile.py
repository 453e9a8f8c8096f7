"""Measuring a `timeline.Profile` on the machine and mesh in use (`profile_model`).

* Compute: the forward time and the whole backward time of a Flax model are
  timed under `jax.jit` (in `profile_model`: 20 times, on the train step's own
  program at trained params on real batches); per-layer backward times come from timing each
  parameter-owning module's VJP alone on the input it sees in the model
  (captured with `flax.linen.intercept_methods`). Their sum misses what lies
  between modules (activations, pooling, shortcuts), so they are scaled to the
  measured whole backward time; the unscaled difference is reported.
* Update: each method's whole local update as training runs it (selection,
  error-feedback bookkeeping -- residual add, gather, new residual -- and the
  optimizer after it) with ``axis_name=None``, fitted as
  ``alpha + beta * elements`` over the sizes the method's messages have
  (`fit_update`). Every method is timed on groups of the model's own leaves
  holding its real gradients -- the last m leaves in backward order, up to the
  whole model (`suffix_groups`) --, from the state a few updates on real
  batches leave (residuals, momentum, thresholds): the grouping methods (one message for the
  model, or planned groups) send a group as one message, the per-leaf methods
  (`PER_LEAF_METHODS`) each leaf as its own message in one program, fitted as
  ``m * alpha + beta * elements`` (`fit_per_leaf`). One leaf as large as the
  model is not what they run: on ResNet-50 DLGS's update of one leaf as large
  as the model took ten times the step the benchmark measured on its 161
  leaves; nor is normal noise what they select from (`measure_update`). DLGS's exact
  and reuse steps are fitted apart and also amortised over its reuse period.
  Timing the selection alone misses the bookkeeping, which on CPU costs more
  than the selection. A program of its own also prices memory-bound updates
  above what the train step pays for them (both measured on ResNet-50:
  experiments/performance_notes.md), so each method's whole-model update is timed
  inside the step too, in paired rounds with the gradients program
  (`measure_update_in_step`), and its fitted cost is scaled to that where
  the rounds resolve it (`in_step_factors`, `scale_update_costs`).
* Refresh rate: how often DLGS's refresh rule recomputes a reused threshold
  depends on how gradients and residuals drift, so it is measured by training
  one worker for a few steps on real batches (`measure_refresh`).
* Communication: dense all-reduce, sparse all-gather and gTop-k timed on the
  current mesh over a range of message sizes and fitted as
  ``alpha + beta * bytes sent per worker``, alpha being the marginal cost of
  one more collective in a program (`measure_comm`); or, to look past this machine,
  `network_comm` builds the same costs from a latency and a link bandwidth.
* Overlap: whether the runtime hides a collective behind computation that does
  not depend on it (`measure_overlap`); the profile's ``overlap`` flag.

All timings are medians after warm-up. With several processes pass a
`barrier` (e.g. `multihost_utils.sync_global_devices`): every process then
starts each repetition together, as in training, so processes sharing a core
are timed sharing it.
"""

from __future__ import annotations
from typing import Any, Callable, Optional, Sequence
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from dlgs_jax.compress import grouping
from dlgs_jax.workload import parallel
from dlgs_jax.planning.timeline import Profile
from dlgs_jax.profiling.comm import measure_comm
from dlgs_jax.profiling.compute import measure_compute, model_gradients
from dlgs_jax.profiling.in_step import IN_STEP_ROUNDS, PROFILE_TRAIN_STEPS, in_step_factors, measure_refresh, measure_update_in_step, scale_update_costs, train_locally, whole_model_update
from dlgs_jax.profiling.update import UPDATE_BATCHES, UPDATE_METHODS, fit_update, measure_update, update_grid



def comm_grid(total: int) -> list[int]:
  """Message sizes (elements) the collectives are timed at, for a model of `total` values."""
  return sorted({int(s) for s in np.geomspace(4096, max(total, 8192), 5)})


def profile_model(name: str, *, density: float, batch_size: int = 32,
                  image_size: Optional[int] = None, mesh: Optional[Mesh] = None,
                  reuse_every: int = 10, repeats: int = 5, seed: int = 0,
                  methods: Sequence[str] = UPDATE_METHODS,
                  refresh_below: Optional[float] = 0.5,
                  batches: Optional[tuple[np.ndarray, np.ndarray]] = None,
                  barrier: Optional[Callable[[], Any]] = None,
                  in_step_rounds: int = IN_STEP_ROUNDS,
                  comm_axis: Optional[str] = None, time_comm: bool = True,
                  progress: Callable[[str], None] = lambda message: None) -> tuple[Profile, dict]:
  """Measures a full profile of model `name` on this machine.

  Args:
    name: a `models.MODELS` name.
    density: density used to size the sparse messages of the benchmarks.
    batch_size: examples per worker.
    image_size: input side length (default: the model's own).
    mesh: the mesh whose collectives are timed (default: all devices); with one
      device no communication cost is measured.
    reuse_every: DLGS reuse period for its amortised update cost.
    repeats: timing repeats per measurement.
    seed: initialisation seed.
    methods: the methods whose update cost is measured.
    refresh_below: DLGS's refresh rule; when "dlgs" is among `methods` and
      this is not None, the share of thresholds it recomputes per step is
      measured (`measure_refresh`) into ``profile.dlgs_exact_fraction``.
    batches: (uint8 images [n, batch_size, H, W, C], labels [n, batch_size])
      for the refresh measurement and for the gradients the updates are timed
      on: `PROFILE_TRAIN_STEPS` dense steps on the first batches
      (`train_locally`), then the next `UPDATE_BATCHES` batches' gradients at
      the trained params (`model_gradients`); the forward and backward totals
      are timed at those params on all of them in turn; default: one worker's
      `data.benchmark_batches` (real CIFAR-10 images at 32x32x3).
    barrier: see `median_seconds`; pass one when several processes profile
      together.
    in_step_rounds: paired rounds per method of `measure_update_in_step`;
      each update cost is scaled to what the train step pays for it where
      those rounds resolve it (`in_step_factors`); 0 keeps the standalone
      costs.
    comm_axis: the mesh axis the workers exchange over (default: the mesh's
      first); on a node mesh "node" profiles the exchange between nodes (the
      profile's workers are then the nodes).
    time_comm: False leaves the collectives unmeasured (``profile.comm`` empty),
      for a caller that models the network instead (`Profile.with_comm`).
    progress: called with a message before each phase.

  Returns:
    (profile, details) where details holds the raw measurements, the
    backward-time check and the in-step factors ("update_in_step").
  """
  from dlgs_jax.workload import losses
  from dlgs_jax.workload import data
  from dlgs_jax.workload import models

  model, shape = models.create_model(name)
  if image_size is not None:
    shape = (image_size, image_size, shape[2])
  if batches is None:
    # Twice the reuse period: enough distinct batches for `measure_refresh`.
    batches = data.benchmark_batches(shape, model.num_classes, 2 * reuse_every, 1, batch_size)
    batches = (batches[0][:, 0], batches[1][:, 0])
  rng = np.random.default_rng(seed)
  images = jnp.asarray(rng.standard_normal((batch_size,) + shape).astype(np.float32))
  labels = jnp.asarray(rng.integers(0, model.num_classes, batch_size).astype(np.int32))
  variables = losses.init_variables(model, images[:1], seed)
  trained = train_locally(model, variables, batches[0], batches[1], PROFILE_TRAIN_STEPS)
  progress("timing forward, backward and each layer's backward")
  # At the trained params, on the real batches: what the benchmark's steps run.
  compute = measure_compute(model, trained, images, labels, repeats=repeats, barrier=barrier,
                            batches=batches)
  total = sum(compute["sizes"])
  progress(f"timing the local update of {', '.join(methods)}")
  after = (PROFILE_TRAIN_STEPS + np.arange(UPDATE_BATCHES)) % batches[0].shape[0]
  leaf_grads = []
  for grads in model_gradients(model, trained, batches[0][after], batches[1][after]):
    grad_of = dict(zip(grouping.leaf_paths(grads), jax.tree_util.tree_leaves(grads)))
    leaf_grads.append([grad_of[p] for p in compute["order"]])
  sparsify, sparsify_raw = measure_update(
      update_grid(compute["sizes"]), density, methods=methods, reuse_every=reuse_every,
      repeats=repeats, barrier=barrier, leaf_grads=leaf_grads)
  in_step_raw, in_step = {}, {}
  if in_step_rounds:
    progress(f"timing the updates inside the step ({in_step_rounds} paired rounds each)")
    in_step_raw = measure_update_in_step(model, trained, batches, density, compute["order"],
                                         methods=methods, reuse_every=reuse_every,
                                         rounds=in_step_rounds, barrier=barrier)
    in_step = in_step_factors(in_step_raw, whole_model_update(sparsify, compute["sizes"]))
    sparsify = scale_update_costs(sparsify, in_step, reuse_every)
  mesh = mesh or parallel.data_mesh()
  comm_axis = mesh.axis_names[0] if comm_axis is None else comm_axis
  workers = int(mesh.shape[comm_axis])
  comm, comm_raw = {}, {}
  if workers > 1 and time_comm:
    progress(f"timing collectives on {workers} workers")
    comm, comm_raw = measure_comm(mesh, comm_grid(total), density, repeats=repeats,
                                  axis=comm_axis)
  fraction = None
  if "dlgs" in methods and refresh_below is not None:
    progress("measuring how often DLGS's refresh rule recomputes thresholds")
    fraction = measure_refresh(model, variables, *batches, density, reuse_every=reuse_every,
                               refresh_below=refresh_below)
  # Measured on the emulated cluster (`measure_overlap`, experiments/overlap_probe.py):
  # XLA's CPU backend hides none of a collective's time behind independent work
  # (a gloo collective blocks its thread); GPU backends run collectives
  # asynchronously.
  overlap = jax.default_backend() != "cpu"
  profile = Profile(
      model=name, paths=compute["order"], sizes=compute["sizes"], overlap=overlap,
      t_forward=compute["t_forward"], t_backward=compute["t_backward"], workers=workers,
      sparsify=sparsify, comm=comm, dlgs_exact_fraction=fraction,
      source=(f"measured on {jax.default_backend()} ({workers} devices of "
              f"{jax.devices()[0].device_kind}), batch {batch_size} per worker, "
              f"input {shape}"))
  details = {key: compute[key] for key in
             ("backward_measured", "backward_sum_alone", "backward_difference", "totals_raw")}
  details.update(sparsify_raw=sparsify_raw, comm_raw=comm_raw, reuse_every=reuse_every,
                 update_in_step_raw=in_step_raw, update_in_step=in_step)
  return profile, details


def refit_profile(profile: Profile, details: dict) -> Profile:
  """`profile` with its update costs fitted again from the raw timings in `details`.

  For profiles measured before a change of the fitting rule (`fit_update`):
  the raw timings are stored beside every profile (``details.json``). Where
  they hold in-step rounds (`measure_update_in_step`), the refitted costs are
  scaled by the factors those give against them (`in_step_factors`).

  Raises:
    ValueError: `details` has no raw update timings.
  """
  raw = details.get("sparsify_raw")
  if not raw or "sizes" not in raw:
    raise ValueError("these details hold no raw update timings ('sparsify_raw'); "
                     "measure the profile again")
  sparsify = fit_update(raw, max(profile.sizes))
  in_step_raw = details.get("update_in_step_raw")
  if in_step_raw:
    factors = in_step_factors(in_step_raw, whole_model_update(sparsify, profile.sizes))
    sparsify = scale_update_costs(sparsify, factors, int(details.get("reuse_every", 10)))
  return dataclasses.replace(profile, sparsify=sparsify)
