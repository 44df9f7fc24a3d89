"""Megatron-LM's own training loop shrinks onto pipeline templates when a rank is lost and no
standby is ready, shrinks again at a second loss, and grows back once a standby is ready:
examples/megatron_lm/pretrain_gpt.py (which calls nothing of mover_plugin) under mover-launch
--policy resilient --standbys 0 with --resilient, TP1 x PP2 x DP2 on 4 processes (pipelines
[0 2] and [1 3]), ranks SIGKILLed by their agents.

Two jobs, compared with the same steps without interruption (mover-launch without
--resilient, one run of GROW_STEPS that saves at SHRUNK_STEPS too):

- rank 1 (first stage) lost at step 3 of GROW_STEPS: the three survivors train on a 2-stage and
  a 1-stage pipeline (planned from a GPT-like profile given with --resilient-template-profile),
  a standby refills the lost slot (``--refill-delay-s 0``; it needs about 10 s to start) and
  the job grows back to PP2 x DP2; Megatron-LM's evaluations while shrunk are skipped, those
  after growing back run;
- rank 2 (last stage of pipeline [0 2]) lost at step 5 of SHRUNK_STEPS, then rank 1 (the
  other pipeline's first stage, alone on the templates) at step 40: two shrinks, the second
  from the templates' state, and the job ends on two ranks, planned from the profile its
  stages measured at start; its checkpoints are skipped, its final parameters are written
  under --save by unit, and PARAMS_DIGEST says why there is none.

Checked: no restart; the loss of every step within 1e-4 relative, as Megatron-LM logs it; the
final parameters within template_runs.PARAM_TOLERANCE (only the order of float additions
differs, see tests/jobs/templates/test_template_training.py). No dropout: which rank runs a
micro-batch would change its masks.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from support.megatron_lm_jobs import PP2, lm_losses
from mover_plugin.megatron.templates.profile import write_profile
from mover_plugin.templates import transformer_profile
from support.template_runs import (check_parameters, check_shrink, check_shrink_and_grow,
                                   checkpoint_parameters, lm_template_run, parameters_by_unit)

pytest.importorskip("megatron.training")

GROW_STEPS = 400
SHRUNK_STEPS = 200
NUM_LAYERS, HEAD_SIZE = 4, 64 // 4
"""megatron_lm_jobs.FLAGS' layers, and hidden size over attention heads."""
TEMPLATE_FLAGS = [
    *PP2, "--hidden-dropout", "0", "--attention-dropout", "0",
    # the learning rate decays over GROW_STEPS in every run, whatever its --train-iters
    "--lr-decay-iters", str(GROW_STEPS),
    # a validation split, evaluated every 50 iterations
    "--split", "98,2,0", "--eval-iters", "1", "--eval-interval", "50",
    "--ckpt-format", "torch"]


def run(folder: Path, steps: int, *flags: str, launcher=()):
    return lm_template_run(folder, [*TEMPLATE_FLAGS, "--train-iters", str(steps), *flags],
                           launcher=launcher)


@pytest.fixture(scope="module")
def failure_free(tmp_path_factory):
    folder = tmp_path_factory.mktemp("failure-free")
    return run(folder, GROW_STEPS, "--save-interval", str(SHRUNK_STEPS)), folder / "ck"


@pytest.fixture(scope="module")
def grown(tmp_path_factory):
    folder = tmp_path_factory.mktemp("grow")
    write_profile(transformer_profile(NUM_LAYERS), folder / "profile.json")
    return (*run(folder, GROW_STEPS, "--resilient", "--resilient-template-profile",
                 str(folder / "profile.json"), "--save-interval", str(2 * GROW_STEPS),
                 launcher=("--refill-delay-s", "0", "--inject-failure", "1:3")), folder / "ck")


@pytest.fixture(scope="module")
def shrunk(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shrink")
    return (*run(folder, SHRUNK_STEPS, "--resilient", "--save-interval", "100",
                 launcher=("--inject-failure", "2:5", "--inject-failure", "1:40")),
            folder / "ck")


def test_megatron_lm_shrinks_and_grows_back_without_a_restart(grown):
    result, summary, events, _ = grown
    _, grow = check_shrink_and_grow(summary, events, GROW_STEPS)
    order = [e["event"] for e in events if e["event"] in (
        "worker_failed", "shrink", "resumed", "standby_ready", "grow", "grown")]
    assert order == ["worker_failed", "shrink", "resumed", "standby_ready", "grow", "resumed",
                     "grown"]
    switched = {e["rank"]: e["role"] for e in events
                if e["event"] == "switched" and e["generation"] == grow["generation"]}
    assert switched == {0: "survivor", 1: "joiner", 2: "survivor", 3: "survivor"}
    # Megatron-LM's evaluations every 50 iterations: skipped while shrunk, run once grown back
    shrunk_through = grow["step"] - 1
    skipped = [f"Megatron-LM's evaluation (iteration {it}) skipped" for it in (50, 100, 150)
               if it <= shrunk_through]
    assert skipped and all(line in result.output for line in skipped)
    evaluated = [it for it in range(50, GROW_STEPS + 1, 50) if it > grow["step"]]
    assert evaluated and all(f"validation loss at iteration {it} |" in result.stdout
                             for it in evaluated)
    # the final checkpoint is Megatron-LM's own again, and so is the digest
    assert (result.output.count("PARAMS_DIGEST ") == 1
            and "PARAMS_DIGEST none" not in result.output)


def test_a_job_that_ends_shrunk_skips_its_checkpoints_and_writes_its_parameters(shrunk):
    result, summary, events, save = shrunk
    assert summary["restarts"] == 0 and summary["steps_completed"] == SHRUNK_STEPS
    first, second = summary["interruptions"]
    shrink = check_shrink(first, events, 2, 5)
    # planned from what the job's two stages measured of their layers before the first step
    assert shrink["profile_source"] == "measured"
    assert [layer["name"] for layer in shrink["profile"]["layers"]] == [
        "embedding", *(f"layer {i}" for i in range(NUM_LAYERS)), "output"]
    assert " + [1] layers 0-3 x " in first["plan"]
    # the 1-stage pipeline of job rank 1 lost: job ranks 0 and 3 go on
    assert check_shrink(second, events, 1, 40, lost_before=(2,))["survivors"] == [0, 3]
    assert result.lines_starting("PARAMS_DIGEST") == [
        "PARAMS_DIGEST none: the job ended on pipeline templates"]
    for iteration in (100, 200):
        assert (f"Megatron-LM's checkpoint at iteration {iteration} skipped" in result.output)
        assert not (save / f"iter_{iteration:07d}").exists()


def test_every_step_loss_matches_the_failure_free_run(grown, shrunk, failure_free):
    expected = lm_losses(failure_free[0].stdout)
    for result, steps in ((grown[0], GROW_STEPS), (shrunk[0], SHRUNK_STEPS)):
        printed = lm_losses(result.stdout)
        assert sorted(printed) == list(range(1, steps + 1)), result.stdout[-3000:]
        worst = max(abs(printed[step] - expected[step]) / abs(expected[step])
                    for step in printed)
        print(f"worst relative loss difference over {steps} steps: {worst:.3e}")
        assert worst < 1e-4


def test_final_parameters_match_the_failure_free_run(grown, shrunk, failure_free):
    """Grown back: Megatron-LM's own final checkpoint; ended shrunk: what the survivors wrote by
    unit."""
    _, reference = failure_free
    for final, iteration in (
            (checkpoint_parameters(grown[-1], GROW_STEPS, NUM_LAYERS, tied=True), GROW_STEPS),
            (parameters_by_unit(shrunk[-1], SHRUNK_STEPS, survivors=2), SHRUNK_STEPS)):
        expected = checkpoint_parameters(reference, iteration, NUM_LAYERS, tied=True)
        check_parameters(final, expected, HEAD_SIZE)
