"""Start N local processes joined by `jax.distributed` (the engine of ``dlgs-launch``).

Each process gets the `jax.distributed` settings of `dlgs_jax.training.distributed`
(coordinator on localhost, process count, its id, simulated CPU devices) in its
environment and runs ``python -m dlgs_jax.cli.train <args>`` (or ``--module``).
Output is streamed line by line with a ``[rank]`` prefix. If any process
fails, the others are stopped (SIGTERM, then SIGKILL after ``--grace``
seconds), so no survivor is left waiting in a collective; the launcher exits
with the failing process's status. Ctrl-C stops them all.

    dlgs-launch --nproc 4 -- --model resnet20 --method dlgs --epochs 1
    dlgs-launch --nproc 2 --local-devices 2 -- --model smallcnn --steps 50

CPU only (gloo collectives); on GPU clusters use ``scripts/cluster/``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, Optional, Sequence


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def child_env(base: dict, rank: int, nproc: int, coordinator: str, local_devices: int) -> dict:
  """The environment of process `rank` (read by `dlgs_jax.training.distributed.initialize`)."""
  env = dict(base)
  env.update(DLGS_COORDINATOR_ADDRESS=coordinator, DLGS_NUM_PROCESSES=str(nproc),
             DLGS_PROCESS_ID=str(rank), DLGS_LOCAL_DEVICES=str(local_devices),
             JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", DLGS_PARENT_PID=str(os.getpid()))
  # A forced host device count would contradict DLGS_LOCAL_DEVICES.
  flags = without_forced_device_count(env.get("XLA_FLAGS", ""))
  if flags:
    env["XLA_FLAGS"] = flags
  else:
    env.pop("XLA_FLAGS", None)
  return env


def without_forced_device_count(xla_flags: str) -> str:
  """`xla_flags` less `--xla_force_host_platform_device_count`, for a process that
  sets its own device count."""
  return " ".join(f for f in xla_flags.split()
                  if not f.startswith("--xla_force_host_platform_device_count"))


class _Stopped(Exception):
  """The launcher itself was asked to stop (by `signum`)."""

  def __init__(self, signum: int):
    super().__init__(signum)
    self.signum = signum


# Signals that stop the launcher; each is passed on to the processes as SIGTERM, on
# which a run saves a checkpoint and leaves.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _stream(rank: int, pipe, lock: threading.Lock, out) -> None:
  for line in iter(pipe.readline, ""):
    with lock:
      out.write(f"[{rank}] {line}" if line.endswith("\n") else f"[{rank}] {line}\n")
      out.flush()
  pipe.close()


def _signal_live(procs: Sequence[subprocess.Popen], signum: int) -> None:
  """Sends `signum` to the process group of every process still running."""
  for p in procs:
    if p.poll() is None:
      try:
        os.killpg(p.pid, signum)
      except ProcessLookupError:
        pass


def _stop(procs: Sequence[subprocess.Popen], grace: float) -> None:
  """SIGTERM every live process group, then SIGKILL what is left after `grace` s."""
  _signal_live(procs, signal.SIGTERM)
  deadline = time.monotonic() + grace
  for p in procs:
    try:
      p.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      pass
  _signal_live(procs, signal.SIGKILL)
  for p in procs:
    p.wait()


def _forward_stop(signum: int, procs, grace: float, lock, out) -> int:
  """Passes a stop on as SIGTERM; 0 when every process then saved and left cleanly."""
  name = signal.Signals(signum).name
  with lock:
    out.write(f"dlgs-launch: {name}: asking every process to save and stop\n")
    out.flush()
  _stop(procs, grace)
  codes = [p.returncode for p in procs]
  if all(code == 0 for code in codes):
    return 0
  with lock:
    out.write(f"dlgs-launch: {name}: processes {[r for r, c in enumerate(codes) if c != 0]} "
              f"did not stop cleanly (statuses {codes})\n")
    out.flush()
  return 128 + signum


def launch(nproc: int, child_args: Sequence[str], *, local_devices: int = 1, port: int = 0,
           module: str = "dlgs_jax.cli.train", grace: float = 10.0, out=None,
           coordinator: Optional[str] = None,
           wrap: Optional[Callable[[int], Sequence[str]]] = None,
           extra_env: Optional[dict] = None) -> int:
  """Runs `nproc` processes of ``python -m module child_args``; returns the exit status.

  Args:
    nproc: processes.
    child_args: arguments of the module.
    local_devices: simulated CPU devices per process.
    port: coordinator port on localhost (0: a free one).
    module: the python module each process runs.
    grace: seconds between SIGTERM and SIGKILL when stopping processes.
    out: where the prefixed output goes (default stdout).
    coordinator: "host:port" of process 0's coordinator, instead of localhost.
    wrap: ``wrap(rank)`` gives a command prefix for that process (e.g.
      ``["ip", "netns", "exec", name]``).
    extra_env: variables added to every process's environment.

  Returns:
    0 when every process succeeded; otherwise the status of the first process
    that failed (a negative status -N, for a process killed by signal N, is
    returned as 128 + N).
  """
  out = out or sys.stdout
  coordinator = coordinator or f"127.0.0.1:{port or free_port()}"
  lock = threading.Lock()
  procs: list[subprocess.Popen] = []
  threads = []
  failed: Optional[tuple[int, int]] = None

  def on_signal(signum, frame):
    raise _Stopped(signum)

  previous = {signum: signal.signal(signum, on_signal) for signum in STOP_SIGNALS}
  try:
    for rank in range(nproc):
      env = child_env(os.environ, rank, nproc, coordinator, local_devices)
      env.update(extra_env or {})
      p = subprocess.Popen(
          [*(wrap(rank) if wrap else []), sys.executable, "-m", module, *child_args], env=env,
          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
          start_new_session=True)
      procs.append(p)
      t = threading.Thread(target=_stream, args=(rank, p.stdout, lock, out), daemon=True)
      t.start()
      threads.append(t)
    while True:
      codes = [p.poll() for p in procs]
      for rank, code in enumerate(codes):
        if code not in (None, 0):
          failed = (rank, code)
          break
      if failed or all(code == 0 for code in codes):
        break
      time.sleep(0.05)
  except _Stopped as stop:
    return _forward_stop(stop.signum, procs, grace, lock, out)
  finally:
    for signum, handler in previous.items():
      signal.signal(signum, handler)
    if failed:
      _stop(procs, grace)
    for t in threads:
      t.join(timeout=5)
  if failed:
    rank, code = failed
    status = 128 - code if code < 0 else code
    with lock:
      out.write(f"dlgs-launch: process {rank} exited with status {status}; stopped the others\n")
      out.flush()
    return status
  return 0
