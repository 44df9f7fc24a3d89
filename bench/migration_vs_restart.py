#!/usr/bin/env python
"""Benchmark: downtime of a planned migration vs moving the rank by restarting the job.

The same Megatron-Core job (examples/pretrain_gpt.py, TP1 x PP2 x DP2 on 4 CPU processes,
10 steps) moves rank 3 off its process when that rank begins step 6, two ways, interleaved,
``--repeats`` times each:

* baseline — what operators do today: the job checkpoints (here at every step, so no work is
  lost), the rank's process is stopped (SIGTERM), every process is stopped and started again,
  and the job resumes from the checkpoint (``--policy restart``);
* migration — ``--policy resilient --standbys 1 --inject-migration 3:6`` (the same request as
  ``mover migrate --rank 3``): a standby takes rank 3 while training goes on, and at an
  iteration boundary the leaving process sends its state to it and exits.

Printed, from this one run: downtime per way (by the run summary: from the end of the last
step before the move to the end of the first step after it, less one step time), the ratio
(goal: >= 30x), the migration's phases, its state transfer time, and whether the migration's
downtime stays within one step time plus the state transfer time (the goal).

Usage::

    python bench/migration_vs_restart.py --repeats 3
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

from common import check_same_digest, interleaved, repeats_argument
from mover_plugin.testing import run_command

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "pretrain_gpt.py")
MODEL = ["--pipeline-model-parallel-size", "2", "--num-layers", "4", "--hidden-size", "64",
         "--num-attention-heads", "4", "--seq-length", "64", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--train-iters", "10"]


def run_job(folder: Path, way: str) -> dict:
    summary_path, events_path = folder / "summary.json", folder / "events.jsonl"
    launcher = [sys.executable, "-m", "mover_plugin.launch.cli", "--standalone",
                "--nproc-per-node", "4", "--summary", str(summary_path),
                "--event-log", str(events_path)]
    script = [EXAMPLE, *MODEL]
    if way == "migration":
        launcher += ["--policy", "resilient", "--standbys", "1", "--inject-migration", "3:6"]
        script += ["--resilient"]
    else:
        launcher += ["--policy", "restart", "--inject-failure", "3:6:SIGTERM"]
        script += ["--save", str(folder / "ckpt"), "--load", str(folder / "ckpt"),
                   "--save-interval", "1"]
    result = run_command([*launcher, *script], timeout_s=600)
    if result.returncode != 0:
        raise SystemExit(f"{way} run failed:\n{result.output[-3000:]}")
    summary = json.loads(summary_path.read_text())
    summary["digest"] = result.lines_starting("PARAMS_DIGEST")[0].split()[1]
    summary["events"] = [json.loads(line) for line in events_path.read_text().splitlines()]
    if len(summary["interruptions"]) != 1:
        raise SystemExit(f"{way} run: expected one interruption, got {summary['interruptions']}")
    return summary


def main() -> None:
    args = repeats_argument(__doc__, default=3)
    with tempfile.TemporaryDirectory(prefix="mover-bench-") as tmp:

        def run(way: str, repeat: int) -> dict:
            folder = Path(tmp) / f"{way}-{repeat}"
            folder.mkdir()
            return run_job(folder, way)

        runs = interleaved(["baseline", "migration"], args.repeats, run,
                           lambda s: f"downtime {s['interruptions'][0]['downtime_s']:.3f} s")
    check_same_digest(runs)
    report(runs)


def report(runs: dict[str, list[dict]]) -> None:
    downtime = {way: [s["interruptions"][0]["downtime_s"] for s in group]
                for way, group in runs.items()}
    for way, values in downtime.items():
        print(f"{way:9s} downtime median {statistics.median(values):7.3f} s "
              f"({', '.join(f'{v:.3f}' for v in values)})")
    ratio = statistics.median(downtime["baseline"]) / statistics.median(downtime["migration"])
    print(f"DOWNTIME_RATIO {ratio:.1f}x (goal >= 30x)")
    migrations = [s["interruptions"][0] for s in runs["migration"]]
    print("migration phases, seconds after the request (median):")
    for phase in ("prepared", "boundary", "handed_over", "switched", "first_step_completed"):
        values = [m["phases_s"][phase] for m in migrations if phase in m["phases_s"]]
        if values:
            print(f"  {phase:22s} {statistics.median(values):8.3f}")
    transfer = statistics.median(e["transfer_s"] for s in runs["migration"] for e in s["events"]
                                 if e["event"] == "handed_over")
    step = statistics.median(s["median_step_time_s"] for s in runs["migration"])
    migration = statistics.median(downtime["migration"])
    print(f"STATE_TRANSFER_S {transfer:.3f}; median step time {step:.3f} s; migration downtime "
          f"{migration:.3f} s {'<=' if migration <= step + transfer else '>'} step + transfer "
          f"{step + transfer:.3f} s (goal <=)")


if __name__ == "__main__":
    main()
