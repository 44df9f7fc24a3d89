"""bf16 and fp16 on pipeline templates: Megatron-LM's own loop (examples/megatron_lm/pretrain_gpt.py
under mover-launch --policy resilient --standbys 0, TP1 x PP2 x DP2 on 4 processes) shrinks when
rank 2 is SIGKILLed and ends shrunk.

A stage is built in Megatron-Core's Float16Module as Megatron-LM builds the job's, trained by
Megatron-Core's mixed-precision optimizer (fp32 main copies of the 16-bit parameters), and each
unit moves with its 16-bit parameters, their fp32 main copies and Adam's state; fp16's loss
scaler goes on from the job's (and back, when a job grows back).

- bf16 with --grad-reduce-in-bf16, rank 2 lost at step 3;
- fp16 whose loss scaler starts at 2^20 and halves at each overflow (hysteresis 1): it skips
  the updates of iterations 1-3 and 7 and settles at 2^17; rank 2 lost at step 12, then rank 1
  at step 20 (a second shrink, from the templates: the scaler goes on from stage to stage). A
  stage whose scaler started again from 2^20 would skip updates the job does not.

Compared with the same steps without interruption. The shrunk job computes the same updates in
fp32 from gradients summed in another order (and on the 1-stage pipeline autograd sums the tied
word embedding's two gradients in the 16-bit dtype, as in any Megatron job of one stage, where
the job's two stages sum them in their gradient buffers), so the fp32 main copies differ by
rounding; cast to 16 bits that flips the rounding of some elements by one unit, and the 16-bit
forward passes carry it on. Hence the bounds: every step's loss within LOSS_TOLERANCE relative
(a quarter of bf16's relative precision, 2^-8; measured about 1e-4 for bf16, 5e-6 for fp16),
every final parameter within PARAM_TOLERANCE: Adam moves an element by at most about the
learning rate per step, so two runs apart by rounding drift by at most twice that per step while
shrunk (measured 5.7e-3 for bf16 over 27 steps, 9.8e-4 for fp16 over 18). The same iterations
skip their update in both runs, at the same loss scales. A lost main copy, Adam state or loss
scale would break these at the first steps after the shrink.
"""

from __future__ import annotations

import re

import numpy
import pytest

from support.megatron_lm_jobs import lm_losses
from support.template_runs import (check_shrink, checkpoint_parameters, lm_template_run,
                                   parameters_by_unit)

pytest.importorskip("megatron.training")

STEPS, LR, NUM_LAYERS = 30, 1e-3, 4
LOSS_TOLERANCE = 2 ** -8 / 4
PRECISIONS = {
    "bf16": ({2: 3}, ["--bf16", "--grad-reduce-in-bf16"]),
    "fp16": ({2: 12, 1: 20}, ["--fp16", "--initial-loss-scale", str(2 ** 20), "--hysteresis",
                              "1"]),
}
"""Each case: the ranks lost and the step each is lost at, and its flags."""
FLAGS = ["--pipeline-model-parallel-size", "2", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--ckpt-format", "torch", "--train-iters", str(STEPS),
         "--lr", str(LR)]
SCALES = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?loss scale: (\S+) \|"
                    r".*?number of skipped iterations:\s+(\d+)")
"""An iteration, the loss scale Megatron-LM logs after it, and whether it skipped its update."""


@pytest.fixture(scope="module", params=sorted(PRECISIONS))
def runs(request, tmp_path_factory):
    lost, precision = PRECISIONS[request.param]
    reference = tmp_path_factory.mktemp(f"failure-free-{request.param}")
    failure_free = lm_template_run(reference, [*FLAGS, *precision,
                                               "--save-interval", str(STEPS)])
    folder = tmp_path_factory.mktemp(request.param)
    shrunk = lm_template_run(folder, [*FLAGS, *precision, "--save-interval", str(2 * STEPS),
                                      "--resilient"],
                             launcher=[flag for rank, step in lost.items()
                                       for flag in ("--inject-failure", f"{rank}:{step}")])
    return request.param, lost, (failure_free, reference), folder, shrunk


def test_a_16_bit_job_shrinks_with_its_main_copies_adam_state_and_loss_scale(runs):
    precision, lost, (failure_free, reference), folder, (result, summary, events) = runs
    assert summary["restarts"] == 0 and summary["steps_completed"] == STEPS
    assert len(summary["interruptions"]) == len(lost)
    for done, (interruption, (rank, step)) in enumerate(zip(summary["interruptions"],
                                                              lost.items())):
        check_shrink(interruption, events, rank, step, lost_before=tuple(lost)[:done])
    scales = SCALES.findall(result.stdout)
    assert [int(step) for step, _, _ in scales] == list(range(1, STEPS + 1))
    assert scales == SCALES.findall(failure_free.stdout)
    if precision == "fp16":
        assert [int(step) for step, _, skipped in scales if skipped != "0"] == [1, 2, 3, 7]
    expected, printed = lm_losses(failure_free.stdout), lm_losses(result.stdout)
    assert sorted(printed) == sorted(expected)
    worst = max(abs(printed[step] - value) / abs(value)
                for step, value in expected.items() if value)
    print(f"{precision}: worst relative loss difference over {STEPS} steps: {worst:.3e}")
    assert worst < LOSS_TOLERANCE
    final = parameters_by_unit(folder / "ck", STEPS, survivors=4 - len(lost))
    reference_parameters = checkpoint_parameters(reference / "ck", STEPS, NUM_LAYERS, tied=True)
    assert set(final) == set(reference_parameters)
    drift = max(float(numpy.abs(final[name] - value).max())
                for name, value in reference_parameters.items())
    print(f"{precision}: worst parameter difference: {drift:.3e}")
    assert drift < 2 * LR * (STEPS - min(lost.values()))
