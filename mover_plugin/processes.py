"""Starting and stopping child processes so that none outlives its parent.

Used by the launcher's agent (workers), the launcher itself (agents) and the test harness.
Every child gets a parent-death signal (Linux ``prctl``), runs in its own process group, and
is stopped by group: SIGTERM, a grace period, then SIGKILL.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import time
from typing import Callable, Optional

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def parent_death_signal(sig: int) -> Callable[[], None]:
    """Returns a ``preexec_fn`` that makes the child receive ``sig`` when its parent dies.
    Run as a ``preexec_fn``, it also covers a parent that died between the fork and the call
    (the kernel signals only a death after it): the child then gets ``sig`` at once. Called in
    the process that made it (a child arming itself), it arms that process.

    ``prctl`` is looked up here, in the parent: between the fork and the exec the child runs
    only the looked-up C function and three system calls. A lookup there (``dlopen``) could
    wait forever for a lock another thread of the parent held at the fork, leaving a child
    that holds the parent's pipes, in a session of its own, with no parent-death signal."""
    parent = os.getpid()
    try:
        prctl: Optional[Callable[..., int]] = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: the child is still stopped by group
        prctl = None

    def preexec() -> None:
        if prctl is None:
            return
        prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getpid() != parent and os.getppid() != parent:
            os.kill(os.getpid(), sig)

    return preexec


def start_process(
    command: list[str],
    env: dict[str, str],
    *,
    death_signal: int = signal.SIGKILL,
    pass_fds: tuple[int, ...] = (),
    cwd: Optional[str] = None,
) -> subprocess.Popen:
    """Starts ``command`` in a new process group, bound to die with this process."""
    return subprocess.Popen(
        command,
        env=env,
        pass_fds=pass_fds,
        cwd=cwd,
        start_new_session=True,
        preexec_fn=parent_death_signal(death_signal),
    )


def signal_group(process: subprocess.Popen, sig: int) -> None:
    """Sends ``sig`` to the process group of ``process`` (ignoring one already gone)."""
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_processes(processes: list[subprocess.Popen], grace_s: float, *,
                   exiting_s: float = 0.0) -> None:
    """Waits up to ``exiting_s`` for processes told to exit to do so by themselves, then
    SIGTERMs every group, waits up to ``grace_s``, SIGKILLs what is left, reaps all."""
    if exiting_s > 0:
        deadline = time.monotonic() + exiting_s
        for process in processes:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    for process in processes:
        if process.poll() is None:
            signal_group(process, signal.SIGTERM)
            # A stopped (SIGSTOP) process only acts on SIGTERM once continued.
            signal_group(process, signal.SIGCONT)
    deadline = time.monotonic() + grace_s
    for process in processes:
        remaining = max(0.0, deadline - time.monotonic())
        try:
            process.wait(timeout=remaining)
        except subprocess.TimeoutExpired:
            logger.warning("pid %d did not stop within %.1f s; killing it", process.pid, grace_s)
    for process in processes:
        # The group may still hold children of an exited leader.
        signal_group(process, signal.SIGKILL)
        process.wait()


def exit_status(end: Optional[BaseException]) -> int:
    """The exit status Python gives a script that ended with ``end`` (None: it returned)."""
    if end is None:
        return 0
    if not isinstance(end, SystemExit):
        return 1
    if end.code is None or isinstance(end.code, int):
        return end.code or 0
    return 1


def describe_exit(returncode: int) -> str:
    """``'exit code 1'`` or ``'signal SIGKILL'`` for a Popen return code."""
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_cpu_s(pid: int) -> Optional[float]:
    """CPU seconds (user + system, all threads) the process ``pid`` has used so far, from
    ``/proc`` (clock-tick resolution); ``None`` where that is not readable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # After the command name: state is field 3 of stat(5), utime and stime fields 14 and 15.
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def established_connections() -> set[int]:
    """The socket inodes of this process's established TCP connections, from ``/proc`` (empty
    where that is not readable): which peers a process holds connections to, e.g. to see what a
    process group connected."""
    mine = set()
    try:
        descriptors = os.listdir("/proc/self/fd")
    except OSError:
        return mine
    for fd in descriptors:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            mine.add(int(target[len("socket:["):-1]))
    established = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as lines:
                rows = list(lines)[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == "01":  # TCP_ESTABLISHED
                established.add(int(fields[9]))
    return mine & established
