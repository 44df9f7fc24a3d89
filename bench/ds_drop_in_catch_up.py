#!/usr/bin/env python
"""Benchmark: what a joiner's catch-up costs an unmodified DeepSpeed script, early and late.

The joiner of an unmodified script (mover_plugin.deepspeed.drop_in) runs its script's loop
through every step the job trained before it came, drawing and dropping those steps'
micro-batches, while the running ranks wait for it: that part of the downtime grows with the
step at which the rank is lost. The same job (tests/support/scripts/ds_pipe_train.py: a user's
PipelineModule script, PP2 x DP2, ZeRO-1 with the peer copy, 4 CPU processes, one standby) is
run with rank 0 (the first stage, which reads the data) SIGKILLed at each step of ``--at``
(default 3 and 60), two steps before its end, interleaved, ``--repeats`` times each. Printed
per run: the downtime (run summary), the joiner's catch-up (the ``caught_up`` event: calls and
seconds) and the median step time; then per failure step the medians, the catch-up per missed
step in ms, and ``LATE_VS_EARLY`` (the downtime of the latest failure step over the earliest's,
the baseline of this run). Every run must end with the same PARAMS_DIGEST for its length.

The script's data is an in-memory tensor dataset, so a missed step costs little here; a loader
that reads and tokenizes from disk costs its per-batch time for every micro-batch the joiner
draws.

Usage::

    python bench/ds_drop_in_catch_up.py --repeats 2 --at 3,60
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from common import add_out_argument, benchmark_parser, interleaved_in, joined, new_out_folder
from jobs import ROOT, mover_launch_command, read_events, run_job, summary_with_digest

SCRIPT = str(ROOT / "tests" / "support" / "scripts" / "ds_pipe_train.py")
CONFIG = ROOT / "examples" / "ds_config.json"


def main() -> None:
    parser = benchmark_parser(__doc__, repeats=2)
    parser.add_argument("--at", default="3,60",
                        help="comma-separated steps at which rank 0 is killed (default 3,60)")
    add_out_argument(parser, "ds-drop-in-catch-up")
    args = parser.parse_args()
    steps = sorted({_step(text) for text in args.at.split(",")})
    out = new_out_folder(args.out)
    out.mkdir(parents=True)
    config = out / "ds_config.json"
    config.write_text(json.dumps({**json.loads(CONFIG.read_text()),
                                  "resilience": {"standbys": 1, "peer_copy": True}}))
    modes = [f"at{step}" for step in steps]
    runs = interleaved_in(out, modes, args.repeats,
                          lambda mode, folder: run(folder, config, int(mode[2:])), describe)
    report(steps, runs)


def _step(text: str) -> int:
    step = int(text)
    if step < 2:
        raise SystemExit(f"--at {text}: a step of at least 2 (the joiner must have a step to "
                         "catch up on)")
    return step


def run(folder: Path, config: Path, step: int) -> dict:
    command = mover_launch_command(folder, 4, "--stop-grace-s", "2", "--inject-failure",
                                   f"0:{step}")
    result = run_job([*command, SCRIPT, "--steps", str(step + 2), "--deepspeed_config",
                      str(config)], f"the job killed at step {step} failed")
    summary = summary_with_digest(folder, result)
    (interruption,) = summary["interruptions"]
    (caught_up,) = [e for e in read_events(folder) if e["event"] == "caught_up"]
    run = {"digest": summary["digest"], "downtime_s": interruption["downtime_s"],
           "catch_up_steps": caught_up["steps"], "catch_up_s": caught_up["catch_up_s"],
           "step_s": summary["median_step_time_s"]}
    return run


def describe(run: dict) -> str:
    return (f"downtime {run['downtime_s']:.3f} s, catch-up {run['catch_up_steps']} calls in "
            f"{run['catch_up_s']:.3f} s, median step {run['step_s'] * 1000:.1f} ms")


def report(steps: list[int], runs: dict[str, list[dict]]) -> None:
    downtimes = {}
    print()
    for step in steps:
        mode_runs = runs[f"at{step}"]
        if len({r["digest"] for r in mode_runs}) != 1:
            raise SystemExit(f"runs killed at step {step} ended with different parameters")
        downtime = statistics.median(r["downtime_s"] for r in mode_runs)
        catch_up = statistics.median(r["catch_up_s"] for r in mode_runs)
        calls = statistics.median(r["catch_up_steps"] for r in mode_runs)
        downtimes[step] = downtime
        print(f"killed at step {step:4d}: median downtime {downtime:.3f} s "
              f"(runs {joined(r['downtime_s'] for r in mode_runs)}), catch-up {catch_up:.3f} s "
              f"over {calls:.0f} calls = {1000 * catch_up / max(calls, 1):.2f} ms per missed "
              "step")
    early, late = steps[0], steps[-1]
    print(f"LATE_VS_EARLY {downtimes[late] / downtimes[early]:.2f} "
          f"(downtime killed at step {late} / at step {early})")


if __name__ == "__main__":
    main()
