"""Tests of the abortable communication layer (``mover_plugin.comm``) over real gloo.

Pure tests drive the alarm; one in-process test runs a world of one rank; the rest run ranks as
processes (:mod:`rank_jobs`).
"""

from __future__ import annotations

import importlib.util
import os
import threading
import signal
import time
from datetime import timedelta
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist

from mover_plugin.comm import (
    CollectiveAborted,
    CommAborted,
    MoverProcessGroup,
    alarm,
    clear_alarm,
    is_raised,
    raise_alarm,
    register_backend,
    retired,
)
from mover_plugin.errors import MoverError
from support.rank_jobs import (  # noqa: F401
    GROUP_TIMEOUT,
    Job,
    init_mover_group,
    rank_job,
    stop_forkserver_after_module,
)


@pytest.fixture(scope="module", autouse=True)
def _stop_forkserver(stop_forkserver_after_module: None) -> None:
    """No forkserver outlives this module (other tests check for stray children)."""


ALARM_KEY = "test/alarm"


def _watch_generation_0(port: int) -> None:
    """Raises the alarm once the test sets :data:`ALARM_KEY`, standing in for the notice a
    rank's runtime gets from its agent (the notice path has its own tests)."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)

    def watch() -> None:
        store.wait([ALARM_KEY], timedelta(seconds=300))
        raise_alarm(store.get(ALARM_KEY).decode())

    threading.Thread(target=watch, daemon=True).start()


# --------------------------------------------------------------------------- pure tests


@pytest.fixture
def clean_alarm() -> Iterator[None]:
    clear_alarm()
    yield
    clear_alarm()


def test_alarm_counts_epochs_and_re_arms_only_when_cleared(clean_alarm: None) -> None:
    heard: list[str] = []
    listener = heard.append
    alarm.add_listener(listener)
    try:
        start = alarm.current_epoch()
        assert not is_raised() and alarm.reason() is None
        assert raise_alarm("rank 3 died") == start + 1
        assert is_raised() and alarm.reason() == "rank 3 died"
        assert alarm.raised_at() is not None and alarm.wait_for_alarm(0)
        # A second detector reporting the same incident changes nothing.
        assert raise_alarm("rank 3 heartbeat lapsed") == start + 1
        assert heard == ["rank 3 died"]
        assert alarm.reason_after(start) == "rank 3 died"
        clear_alarm()
        assert not is_raised() and not alarm.wait_for_alarm(0.01)
        assert raise_alarm("rank 1 died") == start + 2
        assert heard == ["rank 3 died", "rank 1 died"]
    finally:
        alarm.remove_listener(listener)


def test_waiters_wake_at_once_when_the_alarm_is_raised(clean_alarm: None) -> None:
    epoch = alarm.current_epoch()
    assert not alarm.wait_until(lambda: False, epoch, 0.01)
    woke: list[float] = []

    def waiter() -> None:
        alarm.wait_until(lambda: False, epoch, 10.0)
        woke.append(time.monotonic())

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.05)
    raise_alarm("test")
    raised = alarm.raised_at()
    thread.join(5)
    assert woke and raised is not None and woke[0] - raised < 0.05


def test_errors_derive_from_the_project_error() -> None:
    assert issubclass(CollectiveAborted, CommAborted) and issubclass(CommAborted, MoverError)
    error = CollectiveAborted("x", reason="why", group="3")
    assert (error.reason, error.group) == ("why", "3")


class _TimedWork(dist.Work):
    """A backend work that behaves as c10d's ``Work.wait(timeout)`` does when the operation
    ends just as the timeout runs out: the wait raises "Operation timed out!" although the
    work is completed by the time the caller looks (``error`` set: it failed instead)."""

    def __init__(self, error: Exception | None = None) -> None:
        super().__init__()
        self.completed = False
        self.error = error

    def wait(self, timeout: timedelta | None = None) -> bool:  # type: ignore[override]
        if not self.completed:
            self.completed = True
            raise RuntimeError("Operation timed out!")
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self) -> bool:
        return self.completed


def test_a_sliced_wait_that_races_the_completion_reports_how_the_operation_ended() -> None:
    from mover_plugin.comm.work import _Sliced

    assert _Sliced(_TimedWork()).wait_slice(0.01) is True
    failing = _Sliced(_TimedWork(RuntimeError("Connection closed by peer")))
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        failing.wait_slice(0.01)


# --------------------------------------------------------------------------- one rank, in process


def test_a_world_of_one_in_process_aborts_and_rebuilds(clean_alarm: None) -> None:
    assert register_backend() == register_backend() == "mover"
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    init_mover_group(store, "gen0", 0, 1)
    try:
        world = dist.group.WORLD
        assert isinstance(world, MoverProcessGroup) and dist.get_backend() == "mover"
        tensor = torch.ones(3)
        dist.all_reduce(tensor)
        work = dist.all_reduce(tensor, async_op=True)
        assert work.wait() and work.is_completed() and torch.equal(tensor, torch.ones(3))
        assert dist.all_reduce(tensor, async_op=True).get_future().wait()[0].sum() == 3
        sub = dist.new_group([0])
        assert isinstance(sub, MoverProcessGroup) and dist.get_process_group_ranks(sub) == [0]
        with pytest.raises(ValueError, match="no communicator for meta tensors"):
            dist.all_reduce(torch.empty(1, device="meta"), group=sub)
        raise_alarm("test alarm")
        with pytest.raises(CollectiveAborted, match="test alarm"):
            dist.all_reduce(tensor)
        with pytest.raises(CollectiveAborted):
            dist.barrier(group=sub)
        started = time.monotonic()
        dist.destroy_process_group()
        assert time.monotonic() - started < 1.0
        clear_alarm()
        init_mover_group(store, "gen1", 0, 1)
        dist.all_reduce(tensor)
        assert torch.equal(tensor, torch.ones(3))
        # An explicit abort of one group leaves the others alone.
        sub = dist.new_group([0])
        sub.abort("maintenance")
        with pytest.raises(CollectiveAborted, match="maintenance"):
            dist.all_reduce(tensor, group=sub)
        dist.all_reduce(tensor)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class _RecordingBackend:
    """A real gloo backend that records which of its methods the group called."""

    def __init__(self, gloo: Any) -> None:
        self.gloo = gloo
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        self.calls.append(name)
        return getattr(self.gloo, name)


def test_a_group_of_one_completes_its_reductions_without_the_backend(clean_alarm: None) -> None:
    from torch._C._distributed_c10d import _make_nccl_premul_sum

    register_backend()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    init_mover_group(store, "gen0", 0, 1)
    try:
        alone = dist.new_group([0])
        backend = _RecordingBackend(alone._gloo)
        alone._gloo = backend
        tensor = torch.tensor([1.0, -2.0])
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX):
            dist.all_reduce(tensor, op=op, group=alone)
        work = dist.all_reduce(tensor, group=alone, async_op=True)
        assert work.is_completed() and work.wait() and work.get_future().wait()[0] is tensor
        assert backend.calls == [] and torch.equal(tensor, torch.tensor([1.0, -2.0]))
        with pytest.raises(ValueError, match="no communicator for meta tensors"):
            dist.all_reduce(torch.empty(1, device="meta"), group=alone)
        # A pre-multiplied sum scales even alone: it goes to the backend (gloo refuses it).
        with pytest.raises(RuntimeError, match="PREMUL_SUM"):
            dist.all_reduce(tensor, op=_make_nccl_premul_sum(2.0), group=alone)
        assert backend.calls == ["allreduce"]
        raise_alarm("test alarm")
        with pytest.raises(CollectiveAborted, match="test alarm"):
            dist.all_reduce(tensor, group=alone)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# --------------------------------------------------------------------------- ranks as processes


def _registration_is_opt_in(rank: int, store: dist.Store, port: int) -> dict:
    import mover_plugin.comm as comm

    before = comm.is_registered()
    name = comm.register_backend()
    return {"before": before, "after": comm.is_registered(), "name": name,
            "again": comm.register_backend()}


def _collectives(rank: int, store: dist.Store, port: int) -> dict:
    world_size = 4
    init_mover_group(store, "gen0", rank, world_size)
    checks: dict[str, Any] = {}
    world = dist.group.WORLD
    checks["world_type"] = type(world).__name__
    checks["world_is_mover_group"] = isinstance(world, MoverProcessGroup)

    for op, expected in ((dist.ReduceOp.SUM, 10.0), (dist.ReduceOp.MAX, 4.0),
                         (dist.ReduceOp.MIN, 1.0)):
        tensor = torch.full((3,), float(rank + 1))
        dist.all_reduce(tensor, op=op)
        checks[f"all_reduce_{op}"] = tensor.tolist() == [expected] * 3
    tensor = torch.full((2,), float(rank))
    dist.broadcast(tensor, src=2)
    checks["broadcast"] = tensor.tolist() == [2.0, 2.0]
    gathered = [torch.empty(2) for _ in range(world_size)]
    dist.all_gather(gathered, torch.full((2,), float(rank)))
    checks["all_gather"] = [t[0].item() for t in gathered] == [0.0, 1.0, 2.0, 3.0]
    out = torch.empty(world_size * 2)
    dist.all_gather_into_tensor(out, torch.full((2,), float(rank)))
    checks["all_gather_into_tensor"] = out.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    shard = torch.empty(2)
    dist.reduce_scatter_tensor(shard, torch.arange(8, dtype=torch.float32) * (rank + 1))
    checks["reduce_scatter_tensor"] = shard.tolist() == [20.0 * rank, 20.0 * rank + 10]
    dist.barrier()
    objects: list[Any] = [None] * world_size
    dist.all_gather_object(objects, {"rank": rank})
    checks["all_gather_object"] = objects == [{"rank": r} for r in range(world_size)]
    listed: list[Any] = [f"from {rank}", None]
    dist.broadcast_object_list(listed, src=1)
    checks["broadcast_object_list"] = listed == ["from 1", None]
    work = dist.all_reduce(torch.ones(1), async_op=True)
    checks["async_work_type"] = type(work).__name__
    work.wait()

    # Megatron-style subgroups: every rank creates every group, no backend named.
    pp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pp = pp_groups[rank // 2]
    dp = dp_groups[rank % 2]
    checks["sub_types"] = {type(pp).__name__, type(dp).__name__}
    checks["ranks"] = (dist.get_rank(pp), dist.get_world_size(pp), dist.get_global_rank(dp, 1),
                       dist.get_process_group_ranks(dp), dist.get_rank(dp))
    tensor = torch.full((2,), float(rank))
    dist.all_reduce(tensor, group=dp)
    checks["dp_all_reduce"] = tensor.tolist() == [2.0 * (rank % 2) + 2.0] * 2
    out = torch.empty(4)
    dist.all_gather_into_tensor(out, torch.full((2,), float(rank)), group=dp)
    checks["dp_all_gather_into_tensor"] = out.tolist() == [rank % 2] * 2 + [rank % 2 + 2] * 2
    shard = torch.empty(1)
    dist.reduce_scatter_tensor(shard, torch.tensor([1.0, 2.0]), group=dp)
    checks["dp_reduce_scatter"] = shard.tolist() == [2.0 * (dist.get_rank(dp) + 1)]
    tensor = torch.full((1,), float(rank))
    dist.broadcast(tensor, src=(rank // 2) * 2 + 1, group=pp)  # src is a global rank
    checks["pp_broadcast"] = tensor.item() == float((rank // 2) * 2 + 1)

    # Point to point by global rank on the pipeline groups: 0 <-> 1, 2 <-> 3.
    first = rank % 2 == 0
    peer = rank + 1 if first else rank - 1
    tensor = torch.full((2,), float(rank))
    if first:
        dist.send(tensor, dst=peer, group=pp)
    else:
        dist.recv(tensor, src=peer, group=pp)
    checks["send_recv"] = tensor.tolist() == [float(rank - (0 if first else 1))] * 2
    outgoing = torch.full((2,), 10.0 + rank)
    incoming = torch.empty(2)
    works = [dist.isend(outgoing, dst=peer, group=pp), dist.irecv(incoming, src=peer, group=pp)]
    for work in works:
        work.wait()
    checks["isend_irecv"] = incoming.tolist() == [10.0 + peer] * 2
    incoming = torch.empty(1 << 20)  # both neighbours send 4 MB first, as Megatron's pipeline
    ops = [dist.P2POp(dist.isend, torch.full((1 << 20,), 20.0 + rank), peer, group=pp),
           dist.P2POp(dist.irecv, incoming, peer, group=pp)]
    works = dist.batch_isend_irecv(ops)  # the group's own batch (the mover-comm patch)
    for work in works:
        work.wait()
    checks["batch_isend_irecv"] = bool(torch.all(incoming == 20.0 + peer))
    checks["batch_works"] = [type(work).__name__ for work in works]
    # The backends torch's own functions look up by device, as on c10d's groups, and torch's
    # batch_isend_irecv itself (not the patch's), which looks its group's backend up.
    checks["device_types"] = [str(device) for device in pp._device_types]
    checks["cpu_backend"] = type(pp._get_backend(torch.device("cpu"))).__name__
    incoming = torch.empty(2)
    ops = [dist.P2POp(dist.isend, torch.full((2,), 30.0 + rank), peer, group=pp),
           dist.P2POp(dist.irecv, incoming, peer, group=pp)]
    for work in dist.batch_isend_irecv.__wrapped__(ops):
        work.wait()
    checks["torch_batch_isend_irecv"] = incoming.tolist() == [30.0 + peer] * 2

    # The coalescing manager, as Megatron's DDP uses it for bucketed grad reduction.
    buckets = [torch.full((2,), float(rank)), torch.full((3,), 1.0)]
    with dist._coalescing_manager(dp, async_ops=True) as manager:
        for bucket in buckets:
            dist.all_reduce(bucket, group=dp, async_op=True)
    manager.wait()
    checks["coalesced_all_reduce"] = (buckets[0].tolist() == [2.0 * (rank % 2) + 2.0] * 2
                                      and buckets[1].tolist() == [2.0] * 3)
    shards = [torch.empty(1), torch.empty(2)]
    with dist._coalescing_manager(dp, async_ops=True) as manager:
        dist.reduce_scatter_tensor(shards[0], torch.tensor([1.0, 2.0]), group=dp, async_op=True)
        dist.reduce_scatter_tensor(shards[1], torch.ones(4), group=dp, async_op=True)
    manager.wait()
    checks["coalesced_reduce_scatter"] = (shards[0].tolist() == [2.0 * (dist.get_rank(dp) + 1)]
                                          and shards[1].tolist() == [2.0, 2.0])
    full = torch.empty(4)
    with dist._coalescing_manager(dp, async_ops=False):
        dist.all_gather_into_tensor(full, torch.full((2,), float(rank)), group=dp)
    checks["coalesced_all_gather"] = full.tolist() == [rank % 2] * 2 + [rank % 2 + 2] * 2

    # A group that only its members create.
    if rank in (0, 1):
        local = dist.new_group([0, 1], use_local_synchronization=True)
        tensor = torch.ones(1)
        dist.all_reduce(tensor, group=local)
        checks["local_sync_group"] = (type(local).__name__, tensor.item())
    dist.barrier()
    started = time.monotonic()
    dist.destroy_process_group()
    checks["destroy_s"] = time.monotonic() - started
    return checks


def test_the_alarm_s_aborts_run_at_once_and_a_stuck_one_holds_no_other() -> None:
    """NCCL aborts on an alarm (mover_plugin.comm.live.run_concurrently): one that
    blocks (behind another communicator's hung kernel) neither delays the others nor holds
    the alarm's thread past the bound; it is named."""
    from mover_plugin.comm.live import run_concurrently

    release, ran = threading.Event(), []

    def failing() -> None:
        raise RuntimeError("ncclCommAbort failed")

    started = time.monotonic()
    stuck = run_concurrently({"tp": lambda: release.wait(30), "dp": lambda: ran.append("dp"),
                              "pp": failing, "embedding": lambda: ran.append("embedding")},
                             wait_s=0.5)
    took = time.monotonic() - started
    release.set()
    assert stuck == ["tp"] and sorted(ran) == ["dp", "embedding"]
    assert 0.5 <= took < 5.0


def test_registration_is_idempotent_and_not_done_at_import() -> None:
    with rank_job() as job:
        job.start(0, _registration_is_opt_in)
        result = job.collect([0])[0]
    assert result == {"before": False, "after": True, "name": "mover", "again": "mover"}


def test_collectives_and_p2p_on_default_and_sub_groups() -> None:
    with rank_job() as job:
        for rank in range(4):
            job.start(rank, _collectives)
        results = job.collect(list(range(4)))
    for rank, checks in results.items():
        failed = [name for name, ok in checks.items() if ok is False]
        assert not failed, f"rank {rank}: {failed}"
        assert checks["world_type"] == "WorldGroup" and checks["world_is_mover_group"]
        assert checks["async_work_type"] == "AbortableWork"
        assert checks["batch_works"] == ["AbortableWork"]  # one work for the batch
        assert checks["device_types"] == ["cpu"] and checks["cpu_backend"] == "ProcessGroupGloo"
        assert checks["sub_types"] == {"MoverProcessGroup"}
        assert checks["ranks"] == (rank % 2, 2, [2, 3][rank % 2], [[0, 2], [1, 3]][rank % 2],
                                   rank // 2)
        if rank in (0, 1):
            assert checks["local_sync_group"] == ("MoverProcessGroup", 2.0)
        assert checks["destroy_s"] < 1.0


def _ring_connections(rank: int, store: dist.Store, port: int) -> dict:
    """Five ranks build a group with ring connections, a twin that shares its backend, then a
    group with c10d's full mesh; each step's new connections are counted."""
    from mover_plugin.processes import established_connections

    size, opened = 5, {}
    before = established_connections()
    group = MoverProcessGroup(dist.PrefixStore("ring/", store), rank, size, GROUP_TIMEOUT)
    opened["created"] = len(established_connections() - before)
    received = torch.zeros(3)
    works = [group.send([torch.full((3,), float(rank))], (rank + 1) % size),
             group.recv([received], (rank - 1) % size)]
    for work in works:
        work.wait()
    opened["after_neighbour_p2p"] = len(established_connections() - before)
    # Every rank counts before any starts the broadcast, whose root connects to ranks that are
    # not its neighbours (a store barrier: a group operation could connect pairs itself).
    _all_reached(store, "p2p_counted", size)
    tensor = torch.full((4,), float(rank + 1))
    group.broadcast([tensor], 3).wait()
    opened["after_broadcast"] = len(established_connections() - before)
    summed = torch.ones(2)
    group.allreduce([summed]).wait()
    before = established_connections()
    twin = MoverProcessGroup(dist.PrefixStore("twin/", store), rank, size, GROUP_TIMEOUT,
                             group_name="twin", share_with=group)
    opened["twin_created"] = len(established_connections() - before)
    works = [twin.allreduce([torch.full((2,), 10.0)]), group.allreduce([summed])]
    group.shutdown()  # the twin's operation, and later ones, go on over the shared backend
    works[0].wait()
    twin_summed = torch.full((2,), float(rank))
    twin.allreduce([twin_summed]).wait()
    twin.shutdown()
    MoverProcessGroup.c10d_gloo = True
    try:
        before = established_connections()
        mesh = MoverProcessGroup(dist.PrefixStore("mesh/", store), rank, size, GROUP_TIMEOUT)
        opened["mesh_created"] = len(established_connections() - before)
    finally:
        MoverProcessGroup.c10d_gloo = False
    # A peer that shut its mesh down would leave this rank's end of their connection closing,
    # no longer established: every rank counts before any shuts down.
    _all_reached(store, "mesh_counted", size)
    mesh.shutdown()
    return {"opened": opened, "received": received.tolist(), "broadcast": tensor.tolist(),
            "summed": summed.tolist(), "twin_summed": twin_summed.tolist()}


def _all_reached(store: dist.Store, key: str, size: int) -> None:
    """A barrier over the store: returns once ``size`` ranks have called it with ``key``."""
    store.add(key, 1)
    while store.add(key, 0) < size:
        time.sleep(0.01)


def test_a_group_connects_its_ring_at_creation_and_a_twin_shares_its_backend() -> None:
    with rank_job() as job:
        for rank in range(5):
            job.start(rank, _ring_connections)
        results = job.collect(list(range(5)))
    for rank, result in results.items():
        opened = result["opened"]
        # Group ranks rank - 1 and rank + 1; a neighbour's send needs nothing more.
        assert opened["created"] == 2 and opened["after_neighbour_p2p"] == 2, (rank, opened)
        assert opened["after_broadcast"] >= 2, (rank, opened)
        assert opened["mesh_created"] == 4 and opened["twin_created"] == 0, (rank, opened)
        assert result["received"] == [float((rank - 1) % 5)] * 3
        assert result["broadcast"] == [4.0] * 4 and result["summed"] == [25.0, 25.0]
        assert result["twin_summed"] == [10.0, 10.0]


def _survivor_or_hung(rank: int, store: dist.Store, port: int, hung_rank: int) -> dict:
    """Generation 0 with a rank that hangs, then generation 1 with its replacement."""
    world_size = 4
    init_mover_group(store, "gen0", rank, world_size)
    tensor = torch.ones(1)
    dist.all_reduce(tensor)  # every link of generation 0 is up
    if rank == hung_rank:
        store.set("hung/ready", "1")
        time.sleep(3600)  # the parent SIGSTOPs this process; it never takes part again
    _watch_generation_0(port)
    store.wait(["hung/stopped"])
    report: dict[str, Any] = {}
    early = None
    if rank != 2:
        # An asynchronous all_reduce, issued first and waited for only after the alarm.
        early = dist.all_reduce(torch.ones(1), async_op=True)
        try:
            early.wait(timedelta(milliseconds=50))
            report["bounded_wait"] = "completed?!"
        except TimeoutError:
            report["bounded_wait"] = "TimeoutError"
    store.set(f"blocked/{rank}", "1")
    try:
        if rank == 2:
            dist.recv(torch.empty(1), src=hung_rank)  # a p2p wait on the hung rank
        else:
            dist.all_reduce(tensor)  # waits for the hung rank (and rank 2)
        report["left_by"] = "completed?!"
    except CollectiveAborted as error:
        report["left_by"] = type(error).__name__
    left = time.monotonic()
    if early is not None:
        try:
            early.wait()
            report["later_wait"] = "completed?!"
        except CollectiveAborted:
            report["later_wait"] = "CollectiveAborted"
    report["alarm_to_out_s"] = left - (alarm.raised_at() or float("nan"))
    report["left_at"] = left
    # Any new operation on a group of the aborted generation is refused at once.
    started = time.monotonic()
    try:
        dist.barrier()
        report["refused"] = False
    except CollectiveAborted:
        report["refused"] = time.monotonic() - started < 0.1

    # Generation 1: drop generation 0 (its all_reduce is still pending in gloo), re-arm the
    # alarm and rendezvous under a new prefix with the replacement.
    started = time.monotonic()
    dist.destroy_process_group()
    report["destroy_s"] = time.monotonic() - started
    report["retired_pending"] = retired.held()
    clear_alarm()
    report.update(_generation_one(rank, store))
    # From dropping generation 0 to the first all_reduce of generation 1 done.
    report["rebuild_s"] = report["gen1_ready_at"] - started
    return report


def _generation_one(rank: int, store: dist.Store) -> dict:
    """Builds generation 1 (world of 4) and checks a collective and p2p with rank 3."""
    init_mover_group(store, "gen1", rank, 4)
    pairs = [dist.new_group([0, 3]), dist.new_group([1, 2])]
    tensor = torch.full((2,), float(rank + 1))
    dist.all_reduce(tensor)
    report: dict[str, Any] = {"gen1_all_reduce": tensor.tolist(), "gen1_ready_at": time.monotonic()}
    if rank in (0, 3):
        pair = pairs[0]
        message = torch.full((3,), 7.0) if rank == 3 else torch.empty(3)
        if rank == 3:
            dist.send(message, dst=0, group=pair)
        else:
            dist.recv(message, src=3, group=pair)
        report["gen1_p2p"] = message.tolist()
    dist.barrier()
    report["gen1_world_type"] = type(dist.group.WORLD).__name__
    dist.destroy_process_group()
    return report


def _replacement(rank: int, store: dist.Store, port: int, takes_rank: int) -> dict:
    """A process that never belonged to generation 0 joins generation 1 as ``takes_rank``."""
    register_backend()
    store.wait(["gen1/open"])
    return _generation_one(takes_rank, store)


def test_survivors_leave_a_hung_collective_and_rebuild_with_a_replacement() -> None:
    hung, replacement = 3, 103
    with rank_job() as job:
        for rank in range(4):
            job.start(rank, _survivor_or_hung, hung)
        job.start(replacement, _replacement, hung)
        job.wait_keys(["hung/ready"])
        time.sleep(0.1)  # into its sleep
        job.signal(hung, signal.SIGSTOP)
        job.store.set("hung/stopped", "1")
        survivors = [0, 1, 2]
        job.wait_keys([f"blocked/{rank}" for rank in survivors])
        time.sleep(0.3)  # well inside the blocked all_reduce
        job.store.set("gen1/open", "1")
        alarm_set = time.monotonic()
        job.store.set(ALARM_KEY, "rank 3 hung")
        results = job.collect(survivors + [replacement])
        # Survivors exit although their generation-0 all_reduce is still pending.
        assert all(code == 0 for code in job.exits_within(survivors, 10).values())
    for rank in survivors:
        report = results[rank]
        print(f"rank {rank}: alarm -> out {report['alarm_to_out_s'] * 1e3:.1f} ms "
              f"(store key -> out {(report['left_at'] - alarm_set) * 1e3:.1f} ms), destroy "
              f"{report['destroy_s'] * 1e3:.1f} ms, rebuild {report['rebuild_s'] * 1e3:.0f} ms")
        assert report["left_by"] == "CollectiveAborted"
        if rank != 2:
            assert report["bounded_wait"] == "TimeoutError"
            assert report["later_wait"] == "CollectiveAborted"
        assert report["alarm_to_out_s"] < 1.0
        assert report["left_at"] - alarm_set < 1.0
        assert report["refused"] is True
        assert report["destroy_s"] < 1.0
        assert report["retired_pending"] >= 1  # the abandoned op was still pending in gloo
        assert report["gen1_all_reduce"] == [10.0, 10.0]
        assert report["gen1_world_type"] == "WorldGroup"
    assert results[0]["gen1_p2p"] == [7.0] * 3 and results[replacement]["gen1_p2p"] == [7.0] * 3


def _killed_neighbours(rank: int, store: dist.Store, port: int, killed: int) -> dict:
    init_mover_group(store, "gen0", rank, 4)
    tensor = torch.ones(1)
    dist.all_reduce(tensor)
    if rank == killed:
        store.set("victim/ready", "1")
        time.sleep(3600)
    _watch_generation_0(port)
    store.set(f"blocked/{rank}", "1")
    report: dict[str, Any] = {}
    try:
        dist.all_reduce(tensor)
        report["left_by"] = "completed?!"
    except Exception as error:  # a gloo error or CollectiveAborted: either is a way out
        report["left_by"] = type(error).__name__
    report["left_at"] = time.monotonic()
    started = time.monotonic()
    dist.destroy_process_group()
    report["destroy_s"] = time.monotonic() - started
    return report


def test_neighbours_of_a_killed_rank_leave_promptly() -> None:
    killed, alarm_delay_s = 3, 0.3
    with rank_job() as job:
        for rank in range(4):
            job.start(rank, _killed_neighbours, killed)
        survivors = [0, 1, 2]
        job.wait_keys(["victim/ready"] + [f"blocked/{rank}" for rank in survivors])
        time.sleep(0.3)
        job.signal(killed, signal.SIGKILL)
        killed_at = time.monotonic()
        time.sleep(alarm_delay_s)  # let gloo report the loss first where it can
        job.store.set(ALARM_KEY, "rank 3 exited")
        results = job.collect(survivors)
    for rank in survivors:
        report = results[rank]
        left_ms = (report["left_at"] - killed_at) * 1e3
        print(f"rank {rank}: left by {report['left_by']} {left_ms:.0f} ms after the kill, "
              f"destroy {report['destroy_s'] * 1e3:.1f} ms")
        assert report["left_by"] != "completed?!"
        assert report["left_at"] - killed_at < alarm_delay_s + 1.0
        assert report["destroy_s"] < 1.0


def _receive_from_any(rank: int, store: dist.Store, port: int) -> Any:
    """Rank 0 receives from whichever rank sends (``dist.recv`` without ``src``)."""
    init_mover_group(store, "gen0", rank, 2)
    tensor = torch.full((3,), float(rank))
    if rank == 1:
        dist.send(tensor, dst=0)
        source = None
    else:
        source = dist.recv(tensor)
    dist.destroy_process_group()
    return source, tensor.tolist()


def test_a_receive_from_any_source_names_the_sender() -> None:
    with rank_job() as job:
        for rank in range(2):
            job.start(rank, _receive_from_any)
        assert job.collect([0, 1])[0] == (1, [1.0, 1.0, 1.0])


def _failed_unseen(rank: int, store: dist.Store, port: int) -> dict:
    """Rank 1 exits after a first all-reduce; rank 0's next one fails on gloo's connection
    reset without any wait seeing it (as an NCCL work that hit an asynchronous error counts as
    completed while its kernel may still spin)."""
    init_mover_group(store, "gen0", rank, 2)
    group = dist.group.WORLD
    tensor = torch.ones(4)
    dist.all_reduce(tensor)
    if rank == 1:
        os._exit(0)
    work = dist.all_reduce(torch.ones(1 << 16), async_op=True)
    deadline = time.monotonic() + 30
    while group.pending_operations() and time.monotonic() < deadline:
        time.sleep(0.01)
    report = {"pending": group.pending_operations(), "failed": group.failed_operations(),
              "idle": group.idle}
    try:
        dist.all_reduce(torch.ones(1))
        report["after"] = "ran"
    except CollectiveAborted as error:
        report["after"] = str(error)
    except RuntimeError as error:
        report["after"] = f"backend: {error}"
    del work
    dist.destroy_process_group()
    return report


def test_an_operation_that_failed_unseen_makes_its_group_neither_idle_nor_usable() -> None:
    with rank_job() as job:
        for rank in range(2):
            job.start(rank, _failed_unseen)
        report = job.collect([0])[0]
    assert (report["pending"], report["failed"], report["idle"]) == (0, 1, False), report
    assert "an earlier operation failed" in report["after"], report


def _megatron_groups(rank: int, store: dist.Store, port: int) -> dict:
    from megatron.core import parallel_state

    init_mover_group(store, "gen0", rank, 4)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1,
                                             pipeline_model_parallel_size=2)
    groups = {
        "tp": parallel_state.get_tensor_model_parallel_group(),
        "pp": parallel_state.get_pipeline_model_parallel_group(),
        "dp": parallel_state.get_data_parallel_group(),
        "mp": parallel_state.get_model_parallel_group(),
        "embedding": parallel_state.get_embedding_group(),
    }
    report: dict[str, Any] = {name: type(group).__name__ for name, group in groups.items()}
    world = dist.distributed_c10d._world
    report["kinds"] = sorted({(type(pg).__name__, str(backend))
                              for pg, (backend, _) in world.pg_map.items()})
    tensor = torch.full((1,), float(rank))
    dist.all_reduce(tensor, group=groups["dp"])
    report["dp_sum"] = tensor.item()
    next_rank = parallel_state.get_pipeline_model_parallel_next_rank()
    prev_rank = parallel_state.get_pipeline_model_parallel_prev_rank()
    incoming = torch.empty(1)
    ops = [dist.P2POp(dist.isend, torch.full((1,), float(rank)), next_rank, groups["pp"]),
           dist.P2POp(dist.irecv, incoming, prev_rank, groups["pp"])]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    report["pp_from_prev"] = incoming.item() == float(prev_rank)
    raise_alarm("test")
    try:
        dist.all_reduce(tensor, group=groups["dp"])
        report["dp_refused"] = False
    except CollectiveAborted:
        report["dp_refused"] = True
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return report


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                    reason="megatron-core is not installed")
def test_megatron_parallel_state_groups_are_abortable() -> None:
    with rank_job() as job:
        for rank in range(4):
            job.start(rank, _megatron_groups)
        results = job.collect(list(range(4)))
    for rank, report in results.items():
        print(f"rank {rank}: {report['kinds']}")
        for name in ("tp", "pp", "dp", "mp", "embedding"):
            assert report[name] == "MoverProcessGroup", (rank, name)
        # With TP 1 and PP 2 of 4 ranks, Megatron's data-parallel groups are [0, 1] and [2, 3].
        assert report["dp_sum"] == float(4 * (rank // 2) + 1)
        # Megatron's explicit gloo groups (checkpointing helpers) stay plain gloo.
        kinds = {kind for kind, _ in report["kinds"]}
        assert kinds <= {"WorldGroup", "MoverProcessGroup", "ProcessGroup"}
        assert report["pp_from_prev"] and report["dp_refused"]
