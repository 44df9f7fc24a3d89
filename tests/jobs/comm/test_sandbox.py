"""Tests of the sandbox a standby warms up in (``mover_plugin.comm.sandbox``) and of the roles
it plays (``mover_plugin.megatron.standby``).

The proof that the sandbox sends nothing runs it next to a live job: two ranks of a real gloo
job communicate while a third process, posing as one of them in the sandbox and handed the
job's own store namespace, runs every kind of operation. That process must open no socket and
never call the store, and the job's results must be untouched.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist

from mover_plugin.layout import ParallelLayout
from mover_plugin.megatron.standby import KeptRole, pipeline_roles
from support.rank_jobs import (  # noqa: F401 - the fixture is used by name
    GROUP_TIMEOUT,
    init_mover_group,
    rank_job,
    stop_forkserver_after_module,
)

JOB = [0, 1]
SANDBOX = 2
POSING_AS = 1


@pytest.fixture(scope="module", autouse=True)
def _stop_forkserver(stop_forkserver_after_module: None) -> None:
    """No forkserver outlives this module (other tests check for stray children)."""


# --------------------------------------------------------------------------- pure logic


def _roles(tp: int, pp: int, dp: int) -> list[tuple[str, int, int]]:
    return [(role.name, role.rank, role.stage)
            for role in pipeline_roles(ParallelLayout(tp=tp, pp=pp, dp=dp))]


def test_a_standby_plays_first_last_then_a_middle_stage():
    assert _roles(1, 1, 4) == [("only", 0, 0)]
    assert _roles(1, 2, 2) == [("first", 0, 0), ("last", 2, 1)]
    assert _roles(2, 4, 1) == [("first", 0, 0), ("last", 6, 3), ("middle", 2, 1)]


@pytest.mark.parametrize("sharded, fitting", [(False, [0, 2]), (True, [0])])
def test_a_kept_role_fits_its_stage_at_tp0_and_with_a_sharded_optimizer_only_dp0(
        sharded, fitting):
    layout = ParallelLayout(tp=2, pp=2, dp=2)  # ranks 0-3 first stage, 4-7 last
    (first, _) = [KeptRole(role, (None, None, None), {}, sharded)
                  for role in pipeline_roles(layout)]
    assert [rank for rank in range(8) if first.fits(layout.coordinates(rank))] == fitting


def test_a_kept_role_of_a_model_with_experts_fits_only_ranks_holding_the_same_experts():
    layout = ParallelLayout.for_world(8, tp=1, pp=2, ep=2)  # ranks 0, 2 hold experts 0
    (first, _) = [KeptRole(role, (None, None, None), {}, False)
                  for role in pipeline_roles(layout)]
    assert [rank for rank in range(8) if first.fits(layout.coordinates(rank))] == [0, 2]


# --------------------------------------------------------------------------- processes


class _RecordingStore(dist.Store):
    """A store that records every call before passing it on."""

    def __init__(self, inner: dist.Store) -> None:
        super().__init__()
        self.inner = inner
        self.calls: list[str] = []

    def set(self, key: str, value: Any) -> None:
        self.calls.append(f"set {key}")
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        self.calls.append(f"get {key}")
        return self.inner.get(key)

    def add(self, key: str, value: int) -> int:
        self.calls.append(f"add {key}")
        return self.inner.add(key, value)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        self.calls.append(f"compare_set {key}")
        return self.inner.compare_set(key, expected, desired)

    def wait(self, keys: list[str], timeout: Optional[timedelta] = None) -> None:
        self.calls.append(f"wait {keys}")
        self.inner.wait(keys, timeout or GROUP_TIMEOUT)

    def check(self, keys: list[str]) -> bool:
        self.calls.append(f"check {keys}")
        return self.inner.check(keys)

    def delete_key(self, key: str) -> bool:
        self.calls.append(f"delete_key {key}")
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        self.calls.append("num_keys")
        return self.inner.num_keys()


def _sockets() -> set[str]:
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:"):
            found.add(target)
    return found


def _job_rank(rank: int, store: dist.Store, port: int) -> list[float]:
    """A job rank: all-reduces and exchanges with its peer until the sandbox is done."""
    init_mover_group(store, "job/", rank, len(JOB))
    store.set(f"joined/{rank}", "1")
    results: list[float] = []
    finished = False
    while True:
        total = torch.tensor([float(rank + 1)])
        dist.all_reduce(total)
        other = torch.zeros(1)
        peer = 1 - rank
        if rank == 0:
            dist.send(torch.tensor([10.0 + rank]), peer)
            dist.recv(other, peer)
        else:
            dist.recv(other, peer)
            dist.send(torch.tensor([10.0 + rank]), peer)
        results.append(total.item() * 100 + other.item())
        if finished:
            break
        done = torch.tensor([1.0 if store.check(["sandbox/done"]) else 0.0])
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        finished = done.item() > 0  # one more round after the sandbox has finished
    dist.destroy_process_group()
    return results


def _sandbox(rank: int, store: dist.Store, port: int) -> dict[str, Any]:
    """Poses as a rank of the job in the sandbox while the job runs."""
    from mover_plugin.comm.sandbox import SANDBOX_BACKEND, operations_served, \
        register_sandbox_backend

    store.wait([f"joined/{r}" for r in JOB], GROUP_TIMEOUT)
    recording = _RecordingStore(dist.PrefixStore("job/", store))
    sockets_before = _sockets()
    register_sandbox_backend()
    dist.init_process_group(SANDBOX_BACKEND, store=recording, rank=POSING_AS,
                            world_size=len(JOB), timeout=GROUP_TIMEOUT)
    pair = dist.new_group(JOB)
    for _ in range(20):
        value = torch.tensor([5.0])
        dist.all_reduce(value)
        dist.broadcast(value, src=0, group=pair)
        gathered = [None, None]
        dist.all_gather_object(gathered, {"rank": POSING_AS})
        dist.send(torch.tensor([99.0]), 0)
        received = torch.full((1,), 7.0)
        dist.recv(received, 0)
        ops = [dist.P2POp(dist.isend, torch.tensor([98.0]), 0),
               dist.P2POp(dist.irecv, torch.full((1,), 7.0), 0)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        dist.barrier(group=pair)
    outcome = {"value": value.item(), "gathered": gathered, "received": received.item(),
               "rank": dist.get_rank(pair), "operations": operations_served()}
    dist.destroy_process_group()
    outcome["new_sockets"] = sorted(_sockets() - sockets_before)
    outcome["store_calls"] = recording.calls
    store.set("sandbox/done", "1")
    return outcome


def test_the_sandbox_reaches_no_rank_of_a_running_job():
    with rank_job() as job:
        for rank in JOB:
            job.start(rank, _job_rank)
        job.start(SANDBOX, _sandbox)
        results = job.collect([*JOB, SANDBOX])
    sandbox = results[SANDBOX]
    assert sandbox["new_sockets"] == [], "the sandbox opened a connection"
    assert sandbox["store_calls"] == [], "the sandbox used the job's store"
    # It did answer the job's kinds of operation, locally.
    assert sandbox["operations"]["allreduce"] >= 20
    assert sandbox["operations"]["send"] >= 40 and sandbox["operations"]["recv"] >= 40
    assert sandbox["value"] == 5.0 and sandbox["received"] == 0.0
    assert sandbox["gathered"] == [{"rank": POSING_AS}] * 2 and sandbox["rank"] == POSING_AS
    # The job's ranks saw only each other: sums of 1 + 2, and the peer's own message.
    assert len(results[0]) >= 2 and results[0] == [311.0] * len(results[0])
    assert results[1] == [310.0] * len(results[1])
