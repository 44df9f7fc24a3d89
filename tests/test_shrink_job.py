"""A lost rank with no standby ready: the survivors shrink onto pipeline templates in the
running job. examples/pretrain_gpt.py --resilient under mover-launch --policy resilient
--standbys 0, TP1 x PP2 x DP2 on 4 processes, one rank SIGKILLed by the agent at step 3.

The three survivors go on without a restart, in one generation, on the planner's plan for
three hosts: a 2-stage and a 1-stage pipeline with the same global batch, the layers a
survivor newly holds (with their Adam state) sent by a live holder. Compared with the same
steps without interruption (template_runs.RUN, trained in-process):

- the loss of every step within 1e-4 relative, as the step lines print it;
- the final parameters, which the survivors write under ``--save`` by unit, within 1e-5 (only
  the order of float additions differs; see tests/test_template_training.py).
"""

import json
from pathlib import Path

import pytest
import torch

from gpt_jobs import LAUNCH, losses, read_events
from mover_plugin.megatron.shrunk_training import FINAL_FOLDER
from mover_plugin.testing import run_command
from template_runs import EXAMPLE, RUN, STEPS, step_losses, worst_relative

pytest.importorskip("megatron.core")

PARAM_TOLERANCE = 1e-5


def shrink_run(tmp_path: Path, injection: str):
    summary, events, save = tmp_path / "summary.json", tmp_path / "events.jsonl", tmp_path / "ck"
    result = run_command(
        [*LAUNCH, "--standalone", "--nproc-per-node", "4", "--policy", "resilient",
         "--standbys", "0", "--summary", str(summary), "--event-log", str(events),
         "--stop-grace-s", "2", "--inject-failure", injection, str(EXAMPLE), *RUN.argv,
         "--train-iters", str(STEPS), "--resilient", "--save", str(save)],
        timeout_s=300)
    assert result.returncode == 0, result.output[-5000:]
    return result, json.loads(summary.read_text()), read_events(events), save


@pytest.fixture(scope="module", params=[(1, 3), (2, 5)],
                ids=["first-stage-rank-1-at-step-3", "last-stage-rank-2-at-step-5"])
def shrunk(request, tmp_path_factory):
    rank, step = request.param
    return (rank, step, *shrink_run(tmp_path_factory.mktemp("shrink"), f"{rank}:{step}"))


def test_the_survivors_shrink_in_one_generation_without_a_restart(shrunk):
    rank, step, result, summary, events, _ = shrunk
    assert summary["restarts"] == 0 and summary["steps_completed"] == STEPS
    (interruption,) = summary["interruptions"]
    assert interruption["recovery"] == "shrink" and interruption["rank"] == rank
    assert interruption["step"] >= step and interruption["how"] == "signal SIGKILL"
    # the survivors are ranks 0-2 of their world, in the order of their job ranks; the lost
    # rank's replica sits in the 2-stage pipeline of the plan
    assert interruption["plan"] == ("[0 2] layers 0-2|3 x 2 + [1] layers 0-3 x 2" if rank == 2
                                    else "[0 1] layers 0-2|3 x 2 + [2] layers 0-3 x 2")
    survivors = sorted({0, 1, 2, 3} - {rank})
    assert sorted(int(r) for r in interruption["left_s"]) == survivors
    assert {"detected", "alarm", "left", "switched", "first_step_completed"} <= set(
        interruption["phases_s"])
    order = [e["event"] for e in events if e["event"] in ("worker_failed", "shrink", "resumed",
                                                          "fallback", "restart")]
    assert order == ["worker_failed", "shrink", "resumed"]
    (shrink,) = [e for e in events if e["event"] == "shrink"]
    assert shrink["lost"] == [rank] and shrink["survivors"] == survivors
    switched = {e["rank"]: e["role"] for e in events
                if e["event"] == "switched" and e["generation"] == interruption["generation"]}
    assert switched == {r: "survivor" for r in survivors}
    assert not [e for e in events if e["event"] == "attempt_start" and e["attempt"] > 0]
    assert result.lines_starting("PARAMS_DIGEST") == [
        "PARAMS_DIGEST none: the job ended on pipeline templates"]


def test_every_step_loss_matches_the_failure_free_run(shrunk, template_reference):
    _, _, result, _, _, _ = shrunk
    printed = losses(result)
    assert sorted(printed) == list(range(1, STEPS + 1)), result.stdout[-3000:]
    expected = step_losses(template_reference)
    worst = worst_relative([printed[step] for step in range(1, STEPS + 1)], expected)
    print(f"worst relative loss difference over {STEPS} steps: {worst:.3e}")
    assert worst < 1e-4, (printed, expected)


def test_final_parameters_match_the_failure_free_run(shrunk, template_reference):
    _, _, _, _, _, save = shrunk
    files = sorted((save / FINAL_FOLDER / f"iter_{STEPS:07d}").glob("rank_*.pt"))
    assert len(files) == 3
    final: dict = {}
    for path in files:
        saved = torch.load(path)
        assert saved["iteration"] == STEPS
        assert not set(saved["parameters"]) & set(final)  # each unit from one holder
        final.update(saved["parameters"])
    expected = {name: value for rank in template_reference for name, value
                in rank["params"].items()}
    assert set(final) == set(expected)
    worst = max(float(abs(final[name].numpy() - value).max()) for name, value in expected.items())
    print(f"worst parameter difference: {worst:.3e}")
    assert worst < PARAM_TOLERANCE
