"""Multi-process test harness: ranks as processes over real gloo, commands with timeouts.

Layered timeouts: a rank's process group times out first (``group_timeout_s``), the harness
next (``timeout_s``, after which every rank is killed and the call fails with what each rank
reported), and the test runner's own timeout last. Every child is started in its own process
group with a parent-death signal and is killed and reaped in ``finally``, pass or fail.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import subprocess
import time
import traceback
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch.distributed as dist

from mover_plugin.processes import parent_death_signal, signal_group

_CONTEXT = multiprocessing.get_context("spawn")


class RankFailure(AssertionError):
    """One or more ranks raised, exited without a result, or ran out of time."""


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 60.0,
    group_timeout_s: float = 20.0,
) -> list[Any]:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` processes in one gloo group.

    ``fn`` must be importable (module level). Returns the per-rank results in rank order, or
    raises :class:`RankFailure` with every failed rank's traceback.
    """
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    results: Any = _CONTEXT.Queue()
    processes = [
        _CONTEXT.Process(
            target=_rank_main,
            args=(fn, rank, world_size, store.port, group_timeout_s, args, results),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    try:
        for process in processes:
            process.start()
        return _collect(processes, results, world_size, timeout_s)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join(timeout=10)
        results.close()


def _collect(processes: list, results: Any, world_size: int, timeout_s: float) -> list[Any]:
    deadline = time.monotonic() + timeout_s
    outcomes: dict[int, tuple[bool, Any]] = {}
    while len(outcomes) < world_size and time.monotonic() < deadline:
        try:
            rank, ok, value = results.get(timeout=0.1)
            outcomes[rank] = (ok, value)
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in processes) and _all_done(processes):
                break
    failures = []
    for rank, process in enumerate(processes):
        ok, value = outcomes.get(rank, (False, None))
        if ok:
            continue
        if value is None:
            state = "still running" if process.is_alive() else f"exit code {process.exitcode}"
            value = f"no result within {timeout_s:.0f}s ({state})"
        failures.append(f"--- rank {rank} ---\n{value}")
    if failures:
        raise RankFailure("\n".join(failures))
    return [outcomes[rank][1] for rank in range(world_size)]


def _all_done(processes: list) -> bool:
    return all(not p.is_alive() for p in processes)


def _rank_main(fn, rank, world_size, port, group_timeout_s, args, results) -> None:
    parent_death_signal(signal.SIGKILL)()
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False,
                              timeout=timedelta(seconds=group_timeout_s))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=group_timeout_s))
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException:  # report everything, including SystemExit, to the parent
        results.put((rank, False, traceback.format_exc()))


@dataclass
class CommandResult:
    returncode: int
    stdout: str
    stderr: str
    wall_time_s: float

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def lines_starting(self, prefix: str) -> list[str]:
        return [line for line in self.output.splitlines() if line.startswith(prefix)]


COMMAND_ID_ENV = "MOVER_COMMAND_ID"
"""Set by :func:`run_command` in the command's environment: every process the command starts
inherits it, including those it starts in process groups of their own (a launcher's agents
and workers), so all of them are found and killed when the command ends."""

KILL_WAIT_S = 10.0
"""How long :func:`run_command` waits for the pipes to close once every process of the
command was killed."""


def run_command(
    command: Sequence[str],
    *,
    timeout_s: float,
    env: Optional[dict[str, str]] = None,
    cwd: Optional[str] = None,
) -> CommandResult:
    """Runs ``command`` in its own process group. On timeout, and in ``finally``, kills every
    process of the command: its group and each process that inherited its
    :data:`COMMAND_ID_ENV`, whatever group it moved to, so a process left behind can neither
    outlive the call nor keep its output pipes open."""
    started = time.monotonic()
    command_id = f"{os.getpid()}-{uuid.uuid4().hex}"
    process = subprocess.Popen(
        list(command), env={**os.environ, **(env or {}), COMMAND_ID_ENV: command_id},
        cwd=cwd, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL, start_new_session=True,
        preexec_fn=parent_death_signal(signal.SIGKILL),
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        ended = process.poll()
        left = _describe(processes_with_env(COMMAND_ID_ENV, command_id))
        _kill_command(process, command_id)
        stdout, stderr = _remaining_output(process)
        what = ("did not finish" if ended is None else
                f"ended with {ended} but processes it started held its output open")
        raise RankFailure(
            f"{' '.join(command)} {what} within {timeout_s:.0f}s; its processes then: "
            f"{left or 'none'}\n"
            f"--- stdout ---\n{stdout[-4000:]}\n--- stderr ---\n{stderr[-4000:]}"
        ) from None
    finally:
        _kill_command(process, command_id)
    return CommandResult(process.returncode, stdout, stderr, time.monotonic() - started)


def _describe(processes: dict[int, dict[str, str]]) -> str:
    """``pid (command line)`` of each process, for a failure message."""
    described = []
    for pid in sorted(processes):
        try:
            line = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            line = "?"
        described.append(f"{pid} ({line.strip()[:200]})")
    return "; ".join(described)


def _kill_command(process: subprocess.Popen, command_id: str) -> None:
    """SIGKILLs the command's group and every process with its id, until none is left (one
    being started as they are killed is found on the next pass); reaps the command."""
    signal_group(process, signal.SIGKILL)
    deadline = time.monotonic() + KILL_WAIT_S
    while (left := processes_with_env(COMMAND_ID_ENV, command_id)) and \
            time.monotonic() < deadline:
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.05)
    process.wait()


def _remaining_output(process: subprocess.Popen) -> tuple[str, str]:
    """What the killed command wrote, read until its pipes close or :data:`KILL_WAIT_S`."""
    try:
        return process.communicate(timeout=KILL_WAIT_S)
    except subprocess.TimeoutExpired:
        return "", "(its output pipes stayed open after every process of it was killed)"


def processes_with_env(name: str, value: str) -> dict[int, dict[str, str]]:
    """pid -> environment of every live process of this user whose environment has
    ``name=value`` (a tag a test or benchmark puts in a job's environment, which every process
    of the job inherits), read from ``/proc``."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "environ").read_bytes()
        except OSError:
            continue
        env = dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0")
                   if "=" in item)
        if env.get(name) == value:
            found[int(entry.name)] = env
    return found
