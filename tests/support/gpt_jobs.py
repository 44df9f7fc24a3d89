"""Running examples/pretrain_gpt.py under mover-launch on 4 CPU processes, for the tests."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

from mover_plugin.testing import CommandResult, processes_with_env, run_command
from support.paths import EXAMPLES, SCRIPTS

EXAMPLE = str(EXAMPLES / "pretrain_gpt.py")
HELD_EXAMPLE = str(SCRIPTS / "pretrain_gpt_held.py")
"""The example, with rank 0 held between steps while a file says so (for tests that must act
while the job still trains, however slow the machine: see the script)."""
LAUNCH = [sys.executable, "-m", "mover_plugin.launch.cli"]
MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8"]
STEP_LINE = re.compile(r"^step\s+(\d+)/\d+ \| loss (\S+)", re.MULTILINE)


def pretrain(*flags: str, launcher_flags=(), timeout_s: float = 300) -> CommandResult:
    return run_command(
        [*LAUNCH, "--standalone", "--nproc-per-node", "4", *launcher_flags, EXAMPLE, *MODEL,
         *flags],
        timeout_s=timeout_s,
    )


def digest(result: CommandResult) -> str:
    lines = result.lines_starting("PARAMS_DIGEST")
    assert len(lines) == 1, result.output[-4000:]
    return lines[0].split()[1]


def losses(result: CommandResult) -> dict[int, float]:
    return {int(step): float(loss) for step, loss in STEP_LINE.findall(result.stdout)}


def read_events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


TAG_ENV = "MOVER_TEST_TAG"
"""Set by a test in a job's environment; every process of that job inherits it. A test tags
with its ``str(tmp_path)``, unique across test sessions running at once (a test's own name is
not: two sessions would find, and kill, each other's processes)."""


def tagged_processes(tag: str) -> dict[int, dict[str, str]]:
    """pid -> environment of every process started with ``MOVER_TEST_TAG=tag``."""
    return processes_with_env(TAG_ENV, tag)


def worker_pid(rank: int, tag: str, standby: Optional[str] = None) -> Optional[int]:
    """The pid of the process of the tagged job that was started for ``rank`` (a worker,
    without MOVER_STANDBY_ID), or with ``standby`` the standby of that id."""
    for pid, env in tagged_processes(tag).items():
        if standby is not None and env.get("MOVER_STANDBY_ID") == standby:
            return pid
        if standby is None and env.get("RANK") == str(rank) and "MOVER_STANDBY_ID" not in env:
            return pid
    return None


@contextmanager
def background_job(command: list[str], tag: Optional[str] = None,
                   env: Optional[dict[str, str]] = None) -> Iterator[subprocess.Popen]:
    """Runs ``command`` (output merged into stdout; ``env`` added to the environment) in its
    own session while the test works, tagged with ``tag``; kills the whole session if it is
    still running at the end."""
    env = {**os.environ, **(env or {}), **({TAG_ENV: tag} if tag else {})}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True, env=env)
    try:
        yield process
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def wait_for_events(events_path: Path, done: Callable[[list[dict]], bool],
                    process: subprocess.Popen, timeout_s: float = 240,
                    poll_s: float = 0.1) -> list[dict]:
    """The event log once ``done(records)`` holds (the job must still run meanwhile), read
    every ``poll_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        events = read_events(events_path) if events_path.exists() else []
        if done(events):
            return events
        assert process.poll() is None, "the job ended first"
        time.sleep(poll_s)
    raise AssertionError("timed out")
