"""The emulated cluster: namespaces, shaped links, cleanup, and real training over it."""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dlgs_jax.cluster import netns
from tests.helpers import child_env, params_shas

# One pytest-xdist worker runs them all: each shapes links and pins processes to
# cores, and one cleans up stale namespaces.
pytestmark = [pytest.mark.multiprocess, pytest.mark.cluster,
              pytest.mark.xdist_group("emulated_cluster")]
# Read only: scripts/setup_env.sh installs iproute2 for the tests (nothing is installed
# while tests are collected).
REASON = netns.unavailable_reason(install=False) if sys.platform == "linux" else "not Linux"
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"no emulated cluster here: {REASON}")
ROOT = Path(__file__).resolve().parents[2]


def namespaces():
  out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
  return {line.split()[0] for line in out.splitlines() if line.strip()}


@needs_netns
def test_links_are_shaped_and_namespaces_removed(tmp_path):
  server = tmp_path / "server.py"
  server.write_text(textwrap.dedent("""
      import socket, sys, time
      s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
      s.bind((sys.argv[1], 5001)); s.listen(1); c, _ = s.accept(); total, t0 = 0, None
      while True:
        d = c.recv(1 << 20)
        if not d: break
        t0 = t0 or time.perf_counter(); total += len(d)
      print(total * 8 / (time.perf_counter() - t0))
  """))
  client = tmp_path / "client.py"
  client.write_text(textwrap.dedent("""
      import socket, sys, time
      for _ in range(50):
        try:
          s = socket.create_connection((sys.argv[1], 5001)); break
        except OSError:
          time.sleep(0.1)
      buf = b"x" * (1 << 20)
      for _ in range(int(sys.argv[2])): s.sendall(buf)
      s.close()
  """))
  with netns.EmulatedCluster(2, "200mbit") as c:
    made = set(c.created)
    assert made <= namespaces() and len(made) == 3
    srv = subprocess.Popen(c.wrap(0) + [sys.executable, str(server), c.addresses[0]],
                           stdout=subprocess.PIPE, text=True)
    subprocess.run(c.wrap(1) + [sys.executable, str(client), c.addresses[0], "40"], check=True,
                   timeout=120)
    rate = float(srv.communicate(timeout=120)[0])
    assert 0.5 * 200e6 < rate < 1.1 * 200e6, rate  # tbf holds the link near 200 Mbit/s
    assert Path(f"/etc/netns/{c.worker_ns[1]}/hosts").read_text().endswith(
        f"{c.addresses[1]} {os.uname().nodename}\n")
  assert not made & namespaces()
  assert not Path(f"/etc/netns/{c.worker_ns[1]}").exists()


@needs_netns
def test_refuses_names_it_did_not_create_and_cleans_up_on_errors():
  foreign = "dlgs-9999x-w0"
  subprocess.run(["ip", "netns", "add", foreign], check=True)
  try:
    with pytest.raises(netns.ClusterError, match="did not create them"):
      with netns.EmulatedCluster(2, tag="9999x"):
        pass
    assert foreign in namespaces()  # untouched
  finally:
    subprocess.run(["ip", "netns", "del", foreign])
  with pytest.raises(RuntimeError, match="boom"):
    with netns.EmulatedCluster(2) as c:
      made = set(c.created)
      raise RuntimeError("boom")
  assert not made & namespaces()


@needs_netns
def test_sigterm_and_stale_state_are_cleaned(tmp_path):
  script = tmp_path / "hold.py"
  script.write_text(textwrap.dedent(f"""
      import sys, time
      sys.path.insert(0, {str(ROOT)!r})
      from dlgs_jax.cluster import netns
      with netns.EmulatedCluster(2) as c:
        print(" ".join(c.created), flush=True)
        time.sleep(120)
  """))
  proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
  made = set(proc.stdout.readline().split())
  assert len(made) == 3 and made <= namespaces()
  proc.send_signal(signal.SIGTERM)
  proc.wait(timeout=60)
  assert not made & namespaces()
  # A run killed with SIGKILL leaves its namespaces; cleanup_stale removes them
  # (and only those of dead processes).
  proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
  made = set(proc.stdout.readline().split())
  live = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
  alive = set(live.stdout.readline().split())
  proc.kill()
  proc.wait()
  assert made <= namespaces()
  removed = set(netns.cleanup_stale())
  assert removed == made and alive <= namespaces()
  live.send_signal(signal.SIGTERM)
  live.wait(timeout=60)
  assert not (made | alive) & namespaces()


@needs_netns
def test_two_workers_train_over_the_shaped_network(tmp_path):
  """One process of one device per namespace, as the cluster measurements run. (Processes
  of several devices exchange in two levels the same way on localhost: test_launch.)"""
  result = subprocess.run(
      [sys.executable, "-m", "dlgs_jax.cluster", "--workers", "2", "--bandwidth", "1gbit",
       "--local-devices", "1", "--",
       "--model", "smallcnn", "--batch-size", "8", "--steps", "4", "--density", "0.05",
       "--workdir", str(tmp_path)], env=child_env(), capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
  prints = params_shas(result.stdout)
  assert sorted(prints) == [0, 1] and len(set(prints.values())) == 1
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["processes"] == 2 and summary["steps"] == 4 and summary["workers"] == 2
  assert "cluster" in result.stdout and "10." in result.stdout
  assert "two-level" not in result.stdout


def test_unavailable_reason_is_explained_when_not_root(monkeypatch, capsys):
  monkeypatch.setattr(os, "geteuid", lambda: 1000)
  assert "root" in netns.unavailable_reason(install=False)
  # The cluster scripts stop at once, with that reason and status 2.
  with pytest.raises(SystemExit) as stopped:
    netns.exit_if_unavailable()
  assert stopped.value.code == 2
  assert "cannot build the emulated cluster" in capsys.readouterr().err


def test_workers_are_pinned_to_their_share_of_the_cores_unless_told_not_to():
  # Building the namespaces needs root; the command prefix does not.
  cores = sorted(os.sched_getaffinity(0))
  pinned = netns.EmulatedCluster(3, "1gbit", tag="t1")
  for rank in range(3):
    prefix = pinned.wrap(rank)
    assert prefix[:4] == ["ip", "netns", "exec", pinned.worker_ns[rank]]
    assert prefix[4:] == ["taskset", "-c", str(cores[rank % len(cores)])]
  free = netns.EmulatedCluster(3, "1gbit", tag="t2", pin=False)
  assert free.wrap(1) == ["ip", "netns", "exec", free.worker_ns[1]]


@pytest.mark.parametrize("argv, message", [
    (["--workers", "0", "--", "--steps", "1"], "--workers must be in [1, 250], got 0"),
    (["--bandwidth", "foo", "--", "--steps", "1"], "--bandwidth 'foo': bandwidth must look like"),
    (["--workers", "2"], "give the training flags after --"),
])
def test_the_cluster_command_checks_its_flags_before_building_anything(argv, message, capsys):
  before = namespaces() if sys.platform == "linux" and REASON is None else set()
  with pytest.raises(SystemExit):
    netns.main(argv)
  assert message in capsys.readouterr().err
  if before or REASON is None:
    assert namespaces() == before
