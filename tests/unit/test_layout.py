"""Pure tests of the parallel layout and the parameter digest helpers."""

import pytest

from mover_plugin.digest import combine_digests, mismatched_replicas
from mover_plugin.errors import ConfigError
from mover_plugin.layout import ParallelLayout


def test_megatron_rank_order_for_pp2_dp2():
    layout = ParallelLayout.for_world(4, tp=1, pp=2)
    assert layout.dp == 2
    assert layout.data_parallel_group(0) == [0, 1]
    assert layout.data_parallel_group(3) == [2, 3]
    assert layout.pipeline_group(1) == [1, 3]
    assert layout.data_parallel_twins(3) == [2]


def test_tp2_pp2_groups():
    layout = ParallelLayout.for_world(4, tp=2, pp=2)
    assert layout.dp == 1
    assert layout.tensor_parallel_group(3) == [2, 3]
    assert layout.pipeline_group(1) == [1, 3]
    assert layout.data_parallel_twins(1) == []


def test_16k_ranks_every_rank_in_exactly_one_group_of_each_kind():
    layout = ParallelLayout.for_world(16384, tp=8, pp=16)
    assert layout.dp == 128
    seen = sorted(r for group in layout.replica_sets() for r in group)
    assert seen == list(range(16384))
    for rank in (0, 1, 8191, 16383):
        c = layout.coordinates(rank)
        assert layout.rank(c.tp, c.dp, c.pp) == rank
        assert rank in layout.pipeline_group(rank)
        assert len(layout.pipeline_group(rank)) == 16


@pytest.mark.parametrize("world, tp, pp", [(4, 3, 1), (4, 1, 3), (6, 4, 1)])
def test_layout_that_does_not_divide_the_world_is_refused(world, tp, pp):
    with pytest.raises(ConfigError, match=f"world size {world} is not divisible"):
        ParallelLayout.for_world(world, tp=tp, pp=pp)


def test_rank_outside_the_world_is_refused():
    with pytest.raises(ConfigError, match="rank 4 does not exist; valid: 0..3"):
        ParallelLayout.for_world(4, tp=1, pp=2).coordinates(4)


def test_mismatched_replicas_finds_the_differing_group():
    layout = ParallelLayout.for_world(4, tp=1, pp=2)
    assert mismatched_replicas(layout, ["a", "a", "b", "b"]) == []
    assert mismatched_replicas(layout, ["a", "a", "b", "c"]) == [[2, 3]]
    assert combine_digests(["a", "b"]) != combine_digests(["b", "a"])


def test_expert_parallel_twins_hold_the_same_experts():
    # Mixtral's recipe scaled down: TP1 x PP2 x DP4 with EP2: experts alternate within a stage.
    layout = ParallelLayout.for_world(8, tp=1, pp=2, ep=2)
    assert [layout.coordinates(rank).ep for rank in range(8)] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert layout.data_parallel_group(1) == [0, 1, 2, 3]
    assert layout.expert_data_parallel_group(1) == [1, 3]
    assert layout.data_parallel_twins(1) == [3]
    assert layout.data_parallel_twins(6) == [4]
    assert layout.replica_sets() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert ParallelLayout.of_record(layout.record()) == layout


@pytest.mark.parametrize("tp, etp, twins_of_0, twins_of_1", [
    (2, None, [4], [5]),  # ETP = TP: ranks 0-1 hold experts 0, ranks 2-3 experts 1, ...
    (2, 1, [2, 4, 6], [3, 5, 7]),  # ETP 1: each rank holds its experts whole
])
def test_expert_tensor_parallelism_decides_which_tensor_ranks_are_twins(
        tp, etp, twins_of_0, twins_of_1):
    layout = ParallelLayout.for_world(8, tp=tp, pp=1, ep=2, etp=etp)
    assert layout.data_parallel_twins(0) == twins_of_0
    assert layout.data_parallel_twins(1) == twins_of_1


def test_experts_without_an_expert_data_parallel_replica_have_no_twin():
    layout = ParallelLayout.for_world(4, tp=1, pp=2, ep=2)
    assert layout.data_parallel_group(0) == [0, 1]
    assert [layout.data_parallel_twins(rank) for rank in range(4)] == [[], [], [], []]
    assert layout.replica_sets() == [[0], [1], [2], [3]]


@pytest.mark.parametrize("world, tp, pp, ep, etp", [
    (16, 2, 2, 2, None), (16, 2, 1, 4, 1), (32, 4, 2, 2, 2), (64, 2, 4, 4, 1), (16, 1, 1, 1, None)])
def test_twins_are_the_ranks_with_the_same_stage_tensor_and_expert_indices(world, tp, pp, ep,
                                                                           etp):
    layout = ParallelLayout.for_world(world, tp=tp, pp=pp, ep=ep, etp=etp)
    key = {rank: layout.coordinates(rank) for rank in range(world)}
    for rank in range(world):
        c = key[rank]
        same = [other for other in range(world) if other != rank and
                (key[other].pp, key[other].tp, key[other].ep, key[other].etp) ==
                (c.pp, c.tp, c.ep, c.etp)]
        assert layout.data_parallel_twins(rank) == same
        assert rank in layout.expert_data_parallel_group(rank)


def test_experts_carried_in_the_optimizer_shard_make_the_dense_replicas_twins():
    # Mixtral's own layout in miniature: EP over the whole data-parallel group.
    alone = ParallelLayout.for_world(4, tp=1, pp=2, ep=2, experts_in_shard=True)
    assert [alone.data_parallel_twins(rank) for rank in range(4)] == [[1], [0], [3], [2]]
    assert ParallelLayout.of_record(alone.record()) == alone
    # Where experts have twins, only those are (the shard then holds a part of them).
    shared = ParallelLayout.for_world(8, tp=1, pp=2, ep=2, experts_in_shard=True)
    assert shared.data_parallel_twins(1) == [3]


def test_experts_that_do_not_divide_a_stage_are_refused():
    with pytest.raises(ConfigError, match=r"expert-tensor-parallel size 1 x "
                       r"expert-model-parallel size 3 = 3 does not divide the 4 ranks of a "
                       r"pipeline stage .*divisors of 4: \[1, 2, 4\]"):
        ParallelLayout.for_world(8, tp=1, pp=2, ep=3)


def test_a_record_without_experts_reads_as_a_dense_layout():
    assert ParallelLayout.of_record({"tp": 2, "pp": 1, "dp": 2}) == ParallelLayout.for_world(
        4, tp=2, pp=1)
