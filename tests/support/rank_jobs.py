"""Ranks as processes for multi-process tests of the communication layer.

Processes are forked from a forkserver with torch (and Megatron-Core's ``parallel_state``)
preloaded, around a master TCPStore on a port the OS picks; results and tracebacks come back
through a queue and every child is killed and reaped in ``finally``. Timeouts are layered:
gloo's group timeout (15 s) < the harness limit (45 s) < the test runner's.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import queue
import signal
import time
import traceback
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional

import pytest
import torch
import torch.distributed as dist

from mover_plugin.comm import register_backend
from mover_plugin.processes import parent_death_signal

GROUP_TIMEOUT = timedelta(seconds=15)
HARNESS_TIMEOUT_S = 45.0

_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "megatron.core.parallel_state"])


@pytest.fixture(scope="module")
def stop_forkserver_after_module() -> Iterator[None]:
    """The forkserver is a child of the test process: stop it so no child outlives the module
    (other tests check that they leave no children behind)."""
    yield
    stop = getattr(multiprocessing.forkserver._forkserver, "_stop", None)
    if stop is not None:
        stop()


def _child_main(fn: Callable[..., Any], rank: int, port: int, args: tuple, results: Any) -> None:
    parent_death_signal(signal.SIGKILL)()
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=GROUP_TIMEOUT)
        value = fn(rank, store, port, *args)
        results.put((rank, True, value))
    except BaseException:  # report everything, SystemExit included, to the parent
        results.put((rank, False, traceback.format_exc()))


class Job:
    """Ranks as processes around one master TCPStore; see :func:`rank_job`."""

    def __init__(self) -> None:
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=GROUP_TIMEOUT)
        self.results: Any = _CONTEXT.Queue()
        self.processes: dict[int, Any] = {}
        self.deadline = time.monotonic() + HARNESS_TIMEOUT_S

    def start(self, rank: int, fn: Callable[..., Any], *args: Any) -> None:
        """Starts ``fn(rank, store_client, port, *args)`` in a new process; ``rank`` keys the
        result (a replacement uses a key of its own, e.g. 100 + its rank)."""
        process = _CONTEXT.Process(target=_child_main,
                                   args=(fn, rank, self.store.port, args, self.results),
                                   daemon=True)
        process.start()
        self.processes[rank] = process

    def signal(self, rank: int, sig: int) -> None:
        os.kill(self.processes[rank].pid, sig)

    def wait_keys(self, keys: list[str]) -> None:
        remaining = max(0.1, self.deadline - time.monotonic())
        self.store.wait(keys, timedelta(seconds=remaining))

    def collect(self, ranks: list[int]) -> dict[int, Any]:
        """The results of ``ranks``; fails with every failed rank's traceback."""
        outcomes: dict[int, tuple[bool, Any]] = {}
        while len(outcomes) < len(ranks) and time.monotonic() < self.deadline:
            try:
                rank, ok, value = self.results.get(timeout=0.1)
            except queue.Empty:
                if any(not self.processes[r].is_alive() for r in ranks if r not in outcomes):
                    time.sleep(0.5)  # a result may still be in the pipe
                    while True:
                        try:
                            rank, ok, value = self.results.get_nowait()
                        except queue.Empty:
                            break
                        outcomes[rank] = (ok, value)
                    if any(not self.processes[r].is_alive()
                           for r in ranks if r not in outcomes):
                        break
                continue
            outcomes[rank] = (ok, value)
        failures = []
        for rank in ranks:
            ok, value = outcomes.get(rank, (False, None))
            if not ok:
                process = self.processes[rank]
                state = "still running" if process.is_alive() else f"exit {process.exitcode}"
                failures.append(f"--- rank {rank} ---\n{value or f'no result ({state})'}")
        if failures:
            pytest.fail("\n".join(failures), pytrace=False)
        return {rank: outcomes[rank][1] for rank in ranks}

    def exits_within(self, ranks: list[int], seconds: float) -> dict[int, Optional[int]]:
        """Joins ``ranks`` for up to ``seconds`` in all; returns their exit codes."""
        end = time.monotonic() + seconds
        for rank in ranks:
            self.processes[rank].join(max(0.0, end - time.monotonic()))
        return {rank: self.processes[rank].exitcode for rank in ranks}

    def close(self) -> None:
        for process in self.processes.values():
            if process.is_alive():
                try:
                    os.kill(process.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                process.kill()
        for process in self.processes.values():
            process.join(timeout=10)
        self.results.close()


@contextmanager
def rank_job() -> Iterator[Job]:
    job = Job()
    try:
        yield job
    finally:
        job.close()


def init_mover_group(store: dist.Store, prefix: str, rank: int, world_size: int) -> None:
    register_backend()
    dist.init_process_group("mover", store=dist.PrefixStore(prefix, store), rank=rank,
                            world_size=world_size, timeout=GROUP_TIMEOUT)


