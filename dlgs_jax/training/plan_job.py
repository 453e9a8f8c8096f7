"""One ``dlgs-plan`` job: a `PlanConfig` in, every planner compared, the chosen plan written.

The command line only turns flags into a `PlanConfig`; everything here works
on the config: the profile (loaded, or measured on this machine), re-priced
for a modelled network, the methods' costs, every planner's timeline, and the
plan, profile and Gantt chart written to ``out_dir``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

from dlgs_jax.compress.methods import ConfigError, MethodConfig
from dlgs_jax.planning import choice, network, planner, timeline
from dlgs_jax.planning.timeline import MethodCosts, Profile, simulate


class PlanJobError(ValueError):
  """A profile the job cannot use, or options that do not fit it (one line)."""


@dataclasses.dataclass(frozen=True)
class PlanConfig:
  """What a plan is for, the network it prices, and where its profile comes from.

  Attributes:
    model: smallcnn, resnet20, vgg16 or resnet50.
    density: fraction of values sent.
    method: the method planned for (one of `timeline.METHODS`).
    planner: the planner whose plan is written (one of `planner.PLANNERS`).
    collective: Top-k, LAGS, DLGS: the sparse exchange priced ("allgather",
      "gtopk", "owners"), or "auto": the one `planning.choice` prices fastest
      for the model's values on this profile's network (dense bfloat16 among
      them), recorded in a JSON beside the plan.
    profile: a profile JSON to load instead of measuring one here.
    bandwidth: model the network instead of the profile's measured one, e.g. "1gbit".
    latency: per-step latency in seconds with `bandwidth`.
    workers: P with `bandwidth` (None: the profile's); with `node_size`, the nodes.
    node_size: devices per node, for a two-level exchange (None: flat).
    fast_bandwidth: with `node_size`, the link inside a node.
    fast_latency: with `node_size`, its per-step latency in seconds.
    devices: simulated CPU devices the collectives are measured on (CPU only).
    batch_size: examples per worker in the measured step.
    image_size: input side (None: the model's).
    reuse_every: DLGS's steps between exact thresholds.
    refresh_below: DLGS's refresh rule (None: the paper's fixed schedule).
    repeats: timing repeats of the profile.
    in_step_rounds: paired rounds timing each update inside the step (None:
      `profiling.IN_STEP_ROUNDS`; 0 keeps the standalone costs).
    out_dir: where the plan, the profile and the chart are written.
  """
  model: str
  density: float = 0.01
  method: str = "dlgs"
  planner: str = "optimal"
  collective: str = "allgather"
  profile: Optional[str] = None
  bandwidth: Optional[str] = None
  latency: float = 25e-6
  workers: Optional[int] = None
  node_size: Optional[int] = None
  fast_bandwidth: str = "2400gbit"
  fast_latency: float = 5e-6
  devices: int = 8
  batch_size: int = 32
  image_size: Optional[int] = None
  reuse_every: int = 10
  refresh_below: Optional[float] = 0.5
  repeats: int = 5
  in_step_rounds: Optional[int] = None
  out_dir: str = "runs/plan"

  def validate(self) -> "PlanConfig":
    """Returns the config if every option is in range.

    Raises:
      ConfigError: naming the first bad option, its value and the rule.
    """
    if self.method not in timeline.METHODS:
      raise ConfigError("method", self.method, f"choose one of {timeline.METHODS}")
    if self.planner not in planner.PLANNERS:
      raise ConfigError("planner", self.planner, f"choose one of {planner.PLANNERS}")
    MethodConfig(self.method, density=self.density, reuse_every=self.reuse_every,
                 collective=self.collective).validate()
    if self.refresh_below is not None and not 0.0 <= self.refresh_below <= 1.0:
      raise ConfigError("refresh_below", self.refresh_below,
                        "must be a number in [0, 1] or None")
    for option, low in (("workers", 1), ("devices", 1), ("node_size", 1), ("batch_size", 1),
                        ("repeats", 1), ("image_size", 8), ("in_step_rounds", 0)):
      value = getattr(self, option)
      if value is not None and not value >= low:
        raise ConfigError(option, value, f"must be >= {low}")
    network.check_link(self.bandwidth, self.latency)
    network.check_link(self.fast_bandwidth, self.fast_latency, prefix="fast_")
    if (self.node_size or 1) > 1 and not self.bandwidth:
      raise ConfigError("node_size", self.node_size, "needs --bandwidth, the link between "
                        "nodes (the collectives a profile measured are flat)")
    if self.profile is not None and not Path(self.profile).is_file():
      raise ConfigError("profile", self.profile, "no such file")
    return self

  @property
  def local(self) -> int:
    """Devices per node (1: a flat exchange)."""
    return self.node_size or 1


def load_or_measure(config: PlanConfig, progress=print) -> Profile:
  """The profile of ``config.profile``, or one measured here and written to ``out_dir``.

  Raises:
    PlanJobError: for a file that is not a profile, or one of another model.
  """
  if config.profile:
    try:
      profile = Profile.load(config.profile)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
      raise PlanJobError(f"--profile {config.profile!r} is not a profile: {e}") from None
    if profile.model != config.model:
      raise PlanJobError(f"profile {config.profile} is for model {profile.model!r}, not "
                         f"{config.model!r}")
    progress(f"profile {config.profile}: {profile.source}")
    return profile
  from dlgs_jax import profiling  # pylint: disable=g-import-not-at-top

  progress(f"measuring {config.model} on this machine ...")
  profile, details = profiling.profile_model(
      config.model, density=config.density, batch_size=config.batch_size,
      image_size=config.image_size, reuse_every=config.reuse_every, repeats=config.repeats,
      in_step_rounds=(profiling.IN_STEP_ROUNDS if config.in_step_rounds is None
                      else config.in_step_rounds),
      methods=tuple(dict.fromkeys((config.method, "dense"))),
      refresh_below=config.refresh_below if config.method == "dlgs" else None,
      progress=lambda m: progress("  " + m))
  progress(f"  backward: measured whole {details['backward_measured'] * 1e3:.2f} ms, sum of "
           f"layers timed alone {details['backward_sum_alone'] * 1e3:.2f} ms "
           f"({details['backward_difference'] * 100:+.1f}%); layer times scaled to the whole")
  path = Path(config.out_dir) / f"{config.model}_profile.json"
  profile.save(path)
  progress(f"  wrote {path}")
  return profile


def on_network(config: PlanConfig, profile: Profile) -> Profile:
  """`profile` re-priced for ``config.bandwidth`` links (unchanged without it).

  With ``node_size`` L the links join nodes, each shared by its L devices, and
  ``workers`` counts nodes.

  Raises:
    PlanJobError: for ``workers`` without ``bandwidth``.
  """
  if config.bandwidth:
    workers = config.workers or profile.workers
    bits = network.parse_bandwidth(config.bandwidth)
    between = (f"{workers} nodes of {config.local} devices" if config.local > 1
               else f"{workers} workers")
    return profile.with_comm(
        network.network_comm(workers, bits / config.local, config.latency), workers,
        f"network modelled: {between}, {config.bandwidth} links, "
        f"{config.latency * 1e6:g} us latency")
  if config.workers and config.workers != profile.workers:
    raise PlanJobError("--workers needs --bandwidth (measured costs hold for the measured P "
                       "only)")
  return profile


def costs_of(config: PlanConfig, profile: Profile, progress=print) -> MethodCosts:
  """The planned method's costs: two-level links with ``node_size``, DLGS's exact share."""
  exchange = {}
  if config.local > 1:
    fast = network.network_comm(config.local, network.parse_bandwidth(config.fast_bandwidth),
                                config.fast_latency)["allreduce"]
    exchange = {"fast_size": config.local, "fast_link": fast}
  fraction = planner.dlgs_exact_fraction(profile, config.method, config.refresh_below)
  if config.method == "dlgs" and config.refresh_below is not None:
    progress("note: the profile has no measured refresh rate; DLGS is priced at the fixed "
             "schedule's cost" if fraction is None else
             f"DLGS refresh rule: {fraction:.0%} of thresholds computed exactly per step "
             "(measured)")
  collective = None if config.collective in ("allgather", "auto") else config.collective
  return MethodCosts(config.method, config.density, exact_fraction=fraction,
                     collective=collective, **exchange)


def chosen_collective(config: PlanConfig, profile: Profile, progress=print) -> dict:
  """``collective="auto"``: the seconds of each exchange, the fastest, and the method's fastest.

  The whole model as one message; dense bfloat16 is among them, for comparison.
  """
  size = sum(profile.sizes)
  priced = choice.for_method(config.method, size, config.density, profile.workers, profile.comm)
  seconds = priced["seconds"]
  progress(f"one message of {size:,} values at density {config.density:g}, "
           f"{world(config, profile)}: " + ", ".join(
               f"{name} {t * 1e3:.2f} ms" for name, t in seconds.items())
           + f"; fastest: {priced['fastest']}; {config.method}'s: {priced['collective']}")
  return {"model": config.model, "density": config.density, "workers": profile.workers,
          "seconds": seconds, "chosen": priced["fastest"],
          "collective": priced["collective"]}


def world(config: PlanConfig, profile: Profile) -> str:
  """The workers planned for, in words."""
  return (f"{profile.workers} nodes x {config.local} devices (two-level)" if config.local > 1
          else f"P = {profile.workers}")


def compare_planners(config: PlanConfig, profile: Profile, costs: MethodCosts,
                     progress=print) -> dict:
  """Every planner's timeline (name -> `Timeline`), its table printed through `progress`."""
  dense_costs = MethodCosts("dense", 1.0, fast_size=costs.fast_size, fast_link=costs.fast_link)
  dense_time = simulate(profile, planner.optimal(profile, dense_costs), dense_costs).t_iter
  progress(f"\n{config.model}, {config.method} at density {config.density:g}, "
           f"{world(config, profile)}; {profile.source}")
  progress(f"dense all-reduce ({'two-level, ' if costs.fast_size > 1 else ''}optimal fusion): "
           f"{dense_time * 1e3:.2f} ms per iteration\n")
  header = (f"{'planner':8s} {'groups':>6s} {'t_iter ms':>10s} {'compute':>9s} "
            f"{'sparsify':>9s} {'comm exp.':>9s} {'speedup':>8s}")
  progress(header + "\n" + "-" * len(header))
  timelines = {}
  for name in planner.PLANNERS:
    tl = simulate(profile, planner.PLANNER_FUNCTIONS[name](profile, costs), costs)
    timelines[name] = tl
    progress(f"{name:8s} {len(tl.groups):6d} {tl.t_iter * 1e3:10.2f} {tl.compute * 1e3:9.2f} "
             f"{tl.sparsify * 1e3:9.2f} {tl.comm_exposed * 1e3:9.2f} "
             f"{dense_time / tl.t_iter:7.2f}x")
  progress("")
  for name, tl in timelines.items():
    sizes = [sum(profile.sizes[i] for i in g) for g in tl.groups]
    progress(f"{name}: {len(tl.groups)} groups, layers per group {[len(g) for g in tl.groups]}, "
             f"elements per group {sizes}")
  return timelines


def run(config: PlanConfig, progress=print) -> dict[str, Path]:
  """The whole job: the plan of ``config.planner`` and a Gantt chart of every planner's.

  Returns:
    ``{"plan": path, "chart": path}`` in ``config.out_dir``.

  Raises:
    ConfigError: for an option out of range (before anything is measured).
    PlanJobError: for a profile the job cannot use.
  """
  from dlgs_jax.planning.gantt import draw_gantt  # pylint: disable=g-import-not-at-top

  config.validate()
  out_dir = Path(config.out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  profile = on_network(config, load_or_measure(config, progress))
  chosen = chosen_collective(config, profile, progress) if config.collective == "auto" else None
  if chosen:
    config = dataclasses.replace(config, collective=chosen["collective"])
  costs = costs_of(config, profile, progress)
  timelines = compare_planners(config, profile, costs, progress)
  plan = planner.make_plan(profile, config.method, config.density, config.planner,
                           exact_fraction=costs.exact_fraction, fast_size=costs.fast_size,
                           fast_link=costs.fast_link)
  stem = f"{config.model}_{config.method}_{config.density:g}"
  paths = {"plan": out_dir / f"{stem}_{config.planner}_plan.json",
           "chart": out_dir / f"{stem}_timeline.png"}
  plan.save(paths["plan"])
  if chosen:
    paths["collective"] = out_dir / f"{stem}_collective.json"
    paths["collective"].write_text(json.dumps(chosen, indent=1) + "\n")
  draw_gantt(profile, timelines, paths["chart"], title=f"{config.model}, {config.method} "
             f"density {config.density:g}, {world(config, profile)}")
  return paths
