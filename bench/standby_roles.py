#!/usr/bin/env python
"""Benchmark: the downtime when a warmed standby replaces a first-, middle- or last-stage rank.

The same Megatron-Core job (examples/pretrain_gpt.py, TP1 x PP3 x DP2 on 6 CPU processes) loses
one rank (SIGKILL when it begins step 8) and one warmed standby takes its place. The standby
played every pipeline role in the sandbox and kept each role's model, DDP and optimizer, so
whichever stage it replaces it should start training as fast as any other (goal: the slowest
role's median downtime at most 1.2x the fastest's). The killed rank is the first, middle or last
stage's replica ``--dp-index`` (default 0); the three roles alternate, ``--repeats`` times each.
With ``--distributed-optimizer`` the job runs with ``--use-distributed-optimizer`` (its peer copy
on), where a standby adopts only at data-parallel index 0. Printed, from this one run:

* each role's median downtime and switch phase (run summary), its runs' downtimes, and whether
  the joiner adopted a kept role's objects;
* ``ROLE_SPREAD``: the slowest role's median downtime over the fastest's, against the goal;
* ``PEAK_RSS``: the warmed standby's peak RSS (every role kept) vs the workers' median peak.

Usage::

    python bench/standby_roles.py --repeats 3
    python bench/standby_roles.py --repeats 3 --distributed-optimizer --dp-index 1
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from common import benchmark_parser, check_same_digest, interleaved_in, joined
from jobs import (GPT_EXAMPLE, gpt_model_flags, mover_launch_command, params_digest, read_events,
                  read_summary, run_job)

WORLD = 6
DATA_PARALLEL = 2
MODEL = gpt_model_flags(pipeline=3, layers=6, train_iters=12)
FAILURE_STEP = 8
STAGES = {"first": 0, "middle": 1, "last": 2}
GOAL = 1.2


def killed_rank(role: str, dp_index: int) -> int:
    """The global rank of ``role``'s stage at data-parallel index ``dp_index`` (TP1)."""
    return dp_index + DATA_PARALLEL * STAGES[role]


def run_role(folder: Path, rank: int, script_flags: list[str]) -> dict:
    options = ["--policy", "resilient", "--standbys", "1",
               "--inject-failure", f"{rank}:{FAILURE_STEP}"]
    result = run_job([*mover_launch_command(folder, WORLD, *options), GPT_EXAMPLE, *MODEL,
                      "--resilient", *script_flags], f"run failed (rank {rank} killed)")
    summary = read_summary(folder)
    events = read_events(folder)
    (interruption,) = summary["interruptions"]
    if interruption["recovery"] != "standby":
        raise SystemExit(f"rank {rank}: recovered by {interruption['recovery']}, not a standby")
    return {
        "digest": params_digest(result.output),
        "downtime": interruption["downtime_s"],
        "switched": interruption["phases_s"]["switched"],
        "worker_rss": summary["worker_peak_rss_mb"],
        "warmed": next(e for e in events if e["event"] == "standby_warmed"),
        "adopted": next(e.get("adopted") for e in events
                        if e["event"] == "switched" and e.get("role") == "joiner"),
    }


def describe(run: dict) -> str:
    return (f"downtime {run['downtime']:.3f} s, switched +{run['switched']:.3f} s, "
            f"adopted {run['adopted']}")


def main() -> None:
    parser = benchmark_parser(__doc__, repeats=3)
    parser.add_argument("--dp-index", type=int, default=0, choices=range(DATA_PARALLEL),
                        help="the data-parallel index of the killed rank")
    parser.add_argument("--distributed-optimizer", action="store_true",
                        help="train with --use-distributed-optimizer")
    args = parser.parse_args()
    script_flags = ["--use-distributed-optimizer"] if args.distributed_optimizer else []
    print(f"TP1 x PP3 x DP2, {'distributed' if script_flags else 'plain'} optimizer, "
          f"data-parallel index {args.dp_index} killed at step {FAILURE_STEP}")
    with tempfile.TemporaryDirectory(prefix="mover-bench-") as tmp:
        runs = interleaved_in(
            Path(tmp), list(STAGES), args.repeats,
            lambda role, folder: run_role(folder, killed_rank(role, args.dp_index),
                                          script_flags),
            describe)
    check_same_digest(runs)
    report(runs)


def report(runs: dict[str, list[dict]]) -> None:
    downtimes = {}
    for role, results in runs.items():
        values = [run["downtime"] for run in results]
        downtimes[role] = statistics.median(values)
        switched = statistics.median(run["switched"] for run in results)
        print(f"{role:7s} downtime median {downtimes[role]:.3f} s ({joined(values)}), "
              f"switched +{switched:.3f} s, adopted {[run['adopted'] for run in results]}")
    slowest, fastest = max(downtimes.values()), min(downtimes.values())
    print(f"ROLE_SPREAD slowest/fastest median downtime {slowest / fastest:.2f}x "
          f"(goal <= {GOAL}x)")
    every = [run for results in runs.values() for run in results]
    kept = every[0]["warmed"]["kept"]
    standby_rss = statistics.median(run["warmed"]["peak_rss_mb"] for run in every)
    worker_rss = statistics.median(run["worker_rss"] for run in every)
    print(f"PEAK_RSS warmed standby (kept {'/'.join(kept)}) {standby_rss:.1f} MB vs worker "
          f"{worker_rss:.1f} MB: {standby_rss / worker_rss:.3f}x")


if __name__ == "__main__":
    main()
