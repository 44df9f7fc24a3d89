"""The end of a job (launch/job_end.py): what the agents count and do as training ends, and a
real job whose end meets a refill and a joining host's standby, each started at the last step.

The job runs tests/support/scripts/end_of_job.py: no framework, so it starts in seconds. Its
standbys stand for ones still importing (they never report ready) or waiting, and ignore
SIGTERM; rank 0 begins its last step only once the refill and the joining host's standby have
started, so both are in flight when training ends, every time; rank 1's process never ends after
its script. And a process whose parent dies just as it starts does not outlive it."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from support.gpt_jobs import LAUNCH, background_job, read_events, tagged_processes
from support.paths import SCRIPTS
from mover_plugin.contract import EVENTS_MAILBOX
from mover_plugin.launch.agent import Agent
from mover_plugin.launch.agent_config import AgentConfig
from mover_plugin.launch.hosts import NodeSpec
from mover_plugin.launch.job_secret import JOB_SECRET_ENV
from mover_plugin.launch.local_process import Worker
from mover_plugin.mailbox import Mailbox
from mover_plugin.progress import READY, STEP_BEGIN, STEP_END, ProgressEvent
from mover_plugin.testing import run_command

SCRIPT = str(SCRIPTS / "end_of_job.py")
STEPS = 6
JOB_ENV = {JOB_SECRET_ENV: "end-of-job-test-secret"}
TIMEOUT_S = 120.0
"""Each launcher's limit: far above the job's seconds, below the test runner's."""


def test_an_agent_counts_the_steps_of_a_generation_it_has_moved_past():
    """A migration moves the agent to its generation before the ranks switch; if training
    ends first (the migration is called off) the ranks' last steps, all of the old
    generation, still count: the summary's steps are the steps trained."""
    node = NodeSpec(0, "127.0.0.1", 1, 0)
    store = dist.HashStore()
    agent = Agent(AgentConfig(node, 1, "127.0.0.1", 0, ("true",)), store, relay=None)
    agent._generation = 1  # the migration's ``generation`` command
    worker = Worker(0, 0, SimpleNamespace(pid=os.getpid()), pipe=-1)
    agent._on_progress(worker, ProgressEvent(READY, 2, time.time(), generation=0))
    for step in range(3, 13):
        agent._on_progress(worker, ProgressEvent(STEP_BEGIN, step, time.time(), generation=0))
        agent._on_progress(worker, ProgressEvent(STEP_END, step, time.time(), 0.1, 0))
    fields = worker.progress_fields()
    assert (fields["step_begun"], fields["step_completed"]) == (12, 12)
    assert len(worker.step_durations) == 10
    # a report of the old generation still starts no report of the new one's progress
    assert [e["kind"] for e in Mailbox(store, EVENTS_MAILBOX).poll()] == []


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_for(path: Path, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not path.exists():
        assert process.poll() is None, "the job ended first"
        assert time.monotonic() < deadline, f"no {path.name} within {TIMEOUT_S} s"
        time.sleep(0.05)


def test_a_job_ends_with_a_refill_and_a_joining_host_started_at_its_last_step(tmp_path):
    """The pool's standby ``a0.n0.s0`` exits, so a refill starts at once
    (``--refill-delay-s 0``); a host joins (``mover-launch --join``) and its agent starts a
    standby; rank 0 ends training only once both have started. Rank 1's process never ends
    after its script (a thread Python's teardown waits for). The first rank to finish winds the
    job down: both agents stop their standbys (SIGTERM ignored: SIGKILL after the grace) and
    start no other; rank 1's agent stops its teardown ``--exit-timeout-s`` after the host's
    last script ended. The job and the joining host end with exit code 0, a complete summary
    and no process left behind."""
    markers = tmp_path / "markers"
    markers.mkdir()
    events, summary = tmp_path / "events.jsonl", tmp_path / "summary.json"
    port = _free_port()
    job = [*LAUNCH, "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
           str(port), "--policy", "resilient", "--standbys", "2", "--stop-grace-s", "1",
           "--exit-timeout-s", "1", "--refill-delay-s", "0", "--event-log", str(events),
           "--summary", str(summary), SCRIPT, "--steps", str(STEPS), "--markers", str(markers),
           "--await", "a0.n0.r0", "--await", "a0.n1.j0", "--hang-at-exit", "1"]
    joining = [*LAUNCH, "--join", f"127.0.0.1:{port}", "--nproc-per-node", "1",
               "--host", "127.0.0.2"]
    tag = str(tmp_path)  # unique across concurrent test sessions
    with ExitStack() as stack:
        first = stack.enter_context(background_job(job, tag, JOB_ENV))
        _wait_for(markers / "a0.n0.s1.started", first)  # the controller is up
        second = stack.enter_context(background_job(joining, tag, JOB_ENV))
        output, _ = first.communicate(timeout=TIMEOUT_S)
        joined_output, _ = second.communicate(timeout=TIMEOUT_S)
    assert first.returncode == 0, output[-4000:]
    assert second.returncode == 0, joined_output[-4000:]
    assert "STATE" in output
    result = json.loads(summary.read_text())
    assert result["exit_code"] == 0 and result["steps_completed"] == STEPS
    assert result["restarts"] == 0 and result["interruptions"] == []
    (refill,) = result["refills"]
    assert refill["standby"] == "a0.n0.r0" and refill["stopped_at"] is not None
    log = read_events(events)
    (ending,) = [e for e in log if e["event"] == "job_ending"]
    assert ending["refills_stopped"] == ["a0.n0.r0"]
    assert ending["standbys_stopped"] == ["a0.n0.s1"]  # the joining host's never got ready
    assert [e["event"] for e in log][-1] == "job_end"
    assert [e["standbys"] for e in log if e["event"] == "host_joined"] == [["a0.n1.j0"]]
    assert "stopped standby(s) a0.n0.s1, a0.n0.r0" in output
    assert "stopped standby(s) a0.n1.j0" in joined_output
    # rank 1's teardown hangs; rank 0's may outlast the timeout too on a busy machine
    assert re.search(r"rank\(s\) \[(0, )?1\] ended their script", output), output[-4000:]
    assert not tagged_processes(tag)
    # Each standby's slot (its GPU on a host with GPUs): after the workers' 0 and 1 on the
    # first host; the refill takes the slot a0.n0.s0 freed; the joining host's from 0.
    slots = {path.name.removesuffix(".started"): int(path.read_text())
             for path in markers.glob("*.started")}
    assert slots == {"a0.n0.s0": 2, "a0.n0.s1": 3, "a0.n0.r0": 2, "a0.n1.j0": 0}


ORPHAN = """
import os, signal, sys, time
from mover_plugin.processes import parent_death_signal

parent_dies = sys.argv[1] == "dies"
read, write = os.pipe()
middle = os.fork()
if middle == 0:  # the parent-to-be: arms its child, then dies (or waits for it)
    os.close(read)
    arm, me = parent_death_signal(signal.SIGKILL), os.getpid()
    child = os.fork()
    if child == 0:
        deadline = time.monotonic() + 10.0
        while parent_dies and os.getppid() == me and time.monotonic() < deadline:
            time.sleep(0.01)
        arm()
        os.write(write, b"alive")
        os._exit(0)
    if not parent_dies:
        os.waitpid(child, 0)
    os._exit(0)
os.close(write)
os.waitpid(middle, 0)
with os.fdopen(read, "rb") as pipe:
    print(pipe.read().decode() or "killed")  # EOF once the child exited or was killed
"""
"""Forks a parent-to-be that arms its child's death signal (as ``subprocess`` runs a
``preexec_fn``: after the fork) and dies first, or waits; prints what the child said."""


@pytest.mark.parametrize("parent", ["dies", "waits"])
def test_a_child_whose_parent_died_before_it_armed_its_death_signal_gets_it_at_once(parent):
    """The agent's standbys and the launcher's agents are armed in the child between fork and
    exec; a parent that died in between would leave the child running past the job."""
    result = run_command([sys.executable, "-c", ORPHAN, parent], timeout_s=60)
    assert result.returncode == 0, result.output
    assert result.stdout.strip() == ("killed" if parent == "dies" else "alive")
