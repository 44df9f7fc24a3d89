#!/usr/bin/env python
"""Benchmark: a general standby warmed up in the sandbox vs a cold one.

The same Megatron-Core job (examples/pretrain_gpt.py, TP1 x PP3 x DP2 on 6 CPU processes, so
that first, middle and last stages all exist) loses the same rank (SIGKILL of rank 3, a middle
stage, when it begins step 8) and a standby takes its place. The standby is either warmed up
(``--resilient-standby-shadow-iterations 2``: it plays each pipeline role in the sandbox and
keeps them all) or cold (``0``: it only imports and waits). The two modes alternate,
``--repeats`` times each. Printed, from this one run:

* the warm-up: roles played, shadow iterations per role, seconds per role, operations the
  sandbox answered locally;
* the standby's time to ready (its process start to ``standby_ready``) vs a cold worker's start
  (process start to ready to train: imports, groups, model);
* the standby's peak RSS when ready vs the workers' peak RSS (goal: not above a worker's);
* the recovery with a warm vs a cold standby: the switch phase and the downtime, both from the
  run summary, and whether the joiner adopted its warmed model.

Usage::

    python bench/standby_warmup.py --repeats 3
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from common import check_same_digest, interleaved_in, repeats_argument
from jobs import (GPT_EXAMPLE, gpt_model_flags, mover_launch_command, params_digest, read_events,
                  read_summary, run_job)

WORLD = 6
MODEL = gpt_model_flags(pipeline=3, layers=6, train_iters=12)
FAILURE = "3:8"
MODES = {"warm": 2, "cold": 0}


def run_standby(folder: Path, shadow_iterations: int) -> dict:
    options = ["--policy", "resilient", "--standbys", "1", "--inject-failure", FAILURE]
    script = [GPT_EXAMPLE, *MODEL, "--resilient",
              "--resilient-standby-shadow-iterations", str(shadow_iterations)]
    result = run_job([*mover_launch_command(folder, WORLD, *options), *script],
                     f"run failed (shadow iterations {shadow_iterations})")
    summary = read_summary(folder)
    events = read_events(folder)
    return {
        "summary": summary,
        "digest": params_digest(result.output),
        "started": min(e["time"] for e in events if e["event"] == "attempt_start"),
        "workers_ready": [e["time"] for e in events if e["event"] == "worker_ready"],
        "standby_ready": next(e["time"] for e in events if e["event"] == "standby_ready"),
        "warmed": next((e for e in events if e["event"] == "standby_warmed"), None),
        "adopted": next(e.get("adopted") for e in events
                        if e["event"] == "switched" and e.get("role") == "joiner"),
    }


def main() -> None:
    args = repeats_argument(__doc__, default=3)
    with tempfile.TemporaryDirectory(prefix="mover-bench-") as tmp:
        runs = interleaved_in(Path(tmp), list(MODES), args.repeats,
                              lambda mode, folder: run_standby(folder, MODES[mode]), describe)
    check_same_digest(runs)
    report(runs)


def describe(run: dict) -> str:
    interruption = run["summary"]["interruptions"][0]
    return (f"downtime {interruption['downtime_s']:.3f} s, switched "
            f"+{interruption['phases_s']['switched']:.3f} s, adopted {run['adopted']}")


def _median(values: list[float]) -> float:
    return statistics.median(values)


def report(runs: dict[str, list[dict]]) -> None:
    warm = runs["warm"]
    warmed = [run["warmed"] for run in warm]
    first = warmed[0]
    print(f"warm-up: roles {first['roles']} (kept: {first['kept']}), "
          f"{first['shadow_iterations']} shadow iterations per role, "
          f"sandbox operations {_median([w['sandbox_operations'] for w in warmed]):.0f}")
    for role in first["roles"]:
        print(f"  {role:7s} {_median([w['role_s'][role] for w in warmed]):.3f} s")
    for mode in MODES:
        standby = _median([r["standby_ready"] - r["started"] for r in runs[mode]])
        worker = _median([_median(r["workers_ready"]) - r["started"] for r in runs[mode]])
        print(f"TIME_TO_READY {mode} standby {standby:.3f} s vs cold worker start "
              f"{worker:.3f} s (process start to ready)")
    standby_rss = _median([w["peak_rss_mb"] for w in warmed])
    worker_rss = _median([r["summary"]["worker_peak_rss_mb"] for r in warm])
    print(f"PEAK_RSS warmed standby {standby_rss:.1f} MB vs worker {worker_rss:.1f} MB: "
          f"{standby_rss / worker_rss:.3f}x (goal <= 1.0x)")
    for field, label in (("switched", "SWITCHED_S"), ("downtime", "DOWNTIME_S")):
        values = {}
        for mode in MODES:
            interruptions = [r["summary"]["interruptions"][0] for r in runs[mode]]
            values[mode] = _median([i["phases_s"]["switched"] if field == "switched"
                                    else i["downtime_s"] for i in interruptions])
        print(f"{label} warm {values['warm']:.3f} vs cold {values['cold']:.3f}: "
              f"cold/warm {values['cold'] / values['warm']:.2f}x")
    print(f"joiner adopted its warmed model: warm {[r['adopted'] for r in warm]}, "
          f"cold {[r['adopted'] for r in runs['cold']]}")


if __name__ == "__main__":
    main()
