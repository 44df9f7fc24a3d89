"""One process an agent started on its host (a worker or a standby) and what it knows of it.

The agent (:mod:`mover_plugin.launch.agent`) keeps one :class:`Worker` per process: its rank (or
standby id), its pipes, what its progress reports said (steps, heartbeats, the script's end)
and, once it exited, its exit status, peak memory and CPU time per step.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from mover_plugin.contract import (
    ATTEMPT_ENV,
    CONTROL_ADDR_ENV,
    CONTROL_PORT_ENV,
    GENERATION_ENV,
    PROGRESS_FD_ENV,
)
from mover_plugin.launch.hosts import NodeSpec
from mover_plugin.launch.job_secret import JOB_SECRET_ENV
from mover_plugin.launch.store_gate import LOOPBACK
from mover_plugin.processes import process_cpu_s
from mover_plugin.progress import ProgressLineReader


@dataclass
class Worker:
    """One worker or standby process and what the agent knows of its progress."""

    rank: Optional[int]
    """The global rank; None for a standby not promoted yet."""
    attempt: int
    process: subprocess.Popen
    pipe: int
    """The read end of the process's progress pipe (-1 once closed)."""
    notice_pipe: int = -1
    """The write end of the process's notice pipe (-1 once closed)."""
    standby: Optional[str] = None
    slot: int = 0
    """Its slot on the host, seen as ``LOCAL_RANK``: its GPU (:mod:`mover_plugin.devices`)."""
    leaving: bool = False
    """Handing its rank over to a promoted standby (planned migration)."""
    reader: ProgressLineReader = field(default_factory=ProgressLineReader)
    step_begun: int = 0
    step_completed: int = 0
    last_step_end: Optional[float] = None
    last_step_duration: Optional[float] = None
    ready_reported: bool = False
    first_step_reported: bool = False
    exited: bool = False
    script_status: Optional[int] = None
    """The exit status its script ended with, once reported (its teardown follows)."""
    script_ended_at: Optional[float] = None
    """When that report was read (monotonic)."""
    last_heard: float = field(default_factory=time.monotonic)
    hang_timeout_s: Optional[float] = None
    step_durations: list[float] = field(default_factory=list)
    peak_rss_mb: Optional[float] = None
    first_cpu: Optional[tuple[int, float]] = None
    """(step, the process's CPU seconds) when its first step end was read."""
    last_cpu: Optional[tuple[int, float]] = None
    """The same when its latest step end was read."""

    def mark_cpu(self, step: int) -> None:
        """Notes the process's CPU time (all its threads) at the end of ``step``."""
        seconds = process_cpu_s(self.process.pid)
        if seconds is not None:
            self.last_cpu = (step, seconds)
            self.first_cpu = self.first_cpu or self.last_cpu

    def cpu_per_step_s(self) -> Optional[float]:
        """CPU seconds per step between the first step end seen and the latest (the first
        step, with its warm-up, excluded)."""
        if self.first_cpu is None or self.last_cpu is None or self.last_cpu[0] <= self.first_cpu[0]:
            return None
        return (self.last_cpu[1] - self.first_cpu[1]) / (self.last_cpu[0] - self.first_cpu[0])

    def progress_fields(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "standby": self.standby,
            "step_begun": self.step_begun,
            "step_completed": self.step_completed,
            "last_step_end": self.last_step_end,
            "last_step_duration": self.last_step_duration,
            "median_step_s": statistics.median(self.step_durations) if self.step_durations
            else None,
            "peak_rss_mb": self.peak_rss_mb,
            "cpu_per_step_s": self.cpu_per_step_s(),
        }

    def alive(self) -> bool:
        """Whether the process still runs; one that exited is left for :meth:`reap` to
        collect."""
        if self.exited or self.process.returncode is not None:
            return False
        try:
            flags = os.WEXITED | os.WNOHANG | os.WNOWAIT
            return os.waitid(os.P_PID, self.process.pid, flags) is None
        except ChildProcessError:  # reaped elsewhere
            return self.process.poll() is None

    def reap(self) -> bool:
        """Collects the exit status (and peak memory) if the process has exited."""
        if self.process.returncode is not None:
            return True
        try:
            pid, status, usage = os.wait4(self.process.pid, os.WNOHANG)
        except ChildProcessError:  # reaped elsewhere (e.g. by Popen.wait)
            return self.process.poll() is not None
        if pid == 0:
            return False
        self.process.returncode = os.waitstatus_to_exitcode(status)
        self.peak_rss_mb = usage.ru_maxrss / 1024  # Linux reports KiB
        return True


def process_environment(node: NodeSpec, world_size: int, rank: Optional[int], slot: int,
                        attempt: int, generation: int, progress_fd: int, *, store_port: int,
                        control_port: int) -> dict[str, str]:
    """A worker's environment (torchrun's variables), or without ``rank`` a standby's: the
    same but ``RANK``, which its promotion sets. The stores are this host's relay's loopback
    ports (``store_port`` the attempt's, ``control_port`` the controller's)."""
    env = dict(os.environ)
    env.pop(JOB_SECRET_ENV, None)  # workers reach the stores through this host's relay
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("RANK", None)
    if rank is not None:
        env["RANK"] = str(rank)
    env.update(
        LOCAL_RANK=str(slot),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(node.local_world_size),
        GROUP_RANK=str(node.node_rank),
        MASTER_ADDR=LOOPBACK,
        MASTER_PORT=str(store_port),
        # env:// rendezvous connects to the store the controller hosts for this attempt.
        TORCHELASTIC_USE_AGENT_STORE="True",
        TORCHELASTIC_RESTART_COUNT=str(attempt),
    )
    env.update({CONTROL_ADDR_ENV: LOOPBACK, CONTROL_PORT_ENV: str(control_port),
                ATTEMPT_ENV: str(attempt), GENERATION_ENV: str(generation),
                PROGRESS_FD_ENV: str(progress_fd)})
    return env
