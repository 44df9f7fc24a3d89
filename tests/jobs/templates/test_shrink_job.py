"""A lost rank with no standby ready: the survivors shrink onto pipeline templates in the
running job, and grow back once a standby is ready. examples/pretrain_gpt.py --resilient under
mover-launch --policy resilient --standbys 0, TP1 x PP2 x DP2 on 4 processes, one rank
SIGKILLed by its agent.

The three survivors go on without a restart, in one generation, on the planner's plan for
three hosts: a 2-stage and a 1-stage pipeline with the same global batch, the layers a
survivor newly holds (with their Adam state) sent by a live holder. The lost rank's slot is
refilled with a standby (``--refill-delay-s 0``); once it is ready, the survivors switch at an
iteration boundary back to PP2 x DP2 with the standby in the lost rank's place.

Two jobs: rank 2 (last stage) lost at step 5 of 7, which ends shrunk, planned from the profile
the job's stages measured at its start; rank 1 (first stage) lost at step 3 of 400, which grows
back (the standby needs about 10 s to start; 400 steps leave room), planned from a GPT-like
profile given with --resilient-template-profile. Compared with the same steps without
interruption (template_runs.RUN, trained in-process):

- the loss of every step within 1e-4 relative, as the step lines print it;
- the final parameters within a bound (see template_runs.PARAM_TOLERANCE): those the survivors write
  under ``--save`` by unit when the job ends shrunk, or the script's own checkpoint after
  growing back. Only the order of float additions differs (see
  tests/jobs/templates/test_template_training.py).
"""

import json
import re
from pathlib import Path

import pytest

from support.gpt_jobs import LAUNCH, losses, read_events
from mover_plugin.layout import ParallelLayout
from mover_plugin.megatron.templates.profile import write_profile
from mover_plugin.testing.template_run import train_without_interruption
from mover_plugin.shrink import ShrinkPlan, TemplateSpec, plan_shrink
from mover_plugin.templates import transformer_profile
from mover_plugin.testing import run_command, run_ranks
from support.template_runs import (EXAMPLE, RUN, STEPS, check_parameters, check_shrink,
                                   check_shrink_and_grow, checkpoint_parameters, parameters_by_unit,
                                   step_losses, worst_relative)

pytest.importorskip("megatron.core")

HEAD_SIZE = 32 // 4
"""template_runs.RUN's hidden size over its attention heads."""
GROW_STEPS = 400


def shrink_run(tmp_path: Path, injection: str, steps: int, launcher: tuple[str, ...] = (),
               script: tuple[str, ...] = ()):
    summary, events, save = tmp_path / "summary.json", tmp_path / "events.jsonl", tmp_path / "ck"
    result = run_command(
        [*LAUNCH, "--standalone", "--nproc-per-node", "4", "--policy", "resilient",
         "--standbys", "0", "--summary", str(summary), "--event-log", str(events),
         "--stop-grace-s", "2", "--inject-failure", injection, *launcher, str(EXAMPLE),
         *RUN.argv, "--train-iters", str(steps), "--resilient", "--save", str(save), *script],
        timeout_s=300)
    assert result.returncode == 0, result.output[-5000:]
    return result, json.loads(summary.read_text()), read_events(events), save


@pytest.fixture(scope="module")
def shrunk(tmp_path_factory):
    """Rank 2 lost at step 5 of 7: the job ends on the templates."""
    return (2, 5, *shrink_run(tmp_path_factory.mktemp("shrink"), "2:5", STEPS))


@pytest.fixture(scope="module")
def grown(tmp_path_factory):
    """Rank 1 lost at step 3 of GROW_STEPS: the job grows back once a standby is ready."""
    folder = tmp_path_factory.mktemp("grow")
    write_profile(transformer_profile(RUN.num_layers), folder / "profile.json")
    return shrink_run(folder, "1:3", GROW_STEPS, launcher=("--refill-delay-s", "0"),
                      script=("--resilient-template-profile", str(folder / "profile.json")))


@pytest.fixture(scope="module")
def grow_reference():
    return run_ranks(train_without_interruption, 4, RUN, GROW_STEPS, timeout_s=300,
                     group_timeout_s=60)


def test_the_survivors_shrink_in_one_generation_without_a_restart(shrunk):
    rank, step, result, summary, events, _ = shrunk
    assert summary["restarts"] == 0 and summary["steps_completed"] == STEPS
    (interruption,) = summary["interruptions"]
    shrink = check_shrink(interruption, events, rank, step)
    # planned from what the job's two stages measured of their layers before the first step
    assert shrink["profile_source"] == "measured"
    layers = shrink["profile"]["layers"]
    assert [layer["name"] for layer in layers] == [
        "embedding", *(f"layer {i}" for i in range(RUN.num_layers)), "output"]
    for layer in layers:
        assert layer["forward_s"] > 0 and layer["backward_s"] > 0, layer
        assert layer["static_bytes"] > 0 and layer["activation_bytes"] > 0, layer
    spec = TemplateSpec(RUN.num_layers, RUN.tied, RUN.slots, profile=shrink["profile"])
    plan = plan_shrink([rank], ParallelLayout(tp=1, pp=2, dp=2), spec)
    assert isinstance(plan, ShrinkPlan) and interruption["plan"] == plan.placement.describe()
    # ranks 0, 1, 3 of the job are 0-2 of the survivors' world: 0 and 3 keep the first and the
    # last stage as a 2-stage pipeline, 1 trains the whole model alone; where the stages split
    # and how the micro-batches are shared follow the measured times
    assert re.match(r"\[0 2\] layers 0(-\d)?\|\d", interruption["plan"])
    assert " + [1] layers 0-3 x " in interruption["plan"]
    assert result.lines_starting("PARAMS_DIGEST") == [
        "PARAMS_DIGEST none: the job ended on pipeline templates"]


def test_a_ready_standby_grows_the_job_back_at_an_iteration_boundary(grown):
    result, summary, events, _ = grown
    _, grow = check_shrink_and_grow(summary, events, GROW_STEPS)
    assert list(grow["phases_s"]) == ["requested", "switched", "first_step_completed"]
    order = [e["event"] for e in events if e["event"] in (
        "worker_failed", "shrink", "resumed", "standby_refill", "standby_ready", "grow",
        "grown")]
    assert order == ["worker_failed", "shrink", "resumed", "standby_refill", "standby_ready",
                     "grow", "resumed", "grown"]
    switched = {e["rank"]: e["role"] for e in events
                if e["event"] == "switched" and e["generation"] == grow["generation"]}
    assert switched == {0: "survivor", 1: "joiner", 2: "survivor", 3: "survivor"}
    # back on the script's own model: every data-parallel replica is bit-equal
    assert "DP_REPLICAS identical" in result.stdout


def test_every_step_loss_matches_the_failure_free_run(shrunk, grown, template_reference,
                                                     grow_reference):
    for (result, *_), reference, steps in ((shrunk[2:], template_reference, STEPS),
                                           (grown, grow_reference, GROW_STEPS)):
        printed = losses(result)
        assert sorted(printed) == list(range(1, steps + 1)), result.stdout[-3000:]
        expected = step_losses(reference)
        worst = worst_relative([printed[step] for step in range(1, steps + 1)], expected)
        print(f"worst relative loss difference over {steps} steps: {worst:.3e}")
        assert worst < 1e-4, (printed, expected)


def test_final_parameters_match_the_failure_free_run(shrunk, grown, template_reference,
                                                     grow_reference):
    for final, reference in ((ended_shrunk(shrunk[-1]), template_reference),
                             (ended_grown(grown[-1]), grow_reference)):
        expected = {name: value for rank in reference for name, value
                    in rank["params"].items()}
        check_parameters(final, expected, HEAD_SIZE)


def ended_shrunk(save: Path) -> dict:
    """The parameters the survivors wrote by unit, each unit from one holder."""
    return parameters_by_unit(save, STEPS, survivors=3)


def ended_grown(save: Path) -> dict:
    """The parameters of the script's own last checkpoint (each stage's, by canonical name)."""
    return checkpoint_parameters(save, GROW_STEPS, RUN.num_layers, RUN.tied)
