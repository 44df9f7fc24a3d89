"""The example's model for the tests of pipeline templates (in-process and under mover-launch):
TP1 x PP2 x DP2 on 4 ranks, 4 layers, a global batch of 4 micro-batches, no dropout (which
rank runs a micro-batch would change its dropout masks)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Sequence

import numpy
import torch

from mover_plugin.megatron.templates.shrunk import FINAL_FOLDER
from mover_plugin.testing.template_run import TemplateRun
from mover_plugin.megatron.templates.stage import canonical_parameters
from support.gpt_jobs import read_events
from support.megatron_lm_jobs import mover_launch
from support.paths import EXAMPLES

EXAMPLE = EXAMPLES / "pretrain_gpt.py"
RUN = TemplateRun(
    example=EXAMPLE,
    argv=("--pipeline-model-parallel-size", "2", "--num-layers", "4", "--hidden-size", "32",
          "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "32",
          "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3",
          "--seed", "1234", "--hidden-dropout", "0", "--attention-dropout", "0"),
    num_layers=4,
    slots=4,
)
UNTIED = dataclasses.replace(RUN, argv=(*RUN.argv, "--untie-embeddings-and-output-weights"))
STEPS = 7
"""Steps of a run compared with the failure-free one."""


def worst_relative(values: list[float], expected: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(values, expected))


def step_losses(results: list[dict]) -> list[float]:
    """Each step's loss: the one rank that reported it (the job's last stage) or all alike."""
    losses = []
    for step in range(len(results[0]["losses"])):
        values = [r["losses"][step] for r in results if not math.isnan(r["losses"][step])]
        assert values and max(values) == min(values), (step, values)
        losses.append(values[0])
    return losses


PARAM_TOLERANCE = 1e-5
"""Far below one update (the learning rate, 1e-3), above the float rounding that Adam's
division by the root of the second moment magnifies where gradients are tiny."""
KEY_BIAS_TOLERANCE = 1e-2
"""The attention's key bias is not trained: adding the same vector to every key shifts all of
a query's scores alike, which the softmax ignores, so its gradient is zero in exact
arithmetic and what the computation gives is rounding noise. Adam scales that noise to steps
of up to the learning rate, so these elements wander by rounding alone, one way in one run,
another way in another (measured: 1.5e-3 after 400 steps, every other element within 1.5e-6)."""


def check_parameters(final: dict, expected: dict, head_size: int) -> None:
    """``final`` (name -> array) equals ``expected`` within :data:`PARAM_TOLERANCE`, and the
    attention's key biases within :data:`KEY_BIAS_TOLERANCE`."""
    assert set(final) == set(expected)
    worst = worst_key_bias = 0.0
    for name, value in expected.items():
        difference = abs(final[name] - value)
        keys = key_bias(name, difference, head_size)
        worst = max(worst, float(difference[~keys].max()))
        if keys.any():
            worst_key_bias = max(worst_key_bias, float(difference[keys].max()))
    print(f"worst parameter difference: {worst:.3e} (key biases: {worst_key_bias:.3e})")
    assert worst < PARAM_TOLERANCE
    assert worst_key_bias < KEY_BIAS_TOLERANCE


def key_bias(name: str, value: numpy.ndarray, head_size: int) -> numpy.ndarray:
    """Which elements of a parameter are the attention's key bias: in Megatron-Core's fused
    ``linear_qkv.bias`` each head's query, key and value parts follow one another."""
    mask = numpy.zeros(value.shape, dtype=bool)
    if name.endswith("self_attention.linear_qkv.bias"):
        mask[(numpy.arange(value.size) // head_size) % 3 == 1] = True
    return mask


def parameters_by_unit(save: Path, iteration: int, survivors: int) -> dict:
    """The parameters the survivors of a job that ended on pipeline templates wrote under
    ``--save`` by unit, each unit from one holder."""
    files = sorted((save / FINAL_FOLDER / f"iter_{iteration:07d}").glob("rank_*.pt"))
    assert len(files) == survivors
    final: dict = {}
    for path in files:
        saved = torch.load(path)
        assert saved["iteration"] == iteration
        assert not set(saved["parameters"]) & set(final)
        final.update({name: value.float().numpy() for name, value in saved["parameters"].items()})
    return final


def checkpoint_parameters(save: Path, iteration: int, num_layers: int, tied: bool,
                          stages: int = 2) -> dict:
    """The parameters of a TP1 job's checkpoint in Megatron's ``torch`` format (each of its
    pipeline ``stages``', by canonical name)."""
    final: dict = {}
    for stage in range(stages):
        path = save / f"iter_{iteration:07d}" / f"mp_rank_00_{stage:03d}" / "model_optim_rng.pt"
        state = torch.load(path, weights_only=False)["model"]
        values = [(name, value.float().numpy()) for name, value in state.items()
                  if not name.endswith("_extra_state")]
        final.update(canonical_parameters(values, stage * num_layers // stages, tied=tied))
    return final


def lm_template_run(folder: Path, flags: Sequence[str], *, launcher: Sequence[str] = (),
                    nproc: int = 4):
    """Megatron-LM's loop under mover-launch with ``flags`` (and ``--save folder/ck``); with
    ``launcher`` flags, resilient with no standby at start: (the command's result, the run
    summary, the event log); without, the result alone."""
    summary, events = folder / "summary.json", folder / "events.jsonl"
    resilient = ["--policy", "resilient", "--standbys", "0", "--summary", str(summary),
                 "--event-log", str(events), "--stop-grace-s", "2", *launcher] if launcher else []
    result = mover_launch(*flags, "--save", str(folder / "ck"), launcher_flags=resilient,
                          cwd=folder, nproc=nproc)
    assert result.returncode == 0, result.output[-5000:]
    if not launcher:
        return result
    return result, json.loads(summary.read_text()), read_events(events)


def check_shrink(interruption: dict, events: list[dict], rank: int, step: int,
                 lost_before: tuple[int, ...] = (), world: int = 4) -> dict:
    """Checks the record and events of the shrink that lost ``rank`` at ``step`` or later,
    after shrinks that lost ``lost_before``, in a job of ``world`` ranks; returns its event."""
    assert interruption["recovery"] == "shrink" and interruption["rank"] == rank
    assert interruption["step"] >= step and interruption["how"] == "signal SIGKILL"
    survivors = sorted(set(range(world)) - {rank, *lost_before})
    assert sorted(int(r) for r in interruption["left_s"]) == survivors
    assert {"detected", "alarm", "left", "switched", "first_step_completed"} <= set(
        interruption["phases_s"])
    (shrink,) = [e for e in events if e["event"] == "shrink" and e["lost"] == [rank]]
    assert shrink["survivors"] == survivors
    assert shrink["generation"] == interruption["generation"]
    switched = {e["rank"]: e["role"] for e in events
                if e["event"] == "switched" and e["generation"] == interruption["generation"]}
    assert switched == {r: "survivor" for r in survivors}
    assert not [e for e in events if e["event"] in ("fallback", "restart")]
    return shrink


def check_shrink_and_grow(summary: dict, events: list[dict], steps: int) -> tuple[dict, dict]:
    """Checks a 4-rank TP1 x PP2 x DP2 job of ``steps`` steps that lost rank 1 at step 3 with
    no standby ready and planned from the given GPT-like profile of 4 layers: it shrank, grew
    back, and never restarted. Returns the two interruptions' records."""
    assert summary["restarts"] == 0 and summary["steps_completed"] == steps
    shrink, grow = summary["interruptions"]
    assert check_shrink(shrink, events, 1, 3)["profile_source"] == "given"
    assert shrink["plan"] == "[0 1] layers 0-2|3 x 2 + [2] layers 0-3 x 2"
    assert (grow["kind"], grow["recovery"], grow["ranks"]) == ("grow", "grow", [1])
    assert grow["plan"] == "[0 2] layers 0-1|2-3 x 2 + [1 3] layers 0-1|2-3 x 2"
    assert 3 < grow["step"] < steps and grow["downtime_s"] is not None
    return shrink, grow
