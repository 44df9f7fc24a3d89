"""Tests of the multi-process test harness itself: results, tracebacks, timeouts, no leaks."""

import multiprocessing.resource_tracker
import os
import re
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mover_plugin.testing import RankFailure, run_command, run_ranks


def _children() -> set[int]:
    """This process's children, less multiprocessing's resource tracker (it lives on)."""
    pids = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        pids.update(int(pid) for pid in (task / "children").read_text().split())
    return pids - {multiprocessing.resource_tracker._resource_tracker._pid}


def sum_of_ranks(rank, world_size):
    tensor = torch.tensor([float(rank)])
    dist.all_reduce(tensor)
    return tensor.item()


def fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("rank one refuses")
    dist.barrier()
    return rank


def hang_on_rank_zero(rank, world_size):
    if rank == 0:
        time.sleep(3600)
    return rank


def test_results_come_back_in_rank_order():
    assert run_ranks(sum_of_ranks, 3, timeout_s=60) == [3.0, 3.0, 3.0]
    assert not _children()


def test_every_failing_rank_reports_its_traceback():
    with pytest.raises(RankFailure) as error:
        run_ranks(fail_on_rank_one, 2, timeout_s=60, group_timeout_s=5)
    text = str(error.value)
    assert "--- rank 1 ---" in text and "ValueError: rank one refuses" in text
    # Rank 0 waits in the barrier for rank 1 and fails with the group's own timeout or error.
    assert "--- rank 0 ---" in text
    assert not _children()


def test_a_hung_rank_is_killed_at_the_harness_timeout():
    started = time.monotonic()
    with pytest.raises(RankFailure, match="rank 0 ---\nno result within 15s"):
        run_ranks(hang_on_rank_zero, 2, timeout_s=15)
    assert time.monotonic() - started < 40
    assert not _children()


def test_run_command_kills_the_whole_group_on_timeout():
    with pytest.raises(RankFailure, match="did not finish within 2s"):
        run_command(["bash", "-c", "sleep 300 & sleep 300"], timeout_s=2)
    assert not _children()


LEAVES_A_SESSION = """
import subprocess, sys
subprocess.Popen([sys.executable, "-c", "import time; print('left', flush=True); time.sleep(300)"],
                 start_new_session=True)
print("parent done", flush=True)
"""


def test_run_command_kills_what_the_command_left_in_other_sessions():
    """The command exits at once, but a process it started in a session of its own keeps its
    output open (as an agent's worker would, in its own group): the call still ends at its
    timeout, naming that process, and kills it."""
    started = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        run_command([sys.executable, "-c", LEAVES_A_SESSION], timeout_s=3)
    message = str(failure.value)
    assert "ended with 0 but processes it started held its output open within 3s" in message
    assert "time.sleep(300)" in message and "parent done" in message and "left" in message
    assert time.monotonic() - started < 30
    left = int(re.search(r"its processes then: (\d+) \(", message)[1])
    assert not _running(left)


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False
