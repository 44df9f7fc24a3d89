"""A host taken away on purpose is migrated, not lost: a Kubernetes pod's preStop hook, and a
Slurm node that is drained, each followed by SIGTERM of the host's mover-launch.

Three hosts on this machine, each with its own mover-launch, as a JobSet's pods or an srun
step's tasks start them, given only the variables Kubernetes or Slurm would set: two worker
hosts of one rank each (the Megatron-Core example, DP2) and one spare host with one standby.
Host 1 is taken away while the job trains: its ranks move to the spare host's standby
(``mover migrate --host``, run by ``examples/kubernetes/prestop.sh`` or by
``examples/slurm/drain_watch.sh`` seeing a stand-in ``sinfo`` report the node draining), then its
mover-launch gets SIGTERM (directly, as Kubernetes sends it after the hook, or through the
``srun`` wrapper ``examples/slurm/mover_node.sh``). The job's event log and summary show a
migration and the host leaving, no crash recovery and no restart, and the job ends with exit
code 0. Rank 0 is held between steps while the test acts (``pretrain_gpt_held.py``), so the job
cannot end first however slow the machine, and it trains on meanwhile in each generation.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Callable, Iterator

import pytest

from support.gpt_jobs import (HELD_EXAMPLE, LAUNCH, MODEL, background_job, read_events,
                              tagged_processes, wait_for_events)
from support.paths import EXAMPLES
from support.ports import free_job_id, free_port

from mover_plugin.launch.job_secret import JOB_SECRET_ENV
from mover_plugin.testing import run_command

pytest.importorskip("megatron.core")

STEPS = 40
SCRIPT = [HELD_EXAMPLE, *MODEL, "--num-layers", "2", "--train-iters", str(STEPS),
          "--resilient", "--resilient-collective-timeout-s", "120"]
"""DP2, tiny; a hold (below) keeps the other rank waiting in its collectives, well within the
collective timeout."""
LAUNCHER = ["--policy", "resilient", "--standbys", "0", "--nproc-per-node", "1",
            "--stop-grace-s", "2", "--refill-delay-s", "600"]
SECRET = {JOB_SECRET_ENV: "planned-exits-test-secret"}
TIMEOUT_S = 90.0
"""Each wait of the test: the whole job takes about 30 s."""
TOOLS = str(Path(sys.executable).parent)
"""``mover`` and ``python3`` of this environment, for the scripts."""


class Job:
    """The three hosts' mover-launch processes (node 0 runs the controller), the event log,
    the summary and the hold file."""

    def __init__(self, tmp_path: Path, processes: dict[int, subprocess.Popen]) -> None:
        self.tag = str(tmp_path)
        self.processes = processes
        self.events_path = tmp_path / "events.jsonl"
        self.summary_path = tmp_path / "summary.json"
        self.hold = tmp_path / "hold"

    def wait_for(self, event: str) -> dict:
        """The first record of ``event`` in the event log, once there; fails with the first
        host's output when the job ends first or the wait times out."""
        try:
            events = wait_for_events(self.events_path, lambda es: any(e["event"] == event
                                                                      for e in es),
                                     self.processes[0], timeout_s=TIMEOUT_S)
        except AssertionError as error:
            if self.processes[0].poll() is None:
                self.processes[0].kill()
            output, _ = self.processes[0].communicate(timeout=TIMEOUT_S)
            raise AssertionError(f"no {event} ({error}); host 0:\n{output[-4000:]}") from None
        return next(e for e in events if e["event"] == event)

    def end(self) -> dict[int, str]:
        """Releases rank 0; each host's output once its mover-launch ended."""
        self.hold.write_text("")
        return {node: process.communicate(timeout=TIMEOUT_S)[0]
                for node, process in self.processes.items() if process.returncode is None}


@contextmanager
def three_hosts(tmp_path: Path, command_of: Callable[[int], list[str]],
                env_of: Callable[[int], dict[str, str]]) -> Iterator[Job]:
    """Starts hosts 1, 2 and 0 (``command_of(node)`` with ``env_of(node)``) and yields the job
    once it trains and the spare host's standby is ready, rank 0 held after its first step."""
    hold = tmp_path / "hold"
    hold.write_text("0")
    with ExitStack() as stack:
        processes = {node: stack.enter_context(background_job(
            command_of(node), str(tmp_path), {**env_of(node), "HOLD_FILE": str(hold)}))
            for node in (1, 2, 0)}
        job = Job(tmp_path, processes)
        job.wait_for("standby_ready")
        job.wait_for("steps")
        yield job


def _move_host_1(job: Job) -> dict:
    """Once the migration of host 1's rank is requested, rank 0 trains again until its first
    step in the migration's generation; returns the ``migration_done`` record."""
    requested = job.wait_for("migration_requested")
    assert (requested["rank"], requested["standby"], requested["node"]) == (1, "a0.n2.s0", 2)
    job.hold.write_text("1")
    return job.wait_for("migration_done")


def _check_a_planned_exit(job: Job, outputs: dict[int, str], host: str) -> None:
    """Host 1's rank migrated to the spare host, then host 1 left: no crash, no restart."""
    assert job.processes[0].returncode == 0, outputs[0][-4000:]
    assert job.processes[2].returncode == 0, outputs[2][-3000:]
    assert "DP_REPLICAS identical" in outputs[0]
    events = read_events(job.events_path)
    (done,) = [e for e in events if e["event"] == "migration_done"]
    assert done["ranks"] == [1]
    (left,) = [e for e in events if e["event"] == "host_left"]
    assert (left["node"], left["host"], left["how"]) == (1, host, "its mover-launch got SIGTERM")
    crashes = {"host_lost", "worker_failed", "fallback", "restart", "job_unplaceable"}
    assert not [e for e in events if e["event"] in crashes]
    summary = json.loads(job.summary_path.read_text())
    assert summary["exit_code"] == 0 and summary["restarts"] == 0
    assert summary["steps_completed"] == STEPS
    (item,) = summary["interruptions"]
    assert (item["kind"], item["ranks"], item["recovery"]) == ("migration", [1], "standby")
    assert isinstance(item["downtime_s"], float)
    deadline = time.monotonic() + 10
    while tagged_processes(job.tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not tagged_processes(job.tag)


def pod_env(node: int, port: int) -> dict[str, str]:
    """Host ``node``'s pod: workers 0 and 1, then the spare host, as the JobSet's labels, the
    Indexed Job and examples/kubernetes/jobset.yaml set them (the controller at 127.0.0.1)."""
    replicated_job, index = ("workers", node) if node < 2 else ("spares", node - 2)
    return {**SECRET, "JOBSET_NAME": "mt", "REPLICATED_JOB_NAME": replicated_job,
            "JOB_INDEX": "0", "JOB_COMPLETION_INDEX": str(index), "MOVER_WORKERS": "workers:2",
            "MOVER_SPARES": "spares:1", "MOVER_MASTER_ADDR": "127.0.0.1",
            "MOVER_MASTER_PORT": str(port), "MOVER_MIGRATE_TIMEOUT_S": "60"}


def test_a_pods_prestop_hook_and_then_its_sigterm_are_a_planned_migration(tmp_path):
    port = free_port()
    command = [*LAUNCH, *LAUNCHER, "--summary", str(tmp_path / "summary.json"),
               "--event-log", str(tmp_path / "events.jsonl"), *SCRIPT]
    hook_log = tmp_path / "hook.log"
    hook_env = {**pod_env(1, port), "PATH": f"{TOOLS}:{os.environ['PATH']}",
                "MOVER_HOOK_LOG": str(hook_log)}
    with ThreadPoolExecutor(max_workers=1) as pool, \
            three_hosts(tmp_path, lambda node: command, lambda node: pod_env(node, port)) as job:
        hook = pool.submit(run_command, ["bash", str(EXAMPLES / "kubernetes" / "prestop.sh")],
                           env=hook_env, timeout_s=TIMEOUT_S)
        _move_host_1(job)
        assert hook.result().returncode == 0
        os.kill(job.processes[1].pid, signal.SIGTERM)  # what Kubernetes does after the hook
        leaving, _ = job.processes[1].communicate(timeout=TIMEOUT_S)
        job.wait_for("host_left")
        outputs = job.end()
    _check_a_planned_exit(job, outputs, "mt-workers-0-1.mt")
    assert job.processes[1].returncode == 143, leaving[-3000:]
    assert "node 1 (mt-workers-0-1.mt) leaves the job: its mover-launch got SIGTERM" in leaving
    said = hook_log.read_text()
    assert "[prestop] pod" in said and "moving the ranks of mt-workers-0-1.mt" in said
    assert "done after" in said and "mt-workers-0-1.mt holds no rank of the job" in said


def slurm_env(node: int, job_id: int) -> dict[str, str]:
    """Node ``node``'s task of a three-node srun step, as Slurm sets it."""
    return {**SECRET, "SLURM_JOB_ID": str(job_id), "SLURM_JOB_NODELIST": "127.0.0.[1-3]",
            "SLURM_NODEID": str(node), "SLURMD_NODENAME": f"127.0.0.{node + 1}",
            "MOVER_MIGRATE_TIMEOUT_S": "60"}


def _wait_for_line(path: Path, text: str, process: subprocess.Popen) -> None:
    """Returns once ``path`` holds ``text`` (``process`` must still run meanwhile)."""
    deadline = time.monotonic() + TIMEOUT_S
    while not (path.exists() and text in path.read_text()):
        assert process.poll() is None, f"ended first: {path.read_text()}"
        assert time.monotonic() < deadline, f"no {text!r} within {TIMEOUT_S} s"
        time.sleep(0.1)


SINFO = """#!/bin/sh
# A stand-in for Slurm's sinfo: node 127.0.0.2 is draining (listed once per partition).
printf '127.0.0.1 mix\\n127.0.0.2 drng\\n127.0.0.2 drng\\n127.0.0.3 mix\\n'
"""


def test_a_drained_slurm_node_is_migrated_and_its_sigterm_is_a_planned_exit(tmp_path):
    job_id = free_job_id()
    command = [*LAUNCH, *LAUNCHER, "--spare-hosts", "1", "--summary",
               str(tmp_path / "summary.json"), "--event-log", str(tmp_path / "events.jsonl"),
               *SCRIPT]
    wrapper = ["bash", str(EXAMPLES / "slurm" / "mover_node.sh")]
    stand_ins = tmp_path / "bin"
    stand_ins.mkdir()
    (stand_ins / "sinfo").write_text(SINFO)
    (stand_ins / "sinfo").chmod(0o755)
    tools = f"{stand_ins}:{TOOLS}:{os.environ['PATH']}"
    with three_hosts(tmp_path, lambda node: [*wrapper, *command] if node == 1 else command,
                     lambda node: {**slurm_env(node, job_id), "PATH": tools}) as job:
        watch_env = {**slurm_env(0, job_id), "PATH": tools, "MOVER_WATCH_PERIOD_S": "0.5"}
        watch_log = tmp_path / "drain_watch.log"
        watch = f"exec bash {EXAMPLES / 'slurm' / 'drain_watch.sh'} 2>>{watch_log}"
        with background_job(["bash", "-c", watch], job.tag, watch_env) as watcher:
            _move_host_1(job)
            _wait_for_line(watch_log, "holds no rank", watcher)
            os.killpg(watcher.pid, signal.SIGTERM)
            watcher.wait(timeout=TIMEOUT_S)
        watched = watch_log.read_text()
        os.kill(job.processes[1].pid, signal.SIGTERM)  # the wrapper alone
        leaving, _ = job.processes[1].communicate(timeout=TIMEOUT_S)
        job.wait_for("host_left")
        outputs = job.end()
    _check_a_planned_exit(job, outputs, "127.0.0.2")
    assert watched.count("node 127.0.0.2 is being taken out of service") == 1, watched
    assert "done after" in watched and "127.0.0.2 holds no rank of the job" in watched
    # the wrapper: the node's rank had moved already; mover-launch then left on SIGTERM
    assert job.processes[1].returncode == 143, leaving[-3000:]
    assert "SIGTERM: moving this node's ranks away" in leaving
    assert "host '127.0.0.2' holds no rank now" in leaving
    assert "node 1 (127.0.0.2) leaves the job: its mover-launch got SIGTERM" in leaving
