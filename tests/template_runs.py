"""The example's model for the tests of pipeline templates (in-process and under mover-launch):
TP1 x PP2 x DP2 on 4 ranks, 4 layers, a global batch of 4 micro-batches, no dropout (which
rank runs a micro-batch would change its dropout masks)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from mover_plugin.megatron.template_run import TemplateRun

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "pretrain_gpt.py"
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
