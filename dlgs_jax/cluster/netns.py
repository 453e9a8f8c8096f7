"""A real bandwidth-limited cluster on one Linux machine (network namespaces + tbf).

Layout for N workers (tag T, chosen per cluster):

* namespace ``dlgs-T-br`` holds a bridge ``br0``;
* namespace ``dlgs-T-wI`` holds worker I's end ``eth0`` (10.A.B.I+1/24) of a veth
  pair whose other end ``vI`` is a port of the bridge;
* both ends of every link are shaped with ``tc qdisc ... tbf`` to the chosen
  bandwidth (netem is not available here; tbf is), so each worker's uplink
  and downlink are limited;
* ``/etc/netns/dlgs-T-wI/hosts`` maps the machine's hostname to the worker's
  address, so gloo (which binds to the address of the hostname) listens on the
  shaped link, and the coordinator runs in worker 0's namespace.

CPU: each worker process is pinned with ``taskset`` to core ``I mod C`` of the
C cores this process may use, so N workers get C/N cores each (two workers
share a core when N = 2C); compute and communication are both real.

Safety: the cluster records every namespace it creates in a state file under
``/run/dlgs_cluster`` *before* creating it, deletes exactly those on exit
(normal, exception, SIGINT or SIGTERM), refuses to start when a name it would
use already exists, and `cleanup_stale` removes only namespaces listed in the
state files of processes that are gone. Needs root and iproute2 (installed
with apt-get when missing; otherwise `unavailable_reason` says why).

    python -m dlgs_jax.cluster --workers 4 --bandwidth 1gbit -- --model resnet20 --steps 30
    python -m dlgs_jax.cluster cleanup        # namespaces left by killed runs
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

STATE_DIR = Path("/run/dlgs_cluster")
PREFIX = "dlgs-"


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
  result = subprocess.run(list(cmd), capture_output=True, text=True)
  if check and result.returncode != 0:
    raise ClusterError(f"`{' '.join(cmd)}` failed: {result.stderr.strip() or result.stdout.strip()}")
  return result


class ClusterError(RuntimeError):
  """The emulated cluster could not be built or used."""


def unavailable_reason(install: bool = True) -> Optional[str]:
  """Why an emulated cluster cannot run here (None when it can).

  Installs iproute2 with apt-get when `ip`/`tc` are missing and we are root.
  """
  if sys.platform != "linux":
    return f"network namespaces need Linux, this is {sys.platform}"
  if os.geteuid() != 0:
    return "network namespaces and tc need root (run as root)"
  if (shutil.which("ip") is None or shutil.which("tc") is None) and install:
    if shutil.which("apt-get"):
      subprocess.run(["apt-get", "update", "-qq"], capture_output=True)
      subprocess.run(["apt-get", "install", "-y", "-qq", "iproute2"], capture_output=True,
                     env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
  if shutil.which("ip") is None or shutil.which("tc") is None:
    return "iproute2 (`ip`, `tc`) is missing and could not be installed"
  if shutil.which("taskset") is None:
    return "`taskset` (util-linux) is missing"
  probe = f"{PREFIX}probe-{os.getpid()}"
  made = _run("ip", "netns", "add", probe, check=False)
  if made.returncode != 0:
    return f"cannot create a network namespace: {made.stderr.strip()}"
  _run("ip", "netns", "del", probe, check=False)
  return None


def exit_if_unavailable() -> None:
  """For the cluster scripts: exits with status 2, the reason on stderr, when
  `unavailable_reason` names one."""
  reason = unavailable_reason()
  if reason:
    print(f"cannot build the emulated cluster: {reason}", file=sys.stderr)
    raise SystemExit(2)


def _existing_namespaces() -> set[str]:
  listing = _run("ip", "netns", "list", check=False).stdout
  return {line.split()[0] for line in listing.splitlines() if line.strip()}


class EmulatedCluster:
  """N worker namespaces on a shaped bridge; use as a context manager.

  Args:
    workers: number of worker namespaces (>= 1).
    bandwidth: link rate for tbf, e.g. "1gbit", "100mbit".
    burst: tbf bucket size (bytes), e.g. "64kb".
    tag: name tag (default: random); names are ``dlgs-<tag>-...``.
    pin: pin each worker to its share of the cores (`cores_for`); False lets
      every worker use every core (diagnostics only: the share is no longer fair).
  """

  def __init__(self, workers: int, bandwidth: str = "1gbit", *, burst: str = "128kb",
               tag: Optional[str] = None, pin: bool = True):
    from dlgs_jax.planning.network import parse_bandwidth

    if not isinstance(workers, int) or workers < 1 or workers > 250:
      raise ValueError(f"workers must be an integer in [1, 250], got {workers!r}")
    self.bits = parse_bandwidth(bandwidth)
    self.bandwidth = bandwidth
    self.burst = burst
    self.workers = workers
    # Off only to diagnose the runtime (e.g. does a process with more than one
    # core run a collective beside its computation?): unpinned workers compete
    # for every core, so the cluster's CPU share is no longer fair.
    self.pin = pin
    self.tag = tag or f"{os.getpid() % 10000}{random.randrange(100):02d}"
    self.bridge_ns = f"{PREFIX}{self.tag}-br"
    self.worker_ns = [f"{PREFIX}{self.tag}-w{i}" for i in range(workers)]
    octet = random.randrange(16, 250)
    self.addresses = [f"10.{octet}.{self.tag_hash()}.{i + 1}" for i in range(workers)]
    self.created: list[str] = []
    self.state_file = STATE_DIR / f"{self.tag}.json"
    self._previous_handlers = {}

  def tag_hash(self) -> int:
    return sum(map(ord, self.tag)) % 250

  # ---------------------------------------------------------------- build ---
  def __enter__(self) -> "EmulatedCluster":
    reason = unavailable_reason()
    if reason:
      raise ClusterError(reason)
    clash = ({self.bridge_ns, *self.worker_ns} & _existing_namespaces())
    if clash:
      raise ClusterError(f"namespaces {sorted(clash)} already exist; this cluster did not "
                         "create them and will not touch them")
    for sig in (signal.SIGINT, signal.SIGTERM):
      self._previous_handlers[sig] = signal.signal(sig, self._on_signal)
    try:
      self._build()
    except BaseException:
      self.destroy()
      raise
    return self

  def __exit__(self, *exc) -> None:
    self.destroy()

  def _on_signal(self, signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")

  def _record(self) -> None:
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    self.state_file.write_text(json.dumps({"pid": os.getpid(), "namespaces": self.created}))

  def _add_namespace(self, name: str) -> None:
    self.created.append(name)
    self._record()  # recorded first: a crash right after still gets it cleaned
    _run("ip", "netns", "add", name)
    _run("ip", "-n", name, "link", "set", "lo", "up")

  def _shape(self, namespace: str, device: str) -> None:
    _run("tc", "-n", namespace, "qdisc", "add", "dev", device, "root", "tbf",
         "rate", self.bandwidth, "burst", self.burst, "latency", "200ms")

  def _build(self) -> None:
    self._add_namespace(self.bridge_ns)
    _run("ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
    _run("ip", "-n", self.bridge_ns, "link", "set", "br0", "up")
    hostname = socket.gethostname()
    for i, (name, address) in enumerate(zip(self.worker_ns, self.addresses)):
      self._add_namespace(name)
      outer, inner = f"{PREFIX}{self.tag}v{i}", f"{PREFIX}{self.tag}e{i}"
      # Created in the bridge namespace directly, so nothing lands in the host's.
      _run("ip", "-n", self.bridge_ns, "link", "add", outer, "type", "veth", "peer", "name",
           inner, "netns", name)
      _run("ip", "-n", self.bridge_ns, "link", "set", outer, "master", "br0")
      _run("ip", "-n", self.bridge_ns, "link", "set", outer, "up")
      _run("ip", "-n", name, "link", "set", inner, "name", "eth0")
      _run("ip", "-n", name, "addr", "add", f"{address}/24", "dev", "eth0")
      _run("ip", "-n", name, "link", "set", "eth0", "up")
      self._shape(name, "eth0")              # worker -> bridge
      self._shape(self.bridge_ns, outer)     # bridge -> worker
      etc = Path("/etc/netns") / name
      etc.mkdir(parents=True, exist_ok=True)
      (etc / "hosts").write_text(f"127.0.0.1 localhost\n{address} {hostname}\n")

  def destroy(self) -> None:
    """Deletes every namespace this cluster created (and only those)."""
    for name in reversed(self.created):
      _run("ip", "netns", "del", name, check=False)
      shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)
    self.created = []
    if self.state_file.exists():
      self.state_file.unlink()
    for sig, handler in self._previous_handlers.items():
      signal.signal(sig, handler)
    self._previous_handlers = {}

  # ------------------------------------------------------------------ use ---
  def cores_for(self, rank: int) -> str:
    cores = sorted(os.sched_getaffinity(0))
    return str(cores[rank % len(cores)])

  def wrap(self, rank: int) -> list[str]:
    """Command prefix running a process in worker `rank`'s namespace on its core."""
    prefix = ["ip", "netns", "exec", self.worker_ns[rank]]
    return prefix + (["taskset", "-c", self.cores_for(rank)] if self.pin else [])

  def coordinator(self, port: Optional[int] = None) -> str:
    return f"{self.addresses[0]}:{port or random.randrange(20000, 60000)}"

  def train(self, train_args: Sequence[str], *, local_devices: int = 1, out=None,
            grace: float = 10.0) -> int:
    """Runs `dlgs-train` with one process per worker namespace (CPU, gloo).

    With `local_devices` > 1 each namespace is a node of that many CPU devices:
    the links between namespaces are the shaped network, the devices of one
    process share memory (the fast link), and the run exchanges in two levels.
    """
    from dlgs_jax.cluster import launch

    return launch.launch(self.workers, list(train_args), local_devices=local_devices,
                         grace=grace, out=out, coordinator=self.coordinator(), wrap=self.wrap)


def cleanup_stale() -> list[str]:
  """Deletes namespaces recorded by cluster processes that no longer run."""
  removed = []
  if not STATE_DIR.exists():
    return removed
  for path in STATE_DIR.glob("*.json"):
    try:
      state = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
      continue
    pid = int(state.get("pid", -1))
    try:
      os.kill(pid, 0)
      continue  # still running: not stale
    except ProcessLookupError:
      pass
    except PermissionError:
      continue
    for name in state.get("namespaces", []):
      if name.startswith(PREFIX) and name in _existing_namespaces():
        _run("ip", "netns", "del", name, check=False)
        shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)
        removed.append(name)
    path.unlink()
  return removed


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv[:1] == ["cleanup"]:
    removed = cleanup_stale()
    print(f"removed {len(removed)} stale namespaces: {removed}")
    return 0
  split = argv.index("--") if "--" in argv else len(argv)
  parser = argparse.ArgumentParser(prog="python -m dlgs_jax.cluster",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("--workers", type=int, default=4, help="namespaces (nodes)")
  parser.add_argument("--bandwidth", default="1gbit")
  parser.add_argument("--local-devices", type=int, default=1,
                      help="CPU devices of each node's process (> 1: two-level exchange)")
  args = parser.parse_args(argv[:split])
  if not 1 <= args.local_devices <= 64:
    parser.error(f"--local-devices must be in [1, 64], got {args.local_devices}")
  from dlgs_jax.planning.network import parse_bandwidth
  try:
    parse_bandwidth(args.bandwidth)
  except ValueError as e:
    parser.error(f"--bandwidth {args.bandwidth!r}: {e}")
  if not 1 <= args.workers <= 250:
    parser.error(f"--workers must be in [1, 250], got {args.workers}")
  if split == len(argv) or not argv[split + 1:]:
    parser.error("give the training flags after --, e.g. -- --model resnet20 --steps 30")
  reason = unavailable_reason()
  if reason:
    print(f"dlgs_jax.cluster: cannot build an emulated cluster here: {reason}", file=sys.stderr)
    return 2
  with EmulatedCluster(args.workers, args.bandwidth) as cluster:
    print(f"cluster {cluster.tag}: {args.workers} workers at {args.bandwidth}"
          + (f", {args.local_devices} devices each" if args.local_devices > 1 else "")
          + f", addresses {cluster.addresses}", flush=True)
    return cluster.train(argv[split + 1:], local_devices=args.local_devices)


if __name__ == "__main__":
  sys.exit(main())
