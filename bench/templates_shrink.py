#!/usr/bin/env python
"""Benchmark of pipeline templates: throughput before, while shrunk and after growing back,
and what a switch costs against a restart of the same job.

The example's Megatron-Core GPT (TP1 x PP2 x DP2 on 4 CPU processes, no dropout) is first
measured on one process (a per-layer profile, mover_plugin.megatron.layer_profile); the
planner plans from that profile. Then (mover_plugin.megatron.template_run) the job trains
``--steps`` steps; rank 3 drops out and ranks 0-2 switch to the planner's placement for three
hosts (a 2-stage and a 1-stage pipeline) and train ``--steps`` more; rank 3 comes back with
no state and all four switch to the placement for four hosts and train ``--steps`` more. It
prints:

* the median step time of each phase, its throughput against the full job's, and, while
  shrunk, the planner's predicted ratio (from the measured profile);
* each switch's time (new groups, the stage model built, layers and optimizer state copied, the
  schedule carried over), slowest rank, and the bytes moved;
* a restart of the same job (mover-launch, a checkpoint every step, one SIGKILL): its
  downtime as the run summary reports it, and the ratio to the shrink's switch.

On a machine with fewer cores than ranks the ranks share cores, so a phase with fewer ranks
gets more of each: the throughput ratios then say little about hosts of their own (it prints
a note). The switch is timed in-process: a real loss adds its detection (as it does for the restart,
whose summary counts from the failure). Usage::

    python bench/templates_shrink.py --steps 6 --out runs/bench-templates
"""

from __future__ import annotations

import math
import os
import statistics
from pathlib import Path

from common import add_out_argument, benchmark_parser, job_folder, new_out_folder
from jobs import (GPT_EXAMPLE, checkpoint_flags, gpt_model_flags, mover_launch_command,
                  run_job, summary_with_digest)

from mover_plugin.testing import run_ranks
from mover_plugin.megatron.template_run import (
    JOB_PIPELINES,
    TemplateRun,
    measure_example_profile,
    train_shrink_and_grow,
)

LAYERS = 8
NO_DROPOUT = ("--hidden-dropout", "0", "--attention-dropout", "0")


def model_flags(steps: int) -> list[str]:
    return [*gpt_model_flags(pipeline=2, layers=LAYERS, train_iters=steps), *NO_DROPOUT]


def template_run(profile=None) -> TemplateRun:
    argv = model_flags(1)
    at = argv.index("--train-iters")  # each phase sets its own
    del argv[at:at + 2]
    return TemplateRun(Path(GPT_EXAMPLE), tuple(argv), LAYERS, slots=4, profile=profile)


def predicted_ratio(profile, slots: int) -> float:
    """The planner's throughput of three hosts against the job's own PP2 x DP2 split."""
    from mover_plugin.templates import Template, instantiate, plan_templates

    prefix = [0.0]
    for layer in profile.layers:
        prefix.append(prefix[-1] + layer.step_s)
    half = 1 + LAYERS // 2  # the job's stages: embedding + layers 0-3, layers 4-7 + output
    stages = ((0, half), (half, LAYERS + 2))
    job = Template(2, stages, tuple(prefix[b] - prefix[a] for a, b in stages))
    per_pipeline = slots // len(JOB_PIPELINES)
    shrunk = instantiate(plan_templates(profile, 2), 3, slots, 0)
    return shrunk.throughput / (slots / job.iteration_s(per_pipeline))


def restart_downtime(out: Path, steps: int) -> float:
    folder = job_folder(out, "restart")
    options = ["--inject-failure", f"3:{steps}"]
    script = [GPT_EXAMPLE, *model_flags(2 * steps), *checkpoint_flags(folder)]
    result = run_job([*mover_launch_command(folder, 4, *options, event_log=False), *script],
                     "the restart run failed")
    summary = summary_with_digest(folder, result)
    return statistics.median(i["downtime_s"] for i in summary["interruptions"])


def main() -> None:
    parser = benchmark_parser(__doc__, repeats=1)
    parser.add_argument("--steps", type=int, default=6, help="steps in each phase (default 6)")
    add_out_argument(parser, "bench-templates")
    args = parser.parse_args()
    out = new_out_folder(args.out)
    steps = max(args.steps, 3)

    (measured,) = run_ranks(measure_example_profile, 1, template_run(), timeout_s=300,
                            group_timeout_s=120)
    profile = measured["profile"]
    print("profile (ms forward + backward):",
          " ".join(f"{c.name}={1000 * c.step_s:.1f}" for c in profile.layers))
    ranks = run_ranks(train_shrink_and_grow, 4, template_run(profile), steps, steps, steps,
                      timeout_s=900, group_timeout_s=120)
    phases = {"full": range(1, steps), "shrunk": range(steps + 1, 2 * steps),
              "grown": range(2 * steps + 1, 3 * steps)}  # each phase's first step left out
    medians = {name: statistics.median(max(r["times"][i] for r in ranks
                                           if not math.isnan(r["times"][i])) for i in span)
               for name, span in phases.items()}
    cores = os.cpu_count() or 1
    if cores < 4:
        print(f"note: {cores} cores for 4 ranks: the ranks share cores, so a phase with fewer "
              "ranks gets more of each; the planner assumes a host per stage")
    print(f"placements: shrunk {ranks[0]['shrunk']}; grown {ranks[0]['grown']}")
    for name, median in medians.items():
        ratio = medians["full"] / median
        extra = (f"  (planner's prediction {predicted_ratio(profile, 4):.2f})"
                 if name == "shrunk" else "")
        print(f"{name:>7}: step {1000 * median:7.1f} ms  throughput x{ratio:.2f} of the full "
              f"job{extra}")
    shrink = max(r["shrink_s"] for r in ranks[:3])
    grow = max(r["grow_s"] for r in ranks[:3])  # rank 3 waited through the shrunk phase
    moved = (sum(r["shrunk_received"] for r in ranks[:3]), sum(r["grown_received"]
                                                              for r in ranks))
    print(f"switch to 3 ranks: {shrink:.3f} s ({moved[0] / 1e6:.2f} MB moved); back to 4: "
          f"{grow:.3f} s ({moved[1] / 1e6:.2f} MB moved)")
    restart = restart_downtime(out, steps)
    print(f"restart of the same job after a SIGKILL: downtime {restart:.3f} s; "
          f"the shrink's switch is x{restart / shrink:.1f} shorter")


if __name__ == "__main__":
    main()
