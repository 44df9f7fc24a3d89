#!/usr/bin/env python
"""Benchmark of the restart baseline: what one failure costs a job that restarts everything.

Runs the same Megatron-Core GPT job (examples/pretrain_gpt.py, TP1 x PP2 x DP2 on 4 CPU
processes, a checkpoint every step) with and without an injected SIGKILL, interleaved, and
prints for the failure run:

* downtime by wall time (DESIGN.md §5): the failure run's wall time minus the median wall time of
  the failure-free runs, same steps, same machine;
* downtime as the run summary reports it (gap between completed steps less one step time);
* the per-phase breakdown (detected, stopped, started, recovered, first step completed).

These are the figures the resilient policies must beat. Usage::

    python bench/restart_baseline.py --repeats 3 --out runs/bench-restart
"""

from __future__ import annotations

import statistics
from pathlib import Path

from common import (add_out_argument, benchmark_parser, job_folder, joined, new_out_folder,
                    print_phase_medians)
from jobs import (GPT_EXAMPLE, checkpoint_flags, gpt_model_flags, mover_launch_command,
                  run_job, summary_with_digest)


def run_steps(out: Path, name: str, steps: int, failure: str | None) -> dict:
    folder = job_folder(out, name)
    options = ["--inject-failure", failure] if failure else []
    script = [GPT_EXAMPLE, *gpt_model_flags(pipeline=2, layers=4, train_iters=steps),
              *checkpoint_flags(folder)]
    result = run_job([*mover_launch_command(folder, 4, *options, event_log=False), *script],
                     f"{name} failed")
    return summary_with_digest(folder, result)


def main() -> None:
    parser = benchmark_parser(__doc__, repeats=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--failure", default="3:6", help="RANK:STEP[:SIGNAL] to inject")
    add_out_argument(parser, "bench-restart")
    args = parser.parse_args()
    out = new_out_folder(args.out)
    clean_walls, failures = [], []
    for repeat in range(args.repeats):
        clean = run_steps(out, f"clean-{repeat}", args.steps, None)
        failed = run_steps(out, f"failure-{repeat}", args.steps, args.failure)
        if failed["digest"] != clean["digest"]:
            raise SystemExit(f"repeat {repeat}: PARAMS_DIGEST differs after the failure")
        clean_walls.append(clean["wall_time_s"])
        failures.append(failed)
        print(f"repeat {repeat}: clean {clean_walls[-1]:.2f} s, with failure "
              f"{failures[-1]['wall_time_s']:.2f} s, digests equal", flush=True)
    report(clean_walls, failures)


def report(clean_walls: list[float], failures: list[dict]) -> None:
    baseline = statistics.median(clean_walls)
    by_wall = [f["wall_time_s"] - baseline for f in failures]
    interruptions = [f["interruptions"][0] for f in failures]
    by_summary = [i["downtime_s"] for i in interruptions]
    print(f"\nfailure-free wall time (median of {len(clean_walls)}): {baseline:.2f} s")
    print(f"restart downtime by wall time: median {statistics.median(by_wall):.2f} s "
          f"(runs: {joined(by_wall, '.2f')})")
    print(f"restart downtime by summary:   median {statistics.median(by_summary):.2f} s "
          f"(runs: {joined(by_summary, '.2f')})")
    print_phase_medians("phases, seconds after the failure (median):", interruptions,
                        interruptions[0]["phases_s"])
    print(f"RESTART_DOWNTIME_S {statistics.median(by_wall):.3f}")


if __name__ == "__main__":
    main()
