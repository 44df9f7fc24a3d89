"""examples/pretrain_gpt.py under mover-launch on 4 CPU processes: real Megatron-Core training.

Checks the three 4-rank layouts, that loss decreases and data-parallel replicas stay
identical, that the restart baseline survives a SIGKILL with the failure-free result (the
restarted workers load the checkpoint and resume bit-exactly), and that bad flags fail before
any worker starts.
"""

import json
import re

import pytest

from support.gpt_jobs import STEP_LINE, digest, losses, pretrain

pytest.importorskip("megatron.core")


@pytest.fixture
def reference(reference_pp2):
    return reference_pp2


def test_tp1_pp2_dp2_trains(reference):
    steps = losses(reference)
    assert sorted(steps) == list(range(1, 11))
    assert steps[10] < steps[1] - 0.5
    assert "DP_REPLICAS identical" in reference.stdout


def _check_trains(result):
    assert result.returncode == 0, result.output[-4000:]
    steps = losses(result)
    assert sorted(steps) == list(range(1, 7))
    assert steps[6] < steps[1] - 0.3
    assert "DP_REPLICAS identical" in result.stdout


def test_tp2_pp2_dp1_trains(reference_tp2_pp2):
    _check_trains(reference_tp2_pp2)


def test_tp2_pp1_dp2_trains():
    result = pretrain("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1",
                      "--train-iters", "6")
    _check_trains(result)


def test_restart_baseline_survives_sigkill_exactly(tmp_path, reference):
    ckpt, summary_path = str(tmp_path / "ckpt"), tmp_path / "summary.json"
    result = pretrain(
        "--pipeline-model-parallel-size", "2", "--train-iters", "10",
        "--save", ckpt, "--load", ckpt, "--save-interval", "1",
        launcher_flags=["--policy", "restart", "--inject-failure", "3:6",
                        "--summary", str(summary_path)],
    )
    assert result.returncode == 0, result.output[-4000:]
    assert digest(result) == digest(reference)
    # The restarted workers load the last checkpoint and go on bit-exactly.
    resumed = re.search(r"resumed from \S+ at step (\d+)", result.stdout)
    assert resumed is not None, result.stdout[-4000:]
    at = int(resumed.group(1))
    after = {int(step): float(loss)
             for step, loss in STEP_LINE.findall(result.stdout[resumed.end():])}
    assert 1 <= at < 10 and sorted(after) == list(range(at + 1, 11))
    assert after == {step: loss for step, loss in losses(reference).items() if step > at}
    summary = json.loads(summary_path.read_text())
    assert summary["steps_completed"] == 10 and summary["restarts"] == 1
    (interruption,) = summary["interruptions"]
    assert (interruption["rank"], interruption["step"]) == (3, 6)
    assert interruption["how"] == "signal SIGKILL"
    assert interruption["downtime_s"] > 0
    assert set(interruption["phases_s"]) >= {"detected", "recovered", "first_step_completed"}


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--tensor-model-parallel-size", "3"], "world size 4 is not divisible"),
        (["--pipeline-model-parallel-size", "2", "--num-layers", "3"],
         "--num-layers 3 is not divisible by --pipeline-model-parallel-size 2"),
        (["--data-path", "/nonexistent/data"], "/nonexistent/data.bin"),
        (["--lr-decay-style", "sideways"], "invalid choice: 'sideways'"),
    ],
)
def test_bad_flags_fail_before_any_worker_starts(flags, message):
    result = pretrain(*flags, timeout_s=60)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("mover-launch: error: pretrain_gpt.py: ") and message in line
    assert "starting" not in result.output and "step" not in result.stdout
