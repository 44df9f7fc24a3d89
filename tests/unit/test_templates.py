"""Pipeline templates (mover_plugin.templates): optimal splits and instantiations, checked
against brute force on small cases; the planner's speed at 1,024 hosts; fault tolerance."""

from __future__ import annotations

import itertools
import json
import random
import time

import pytest

from mover_plugin.templates import (
    LayerCost,
    PlanningError,
    Profile,
    best_template,
    check_fault_tolerance,
    instantiate,
    plan_templates,
    split_batch,
    transformer_profile,
)


def random_profile(rng: random.Random, layers: int, tight: bool) -> Profile:
    costs = tuple(LayerCost(f"l{i}", rng.uniform(0.1, 1.0), rng.uniform(0.1, 2.0),
                            rng.randint(1, 10), rng.randint(0, 6)) for i in range(layers))
    total = sum(c.static_bytes + c.activation_bytes for c in costs)
    return Profile(costs, rng.randint(total // 4, total // 2) if tight else 10 * total * layers)


def splits(layers: int, stages: int):
    """Every split of ``layers`` layers into ``stages`` non-empty contiguous stages."""
    for cuts in itertools.combinations(range(1, layers), stages - 1):
        bounds = (0, *cuts, layers)
        yield list(zip(bounds, bounds[1:]))


def fits(profile: Profile, stage: tuple[int, int], index: int, stages: int) -> bool:
    layers = profile.layers[stage[0]:stage[1]]
    used = sum(l.static_bytes for l in layers) + (stages - index) * sum(
        l.activation_bytes for l in layers)
    return used <= profile.host_memory_bytes


def brute_bottleneck(profile: Profile, stages: int):
    best = None
    for split in splits(len(profile.layers), stages):
        if all(fits(profile, stage, i, stages) for i, stage in enumerate(split)):
            slowest = max(sum(l.step_s for l in profile.layers[a:b]) for a, b in split)
            best = slowest if best is None else min(best, slowest)
    return best


@pytest.mark.parametrize("seed", range(60))
def test_a_template_is_the_fastest_split_that_fits(seed):
    rng = random.Random(seed)
    profile = random_profile(rng, rng.randint(1, 8), tight=seed % 2 == 0)
    for stages in range(1, 5):
        template = best_template(profile, stages)
        expected = brute_bottleneck(profile, stages) if stages <= len(profile.layers) else None
        if expected is None:
            assert template is None
            continue
        assert template is not None and template.hosts == stages
        assert template.bottleneck_s == pytest.approx(expected)
        assert [a for a, _ in template.stages] == [0, *[b for _, b in template.stages[:-1]]]
        assert template.stages[-1][1] == len(profile.layers)
        assert all(fits(profile, stage, i, stages) for i, stage in enumerate(template.stages))


def test_a_layer_with_many_activations_goes_where_fewer_micro_batches_are_in_flight():
    """Stages laid greedily from the first would give the first two layers to stage 0 and
    leave layer 2, whose activations fit only at the last stage (one micro-batch in flight), in
    stage 1 (two in flight)."""
    layers = tuple(LayerCost(f"l{i}", 0.5, 0.5, static, activation)
                   for i, (static, activation) in enumerate([(1, 0), (1, 0), (0, 5), (1, 0)]))
    template = best_template(Profile(layers, host_memory_bytes=6), 3)
    assert template is not None and template.stages == ((0, 1), (1, 2), (2, 4))


def test_the_templates_run_from_the_fewest_hosts_that_fit_to_the_pipeline_size():
    profile = transformer_profile(16, layer_bytes=10 << 30, activation_bytes=1 << 30,
                                  host_memory_bytes=80 << 30)
    templates = plan_templates(profile, pipeline_size=8)
    # 18 layers of 10 GiB (+ activations): no fewer than 3 hosts of 80 GiB hold them
    assert sorted(templates) == list(range(3, 9))
    assert all(best_template(profile, n) is None for n in (1, 2))


def test_a_model_that_fits_no_host_count_is_refused_with_its_size():
    profile = transformer_profile(4, layer_bytes=100 << 30, host_memory_bytes=80 << 30)
    with pytest.raises(PlanningError, match="fits no pipeline of 1 to 4 hosts"):
        plan_templates(profile, pipeline_size=4)


def brute_instantiation(templates, hosts: int, least: int):
    """(pipelines, rate) of the best cover: fewest pipelines, then the highest rate."""
    sizes = sorted(templates)
    for count in range(least, hosts + 1):
        covers = [c for c in itertools.combinations_with_replacement(sizes, count)
                  if sum(c) == hosts]
        if covers:
            return count, max(sum(1 / templates[n].bottleneck_s for n in c) for c in covers)
    return None


@pytest.mark.parametrize("seed", range(40))
def test_an_instantiation_covers_the_hosts_with_the_fewest_fastest_pipelines(seed):
    rng = random.Random(100 + seed)
    profile = random_profile(rng, rng.randint(3, 9), tight=False)
    templates = plan_templates(profile, pipeline_size=rng.randint(1, 4))
    hosts, least = rng.randint(1, 12), rng.randint(1, 3)
    expected = brute_instantiation(templates, hosts, least)
    if expected is None:
        with pytest.raises(PlanningError, match=f"cover exactly {hosts} hosts"):
            instantiate(templates, hosts, 64, least - 1)
        return
    plan = instantiate(templates, hosts, 64, least - 1)
    assert sum(t.hosts for t in plan.pipelines) == hosts
    assert len(plan.pipelines) == expected[0]
    assert sum(1 / t.bottleneck_s for t in plan.pipelines) == pytest.approx(expected[1])
    assert sum(plan.microbatches) == 64 and min(plan.microbatches) >= 1


@pytest.mark.parametrize("seed", range(20))
def test_the_batch_split_makes_the_slowest_pipeline_as_fast_as_it_can_be(seed):
    rng = random.Random(200 + seed)
    profile = random_profile(rng, 6, tight=False)
    templates = plan_templates(profile, pipeline_size=3)
    pipelines = [templates[rng.choice(sorted(templates))] for _ in range(rng.randint(1, 3))]
    microbatches = rng.randint(len(pipelines), 9)
    counts = split_batch(pipelines, microbatches)
    best = min(max(t.iteration_s(m) for t, m in zip(pipelines, c))
               for c in itertools.product(range(1, microbatches + 1), repeat=len(pipelines))
               if sum(c) == microbatches)
    assert sum(counts) == microbatches
    assert max(t.iteration_s(m) for t, m in zip(pipelines, counts)) == pytest.approx(best)


def test_a_faster_pipeline_gets_more_of_the_global_batch():
    profile = transformer_profile(8)
    templates = plan_templates(profile, pipeline_size=2)
    plan = instantiate(templates, 3, 32, fault_tolerance=1)  # a 2-host and a 1-host pipeline
    assert [t.hosts for t in plan.pipelines] == [2, 1]
    assert plan.microbatches[0] > plan.microbatches[1] and sum(plan.microbatches) == 32


def test_1024_hosts_and_a_96_layer_model_are_planned_in_under_a_second():
    started = time.perf_counter()
    profile = transformer_profile(96)
    templates = plan_templates(profile, pipeline_size=16)
    plans = check_fault_tolerance(templates, 1024, 4096, fault_tolerance=2)
    elapsed = time.perf_counter() - started
    assert elapsed < 1.0, elapsed
    full = plans[1024]
    assert [t.hosts for t in full.pipelines] == [16] * 64  # the job's own layout
    assert full.microbatches == (64,) * 64
    assert sorted(plans) == [1022, 1023, 1024]


@pytest.mark.parametrize("seed", range(30))
def test_every_loss_of_up_to_f_hosts_leaves_a_plan_and_a_whole_pipeline(seed):
    rng = random.Random(300 + seed)
    profile = random_profile(rng, rng.randint(2, 8), tight=rng.random() < 0.5)
    try:
        templates = plan_templates(profile, pipeline_size=rng.randint(1, 4))
    except PlanningError:
        return
    hosts, fault_tolerance = rng.randint(1, 10), rng.randint(0, 2)
    try:
        plans = check_fault_tolerance(templates, hosts, 32, fault_tolerance)
    except PlanningError as error:
        assert f"fault tolerance {fault_tolerance}" in str(error) or "cover exactly" in str(error)
        return
    layout = [p for p, t in enumerate(plans[hosts].pipelines) for _ in range(t.hosts)]
    for lost in range(1, fault_tolerance + 1):
        assert plans[hosts - lost].hosts == hosts - lost  # a plan for the hosts left
        for hosts_lost in itertools.combinations(range(hosts), lost):
            hit = {layout[h] for h in hosts_lost}
            assert len(hit) < len(plans[hosts].pipelines)  # a pipeline is left whole


def test_a_fault_tolerance_too_large_for_the_hosts_is_refused_naming_them():
    templates = plan_templates(transformer_profile(8), pipeline_size=2)
    with pytest.raises(PlanningError, match="no 4 or more pipelines of 1 to 2 hosts"):
        check_fault_tolerance(templates, 3, 32, fault_tolerance=3)
    big = plan_templates(transformer_profile(16, layer_bytes=10 << 30, activation_bytes=1 << 30),
                         pipeline_size=4)  # templates of 3 and 4 hosts
    with pytest.raises(PlanningError, match="fault tolerance 1 is too large for 6 hosts: after "
                                            "losing 1, no 1 or more pipelines of 3 to 4 hosts"):
        check_fault_tolerance(big, 6, 32, fault_tolerance=1)


def test_mover_templates_prints_the_templates_and_the_plans(capsys):
    from mover_plugin.launch import jobctl

    argv = ["templates", "--hosts", "3", "--pipeline-size", "2", "--num-layers", "2",
            "--global-batch-size", "8", "--micro-batch-size", "2"]
    assert jobctl.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "templates (4 layers, 1F1B; a stage is one host):"
    assert [line.split()[0] for line in lines[2:4]] == ["1", "2"]
    assert lines[4].startswith("3 hosts: 2 pipeline(s) (1 x 2 hosts with 2 micro-batches, "
                               "1 x 1 hosts with 2 micro-batches)")
    assert lines[5].startswith("2 hosts: 1 pipeline(s) (1 x 2 hosts with 4 micro-batches)")
    assert jobctl.main(["--json", *argv]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [p["hosts"] for p in result["plans"]] == [3, 2]


def test_a_profile_file_is_read_and_a_bad_one_named(tmp_path, capsys):
    from mover_plugin.launch import jobctl

    profile = {"host_memory_bytes": 100, "layers": [
        {"name": f"l{i}", "forward_s": 0.01, "backward_s": 0.02, "static_bytes": 10,
         "activation_bytes": 1} for i in range(4)]}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    argv = ["templates", "--hosts", "4", "--pipeline-size", "4", "--fault-tolerance", "0",
            "--global-batch-size", "8", "--profile", str(path)]
    assert jobctl.main(argv) == 0
    assert "4 hosts: 1 pipeline(s) (1 x 4 hosts with 8 micro-batches)" in capsys.readouterr().out
    path.write_text('{"layers": []}')
    assert jobctl.main(argv) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"mover templates: error: {path}: not a profile (KeyError")
