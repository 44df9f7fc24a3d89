"""Pure tests of the recovery decision, the standby pool and membership."""

from mover_plugin.generations import (
    NO_TWIN,
    Fallback,
    Membership,
    Replacement,
    StandbyPool,
    plan_migration,
    plan_recovery,
    plan_return,
)
from mover_plugin.layout import ParallelLayout


def pool_of(*items):
    pool = StandbyPool()
    for standby, node in items:
        pool.add(standby, node)
    return pool


def test_a_lost_rank_gets_a_standby_and_its_twin():
    layout = ParallelLayout.for_world(4, tp=1, pp=2)
    plan = plan_recovery([3], layout, pool_of(("s0", 0)))
    assert plan == [Replacement(rank=3, standby="s0", twin=2, node=0)]


def test_standby_on_another_host_is_preferred():
    layout = ParallelLayout.for_world(4, tp=1, pp=2)
    plan = plan_recovery([1], layout, pool_of(("a", 0), ("b", 1)), node_of_rank={1: 0})
    assert plan[0].standby == "b"


def test_no_twin_when_data_parallel_size_is_one():
    layout = ParallelLayout.for_world(4, tp=2, pp=2)
    plan = plan_recovery([1], layout, pool_of(("s0", 0)))
    assert isinstance(plan, Fallback) and "data-parallel size is 1" in plan.reason


def test_no_standby_left():
    layout = ParallelLayout.for_world(4, tp=1, pp=2)
    plan = plan_recovery([0], layout, StandbyPool())
    assert plan == Fallback("1 rank(s) lost but 0 standby(s) ready")


def test_both_replicas_of_a_shard_lost():
    layout = ParallelLayout.for_world(4, tp=1, pp=2)
    plan = plan_recovery([2, 3], layout, pool_of(("a", 0), ("b", 0)))
    assert isinstance(plan, Fallback) and "every data-parallel twin was lost" in plan.reason


def test_unknown_layout_falls_back():
    assert isinstance(plan_recovery([0], None, pool_of(("a", 0))), Fallback)


def test_16k_ranks_two_failures_two_standbys():
    layout = ParallelLayout.for_world(16384, tp=8, pp=16)
    plan = plan_recovery([5, 9000], layout, pool_of(("a", 0), ("b", 1)))
    # The first live replica of the same shard: rank 5 is (tp 5, dp 0, pp 0) -> dp 1 is 13;
    # rank 9000 is (tp 0, dp 101, pp 8) -> dp 0 is 8 * 128 * 8 = 8192.
    assert [(r.rank, r.twin) for r in plan] == [(5, 13), (9000, 8192)]
    membership = Membership(0, {r: f"w{r}" for r in range(16384)}).next_generation(plan)
    assert membership.generation == 1
    assert membership.members[5] == "a" and membership.members[9000] == "b"


def test_a_migration_moves_each_rank_to_a_standby_with_itself_as_source():
    pool = pool_of(("a", 0), ("b", 1))
    plan = plan_migration([3], pool, {0: 0, 1: 0, 2: 1, 3: 1})
    assert plan == [Replacement(rank=3, standby="a", twin=3, node=0)]
    assert list(pool.hosts) == ["b"]


def test_a_single_rank_may_move_to_a_standby_on_its_own_host():
    plan = plan_migration([2], pool_of(("a", 0)), {2: 0})
    assert plan == [Replacement(rank=2, standby="a", twin=2, node=0)]


def test_emptying_a_host_uses_only_standbys_elsewhere():
    nodes = {0: 0, 1: 0, 2: 1, 3: 1}
    pool = pool_of(("n1a", 1), ("n0a", 0), ("n0b", 0))
    plan = plan_migration([2, 3], pool, nodes, leave_hosts=True)
    assert [(r.rank, r.standby, r.node) for r in plan] == [(2, "n0a", 0), (3, "n0b", 0)]
    refused = plan_migration([2, 3], pool_of(("n1a", 1), ("n0a", 0)), nodes, leave_hosts=True)
    assert refused == Fallback("2 rank(s) to move but 1 standby(s) ready off node(s) 1")


def test_no_standby_for_a_migration():
    assert plan_migration([0], StandbyPool(), {0: 0}) == Fallback(
        "1 rank(s) to move but 0 standby(s) ready")


def test_a_standby_of_a_spare_host_is_taken_first():
    layout = ParallelLayout.for_world(4, tp=1, pp=2)
    pool = pool_of(("a0.n0.s0", 0), ("a0.n1.s0", 1), ("a0.n2.s0", 2))
    pool.spare_nodes = frozenset({2})
    plan = plan_recovery([1], layout, pool, node_of_rank={1: 0})
    assert plan == [Replacement(rank=1, standby="a0.n2.s0", twin=0, node=2)]
    assert sorted(pool.hosts) == ["a0.n0.s0", "a0.n1.s0"]


def test_a_hosts_ranks_move_onto_one_spare_host_in_local_rank_order():
    # Ranks 2 and 3 live on node 1; node 3 is a spare host whose standbys became ready in the
    # order s1, s0; node 2 has one standby ready before them.
    pool = pool_of(("a0.n2.s0", 2), ("a0.n3.s1", 3), ("a0.n0.s0", 0), ("a0.n3.s0", 3))
    pool.spare_nodes = frozenset({3})
    node_of_rank = {0: 0, 1: 0, 2: 1, 3: 1}
    plan = plan_migration([3, 2], pool, node_of_rank, leave_hosts=True)
    assert plan == [Replacement(2, "a0.n3.s0", 2, 3), Replacement(3, "a0.n3.s1", 3, 3)]


def test_a_hosts_ranks_stay_together_on_a_worker_host_without_spares():
    pool = pool_of(("a0.n0.s0", 0), ("a0.n2.s0", 2), ("a0.n2.s1", 2))
    plan = plan_migration([2, 3], pool, {0: 0, 1: 0, 2: 1, 3: 1}, leave_hosts=True)
    assert [(item.rank, item.node) for item in plan] == [(2, 2), (3, 2)]


def test_no_standby_is_taken_when_a_rank_has_no_twin():
    pool = pool_of(("s0", 0), ("s1", 0))
    layout = ParallelLayout.for_world(4, tp=1, pp=2)
    assert isinstance(plan_recovery([0, 1], layout, pool), Fallback)
    assert len(pool) == 2


def test_ranks_coming_back_into_a_shrunk_job_take_standbys_of_one_host_together():
    pool = StandbyPool()
    pool.add("a0.n0.r0", 0)
    pool.add("a0.n2.s0", 2)
    pool.add("a0.n2.s1", 2)
    assert plan_return([0, 1, 2, 3], pool, {0: 0, 1: 0, 2: 1, 3: 1}) is None  # four, three ready
    assert len(pool) == 3  # nothing taken
    plan = plan_return([1, 0], pool, {0: 0, 1: 0})
    assert plan == [Replacement(0, "a0.n2.s0", NO_TWIN, 2), Replacement(1, "a0.n2.s1", NO_TWIN, 2)]
    assert len(pool) == 1
