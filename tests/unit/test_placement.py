"""Placement of pipeline-template plans on ranks (mover_plugin.placement): roles, the groups
a plan needs, gradient weights and the transfers of a change, without processes."""

from __future__ import annotations

import itertools
import random

import pytest

from mover_plugin.placement import (
    Placement,
    PlacementError,
    Transfer,
    transfers,
    transformer_stages,
)
from mover_plugin.templates import Template, instantiate, plan_templates, transformer_profile

JOB = Placement.uniform([(0, 2), (1, 3)], num_layers=4, microbatches=4)
"""TP1 x PP2 x DP2 on 4 ranks, as Megatron-Core lays it out."""
SHRUNK = Placement.of_pipelines([([(0, 3), (3, 4)], 2), ([(0, 4)], 2)], [0, 2, 1], 4)


def test_roles_follow_the_pipelines_layers_and_batch_slots():
    assert SHRUNK.ranks == (0, 1, 2)
    zero, one, two = (SHRUNK.role(r) for r in range(3))
    assert (zero.pipeline_ranks, zero.layers, zero.microbatches) == ((0, 2), (0, 3), (0, 2))
    assert zero.pre_process and not zero.post_process
    assert (two.stage, two.layers, two.pre_process, two.post_process) == (1, (3, 4), False, True)
    assert (one.pipeline_ranks, one.layers, one.microbatches) == ((1,), (0, 4), (2, 4))
    assert one.pre_process and one.post_process
    assert SHRUNK.describe() == "[0 2] layers 0-2|3 x 2 + [1] layers 0-3 x 2"
    with pytest.raises(PlacementError, match="rank 3 has no stage"):
        SHRUNK.role(3)


def test_the_tied_embedding_is_held_by_both_ends_of_every_pipeline():
    holders = SHRUNK.holders()
    assert holders["embedding"] == (0, 1, 2)  # rank 2 as the output layer's copy
    assert holders["position"] == (0, 1)
    assert holders["final_norm"] == (1, 2)
    assert holders["layer 2"] == (0, 1) and holders["layer 3"] == (1, 2)
    untied = Placement.of_pipelines([([(0, 3), (3, 4)], 2), ([(0, 4)], 2)], [0, 2, 1], 4,
                                    tied=False)
    assert untied.holders()["embedding"] == (0, 1)
    assert untied.holders()["output"] == (1, 2)


def test_gradient_groups_cover_every_unit_once_in_one_order():
    groups = SHRUNK.gradient_groups()
    units = [unit for _, members in groups for unit in members]
    assert sorted(units) == sorted(SHRUNK.holders())
    assert [ranks for ranks, _ in groups] == sorted({r for r, _ in groups},
                                                    key=lambda r: (len(r), r))
    assert dict(groups)[(0, 1)] == ("position", "layer 0", "layer 1", "layer 2")
    # every group a rank needs: alone, its pipeline, the pipeline's ends, its gradient groups
    assert SHRUNK.rank_sets() == [(0,), (1,), (2,), (0, 1), (0, 2), (1, 2), (0, 1, 2)]


def test_the_weights_are_each_pipelines_share_of_the_global_batch():
    plan = Placement.of_pipelines([([(0, 3), (3, 4)], 3), ([(0, 4)], 1)], [0, 2, 1], 4)
    assert [plan.weight(r) for r in range(3)] == [0.75, 0.25, 0.75]
    assert plan.microbatches == 4


def test_a_shrink_copies_only_what_a_rank_did_not_hold_from_a_live_holder():
    moves = transfers(JOB, SHRUNK, live=[0, 1, 2])
    # rank 0 held layers 0-1 and takes 0-2; rank 1 held 0-1 and takes everything; rank 2
    # held 2-3 and keeps 3 with the output side
    assert moves == [
        Transfer("layer 2", 2, 0),
        Transfer("layer 2", 2, 1),
        Transfer("layer 3", 2, 1),
        Transfer("final_norm", 2, 1),
    ]
    # a lost rank is never a source; with every holder of a unit lost there is no plan
    assert all(move.source != 3 for move in moves)
    with pytest.raises(PlacementError, match="no live rank holds layer 2"):
        transfers(JOB, SHRUNK, live=[0, 1])


def test_a_fresh_rank_receives_every_unit_it_holds():
    grown = Placement.uniform([(0, 2), (1, 3)], 4, 4)
    moves = transfers(SHRUNK, grown, live=[0, 1, 2], fresh=[3])
    to_three = sorted(m.unit for m in moves if m.destination == 3)
    assert to_three == sorted(grown.units(grown.role(3)))
    assert all(m.source in (0, 1, 2) for m in moves)


def test_of_plan_places_stages_on_the_ranks_that_hold_most_of_them():
    templates = plan_templates(transformer_profile(4), pipeline_size=2)
    shrunk = Placement.of_plan(instantiate(templates, 3, 4, 0), [0, 1, 2], 4, previous=JOB)
    assert shrunk.describe() == "[0 2] layers 0-2|3 x 2 + [1] layers 0-3 x 2"
    grown = Placement.of_plan(instantiate(templates, 4, 4, 1), [0, 1, 2, 3], 4,
                              previous=shrunk)
    assert grown.describe() == "[0 2] layers 0-2|3 x 2 + [1 3] layers 0-2|3 x 2"
    assert len(transfers(shrunk, grown, live=[0, 1, 2])) == len(grown.units(grown.role(3)))
    with pytest.raises(PlacementError, match="needs as many distinct ranks"):
        Placement.of_plan(instantiate(templates, 3, 4, 0), [0, 1], 4)


def test_template_stages_map_to_transformer_layers_each_holding_one():
    # profile layers: 0 embedding, 1..4 transformer, 5 output
    assert transformer_stages(Template(2, ((0, 4), (4, 6)), (1, 1)), 4) == [(0, 3), (3, 4)]
    # a stage of the output layer alone takes the last transformer layer
    assert transformer_stages(Template(2, ((0, 5), (5, 6)), (1, 1)), 4) == [(0, 3), (3, 4)]
    # a stage of the embedding alone takes the first
    assert transformer_stages(Template(3, ((0, 1), (1, 3), (3, 6)), (1, 1, 1)), 4) == [
        (0, 1), (1, 2), (2, 4)]
    with pytest.raises(PlacementError, match="5 profile layers, not the 6"):
        transformer_stages(Template(1, ((0, 5),), (1,)), 4)


@pytest.mark.parametrize("seed", range(20))
def test_random_plans_hold_every_unit_and_split_the_batch(seed):
    rng = random.Random(seed)
    layers = rng.randint(2, 12)
    templates = plan_templates(transformer_profile(layers), pipeline_size=rng.randint(1, 4))
    hosts = rng.randint(min(templates), 10)
    microbatches = rng.randint(hosts, 4 * hosts)
    try:
        plan = instantiate(templates, hosts, microbatches, 0)
    except Exception:
        pytest.skip("no instantiation for these hosts")
    placement = Placement.of_plan(plan, rng.sample(range(20), hosts), layers)
    assert abs(sum(placement.weight(r) for r in placement.ranks
                   if placement.role(r).pre_process) - 1.0) < 1e-12
    holders = placement.holders()
    assert {f"layer {i}" for i in range(layers)} <= set(holders)
    slots = sorted(itertools.chain.from_iterable(
        range(*placement.role(r).microbatches) for r in placement.ranks
        if placement.role(r).pre_process))
    assert slots == list(range(microbatches))
    for unit, ranks in holders.items():  # one holder per pipeline (two for the tied weight)
        pipelines = {placement.role(r).pipeline for r in ranks}
        assert len(pipelines) == len(placement.pipelines()) or unit == "embedding"


def test_a_pipelines_stages_are_on_ascending_ranks_even_when_the_lowest_rank_returns():
    # rank 0 was lost: ranks 1-3 trained on [1 3] + [2]; rank 0 comes back with nothing
    templates = plan_templates(transformer_profile(4), pipeline_size=2)
    shrunk = Placement.of_pipelines([([(0, 3), (3, 4)], 2), ([(0, 4)], 2)], [1, 3, 2], 4)
    grown = Placement.of_plan(instantiate(templates, 4, 4, 1), [0, 1, 2, 3], 4,
                              previous=shrunk, fresh=[0])
    for members in grown.pipelines():
        assert list(members) == sorted(members)
        assert [grown.role(r).stage for r in members] == list(range(len(members)))
    with pytest.raises(PlacementError, match=r"pipeline \[3, 0\]: its stages must be on "
                                             "ascending ranks"):
        Placement.of_pipelines([([(0, 2), (2, 4)], 2), ([(0, 2), (2, 4)], 2)],
                               [1, 2, 3, 0], 4)


def test_the_gradient_norm_group_is_every_rank():
    assert SHRUNK.rank_sets()[-1] == (0, 1, 2)
    assert (0, 1, 2, 3) in JOB.rank_sets()
