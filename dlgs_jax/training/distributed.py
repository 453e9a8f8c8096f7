"""Starting JAX's multi-process runtime (`jax.distributed`) from flags or environment.

JAX's own `jax.distributed` is the distributed engine; this module only finds
its three settings -- coordinator address, process count, process id -- from
explicit arguments, then ``DLGS_COORDINATOR_ADDRESS`` / ``DLGS_NUM_PROCESSES`` /
``DLGS_PROCESS_ID``, then SLURM (which JAX detects itself), and turns on gloo
collectives for CPU runs. A run with one process needs nothing.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

import jax

ENV_COORDINATOR = "DLGS_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "DLGS_NUM_PROCESSES"
ENV_PROCESS_ID = "DLGS_PROCESS_ID"
ENV_LOCAL_DEVICES = "DLGS_LOCAL_DEVICES"
ENV_PARENT_PID = "DLGS_PARENT_PID"  # set by dlgs-launch: die with it
# A process whose peer died learns it from the coordination service's heartbeats:
# within seconds rather than JAX's default 100 s; shutdown waits at most 30 s.
_TIMEOUTS = {"heartbeat_timeout_seconds": 10, "shutdown_timeout_seconds": 30}
# Seconds a process waits for all the others to join, by default. JAX's own limit
# is set past ours: when it runs out, XLA aborts the process from C++.
INIT_TIMEOUT = 300  # JAX's own default; cluster jobs may start minutes apart
_JAX_GRACE = 60


def _env_int(name: str) -> Optional[int]:
  value = os.environ.get(name)
  if value in (None, ""):
    return None
  try:
    return int(value)
  except ValueError:
    raise ValueError(f"{name} must be an integer, got {value!r}") from None


# What JAX's SLURM detection reads (jax._src.clusters.SlurmCluster): set by
# `srun` for each task of a job step.
SLURM_VARIABLES = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
                   "SLURM_LOCALID")


def in_slurm_job() -> bool:
  """True inside a SLURM job step (``srun``), where JAX finds its settings itself.

  JAX then makes one process per accelerator: task ``SLURM_LOCALID`` of a node
  uses that node's device number ``SLURM_LOCALID`` (so ask SLURM for one task
  per GPU). ``JAX_COORDINATOR_PORT`` overrides the port JAX derives from the
  job id.
  """
  return all(name in os.environ for name in SLURM_VARIABLES)


def die_with_parent() -> None:
  """A launched process (``DLGS_PARENT_PID`` set) gets SIGTERM when its launcher dies.

  SIGTERM makes a run save a checkpoint and leave (`training.persistence.preemption`), so a
  launcher killed outright does not leave its processes running without it.
  Linux only; elsewhere nothing happens.
  """
  parent = _env_int(ENV_PARENT_PID)
  if parent is None or not sys.platform.startswith("linux"):
    return
  import ctypes
  import signal

  ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
  if os.getppid() != parent:  # the launcher was already gone
    raise SystemExit(f"the launcher (process {parent}) has exited; not starting")


def initialize(
    coordinator_address: Optional[str] = None,
    num_processes: Optional[int] = None,
    process_id: Optional[int] = None,
    *,
    local_cpu_devices: Optional[int] = None,
    platform: Optional[str] = None,
    init_timeout: int = INIT_TIMEOUT,
) -> None:
  """Starts `jax.distributed` when more than one process takes part.

  Must run before anything touches a JAX device.

  Args:
    coordinator_address: "host:port" of process 0's coordinator service.
    num_processes: total number of processes.
    process_id: this process's id in [0, num_processes).
    local_cpu_devices: simulated CPU devices in this process (CPU runs only;
      default ``DLGS_LOCAL_DEVICES`` or JAX's default of one).
    platform: "cpu" forces gloo CPU collectives; default: from ``JAX_PLATFORMS``.
    init_timeout: seconds to wait for every process to join; then this process
      says which it waited for and exits with status 1 (`_join_or_exit`).

  Raises:
    ValueError: when the settings are incomplete or inconsistent.
  """
  die_with_parent()
  coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR) or None
  num_processes = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
  process_id = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)
  local_cpu_devices = (local_cpu_devices if local_cpu_devices is not None
                       else _env_int(ENV_LOCAL_DEVICES))
  platform = platform or os.environ.get("JAX_PLATFORMS", "").split(",")[0] or None

  if local_cpu_devices is not None:
    if local_cpu_devices < 1:
      raise ValueError(f"local_cpu_devices must be >= 1, got {local_cpu_devices!r}")
    jax.config.update("jax_num_cpu_devices", local_cpu_devices)

  explicit = coordinator_address is not None or num_processes is not None or process_id is not None
  if not explicit and not in_slurm_job():
    return  # a single process: nothing to start
  if explicit:
    if num_processes is None or num_processes < 1:
      raise ValueError(f"num_processes must be >= 1, got {num_processes!r}")
    if num_processes == 1 and coordinator_address is None:
      return
    if coordinator_address is None or ":" not in coordinator_address:
      raise ValueError(
          f"coordinator_address must be 'host:port', got {coordinator_address!r} "
          f"(set --coordinator or {ENV_COORDINATOR})")
    if process_id is None or not 0 <= process_id < num_processes:
      raise ValueError(
          f"process_id must be in [0, {num_processes}), got {process_id!r} "
          f"(set --process-id or {ENV_PROCESS_ID})")
  if platform in (None, "cpu"):
    # gloo only matters for CPU collectives; GPU runs use NCCL regardless.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if isinstance(init_timeout, bool) or not isinstance(init_timeout, int) or init_timeout < 1:
    raise ValueError(f"init_timeout must be an integer number of seconds >= 1, got "
                     f"{init_timeout!r}")
  timeouts = dict(_TIMEOUTS, initialization_timeout=init_timeout + _JAX_GRACE)
  if explicit:
    _join_or_exit(lambda: jax.distributed.initialize(
        coordinator_address, num_processes, process_id, **timeouts),
        coordinator_address, num_processes, process_id, init_timeout)
  else:  # JAX reads SLURM's variables itself
    _join_or_exit(lambda: jax.distributed.initialize(**timeouts),
                  f"the SLURM job's coordinator (job {os.environ.get('SLURM_JOB_ID')})",
                  _env_int("SLURM_NTASKS"), _env_int("SLURM_PROCID"), init_timeout)


def _join_or_exit(start, address: str, num_processes, process_id, timeout: int) -> None:
  """Runs `start` (which blocks until every process has joined), saying what it waits for.

  XLA ends a process whose join times out with a C++ abort and a stack trace;
  a watchdog thread ends it first, in one line (exit status 1). A process
  cannot see which of the others have joined: process 0 names all the others,
  another process the coordinator it could not reach.
  """
  import threading

  others = [i for i in range(num_processes or 0) if i != process_id]
  waited = (f"{len(others)} more" if process_id == 0 else "process 0's coordinator")
  print(f"process {process_id} of {num_processes} waiting for {waited} at {address}, "
        f"timeout {timeout} s (--init-timeout)", file=sys.stderr, flush=True)

  def give_up():
    if process_id == 0:
      missing = ", ".join(map(str, others[:8])) + (" ..." if len(others) > 8 else "")
      why = (f"not every process joined: waited for process ids {missing} (one or more "
             f"never started, or was given another --coordinator or --num-processes)")
    else:
      why = ("no coordinator answered, or not every process joined: start process 0 "
             "there, every process with the same --coordinator and --num-processes")
    print(f"process {process_id} of {num_processes} at {address}: gave up after {timeout} s: "
          f"{why}; or raise --init-timeout", file=sys.stderr, flush=True)
    os._exit(1)  # the main thread is blocked inside XLA's connect

  watchdog = threading.Timer(timeout, give_up)
  watchdog.daemon = True
  watchdog.start()
  try:
    start()
  finally:
    watchdog.cancel()
