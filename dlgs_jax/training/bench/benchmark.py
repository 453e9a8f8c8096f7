"""Iteration time and its measured breakdown, on the processes of the current job.

Run one copy per process (``python -m dlgs_jax.cli.benchmark``, e.g. under
`dlgs_jax.cluster`). `breakdown` times, every process in lockstep (a barrier
before each repetition), five jitted programs:

* ``compute``  -- forward + backward on the local batch;
* ``compress`` -- compute + the method's update with ``axis_name=None`` and
  the params update: selection, residual bookkeeping and the optimizer, no
  communication;
* ``exchange`` -- the method's update and the params update inside
  ``shard_map`` on fixed gradients: selection + collectives, no
  forward/backward;
* ``update``   -- the same update on the same gradients and state with
  ``axis_name=None``: ``exchange`` without its collectives;
* ``step``     -- the real training step (compute, selection, collectives).

The step is timed first, from initialisation; the four others then run at the
params and optimizer state the timed steps left: at initialisation ResNets'
gradients are mostly exact zeros, which makes selections cheaper than in
training. Each repetition takes the next of ``batches`` distinct batches per
worker (real CIFAR-10 images when the input is 32x32x3), and the train step uses
training's learning rate: DLGS's refresh rule and DGC's threshold search depend
on how gradients change from step to step.

Breakdown (medians): compute; sparsification = compress - compute;
non-overlapped communication = step - compress; communication alone =
exchange - update (the two programs differ only by the collectives); overlap =
communication alone - non-overlapped. "Communication alone" can be far below
what the collectives cost by themselves (TernGrad's 161 all-gathers on
ResNet-50: experiments/performance_notes.md).

`compare` times only the train steps of several methods in one job,
interleaved: ``rounds`` rounds, each timing ``steps`` steps of every method, the
order rotated from round to round, so each round is a paired comparison.
`profile` measures a planner profile on the same processes, and `overlap` asks
whether the runtime hides a collective behind independent computation.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Optional

from dlgs_jax.compress.methods import METHODS, MethodConfig, base_method, known, method_config
from dlgs_jax.compress.optimizer import OptimizerConfig, build_optimizer
from dlgs_jax.training.compiling import check_slots
from dlgs_jax.training.plans import backward_order_of

# The programs every process times, in the order of ``per_process_median``'s columns.
PROGRAMS = ("compute", "compress", "exchange", "update", "step")


@dataclasses.dataclass(frozen=True)
class BenchmarkConfig:
  """What a benchmark job measures.

  Attributes:
    model: a model name.
    method: the method (and options) of `breakdown`; its options are shared
      by the methods of `compare` (``min_ndim``/``send_whole`` by the
      layer-wise ones), a variant's own options winning.
    batch_size: examples per worker per step.
    image_size: input side (None: the model's).
    plan: a plan JSON giving the method's groups (`breakdown`).
    steps: timed repetitions per program.
    warmup: untimed repetitions first.
    batches: distinct batches per worker, taken in turn.
    out: JSON result written by process 0.
    compare: methods or variants `compare` times.
    rounds: `compare`'s rounds.
    plans: `compare`'s groups per method: name -> plan JSON.
    compile_slots: `compare`: processes compiling at once, the others
      waiting their turn (`compiling.compile_in_turns`); None: all at once.
  """
  model: str = "resnet20"
  method: MethodConfig = MethodConfig()
  batch_size: int = 8
  image_size: Optional[int] = None
  plan: Optional[str] = None
  steps: int = 20
  warmup: int = 3
  batches: int = 8
  out: Optional[str] = None
  compare: tuple = ()
  rounds: int = 8
  plans: dict = dataclasses.field(default_factory=dict)
  compile_slots: Optional[int] = None

  def validate(self) -> "BenchmarkConfig":
    """Raises ValueError naming the first bad setting."""
    for name in ("batches", "steps", "batch_size"):
      if getattr(self, name) < 1:
        raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
    check_slots(self.compile_slots)
    if self.compare:
      # The shared options are checked as each compared method takes them.
      self._validate_compare()
      for name in self.compare:
        self.compared_method(name)
    elif self.plans or self.compile_slots is not None:
      given = "--plans" if self.plans else "--compile-slots"
      raise ValueError(f"{given} is for --compare; got {given} "
                       f"{self.plans or self.compile_slots!r} without it")
    else:
      self.method.validate()
    return self

  def _validate_compare(self) -> None:
    names = list(self.compare)
    if len(set(names)) != len(names) or "" in names:
      raise ValueError(f"--compare needs distinct method names, got {','.join(names)!r}")
    unknown = [name for name in names if not known(exchange_of(name)[0])]
    if unknown:
      raise ValueError(f"--compare: unknown methods {unknown} (methods: {', '.join(METHODS)}, "
                       "or a variant such as dlgs-paper)")
    if self.rounds < 1:
      raise ValueError(f"--rounds must be >= 1, got {self.rounds}")
    if self.plan:
      raise ValueError(f"--compare takes its plans as --plans METHOD=PLAN.json, got --plan "
                       f"{self.plan!r}")
    stray = sorted(set(self.plans) - set(names))
    if stray:
      raise ValueError(f"--plans names methods not in --compare: {stray}")
    fixed = sorted(n for n in self.plans
                   if not METHODS[base_method(exchange_of(n)[0])].takes_groups)
    if fixed:
      raise ValueError(f"--plans: {fixed} send a fixed message layout and take no plan")

  def compared_method(self, name: str) -> MethodConfig:
    """The checked config of method or variant `name` in a `compare` run."""
    name = exchange_of(name)[0]
    shared = dataclasses.asdict(self.method)
    shared.pop("name")
    if not METHODS[base_method(name)].layer_wise:
      shared.pop("min_ndim"), shared.pop("send_whole")
    return method_config(name, **shared).validate()


# A compared method's name with this suffix runs the two-level exchange
# (`compress.hierarchical`) on a (node, local) mesh: "dlgs@2l".
TWO_LEVEL = "@2l"


def exchange_of(name: str) -> tuple[str, bool]:
  """(method or variant name, whether it runs in two levels) of a compared name."""
  if name.endswith(TWO_LEVEL):
    return name[:-len(TWO_LEVEL)], True
  return name, False


def time_repetitions(run, repetitions: int, barrier) -> list[float]:
  """Seconds of each of `repetitions` calls of `run`, every process starting together.

  Args:
    run: does one repetition and returns its (device) result.
    repetitions: how many to time.
    barrier: called before each repetition (all processes wait for each other).

  Returns:
    The wall time of each repetition, up to its result being ready.
  """
  import jax

  times = []
  for _ in range(repetitions):
    barrier()
    start = time.perf_counter()
    jax.block_until_ready(run())
    times.append(time.perf_counter() - start)
  return times


@dataclasses.dataclass
class Workload:
  """The model, its initial variables and this process's benchmark batches."""
  model: object
  shape: tuple
  mesh: object
  images: object  # uint8 [batches, local workers, batch, H, W, C]
  labels: object
  variables: dict
  order: list
  global_batches: list

  @property
  def workers(self) -> int:
    return int(self.mesh.devices.size)


def benchmark_inputs(config: BenchmarkConfig, mesh):
  """(model, input shape, images, labels): this process's workers' batches."""
  import jax

  from dlgs_jax.workload import data, models, parallel

  model, shape = models.create_model(config.model)
  if config.image_size:
    shape = (config.image_size, config.image_size, shape[2])
  local = parallel.local_worker_count(mesh)
  images, labels = data.benchmark_batches(shape, model.num_classes, config.batches, local,
                                          config.batch_size,
                                          first_worker=jax.process_index() * local)
  return model, shape, images, labels


def workload(config: BenchmarkConfig, mesh) -> Workload:
  """The `Workload` of a breakdown or compare run."""
  import numpy as np

  from dlgs_jax.workload import losses, parallel

  model, shape, images, labels = benchmark_inputs(config, mesh)
  sample = np.zeros((1,) + shape, np.uint8)
  variables = losses.init_variables(model, sample, seed=0)
  order = backward_order_of(model, variables["params"], variables.get("batch_stats", {}),
                            sample.shape)
  return Workload(model, shape, mesh, images, labels, variables, order,
                  [parallel.shard_batch((images[i], labels[i]), mesh)
                   for i in range(config.batches)])


def write_result(result: dict, path: Optional[str]) -> None:
  """Writes `result` as JSON from process 0 (nothing when `path` is None)."""
  import jax

  if path and jax.process_index() == 0:
    with open(path, "w") as f:
      json.dump(result, f, indent=1)


def optimizer_for(method: MethodConfig, axis_name, groups, order, fast_size=None):
  """Training's optimizer chain for `method`, at training's learning rate.

  How fast gradients drift decides how often DLGS must recompute a reused
  threshold, so the benchmark trains at the rate training uses. `fast_size`:
  devices per node of a two-level exchange (`axis_name` is then the pair of
  axes).
  """
  optimizer = OptimizerConfig()
  return build_optimizer(method, optimizer, axis_name=axis_name, schedule=optimizer.lr,
                         groups=groups, order=order, fast_size=fast_size)


def compare_groups(config: BenchmarkConfig, name: str, work: Workload):
  """(groups, description) of method `name` in a `compare` run."""
  from dlgs_jax.compress import grouping
  from dlgs_jax.planning import planner

  base = exchange_of(name)[0]
  if name in config.plans:
    plan = planner.Plan.load(config.plans[name])
    plan.check_compatible(paths=grouping.leaf_paths(work.variables["params"]),
                          workers=work.workers)
    return plan.groups, f"plan {os.path.basename(config.plans[name])}"
  if METHODS[base_method(base)].grouping == "optimal":
    # What the optimal planner chooses where collectives do not overlap computation.
    return [list(work.order)], "one message"
  return None, "the method's own"


def profile(config: BenchmarkConfig, mesh, out: str, methods: Optional[tuple] = None) -> None:
  """Measures a planner profile on these processes, in lockstep; process 0 writes it.

  Args:
    config: model, batches and the method (density, reuse period, refresh rule).
    mesh: the data mesh of every device.
    out: the profile's path (its raw timings go to ``out + ".details.json"``).
    methods: the methods whose update is timed (None: every modelled method).
  """
  import jax
  from jax.experimental import multihost_utils

  from dlgs_jax import profiling

  leader = jax.process_index() == 0
  _, _, images, labels = benchmark_inputs(config, mesh)
  # In lockstep, as the timed runs are: processes sharing a core share it.
  barrier = ((lambda: multihost_utils.sync_global_devices("profile"))
             if jax.process_count() > 1 else None)
  method = config.method
  # The refresh rate is measured on the batches the timed runs take (this
  # process's first worker's).
  measured, details = profiling.profile_model(
      config.model, density=method.density, batch_size=config.batch_size,
      image_size=config.image_size, mesh=mesh, reuse_every=method.reuse_every, barrier=barrier,
      refresh_below=method.refresh_below, batches=(images[:, 0], labels[:, 0]),
      **({"methods": methods} if methods else {}),
      progress=(lambda m: print(f"profile: {m}", flush=True)) if leader else (lambda m: None))
  if leader:
    measured.save(out)
    with open(out + ".details.json", "w") as f:
      # The raw timings too, so a profile can be fitted again without measuring.
      json.dump(details, f, indent=1)
    print(f"profile written to {out}: {measured.source}", flush=True)


def check_overlap(rounds: tuple, leaves: int, size: int) -> None:
  """Raises ValueError unless `overlap`'s settings make sense."""
  if min(rounds) < 1 or leaves < 1 or size < 2_000:
    raise ValueError(f"--overlap-rounds must be >= 1 (got {','.join(map(str, rounds))!r}), "
                     f"--overlap-leaves >= 1 (got {leaves}), --overlap-size >= 2000 "
                     f"(got {size})")


def overlap(mesh, out: str, *, rounds: tuple, leaves: int, size: int, repeats: int) -> None:
  """`profiling.measure_overlap` once per entry of `rounds`; process 0 writes the results."""
  import jax
  from jax.experimental import multihost_utils

  from dlgs_jax import profiling

  check_overlap(rounds, leaves, size)
  barrier = lambda: multihost_utils.sync_global_devices("overlap")  # noqa: E731
  leader = jax.process_index() == 0
  results = []
  for r in rounds:
    result = profiling.measure_overlap(mesh, leaves=leaves, size=size, rounds=r,
                                       repeats=repeats, barrier=barrier)
    results.append(result)
    if leader:
      ms = {k: f"{v * 1e3:.1f}" for k, v in result["seconds"].items()}
      print(f"overlap, {r} rounds of work per collective: {ms} ms, hidden "
            f"{result['hidden']:+.2f}", flush=True)
  write_result({"backend": jax.default_backend(), "processes": jax.process_count(),
                "results": results}, out)
