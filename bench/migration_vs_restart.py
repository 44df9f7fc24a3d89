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

import statistics
import tempfile
from pathlib import Path

from common import (check_same_digest, interleaved_in, median_of, print_downtime_medians,
                    print_phase_medians, repeats_argument)
from jobs import (GPT_EXAMPLE, checkpoint_flags, gpt_model_flags, mover_launch_command,
                  read_events, run_job, summary_with_digest)

MODEL = gpt_model_flags(pipeline=2, layers=4, train_iters=10)


def run_way(way: str, folder: Path) -> dict:
    script = [GPT_EXAMPLE, *MODEL]
    if way == "migration":
        options = ["--policy", "resilient", "--standbys", "1", "--inject-migration", "3:6"]
        script += ["--resilient"]
    else:
        options = ["--policy", "restart", "--inject-failure", "3:6:SIGTERM"]
        script += checkpoint_flags(folder)
    result = run_job([*mover_launch_command(folder, 4, *options), *script], f"{way} run failed")
    summary = summary_with_digest(folder, result)
    summary["events"] = read_events(folder)
    if len(summary["interruptions"]) != 1:
        raise SystemExit(f"{way} run: expected one interruption, got {summary['interruptions']}")
    return summary


def main() -> None:
    args = repeats_argument(__doc__, default=3)
    with tempfile.TemporaryDirectory(prefix="mover-bench-") as tmp:
        runs = interleaved_in(Path(tmp), ["baseline", "migration"], args.repeats, run_way,
                              lambda s: f"downtime {s['interruptions'][0]['downtime_s']:.3f} s")
    check_same_digest(runs)
    report(runs)


def report(runs: dict[str, list[dict]]) -> None:
    medians = print_downtime_medians({way: [s["interruptions"][0]["downtime_s"] for s in group]
                                      for way, group in runs.items()})
    print(f"DOWNTIME_RATIO {medians['baseline'] / medians['migration']:.1f}x (goal >= 30x)")
    print_phase_medians("migration phases, seconds after the request (median):",
                        [s["interruptions"][0] for s in runs["migration"]],
                        ("prepared", "boundary", "handed_over", "switched",
                         "first_step_completed"))
    transfer = statistics.median(e["transfer_s"] for s in runs["migration"] for e in s["events"]
                                 if e["event"] == "handed_over")
    step = median_of(runs["migration"], "median_step_time_s")
    migration = medians["migration"]
    print(f"STATE_TRANSFER_S {transfer:.3f}; median step time {step:.3f} s; migration downtime "
          f"{migration:.3f} s {'<=' if migration <= step + transfer else '>'} step + transfer "
          f"{step + transfer:.3f} s (goal <=)")


if __name__ == "__main__":
    main()
