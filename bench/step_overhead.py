#!/usr/bin/env python
"""Benchmark: steady step time, CPU per step and peak RSS of a worker with ``--resilient`` on
vs off.

The same failure-free Megatron-Core job (examples/pretrain_gpt.py, TP1 x PP2 x DP2 on 4 CPU
processes by default; ``--nproc 2 --pp 1`` runs TP1 x PP1 x DP2, one process per core) runs
with ``--policy resilient --standbys 1 ... --resilient`` and with ``--policy restart``,
alternating, ``--repeats`` times each. Each run's step time is the median over its workers of
each worker's median step duration (the launcher's summary), so start-up and the first steps'
warm-up do not count. Printed, from this one run: every run's
figure, the median per mode, and the ratios (goal: <= 1 % more of each). Also printed: each
worker's CPU seconds per step (all its threads; the median over workers), which counts what the
resilience runtime adds to a worker's own work (its hooks, the ``mover`` backend's dispatch, its
threads) without the waiting for cores and peers that makes the step time noisy here.

Run-to-run noise with 4 workers and a standby sharing 2 cores is 10-20 %, far above the 1 %
being measured; with one worker per core (``--nproc 2 --pp 1``) it is much smaller. Use enough
repeats and steps and read the spread before the ratio. For each figure the ``_PAIRED`` line
compares the two runs of each repeat (run next to each other, order alternating) and prints the
mean difference with its one-sided 95 % upper confidence bound: the goal counts as shown only
when that bound is <= +1 %.

The two modes run one after the other, never at the same time: two jobs sharing the cores do
not get equal shares of them (measured here, TP1 x PP1 x DP2 each: the plain job's workers used
~85 % of a core each, the ``--resilient`` job's ~30 %, whose steps took 2.2x longer; the likely
cause is the threads' wake-up pattern: a plain worker has ~20 gloo transport threads, one per
group, each waking ~125 times a second, a resilient one ~4), so simultaneous runs would measure
the scheduler, not the runtime. The speed of a core here also drifts by up to 2x over seconds
(a fixed loop pinned to one core), which is what the alternating order and the paired bound
absorb.

Usage::

    python bench/step_overhead.py --repeats 5 --train-iters 40
    python bench/step_overhead.py --repeats 12 --train-iters 200 --nproc 2 --pp 1  # ~16 min
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from common import (benchmark_parser, check_same_digest, interleaved_in, joined,
                    percent_more)
from jobs import (GPT_EXAMPLE, gpt_model_flags, mover_launch_command, run_job,
                  summary_with_digest)


def run_mode(folder: Path, resilient: bool, train_iters: int, nproc: int, pp: int) -> dict:
    script = [GPT_EXAMPLE, *gpt_model_flags(pipeline=pp, layers=4, train_iters=train_iters)]
    if resilient:
        options = ["--policy", "resilient", "--standbys", "1"]
        script += ["--resilient"]
    else:
        options = ["--policy", "restart"]
    result = run_job([*mover_launch_command(folder, nproc, *options, event_log=False), *script],
                     f"run failed (resilient={resilient})")
    return summary_with_digest(folder, result)


def main() -> None:
    parser = benchmark_parser(__doc__, repeats=5)
    parser.add_argument("--train-iters", type=int, default=40)
    parser.add_argument("--nproc", type=int, default=4, help="worker processes (default 4)")
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages (default 2)")
    args = parser.parse_args()
    if args.repeats < 1 or args.train_iters < 5:
        raise SystemExit("--repeats must be >= 1 and --train-iters >= 5")
    if args.pp < 1 or args.nproc % args.pp or args.nproc // args.pp < 2:
        raise SystemExit(f"--nproc {args.nproc} must be a multiple of --pp {args.pp} with at "
                         "least 2 data-parallel replicas")
    with tempfile.TemporaryDirectory(prefix="mover-bench-") as tmp:
        runs = interleaved_in(Path(tmp), ["off", "on"], args.repeats,
                              lambda mode, folder: run_mode(folder, mode == "on",
                                                            args.train_iters, args.nproc,
                                                            args.pp),
                              lambda s: f"step {s['median_step_time_s']:.4f} s, CPU "
                                        f"{s['median_cpu_per_step_s']:.4f} s/step, peak RSS "
                                        f"{s['worker_peak_rss_mb']:.1f} MB")
    check_same_digest(runs)
    for field, label in (("median_step_time_s", "STEP_TIME"),
                         ("median_cpu_per_step_s", "CPU_PER_STEP"),
                         ("worker_peak_rss_mb", "PEAK_RSS")):
        off = [s[field] for s in runs["off"]]
        on = [s[field] for s in runs["on"]]
        ratio = statistics.median(on) / statistics.median(off)
        print(f"{label} off median {statistics.median(off):.4f} (min {min(off):.4f}, "
              f"max {max(off):.4f}); on median {statistics.median(on):.4f} (min {min(on):.4f}, "
              f"max {max(on):.4f}); on/off {ratio:.4f} ({100 * (ratio - 1):+.1f} %, goal <= +1 %)")
        print(f"{label}_PAIRED {_paired(on, off)}")


# One-sided 95 % quantiles of Student's t for 1..30 degrees of freedom.
_T95 = (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812, 1.796, 1.782,
        1.771, 1.761, 1.753, 1.746, 1.740, 1.734, 1.729, 1.725, 1.721, 1.717, 1.714, 1.711,
        1.708, 1.706, 1.703, 1.701, 1.699, 1.697)


def _paired(on: list[float], off: list[float]) -> str:
    """The on/off difference of each repeat's pair (the two runs next to each other in time,
    so slow drifts of the machine cancel), their mean and its one-sided 95 % upper confidence
    bound (Student's t): the overhead is shown to be <= 1 % when that bound is."""
    differences = [percent_more(a, b) for a, b in zip(on, off)]
    listed = joined(differences, "+.1f")
    if len(differences) < 2:
        return f"on/off per repeat {listed} % (one pair: no confidence bound)"
    mean = statistics.mean(differences)
    t = _T95[min(len(differences) - 1, len(_T95)) - 1]
    bound = mean + t * statistics.stdev(differences) / len(differences) ** 0.5
    verdict = "shown" if bound <= 1 else "not shown"
    return (f"on/off per repeat {listed} %; mean {mean:+.2f} %, 95 % upper bound {bound:+.2f} % "
            f"(goal <= +1 %: {verdict})")


if __name__ == "__main__":
    main()
