"""The jobs the benchmarks run: ``mover-launch`` commands for the examples, a run that stops the
benchmark when it fails, and what a run leaves behind (its summary, event log and
PARAMS_DIGEST)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mover_plugin.testing import CommandResult, run_command

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
GPT_EXAMPLE = str(EXAMPLES / "pretrain_gpt.py")
JOB_TIMEOUT_S = 600


def gpt_model_flags(pipeline: int, layers: int, train_iters: int) -> list[str]:
    """The small GPT of examples/pretrain_gpt.py: ``pipeline`` stages, ``layers`` layers of
    width 64, ``train_iters`` steps of a global batch of 8."""
    return ["--pipeline-model-parallel-size", str(pipeline), "--num-layers", str(layers),
            "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--micro-batch-size", "2", "--global-batch-size", "8",
            "--train-iters", str(train_iters)]


def checkpoint_flags(folder: Path) -> list[str]:
    """Save a checkpoint in ``folder``/ckpt at every step and resume from it."""
    checkpoints = str(folder / "ckpt")
    return ["--save", checkpoints, "--load", checkpoints, "--save-interval", "1"]


def mover_launch_command(folder: Path, nproc: int, *options: str,
                         event_log: bool = True) -> list[str]:
    """``mover-launch --standalone`` with ``nproc`` workers and ``options``, writing its run
    summary (and, with ``event_log``, its event log) into ``folder``; the script and its flags
    go after it."""
    command = [sys.executable, "-m", "mover_plugin.launch.cli", "--standalone",
               "--nproc-per-node", str(nproc), "--summary", str(folder / "summary.json")]
    if event_log:
        command += ["--event-log", str(folder / "events.jsonl")]
    return [*command, *options]


def run_job(command: list[str], failed: str, timeout_s: float = JOB_TIMEOUT_S) -> CommandResult:
    """Runs ``command``; unless it exits 0 within ``timeout_s``, stops the benchmark with
    ``failed`` and the end of its output."""
    result = run_command(command, timeout_s=timeout_s)
    if result.returncode != 0:
        raise SystemExit(f"{failed}:\n{result.output[-3000:]}")
    return result


def params_digest(output: str) -> str:
    """The digest on the first ``PARAMS_DIGEST`` line of a job's output."""
    lines = [line for line in output.splitlines() if line.startswith("PARAMS_DIGEST")]
    return lines[0].split()[1]


def read_summary(folder: Path) -> dict:
    """The run summary ``mover-launch`` wrote into ``folder``."""
    return json.loads((folder / "summary.json").read_text())


def read_events(folder: Path) -> list[dict]:
    """The records of the event log ``mover-launch`` wrote into ``folder``."""
    return [json.loads(line) for line in (folder / "events.jsonl").read_text().splitlines()]


def summary_with_digest(folder: Path, result: CommandResult) -> dict:
    """The run summary in ``folder`` with the job's PARAMS_DIGEST added as ``digest``."""
    summary = read_summary(folder)
    summary["digest"] = params_digest(result.output)
    return summary
