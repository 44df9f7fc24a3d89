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

from mover_plugin.comm import raise_alarm
from mover_plugin.comm.delta import (
    GroupInfo,
    agree_on_idle_groups,
    install_delta,
    member_groups,
    prepare_delta,
    replaced_group_names,
)
from rank_jobs import (  # noqa: F401 - the fixture is used by name
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


# --------------------------------------------------------------------------- processes


def _build_groups() -> dict[tuple[int, ...], Any]:
    """The same ``new_group`` calls on every process, in the same order (as Megatron's)."""
    return {ranks: dist.new_group(list(ranks)) for ranks in GROUPS}


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
    dist.destroy_process_group()
    return checks


def _replace_rank(stayer) -> dict[int, dict[str, Any]]:
    """Runs ``stayer`` on the 4 ranks and, once they are warm, the joiner for rank 3; returns
    each process's checks (keyed by rank, the joiner by 100), failing on any failed check."""
    with rank_job() as job:
        for rank in range(WORLD_SIZE):
            job.start(rank, stayer)
        job.wait_keys([f"gen0/ready/{r}" for r in range(WORLD_SIZE)])
        job.start(100, _joiner)
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
