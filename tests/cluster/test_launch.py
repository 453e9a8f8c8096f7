"""Multi-process training: dlgs-launch, the per-node script and SLURM's variables.

Real processes on localhost join with `jax.distributed` and exchange gradients
with gloo CPU collectives.
"""

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dlgs_jax.cli import launch as launch_cli
from dlgs_jax.cluster import launch
from dlgs_jax.cluster.launch import free_port
from tests.helpers import child_env, params_shas, run_group, wait_for_step

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ["--model", "smallcnn", "--batch-size", "16", "--density", "0.1", "--lr", "0.02",
         "--check-every", "4"]
# Where the start of the processes is under test, not the method: dense, whose step
# compiles fastest (every process but 0 compiles it again: see tests/conftest.py).
STARTUP = [*TRAIN, "--method", "dense", "--steps", "3"]


def shas(output, processes):
  found = params_shas(output)
  assert sorted(found) == list(range(processes)), output[-4000:]
  return found


def losses(workdir):
  lines = (Path(workdir) / "metrics.jsonl").read_text().splitlines()
  return [r["loss"] for r in map(json.loads, lines) if "loss" in r]


def test_launch_trains_four_processes_in_two_levels_with_identical_parameters(tmp_path):
  """SLURM's one task per GPU, on localhost: 4 processes of one device, and --node-size 2
  makes processes 0-1 and 2-3 the two nodes. Every process ends with the same parameters
  and the loss falls."""
  nproc = 4  # on two cores; two processes are launched by the tests below
  result = subprocess.run(
      [sys.executable, "-m", "dlgs_jax.cli.launch", "--nproc", str(nproc), "--local-devices",
       "1", "--", *TRAIN, "--steps", "16", "--node-size", "2", "--workdir", str(tmp_path)],
      env=child_env(), capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout[-4000:]
  assert "two-level exchange: 2 nodes x 2 devices" in result.stdout
  prints = shas(result.stdout, nproc)
  assert len(set(prints.values())) == 1  # every process holds the same parameters
  assert f"{nproc} workers ({nproc} processes)" in result.stdout
  loss = losses(tmp_path)
  assert len(loss) == 16
  assert np.mean(loss[-4:]) < np.mean(loss[:4]) - 0.05, loss
  for rank in range(nproc):  # output is streamed with a rank prefix
    assert f"[{rank}] process {rank}: params_sha256" in result.stdout


def stop_and_resume(launch, tmp_path) -> str:
  """Runs 3 of 6 steps, then the whole run and the resumed rest; checks they end alike.

  Returns the first part's output.
  """
  # The persistent compilation cache serves only process 0 (JAX writes no entry
  # from another process), so every launch's process 1 compiles the train step
  # again while process 0 waits on one core. The first part runs alone (both
  # compile and fill the cache); the uninterrupted run and the resumed part then
  # run side by side, their two process 1s compiling on the two cores.
  first, = run_group([(launch("--workdir", str(tmp_path / "parts"), "--stop-after", "3"),
                       child_env())], timeout=600)
  assert "stopped by --stop-after after 3 steps at step 3 of 6" in first
  whole, rest = run_group([
      (launch("--workdir", str(tmp_path / "whole")), child_env()),
      (launch("--workdir", str(tmp_path / "parts"), "--resume"), child_env())], timeout=600)
  whole = shas(whole, 2)
  assert "resumed from step 3" in rest
  assert shas(rest, 2) == whole and len(set(whole.values())) == 1
  return first


def test_processes_of_several_devices_exchange_in_two_levels_and_resume_bit_identical(tmp_path):
  """2 processes x 2 devices: dense inside a process, DLGS between them; per-slice
  residuals checkpointed and resumed exactly, and resumed flat. (Plans of slices on two
  levels: the CLI's tests.)"""
  args = ["--model", "smallcnn", "--batch-size", "8", "--lr", "0.05", "--density", "0.05",
          "--steps", "6", "--check-every", "2"]

  def launch(*extra):
    return [sys.executable, "-m", "dlgs_jax.cli.launch", "--nproc", "2", "--local-devices", "2",
            "--", *args, *extra]

  assert "two-level exchange: 2 nodes x 2 devices" in stop_and_resume(launch, tmp_path)
  # Across processes too, a resume onto a flat exchange deals the residual slices out again.
  flat = subprocess.run(launch("--workdir", str(tmp_path / "parts"), "--resume", "--flat"),
                        env=child_env(), capture_output=True, text=True, timeout=600)
  assert flat.returncode == 0, flat.stdout[-3000:]
  assert "this run has 4 (two-level 2x2 -> flat): residuals redistributed" in flat.stdout
  assert "resumed from step 6" in flat.stdout and len(set(shas(flat.stdout, 2).values())) == 1


def test_a_failing_process_stops_the_others(tmp_path):
  module = tmp_path / "flaky_worker.py"
  module.write_text(
      "import os, sys, time\n"
      "rank = int(os.environ['DLGS_PROCESS_ID'])\n"
      f"open(os.path.join({str(tmp_path)!r}, f'pid{{rank}}'), 'w').write(str(os.getpid()))\n"
      "print('started', os.environ['DLGS_NUM_PROCESSES'], os.environ['DLGS_COORDINATOR_ADDRESS'],"
      " flush=True)\n"
      "if rank == 1:\n"
      "    time.sleep(1.0)\n"
      "    sys.exit(3)\n"
      "time.sleep(300)\n")
  env = child_env()
  env["PYTHONPATH"] = str(tmp_path) + os.pathsep + env["PYTHONPATH"]
  start = time.monotonic()
  result = subprocess.run(
      [sys.executable, "-m", "dlgs_jax.cli.launch", "--nproc", "3", "--module", "flaky_worker",
       "--grace", "2"], env=env, capture_output=True, text=True, timeout=120)
  elapsed = time.monotonic() - start
  assert result.returncode == 3, result.stdout
  assert "process 1 exited with status 3; stopped the others" in result.stdout
  assert elapsed < 60
  assert "[0] started 3 127.0.0.1:" in result.stdout
  for rank in (0, 2):  # the sleepers are gone, not left behind
    pid = int((tmp_path / f"pid{rank}").read_text())
    with pytest.raises(ProcessLookupError):
      os.kill(pid, 0)


def test_launcher_rejects_bad_arguments():
  with pytest.raises(SystemExit):
    launch_cli.parse_args(["--nproc", "0"])
  args, child = launch_cli.parse_args(["--nproc", "2", "--", "--model", "vgg16"])
  assert args.nproc == 2 and child == ["--model", "vgg16"]
  env = launch.child_env({"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --foo"},
                         1, 2, "127.0.0.1:1234", 3)
  assert env["DLGS_PROCESS_ID"] == "1" and env["DLGS_LOCAL_DEVICES"] == "3"
  assert env["XLA_FLAGS"] == "--foo"


def test_node_script_checks_its_variables(tmp_path):
  script = ROOT / "scripts" / "cluster" / "run_node.sh"
  env = child_env()
  for name in ("DLGS_COORDINATOR_ADDRESS", "DLGS_NUM_NODES", "DLGS_NODE_RANK"):
    env.pop(name, None)
  missing = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
  assert missing.returncode == 2
  assert "DLGS_COORDINATOR_ADDRESS DLGS_NUM_NODES DLGS_NODE_RANK" in missing.stderr
  for variables, message in (
      (dict(DLGS_COORDINATOR_ADDRESS="h:1", DLGS_NUM_NODES="2", DLGS_NODE_RANK="2"),
       "must be in [0, 2), got '2'"),
      (dict(DLGS_COORDINATOR_ADDRESS="h:1", DLGS_NUM_NODES="two", DLGS_NODE_RANK="0"),
       "positive integer, got 'two'"),
      (dict(DLGS_COORDINATOR_ADDRESS="nohost", DLGS_NUM_NODES="2", DLGS_NODE_RANK="0"),
       "host:port, got 'nohost'")):
    bad = subprocess.run(["bash", str(script)], env={**env, **variables},
                         capture_output=True, text=True)
    assert bad.returncode == 2 and message in bad.stderr, bad.stderr


def test_node_script_runs_two_nodes_on_localhost(tmp_path):
  script = ROOT / "scripts" / "cluster" / "run_node.sh"
  coordinator = f"127.0.0.1:{free_port()}"
  base = child_env()
  base["DLGS_PYTHON"] = sys.executable
  outputs = run_group([
      (["bash", str(script), *STARTUP, "--workdir", str(tmp_path)],
       {**base, "DLGS_COORDINATOR_ADDRESS": coordinator, "DLGS_NUM_NODES": "2",
        "DLGS_NODE_RANK": str(rank)}) for rank in range(2)])
  values = {sha for out in outputs for sha in params_shas(out).values()}
  assert len(values) == 1
  assert "2 workers (2 processes)" in outputs[0]


def test_slurm_variables_start_jax_distributed(tmp_path):
  """What `srun` sets for each task is enough: JAX reads it, dlgs_jax enables gloo."""
  base = child_env()
  base.update(SLURM_JOB_ID="4242", SLURM_STEP_NODELIST="localhost", SLURM_NTASKS="2",
              JAX_COORDINATOR_PORT=str(free_port()))
  for name in ("DLGS_COORDINATOR_ADDRESS", "DLGS_NUM_PROCESSES", "DLGS_PROCESS_ID"):
    base.pop(name, None)
  outputs = run_group([
      ([sys.executable, "-m", "dlgs_jax.cli.train", *STARTUP, "--workdir", str(tmp_path)],
       {**base, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)})
      for rank in range(2)])
  values = {sha for out in outputs for sha in params_shas(out).values()}
  assert len(values) == 1
  assert "2 workers (2 processes)" in outputs[0]


def test_sbatch_script_refuses_outside_slurm_and_runs_srun(tmp_path):
  script = ROOT / "scripts" / "cluster" / "train.sbatch"
  env = child_env()
  env.pop("SLURM_JOB_ID", None)
  outside = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
  assert outside.returncode == 2 and "submit with sbatch" in outside.stderr
  # Inside a job, the script hands its arguments to one `srun` that stops every
  # task if one fails; a stand-in srun on PATH records the call.
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  srun = bin_dir / "srun"
  srun.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {tmp_path}/srun_args\n")
  srun.chmod(srun.stat().st_mode | stat.S_IEXEC)
  env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", SLURM_JOB_ID="7",
             SLURM_SUBMIT_DIR=str(ROOT), SLURM_JOB_NUM_NODES="2", SLURM_JOB_NODELIST="n[1-2]",
             SLURM_NTASKS_PER_NODE="8", DLGS_PYTHON="/opt/py")

  def srun_args(*args, **extra):
    inside = subprocess.run(["bash", str(script), *args], env={**env, **extra},
                            capture_output=True, text=True)
    assert inside.returncode == 0, inside.stderr
    return (tmp_path / "srun_args").read_text().split("\n")[:-1]

  start = ["--kill-on-bad-exit=1", "--distribution=block", "/opt/py", "-m", "dlgs_jax.cli.train"]
  # Several nodes of 8 tasks: each node's 8 tasks form a node of the two-level exchange.
  assert srun_args("--model", "vgg16", "--resume") == [
      *start, "--model", "vgg16", "--resume", "--node-size", "8"]
  assert srun_args("--model", "vgg16", "--flat") == [*start, "--model", "vgg16", "--flat"]
  assert srun_args("--node-size", "4") == [*start, "--node-size", "4"]
  # The model sliced over each node's 8 GPUs: the node is --fsdp's, no two-level exchange.
  assert srun_args("--model", "vgg16", "--fsdp", "8") == [*start, "--model", "vgg16",
                                                          "--fsdp", "8"]
  assert srun_args("--model", "vgg16", SLURM_JOB_NUM_NODES="1") == [*start, "--model", "vgg16"]
  odd = subprocess.run(["bash", str(script)], env={**env, "SLURM_NTASKS_PER_NODE": "8(x2)"},
                       capture_output=True, text=True)
  assert odd.returncode == 2 and "SLURM_NTASKS_PER_NODE must be one number, got '8(x2)'" \
      in odd.stderr
  text = script.read_text()
  tasks = int(text.split("--ntasks-per-node=")[1].split()[0])
  gpus = int(text.split("--gpus-per-node=")[1].split()[0])
  assert tasks == gpus  # JAX's SLURM convention: one task per GPU


def _worker_pid(launcher_pid: int, rank: int) -> int:
  """The process id of `rank` among the processes `launcher_pid` started."""
  for entry in Path("/proc").iterdir():
    if not entry.name.isdigit():
      continue
    try:
      env = (entry / "environ").read_bytes().split(b"\0")
    except OSError:
      continue
    if (f"DLGS_PARENT_PID={launcher_pid}".encode() in env
        and f"DLGS_PROCESS_ID={rank}".encode() in env):
      return int(entry.name)
  raise AssertionError(f"no process {rank} of launcher {launcher_pid}")


def _launch_until(args, workdir, step, *extra):
  proc = subprocess.Popen([sys.executable, "-m", "dlgs_jax.cli.launch", "--nproc", "2", "--",
                           *args, "--workdir", str(workdir), *extra], env=child_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  return wait_for_step(proc, workdir, step, timeout=400)


def _stopped_step(output: str, name: str) -> int:
  found = re.search(rf"\[0\] stopped by {name} after \d+ steps at step (\d+) of 90", output)
  assert found, output[-4000:]
  return int(found.group(1))


def test_a_signal_to_one_process_or_to_the_launcher_stops_every_process_at_one_step(tmp_path):
  """SIGTERM to process 1: JAX's preemption service has both save the same step and
  leave; SIGINT to process 0 and SIGHUP to the launcher do the same. Resumed three
  times, the run ends bit for bit where an uninterrupted one does. (TernGrad: each
  worker draws from its own PRNG key, whose state must resume exactly too, and its step
  compiles in a fraction of DLGS's time, which every launch's process 1 pays again.
  DLGS's residuals across processes resume in the two-level test, DGC's in the CLI's.)"""
  args = ["--model", "smallcnn", "--batch-size", "8", "--lr", "0.05", "--density", "0.05",
          "--method", "terngrad", "--steps", "90", "--checkpoint-every", "100",
          "--check-every", "5"]
  parts = tmp_path / "parts"
  first = _launch_until(args, parts, 4)
  os.kill(_worker_pid(first.pid, 1), signal.SIGTERM)
  out = first.communicate(timeout=120)[0]
  assert first.returncode == 0, out[-4000:]
  step = _stopped_step(out, "SIGTERM")
  # SIGINT to process 0: handed to the same service, so process 1 stops at the same step.
  second = _launch_until(args, parts, step + 2, "--resume")
  os.kill(_worker_pid(second.pid, 0), signal.SIGINT)
  out = second.communicate(timeout=120)[0]
  assert second.returncode == 0, out[-4000:]
  middle = _stopped_step(out, "SIGINT")
  assert middle > step
  third = _launch_until(args, parts, middle + 2, "--resume")
  third.send_signal(signal.SIGHUP)
  out = third.communicate(timeout=120)[0]
  assert third.returncode == 0 and "dlgs-launch: SIGHUP: asking every process" in out, out[-4000:]
  later = _stopped_step(out, "SIGTERM")
  assert later > middle
  launch = [sys.executable, "-m", "dlgs_jax.cli.launch", "--nproc", "2", "--", *args]
  whole, rest = run_group([
      ([*launch, "--workdir", str(tmp_path / "whole")], child_env()),
      ([*launch, "--workdir", str(parts), "--resume"], child_env())], timeout=600)
  assert f"resumed from step {later}" in rest
  assert shas(rest, 2) == shas(whole, 2)


def test_processes_of_a_killed_launcher_save_and_leave(tmp_path):
  """The launcher killed outright (no chance to pass anything on): its processes get
  SIGTERM from the kernel (parent-death signal), save one checkpoint and exit."""
  args = ["--model", "smallcnn", "--batch-size", "8", "--lr", "0.05", "--density", "0.05",
          "--steps", "400", "--checkpoint-every", "1000", "--check-every", "0"]
  proc = _launch_until(args, tmp_path, 3)
  workers = [_worker_pid(proc.pid, rank) for rank in (0, 1)]
  proc.kill()
  proc.wait()
  deadline = time.monotonic() + 60
  while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in workers):
    time.sleep(0.1)
  assert not any(Path(f"/proc/{p}").exists() for p in workers), "orphaned processes"
  saved = [int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()]
  assert len(saved) == 1 and 3 <= saved[0] < 400
