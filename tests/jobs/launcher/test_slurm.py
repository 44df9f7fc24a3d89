"""``srun mover-launch`` inside a Slurm allocation: the hosts from Slurm's variables.

Pure tests of the host-list syntax and of the launcher's settings, then a two-host job whose
two ``mover-launch`` processes (one per "node", as ``srun`` starts them) get only the
variables Slurm would set, no host flag; and such a job losing its controller.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from support.gpt_jobs import EXAMPLE, MODEL, background_job, tagged_processes
from support.ports import free_job_id

from mover_plugin.errors import ConfigError
from mover_plugin.launch.config import parse_launch_args
from mover_plugin.launch.job_secret import JOB_SECRET_ENV
from mover_plugin.launch.slurm import expand_hostlist, port_of_job
from mover_plugin.testing import run_command
from support.paths import SCRIPTS

TOY = str(SCRIPTS / "toy_train.py")
LAUNCH = [sys.executable, "-m", "mover_plugin.launch.cli"]


def slurm_env(nodelist: str, node_id: int, job_id: int = 4242, **more: str) -> dict[str, str]:
    # The job's secret, exported before srun as the launch path asks of multi-host jobs.
    return {"SLURM_JOB_ID": str(job_id), "SLURM_JOB_NODELIST": nodelist,
            "SLURM_NODEID": str(node_id), JOB_SECRET_ENV: f"slurm-job-{job_id}-secret", **more}


@pytest.mark.parametrize("text, hosts", [
    ("gpu7", ["gpu7"]),
    ("gpu[01-03,7],login1", ["gpu01", "gpu02", "gpu03", "gpu7", "login1"]),
    ("rack[1-2]-n[8-9]", ["rack1-n8", "rack1-n9", "rack2-n8", "rack2-n9"]),
    ("127.0.0.[1-2]", ["127.0.0.1", "127.0.0.2"]),
    ("a[098-101]-ib", ["a098-ib", "a099-ib", "a100-ib", "a101-ib"]),
])
def test_a_slurm_host_list_expands_in_order(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text, message", [
    ("gpu[3-1]", "range '3-1' runs backwards"),
    ("gpu[1-x]", "'1-x' is not N or N-M"),
    ("gpu[1-2", "unbalanced brackets in 'gpu[1-2'"),
    ("", "names no host"),
])
def test_a_bad_host_list_is_named(text, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        expand_hostlist(text)


def test_without_host_flags_the_hosts_come_from_slurm():
    env = slurm_env("node[1-3]", 2, SLURM_JOB_NUM_NODES="3", SLURM_GPUS_ON_NODE="4")
    config = parse_launch_args(["train.py"], sys.executable, env)
    assert [(n.host, n.nproc, n.first_rank) for n in config.nodes] == [
        ("node1", 4, 0), ("node2", 4, 4), ("node3", 4, 8)]
    assert (config.local_node_ranks, config.runs_controller) == ((2,), False)
    assert (config.master_addr, config.master_port) == ("node1", port_of_job(4242))
    named = parse_launch_args(["--nproc-per-node", "2", "--master-port", "6000", "train.py"],
                              sys.executable, {**env, "SLURMD_NODENAME": "node1"})
    assert ([n.nproc for n in named.nodes], named.local_node_ranks, named.runs_controller,
            named.master_port) == ([2, 2, 2], (0,), True, 6000)


def test_host_flags_win_over_slurm():
    env = slurm_env("node[1-3]", 2)
    config = parse_launch_args(["--standalone", "--nproc-per-node", "2", "train.py"],
                               sys.executable, env)
    assert [n.host for n in config.nodes] == ["127.0.0.1"] and config.runs_controller
    outside = parse_launch_args(["train.py"], sys.executable, {"SLURM_JOB_ID": "7"})
    assert [n.host for n in outside.nodes] == ["127.0.0.1"]


@pytest.mark.parametrize("env, message", [
    (slurm_env("node[1-3]", 0, SLURM_JOB_NUM_NODES="2"),
     "Slurm's node count 2 does not match its host list 'node[1-3]' (3 hosts)"),
    (slurm_env("node[1-3]", 5), "SLURM_NODEID 5 does not exist; Slurm's host list has 3 hosts"),
    (slurm_env("node1", 0, job_id=1, SLURM_GPUS_ON_NODE="four"),
     "Slurm's SLURM_GPUS_ON_NODE 'four' is not a whole number"),
])
def test_contradicting_slurm_variables_stop_the_launch(env, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")
                       .replace(")", r"\)")):
        parse_launch_args(["train.py"], sys.executable, env)


def test_srun_style_launch_trains_on_two_hosts_with_only_slurm_variables(tmp_path):
    job_id = free_job_id()
    command = [*LAUNCH, "--nproc-per-node", "2", TOY, "--steps", "4"]
    # Each run_command is bounded by its timeout; the pool waits for both.
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = [pool.submit(run_command, command, env=slurm_env("127.0.0.[1-2]", node, job_id),
                            timeout_s=180) for node in (1, 0)]
        second, first = (run.result() for run in runs)
    assert first.returncode == 0, first.output[-3000:]
    assert second.returncode == 0, second.output[-3000:]
    assert "agent of node 1 (127.0.0.2) joined" in first.output
    assert len(first.lines_starting("PARAMS_DIGEST")) == 1, first.output[-3000:]


def test_a_lost_controller_stops_every_process_and_a_new_launch_resumes(tmp_path,
                                                                         reference_pp2_40):
    """Two srun-style hosts, a standby each; the controller's mover-launch (node 0, with its
    agent) SIGKILLed while the job trains and checkpoints: node 1's agent stops its worker and
    standby processes and its mover-launch exits saying why, no process of the job is left, the
    last checkpoint is whole, and the same two commands started again resume from it to the
    failure-free result."""
    ckpt = tmp_path / "ckpt"
    job_id = free_job_id()
    command = [*LAUNCH, "--nproc-per-node", "2", "--policy", "resilient", "--standbys", "1",
               "--stop-grace-s", "2", EXAMPLE, *MODEL, "--pipeline-model-parallel-size", "2",
               "--train-iters", "40", "--resilient", "--save", str(ckpt), "--load", str(ckpt),
               "--save-interval", "1"]
    tracker = ckpt / "latest_checkpointed_iteration.txt"
    tag = str(tmp_path)  # unique across concurrent test sessions
    with background_job(command, tag, slurm_env("127.0.0.[1-2]", 1, job_id)) as node1, \
            background_job(command, tag, slurm_env("127.0.0.[1-2]", 0, job_id)) as node0:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not (
                tracker.exists() and int(tracker.read_text() or 0) >= 5):
            assert node0.poll() is None and node1.poll() is None
            time.sleep(0.02)
        os.kill(node0.pid, signal.SIGKILL)
        killed = time.monotonic()
        output, _ = node1.communicate(timeout=60)
        stopped_s = time.monotonic() - killed
    assert node1.returncode == 1, output[-3000:]
    assert "node 1 lost the controller" in output and "stopping its workers" in output
    assert stopped_s < 60  # the collective timeout
    assert _all_gone(tag), f"left: {sorted(tagged_processes(tag))}"
    saved = int(tracker.read_text())
    assert 5 <= saved < 40
    assert sorted(p.name for p in (ckpt / f"iter_{saved:07d}").iterdir()) == [
        "mp_rank_00_000", "mp_rank_00_001"]
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = [pool.submit(run_command, command, env=slurm_env("127.0.0.[1-2]", node, job_id),
                            timeout_s=300) for node in (1, 0)]
        second, first = (run.result() for run in runs)
    assert first.returncode == 0 and second.returncode == 0, first.output[-3000:]
    assert first.lines_starting("PARAMS_DIGEST") == reference_pp2_40.lines_starting(
        "PARAMS_DIGEST")


def _all_gone(tag: str, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while tagged_processes(tag):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True
