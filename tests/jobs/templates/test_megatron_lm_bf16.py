"""bf16 on pipeline templates: Megatron-LM's own loop with --bf16 --grad-reduce-in-bf16
(examples/megatron_lm/pretrain_gpt.py under mover-launch --policy resilient --standbys 0,
TP1 x PP2 x DP2 on 4 processes) shrinks when rank 2 is SIGKILLed at step 3 and ends shrunk.

A stage is built in Megatron-Core's Float16Module as Megatron-LM builds the job's, trained by
Megatron-Core's mixed-precision optimizer (fp32 main copies of the bf16 parameters), and each
unit moves with its bf16 parameters, their fp32 main copies and Adam's state.

Compared with the same steps without interruption. The shrunk job computes the same updates in
fp32 from gradients summed in another order (and on the 1-stage pipeline autograd sums the tied
word embedding's two gradients in bf16, as in any Megatron job of one stage, where the job's two
stages sum them in their gradient buffers), so the fp32 main copies differ by rounding; cast to
bf16 (8 bits of mantissa) that flips the rounding of some elements by one bf16 unit, and the
bf16 forward passes carry it on. Hence the bounds: every step's loss within LOSS_TOLERANCE
relative (a quarter of bf16's relative precision, 2^-8; measured a few 1e-5), every final
parameter within PARAM_TOLERANCE: Adam moves an element by at most about the learning rate per
step, so two runs apart by rounding drift by at most twice that per step while shrunk (measured
about 5e-3 over 25 steps). A lost main copy or Adam state would break both at the first step
after the shrink.
"""

from __future__ import annotations

import numpy
import pytest

from support.megatron_lm_jobs import lm_losses
from support.template_runs import (check_shrink, checkpoint_parameters, lm_template_run,
                                   parameters_by_unit)

pytest.importorskip("megatron.training")

STEPS, LOST_AT, LR = 30, 3, 1e-3
NUM_LAYERS = 4
LOSS_TOLERANCE = 2 ** -8 / 4
PARAM_TOLERANCE = 2 * LR * (STEPS - LOST_AT)
FLAGS = ["--pipeline-model-parallel-size", "2", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--ckpt-format", "torch", "--train-iters", str(STEPS),
         "--lr", str(LR), "--bf16", "--grad-reduce-in-bf16"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    reference = tmp_path_factory.mktemp("failure-free")
    failure_free = lm_template_run(reference, [*FLAGS, "--save-interval", str(STEPS)])
    folder = tmp_path_factory.mktemp("bf16")
    shrunk = lm_template_run(folder, [*FLAGS, "--save-interval", str(2 * STEPS), "--resilient"],
                             launcher=("--inject-failure", f"2:{LOST_AT}"))
    return (failure_free, reference), folder, shrunk


def test_a_bf16_job_shrinks_with_its_main_copies_and_adam_state(runs):
    (failure_free, reference), folder, (result, summary, events) = runs
    assert summary["restarts"] == 0 and summary["steps_completed"] == STEPS
    (interruption,) = summary["interruptions"]
    check_shrink(interruption, events, 2, LOST_AT)
    expected, printed = lm_losses(failure_free.stdout), lm_losses(result.stdout)
    assert sorted(printed) == list(range(1, STEPS + 1)), result.stdout[-3000:]
    worst = max(abs(printed[step] - expected[step]) / abs(expected[step]) for step in printed)
    print(f"worst relative loss difference over {STEPS} steps: {worst:.3e}")
    assert worst < LOSS_TOLERANCE
    final = parameters_by_unit(folder / "ck", STEPS, survivors=3)
    reference_parameters = checkpoint_parameters(reference / "ck", STEPS, NUM_LAYERS, tied=True)
    assert set(final) == set(reference_parameters)
    drift = max(float(numpy.abs(final[name] - value).max())
                for name, value in reference_parameters.items())
    print(f"worst parameter difference: {drift:.3e}")
    assert drift < PARAM_TOLERANCE
