"""Running examples/pretrain_gpt.py under mover-launch on 4 CPU processes, for the tests."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from mover_plugin.testing import CommandResult, run_command

EXAMPLE = str(Path(__file__).parents[1] / "examples" / "pretrain_gpt.py")
LAUNCH = [sys.executable, "-m", "mover_plugin.launch.cli"]
MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8"]
STEP_LINE = re.compile(r"^step\s+(\d+)/\d+ \| loss (\S+)", re.MULTILINE)


def pretrain(*flags: str, launcher_flags=(), timeout_s: float = 300) -> CommandResult:
    return run_command(
        [*LAUNCH, "--standalone", "--nproc-per-node", "4", *launcher_flags, EXAMPLE, *MODEL,
         *flags],
        timeout_s=timeout_s,
    )


def digest(result: CommandResult) -> str:
    lines = result.lines_starting("PARAMS_DIGEST")
    assert len(lines) == 1, result.output[-4000:]
    return lines[0].split()[1]


def losses(result: CommandResult) -> dict[int, float]:
    return {int(step): float(loss) for step, loss in STEP_LINE.findall(result.stdout)}


def read_events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]
