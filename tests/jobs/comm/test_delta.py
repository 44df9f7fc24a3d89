"""Tests of the delta communicators (``mover_plugin.comm.delta``): a rank is replaced and only
the groups that contain it are rebuilt, over real gloo between processes (:mod:`rank_jobs`).

The layout is that of TP1·PP2·DP2: data-parallel groups {0,1} and {2,3}, pipeline groups
{0,2} and {1,3}. Rank 3 leaves and a new process takes its global rank.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from mover_plugin.comm import raise_alarm, register_backend
from mover_plugin.comm.delta import (
    GroupInfo,
    agree_on_idle_groups,
    install_delta,
    member_groups,
    prepare_delta,
    replaced_group_names,
)
from mover_plugin.comm.world import CoverError, WorldOptions, check_cover, cover_world
from support.rank_jobs import (  # noqa: F401 - the fixture is used by name
    GROUP_TIMEOUT,
    init_mover_group,
    rank_job,
    stop_forkserver_after_module,
)

WORLD_SIZE = 4
LEAVING = 3
GROUPS = [(0, 1), (2, 3), (0, 2), (1, 3)]


@pytest.fixture(scope="module", autouse=True)
def _stop_forkserver(stop_forkserver_after_module: None) -> None:
    """No forkserver outlives this module (other tests check for stray children)."""


# --------------------------------------------------------------------------- pure logic


def test_only_groups_with_a_changed_rank_the_default_group_and_unsettled_ones_are_replaced():
    groups = [GroupInfo("0", (0, 1, 2, 3), True), GroupInfo("1", (0, 1), False),
              GroupInfo("2", (2, 3), False), GroupInfo("3", (0, 2), False),
              GroupInfo("4", (1, 3), False)]
    assert replaced_group_names(groups, {3}) == ["0", "2", "4"]
    assert replaced_group_names(groups, {3}, unsettled={"1"}) == ["0", "1", "2", "4"]
    assert replaced_group_names(groups, set()) == []
    assert replaced_group_names(groups, set(), unsettled={"3"}) == ["3"]
    covered = [GroupInfo("0", (0, 1, 2, 3), True, covered=True), *groups[1:]]
    assert replaced_group_names(covered, {3}) == ["2", "4"]


def test_a_cover_must_be_a_grid_over_the_world():
    check_cover(1, 4, [(0, 1), (1, 3)])
    check_cover(5, 8, [(4, 5), (1, 5), (5, 7)])
    with pytest.raises(CoverError, match="does not hold this rank"):
        check_cover(1, 4, [(0, 1), (0, 2)])
    with pytest.raises(CoverError, match=r"meet in \[0, 1\]"):
        check_cover(1, 4, [(0, 1), (0, 1, 3)])
    with pytest.raises(CoverError, match="multiply to 2, not to the world size 4"):
        check_cover(1, 4, [(0, 1)])
    check_cover(0, 1, [])
    with pytest.raises(CoverError, match="multiply to 1, not to the world size 2"):
        check_cover(0, 2, [])


# --------------------------------------------------------------------------- processes


def _build_groups() -> dict[tuple[int, ...], Any]:
    """The same ``new_group`` calls on every process, in the same order (as Megatron's); the
    pipeline group {1,3} with NCCL options of its own (as Megatron's ``--nccl-communicator-
    config-path`` gives)."""
    return {ranks: dist.new_group(list(ranks), pg_options=_nccl_options(ranks))
            for ranks in GROUPS}


def _nccl_options(ranks: tuple[int, ...]) -> Any:
    if ranks != (1, 3):
        return None
    options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)
    options.config.max_ctas = 4
    return options


def _contribution(rank: int, joiner: bool) -> float:
    return rank + 1 + (100.0 if joiner else 0.0)


def _expected_sum(ranks: tuple[int, ...]) -> float:
    return sum(_contribution(r, r == LEAVING) for r in ranks)


def _exercise(rank: int, groups: dict[tuple[int, ...], Any], joiner: bool) -> dict[str, Any]:
    """Collectives on the default group and on every group of this rank, point-to-point by
    global rank over the pipeline group {1,3}, and c10d's view of the groups."""
    checks: dict[str, Any] = {}
    value = torch.tensor([_contribution(rank, joiner)])
    dist.all_reduce(value)
    checks["world"] = value.item() == _expected_sum(tuple(range(WORLD_SIZE)))
    for ranks, group in groups.items():
        if rank not in ranks:
            continue
        value = torch.tensor([_contribution(rank, joiner)])
        dist.all_reduce(value, group=group)
        checks[f"sum{ranks}"] = value.item() == _expected_sum(ranks)
        checks[f"rank{ranks}"] = dist.get_rank(group) == ranks.index(rank)
        checks[f"global{ranks}"] = [dist.get_global_rank(group, i)
                                    for i in range(len(ranks))] == list(ranks)
        checks[f"registered{ranks}"] = c10d._resolve_process_group(group.group_name) is group
    if rank == 1:
        dist.send(torch.tensor([7.0]), dst=LEAVING, group=groups[(1, 3)])
    elif rank == LEAVING:
        received = torch.zeros(1)
        dist.recv(received, src=1, group=groups[(1, 3)])
        checks["p2p"] = received.item() == 7.0
    return checks


def _joiner(rank: int, store: dist.Store, port: int) -> dict[str, Any]:
    init_mover_group(store, "gen1/", LEAVING, WORLD_SIZE)
    checks = _exercise(LEAVING, _build_groups(), joiner=True)
    dist.destroy_process_group()
    return checks


def _generation_zero(rank: int, store: dist.Store) -> dict[tuple[int, ...], Any]:
    init_mover_group(store, "gen0/", rank, WORLD_SIZE)
    groups = _build_groups()
    _exercise(rank, groups, joiner=False)  # connects every group
    store.set(f"gen0/ready/{rank}", "1")
    return groups


def _stayer(rank: int, store: dist.Store, port: int) -> dict[str, Any]:
    groups = _generation_zero(rank, store)
    store.wait([f"gen0/ready/{r}" for r in range(WORLD_SIZE)], GROUP_TIMEOUT)
    if rank == LEAVING:
        return {}
    before = {ranks: id(group) for ranks, group in groups.items()}
    world_before = id(dist.group.WORLD)
    delta = prepare_delta(dist.PrefixStore("gen1/", store), {LEAVING}, timeout=GROUP_TIMEOUT)
    replaced = install_delta(delta)
    groups = {ranks: replaced.get(id(group), group) for ranks, group in groups.items()}
    checks = _exercise(rank, groups, joiner=False)
    checks["kept"] = sorted(ranks for ranks in groups
                            if rank in ranks and id(groups[ranks]) == before[ranks])
    checks["world_replaced"] = id(dist.group.WORLD) != world_before
    if rank == 1:  # {1,3} was rebuilt with the options the joiner's is made with
        options = groups[(1, 3)].nccl_options_copy()
        checks["nccl_options_kept"] = (options.is_high_priority_stream,
                                       options.config.max_ctas) == (True, 4)
    dist.destroy_process_group()
    return checks


def _replace_rank(stayer, joiner=_joiner) -> dict[int, dict[str, Any]]:
    """Runs ``stayer`` on the 4 ranks and, once they are warm, ``joiner`` for rank 3; returns
    each process's checks (keyed by rank, the joiner by 100), failing on any failed check."""
    with rank_job() as job:
        for rank in range(WORLD_SIZE):
            job.start(rank, stayer)
        job.wait_keys([f"gen0/ready/{r}" for r in range(WORLD_SIZE)])
        job.start(100, joiner)
        results = job.collect([0, 1, 2, LEAVING, 100])
    for key, checks in results.items():
        failed = [name for name, ok in checks.items() if ok is False]
        assert not failed, f"process {key}: {failed} in {checks}"
    return results


def test_a_replaced_rank_rebuilds_only_its_groups_and_the_stayers_keep_the_rest() -> None:
    results = _replace_rank(_stayer)
    assert results[0]["kept"] == [(0, 1), (0, 2)]
    assert results[1]["kept"] == [(0, 1)]  # {1,3} holds the leaving rank
    assert results[2]["kept"] == [(0, 2)]
    assert all(results[r]["world_replaced"] for r in (0, 1, 2))
    assert results[1]["nccl_options_kept"] is True
    assert results[100]["p2p"] is True


def _stayer_after_alarm(rank: int, store: dist.Store, port: int) -> dict[str, Any]:
    """Rank 0 is left inside an all-reduce on {0,1} that rank 1 never joins; then the alarm
    (rank 3 lost). {0,1} must be rebuilt although it does not hold rank 3; {0,2} is kept."""
    groups = _generation_zero(rank, store)
    store.wait([f"gen0/ready/{r}" for r in range(WORLD_SIZE)], GROUP_TIMEOUT)
    if rank == LEAVING:
        return {}
    if rank == 0:
        dist.all_reduce(torch.ones(1), group=groups[(0, 1)], async_op=True)
    raise_alarm("rank 3 lost")
    candidates = {name: entry for name, entry in member_groups().items()
                  if LEAVING not in entry[1].global_ranks}
    generation = dist.PrefixStore("gen1/", store)
    unsettled = agree_on_idle_groups(generation, candidates, timeout=GROUP_TIMEOUT)
    names = {ranks: groups[ranks].group_name for ranks in groups if rank in ranks}
    before = {ranks: id(group) for ranks, group in groups.items()}
    replaced = install_delta(prepare_delta(generation, {LEAVING}, timeout=GROUP_TIMEOUT,
                                           unsettled=unsettled))
    groups = {ranks: replaced.get(id(group), group) for ranks, group in groups.items()}
    checks = _exercise(rank, groups, joiner=False)
    checks["unsettled"] = sorted(ranks for ranks, name in names.items() if name in unsettled)
    checks["kept"] = sorted(ranks for ranks in names if id(groups[ranks]) == before[ranks])
    dist.destroy_process_group()
    return checks


def test_after_an_alarm_a_group_left_mid_operation_is_rebuilt_and_idle_ones_are_kept() -> None:
    results = _replace_rank(_stayer_after_alarm)
    assert results[0]["unsettled"] == [(0, 1)] and results[1]["unsettled"] == [(0, 1)]
    assert results[0]["kept"] == [(0, 2)] and results[2]["kept"] == [(0, 2)]
    assert results[1]["kept"] == []


# --------------------------------------------------------------------------- covered default group


def _cover_world(rank: int, groups: dict[tuple[int, ...], Any]) -> None:
    """Each rank's data-parallel group, then its pipeline group (the same kinds, in the same
    order, on every rank)."""
    assert cover_world([group for ranks, group in groups.items() if rank in ranks])


def _exercise_covered_world(rank: int, joiner: bool) -> dict[str, Any]:
    """Every kind of operation on the covered default group, checked against its meaning."""
    mine = _contribution(rank, joiner)
    checks: dict[str, Any] = {}
    value = torch.tensor([float(rank), -0.0])
    dist.broadcast(value, src=2)
    checks["broadcast"] = value.tolist() == [2.0, -0.0] and str(value[1].item()) == "-0.0"
    top = torch.tensor([mine])
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    checks["max"] = top.item() == _contribution(LEAVING, True)
    gathered: list[Any] = [None] * WORLD_SIZE
    dist.all_gather_object(gathered, (rank, joiner))
    checks["all_gather_object"] = gathered == [(r, r == LEAVING) for r in range(WORLD_SIZE)]
    scattered = torch.zeros(2)
    dist.reduce_scatter_tensor(scattered, torch.arange(8.0) * mine)
    total = _expected_sum(tuple(range(WORLD_SIZE)))
    checks["reduce_scatter"] = scattered.tolist() == [(2 * rank + i) * total for i in range(2)]
    exchanged = torch.zeros(WORLD_SIZE, dtype=torch.int64)
    dist.all_to_all_single(exchanged, torch.tensor([10 * rank + j for j in range(WORLD_SIZE)]))
    checks["all_to_all"] = exchanged.tolist() == [10 * j + rank for j in range(WORLD_SIZE)]
    if rank in (0, 1):  # over {0,2} and {1,3}, by global rank on the default group
        dist.send(torch.tensor([mine]), dst=rank + 2)
    else:
        received = torch.zeros(1)
        dist.recv(received, src=rank - 2)
        checks["p2p"] = received.item() == _contribution(rank - 2, False)
    dist.barrier()
    return checks


def _covered_joiner(rank: int, store: dist.Store, port: int) -> dict[str, Any]:
    register_backend()
    dist.init_process_group("mover", store=dist.PrefixStore("gen1/", store), rank=LEAVING,
                            world_size=WORLD_SIZE, timeout=GROUP_TIMEOUT,
                            pg_options=WorldOptions(connect=False))
    groups = _build_groups()
    _cover_world(LEAVING, groups)
    checks = _exercise(LEAVING, groups, joiner=True)
    checks.update(_exercise_covered_world(LEAVING, joiner=True))
    dist.destroy_process_group()
    return checks


def _covered_stayer(rank: int, store: dist.Store, port: int) -> dict[str, Any]:
    init_mover_group(store, "gen0/", rank, WORLD_SIZE)
    groups = _build_groups()
    _cover_world(rank, groups)
    _exercise(rank, groups, joiner=False)
    store.set(f"gen0/ready/{rank}", "1")
    store.wait([f"gen0/ready/{r}" for r in range(WORLD_SIZE)], GROUP_TIMEOUT)
    if rank == LEAVING:
        return {}
    world_before = dist.group.WORLD
    delta = prepare_delta(dist.PrefixStore("gen1/", store), {LEAVING}, timeout=GROUP_TIMEOUT)
    checks: dict[str, Any] = {"rebuilt": len(delta.replacements)}
    replaced = install_delta(delta)
    groups = {ranks: replaced.get(id(group), group) for ranks, group in groups.items()}
    checks.update(_exercise(rank, groups, joiner=False))
    checks.update(_exercise_covered_world(rank, joiner=False))
    checks["world_kept"] = dist.group.WORLD is world_before
    dist.destroy_process_group()
    return checks


def test_a_covered_default_group_is_kept_and_carries_every_operation_over_the_groups() -> None:
    results = _replace_rank(_covered_stayer, _covered_joiner)
    assert all(results[r]["world_kept"] is True for r in (0, 1, 2))
    assert [results[r]["rebuilt"] for r in (0, 1, 2)] == [0, 1, 1]
    assert results[100]["p2p"] is True and results[2]["p2p"] is True
