"""The shrink decision (mover_plugin.shrink): the survivors' plan, without processes."""

import itertools
import json
from dataclasses import replace

import pytest

from mover_plugin.contract import GenerationPlan
from mover_plugin.generations import Fallback
from mover_plugin.layout import ParallelLayout
from mover_plugin.placement import Placement
from mover_plugin.shrink import (
    ShrinkPlan,
    TemplateSpec,
    job_placement,
    plan_grow,
    plan_shrink,
    profile_record,
    shrunk_placement,
)
from mover_plugin.templates import PlanningError, Profile, transformer_profile
from support.profiles import slow_first_layers, stage_records

PP2_DP2 = ParallelLayout(tp=1, pp=2, dp=2)
SPEC = TemplateSpec(num_layers=4, tied=True, microbatches=4)


def test_the_job_placement_is_megatrons_equal_pipelines():
    job = job_placement(PP2_DP2, SPEC)
    assert job.describe() == "[0 2] layers 0-1|2-3 x 2 + [1 3] layers 0-1|2-3 x 2"


@pytest.mark.parametrize("lost", [0, 1, 2, 3])
def test_any_single_loss_of_pp2_dp2_leaves_a_two_and_a_one_stage_pipeline(lost):
    plan = plan_shrink([lost], PP2_DP2, SPEC)
    assert isinstance(plan, ShrinkPlan)
    assert plan.survivors == tuple(r for r in range(4) if r != lost)
    assert plan.placement.ranks == (0, 1, 2)
    assert sorted(len(p) for p in plan.placement.pipelines()) == [1, 2]
    assert plan.placement.microbatches == 4
    check_moves(job_placement(PP2_DP2, SPEC), plan)


def check_moves(before: Placement, plan: ShrinkPlan) -> None:
    """A survivor receives exactly the units it did not hold ``before`` (job ranks), each from
    a survivor that held it."""
    for new_rank, job_rank in enumerate(plan.survivors):
        had = set(before.units(before.role(job_rank)))
        needs = set(plan.placement.units(plan.placement.role(new_rank)))
        received = {unit for unit, _, destination in plan.moves if destination == new_rank}
        assert received == needs - had, (job_rank, received)
    for unit, source, _ in plan.moves:
        assert unit in before.units(before.role(plan.survivors[source]))


def test_losing_every_replica_of_a_stage_is_no_plan():
    plan = plan_shrink([0, 1], PP2_DP2, SPEC)  # both replicas of the first stage
    assert isinstance(plan, Fallback)
    assert "no live rank holds" in plan.reason


def test_losing_one_replica_of_each_stage_leaves_two_whole_pipelines():
    plan = plan_shrink([1, 2], PP2_DP2, SPEC)
    assert isinstance(plan, ShrinkPlan)
    assert plan.placement.describe() == "[0] layers 0-3 x 2 + [1] layers 0-3 x 2"


def test_fault_tolerance_asks_for_more_pipelines_when_the_ranks_allow_it():
    two = TemplateSpec(4, True, 4, fault_tolerance=2)
    plan = plan_shrink([3], PP2_DP2, two)
    assert isinstance(plan, ShrinkPlan)
    assert len(plan.placement.pipelines()) == 3
    # more than the ranks left allow: as many pipelines as they can hold
    many = TemplateSpec(4, True, 4, fault_tolerance=5)
    plan = plan_shrink([3], PP2_DP2, many)
    assert isinstance(plan, ShrinkPlan) and len(plan.placement.pipelines()) == 3


@pytest.mark.parametrize("layout, spec, reason", [
    (None, SPEC, "layout is unknown"),
    (PP2_DP2, None, "does not train on pipeline templates"),
    (ParallelLayout(tp=2, pp=2, dp=1), SPEC, "tensor-parallel size 1, not 2"),
])
def test_what_cannot_shrink_says_why(layout, spec, reason):
    plan = plan_shrink([1], layout, spec)
    assert isinstance(plan, Fallback) and reason in plan.reason


def test_every_loss_of_one_or_two_ranks_of_pp2_dp4_has_a_plan():
    """Each stage has four replicas: any two losses leave one of every layer."""
    layout = ParallelLayout(tp=1, pp=2, dp=4)
    spec = TemplateSpec(num_layers=8, tied=False, microbatches=8)
    for count in (1, 2):
        for lost in itertools.combinations(range(8), count):
            plan = plan_shrink(list(lost), layout, spec)
            assert isinstance(plan, ShrinkPlan), (lost, plan)
            assert plan.placement.ranks == tuple(range(8 - count))
            assert len(plan.placement.pipelines()) >= 2  # --resilient-fault-tolerance 1
            slots = sorted({role.microbatches for role in plan.placement.roles})
            assert [first for first, _ in slots] == [0] + [end for _, end in slots[:-1]]
            assert slots[-1][1] == 8  # the pipelines share the whole global batch


def test_a_loss_while_shrunk_shrinks_again_from_the_templates():
    first = plan_shrink([1], PP2_DP2, SPEC)
    assert isinstance(first, ShrinkPlan)
    shrunk = first.generation_plan()
    assert shrunk.lost == (1,) and shrunk.survivors == (0, 2, 3)
    second = plan_shrink([2], PP2_DP2, SPEC, shrunk)
    assert isinstance(second, ShrinkPlan)
    assert second.survivors == (0, 3) and second.lost == (1, 2)
    assert second.generation_plan().lost == (1, 2)
    # a survivor receives what it lacks on the templates, from a survivor holding it there
    check_moves(shrunk_placement(shrunk), second)
    # growing back afterwards: the two lost ranks come back empty, the rest from survivors
    _, moves = plan_grow(second.generation_plan(), PP2_DP2, SPEC)
    assert {destination for _, _, destination in moves} >= {1, 2}
    assert {source for _, source, _ in moves} <= {0, 3}


def test_every_two_losses_one_after_the_other_of_pp2_dp4_shrink_twice():
    """After any first loss, any second one still leaves a holder of every layer."""
    layout = ParallelLayout(tp=1, pp=2, dp=4)
    spec = TemplateSpec(num_layers=8, tied=False, microbatches=8)
    for first, second in itertools.permutations(range(8), 2):
        shrunk = plan_shrink([first], layout, spec)
        assert isinstance(shrunk, ShrinkPlan)
        again = plan_shrink([second], layout, spec, shrunk.generation_plan())
        assert isinstance(again, ShrinkPlan), (first, second, again)
        assert again.lost == tuple(sorted((first, second)))
        assert again.placement.ranks == tuple(range(6))
        assert sorted(again.placement.holders()) == sorted(
            job_placement(layout, spec).holders())


def test_a_loss_while_shrunk_that_leaves_a_layer_no_holder_is_no_plan():
    shrunk = plan_shrink([1], PP2_DP2, SPEC)  # job ranks [0 2] layers 0-2|3 + [3] layers 0-3
    assert isinstance(shrunk, ShrinkPlan)
    assert isinstance(plan_shrink([0], PP2_DP2, SPEC, shrunk.generation_plan()), ShrinkPlan)
    # job rank 2 alone is left, holding layer 3 only
    gone = plan_shrink([0, 3], PP2_DP2, SPEC, shrunk.generation_plan())
    assert isinstance(gone, Fallback)
    assert gone.reason == ("no pipeline-template plan for the 1 rank(s) left: no live rank "
                           "holds position (rank 2 needs it)")


def test_records_round_trip():
    plan = plan_shrink([1], PP2_DP2, SPEC)
    assert isinstance(plan, ShrinkPlan)
    record = plan.generation_plan().to_record()
    assert Placement.of_record(record["placement"]) == plan.placement
    assert record["describe"] == plan.placement.describe()
    assert GenerationPlan.from_record(json.loads(json.dumps(record))) == plan.generation_plan()
    renamed = plan.placement.renumbered({0: 4, 1: 5, 2: 7})
    assert renamed.ranks == (4, 5, 7)
    assert renamed.describe() == plan.placement.describe().replace("[0 1]", "[4 5]").replace(
        "[2]", "[7]")
    measured = TemplateSpec(4, False, 4, fault_tolerance=2,
                            profile=profile_record(transformer_profile(4)))
    assert TemplateSpec.of_record(measured.to_record()) == measured
    assert measured.planner_profile() == transformer_profile(4)


def test_the_profile_the_stages_measured_is_the_models():
    gib = 1 << 30
    whole = transformer_profile(4)
    measured = SPEC.with_measured(stage_records(whole, (8 * gib, 6 * gib)))
    assert measured.profile_source == "measured"
    assert measured.planner_profile() == Profile(whole.layers, 6 * gib)  # the smaller host
    assert TemplateSpec.of_record(measured.to_record()) == measured
    given = replace(SPEC, profile=profile_record(whole))
    assert given.with_measured(stage_records(slow_first_layers(), (gib, gib))) is given
    missing = r"measured \['embedding', 'layer 0', 'layer 1'\], not the 6 layers"
    with pytest.raises(PlanningError, match=missing):
        SPEC.with_measured(stage_records(whole, (gib, gib))[:1])  # the last stage is missing
    with pytest.raises(PlanningError, match="not the 8 layers"):
        replace(SPEC, num_layers=6).with_measured(stage_records(whole, (gib, gib)))


def test_a_measured_profile_changes_the_plan():
    estimated = plan_shrink([1], PP2_DP2, SPEC)
    measured = plan_shrink([1], PP2_DP2, SPEC.with_measured(
        stage_records(slow_first_layers(), (80 << 30, 80 << 30))))
    assert isinstance(estimated, ShrinkPlan) and isinstance(measured, ShrinkPlan)
    assert estimated.placement.describe() == "[0 1] layers 0-2|3 x 2 + [2] layers 0-3 x 2"
    # the first stage's three slow layers (6.3 layer-times) are its bottleneck; with layer 2
    # too it would take 7.3, against the estimate's 3.1 for the embedding and layers 0-2
    assert measured.placement.describe() == "[0 1] layers 0-1|2-3 x 2 + [2] layers 0-3 x 2"
