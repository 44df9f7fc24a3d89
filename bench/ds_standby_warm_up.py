#!/usr/bin/env python
"""Benchmark: a DeepSpeed standby warmed up by a shadow run of its script vs a cold one.

The same job (tests/support/scripts/ds_dp_train.py: a user's data-parallel script, 4 CPU processes,
ZeRO stage ``--stage``, default 3, with the peer copy; one standby) loses rank 1 (SIGKILL as
it begins step 6 of 10). The standby either runs its script ``--shadow`` iterations (default
2) in the sandbox before it reports ready (``"standby_shadow_iterations"``: warm) or only
imports and waits (0: cold); the modes alternate, ``--repeats`` times each. The workers wait
for the standby before their first step, so it is ready when the rank is lost. Printed, per
run and as medians:

* the joiner's build: from its promotion (the controller's ``promote``) to its switch (its
  script ran again from the start, built its engine and received its state);
* from its promotion to the job's first step after the loss (``resumed``);
* the downtime (run summary);
* the shadow run: seconds, sandbox operations, and the standby's peak RSS vs the workers'.

``WARM_VS_COLD`` is the median promotion-to-switch time of the warm runs over the cold runs'
(the baseline, measured in this run). Every run must end with the same PARAMS_DIGEST.

Usage::

    python bench/ds_standby_warm_up.py --repeats 2
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from common import (add_out_argument, benchmark_parser, check_same_digest, interleaved_in,
                    joined, new_out_folder)
from jobs import ROOT, mover_launch_command, read_events, run_job, summary_with_digest

SCRIPT = str(ROOT / "tests" / "support" / "scripts" / "ds_dp_train.py")
CONFIG = ROOT / "examples" / "ds_config.json"
KILLED, STEP, STEPS = 1, 6, 10


def main() -> None:
    parser = benchmark_parser(__doc__, repeats=2)
    parser.add_argument("--stage", type=int, choices=(1, 2, 3), default=3,
                        help="ZeRO stage (default 3)")
    parser.add_argument("--shadow", type=int, default=2,
                        help="shadow iterations of a warm standby (default 2)")
    add_out_argument(parser, "ds-standby-warm-up")
    args = parser.parse_args()
    out = new_out_folder(args.out)
    out.mkdir(parents=True)
    configs = {mode: write_config(out, args.stage, iterations)
               for mode, iterations in (("warm", args.shadow), ("cold", 0))}
    runs = interleaved_in(out, ["warm", "cold"], args.repeats,
                          lambda mode, folder: run(folder, configs[mode]), describe)
    report(runs)


def write_config(out: Path, stage: int, iterations: int) -> Path:
    config = json.loads(CONFIG.read_text())
    config["zero_optimization"] = {"stage": stage}
    if stage == 3:
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 100
    config["resilience"] = {"standbys": 1, "peer_copy": True,
                            "standby_shadow_iterations": iterations}
    path = out / f"ds_config_shadow{iterations}.json"
    path.write_text(json.dumps(config))
    return path


def run(folder: Path, config: Path) -> dict:
    command = mover_launch_command(folder, 4, "--stop-grace-s", "2", "--inject-failure",
                                   f"{KILLED}:{STEP}")
    result = run_job([*command, SCRIPT, "--steps", str(STEPS), "--deepspeed_config",
                      str(config)], f"the job with {config.name} failed")
    summary = summary_with_digest(folder, result)
    if summary["restarts"]:
        raise SystemExit(f"{folder}: the job restarted; a standby should have taken the rank")
    (interruption,) = summary["interruptions"]
    events = read_events(folder)
    (promoted,) = [e["time"] for e in events if e["event"] == "promote"]
    (switched,) = [e["time"] for e in events if e["event"] == "switched"
                   and e.get("role") == "joiner"]
    resumed = next(e["time"] for e in events if e["event"] == "resumed" and e["time"] > switched)
    warmed = [e for e in events if e["event"] == "standby_warmed" and "shadow_rank" in e]
    return {"digest": summary["digest"], "build_s": switched - promoted,
            "to_first_step_s": resumed - promoted, "downtime_s": interruption["downtime_s"],
            "warm_up": warmed[0] if warmed else None,
            "worker_peak_rss_mb": summary["worker_peak_rss_mb"]}


def describe(run: dict) -> str:
    warm_up = run["warm_up"]
    shadow = ("cold" if warm_up is None else
              f"shadow run {warm_up['warm_up_s']:.2f} s, {warm_up['sandbox_operations']} "
              f"sandbox operations, peak RSS {warm_up['peak_rss_mb']:.0f} MB (workers' "
              f"{run['worker_peak_rss_mb']:.0f} MB)")
    return (f"promotion to switch {run['build_s']:.3f} s, to the first step "
            f"{run['to_first_step_s']:.3f} s, downtime {run['downtime_s']:.3f} s; {shadow}")


def report(runs: dict[str, list[dict]]) -> None:
    check_same_digest(runs, blank_line=True)
    medians = {}
    for mode, mode_runs in runs.items():
        medians[mode] = {field: statistics.median(r[field] for r in mode_runs)
                         for field in ("build_s", "to_first_step_s", "downtime_s")}
        print(f"{mode}: median promotion to switch {medians[mode]['build_s']:.3f} s "
              f"(runs {joined(r['build_s'] for r in mode_runs)}), to the first step "
              f"{medians[mode]['to_first_step_s']:.3f} s, downtime "
              f"{medians[mode]['downtime_s']:.3f} s "
              f"(runs {joined(r['downtime_s'] for r in mode_runs)})")
    print(f"WARM_VS_COLD {medians['warm']['build_s'] / medians['cold']['build_s']:.2f} "
          f"(promotion to switch, warm / cold); downtime "
          f"{medians['warm']['downtime_s'] / medians['cold']['downtime_s']:.2f}")


if __name__ == "__main__":
    main()
