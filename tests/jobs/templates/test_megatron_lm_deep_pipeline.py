"""A 4-stage pipeline on Megatron-LM's own loop shrinks onto pipeline templates twice:
examples/megatron_lm/pretrain_gpt.py under mover-launch --policy resilient --standbys 0 with
--resilient, TP1 x PP4 x DP2 on 8 processes (pipelines [0 2 4 6] and [1 3 5 7], one layer per
stage), planned from a GPT-like profile given with --resilient-template-profile.

Rank 6 (a last stage) is SIGKILLed at step 3: the other pipeline goes on as a 3-stage one in
which job rank 5, a middle stage of the job, is the last stage (it reads the labels and the loss
mask). Rank 1 (the first stage of that pipeline) is SIGKILLed at step 10: the six survivors go on
as two 3-stage pipelines from the templates' state, in which job rank 2, a middle stage of the
job, is a first stage (it reads the tokens). A middle stage of the job builds the training
dataset at start for that, and reads the samples Megatron-LM's sampler gives the job.

Compared with the same steps without interruption: no restart, every step's loss within 1e-4
relative, the final parameters (written by unit, the job ending shrunk) within
template_runs.PARAM_TOLERANCE. No dropout: which rank runs a micro-batch would change its
masks.
"""

from __future__ import annotations

import pytest

from mover_plugin.megatron.templates.profile import write_profile
from mover_plugin.templates import transformer_profile
from support.megatron_lm_jobs import lm_losses
from support.template_runs import (check_parameters, check_shrink, checkpoint_parameters,
                                   lm_template_run, parameters_by_unit)

pytest.importorskip("megatron.training")

STEPS = 30
NUM_LAYERS, HEAD_SIZE = 4, 64 // 4
FLAGS = ["--pipeline-model-parallel-size", "4", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--ckpt-format", "torch", "--train-iters", str(STEPS)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    reference = tmp_path_factory.mktemp("failure-free")
    failure_free = lm_template_run(reference, [*FLAGS, "--save-interval", str(STEPS)], nproc=8)
    folder = tmp_path_factory.mktemp("pp4")
    write_profile(transformer_profile(NUM_LAYERS), folder / "profile.json")
    shrunk = lm_template_run(
        folder, [*FLAGS, "--save-interval", str(2 * STEPS), "--resilient",
                 "--resilient-template-profile", str(folder / "profile.json")],
        launcher=("--inject-failure", "6:3", "--inject-failure", "1:10"), nproc=8)
    return (failure_free, reference), folder, shrunk


def test_a_four_stage_pipeline_shrinks_twice_and_middle_stages_read_data(runs):
    (failure_free, reference), folder, (result, summary, events) = runs
    assert summary["restarts"] == 0 and summary["steps_completed"] == STEPS
    first, second = summary["interruptions"]
    check_shrink(first, events, 6, 3, world=8)
    # survivors 0-5 and 7 are ranks 0-6 of the first templates' world: job rank 5 (world
    # rank 5) ends the 3-stage pipeline
    assert first["plan"] == "[0 2 4 6] layers 0|1|2|3 x 2 + [1 3 5] layers 0-1|2|3 x 2"
    shrink = check_shrink(second, events, 1, 10, lost_before=(6,), world=8)
    assert shrink["survivors"] == [0, 2, 3, 4, 5, 7]
    # job ranks 0 3 5 and 2 4 7: job rank 2 (world rank 1) begins the second pipeline
    assert second["plan"] == "[0 2 4] layers 0-1|2|3 x 2 + [1 3 5] layers 0-1|2|3 x 2"
    assert result.lines_starting("PARAMS_DIGEST") == [
        "PARAMS_DIGEST none: the job ended on pipeline templates"]
    expected = lm_losses(failure_free.stdout)
    printed = lm_losses(result.stdout)
    assert sorted(printed) == list(range(1, STEPS + 1)), result.stdout[-3000:]
    worst = max(abs(printed[step] - expected[step]) / abs(expected[step]) for step in printed)
    print(f"worst relative loss difference over {STEPS} steps: {worst:.3e}")
    assert worst < 1e-4
    check_parameters(parameters_by_unit(folder / "ck", STEPS, survivors=6),
                     checkpoint_parameters(reference / "ck", STEPS, NUM_LAYERS, tied=True,
                                           stages=4), HEAD_SIZE)
