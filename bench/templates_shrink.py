#!/usr/bin/env python
"""Benchmark of pipeline templates in a running job: throughput before a loss, while shrunk
and after growing back, and the downtime of each change against a restart of the same job.

The example's Megatron-Core GPT (TP1 x PP2 x DP2 on 4 CPU processes, 8 layers of width 64, no
dropout), or with ``--megatron-lm`` the same model on Megatron-LM's own loop
(examples/megatron_lm/pretrain_gpt.py, Megatron-LM's flags and checkpoints), runs under
``mover-launch --policy resilient --standbys 0 --refill-delay-s 0`` with ``--resilient``.
Before its first step each pipeline stage measures its layers (the per-layer profile,
mover_plugin.megatron.templates.profile), which the planner plans from. Its agent
SIGKILLs rank 3 at step ``--kill-at``; with no standby ready the survivors shrink onto the
planner's pipelines for three hosts (a 2-stage and a 1-stage pipeline); the lost rank's slot
is refilled with a standby at once, and once it is ready the job grows back to PP2 x DP2. It
prints:

* the profile the job measured (from the event log's ``shrink`` record);

* the median step time of each phase (as the step lines print it; the first step after each
  change left out) and that of the same steps of a failure-free run of the job, measured first
  in the same invocation: the phase's throughput as a ratio to the failure-free run's, and,
  while shrunk, the ratio the planner predicts from that profile;
* the downtime of the shrink and of the growing back, as the run summary reports them (from the
  failure, or from the end of the last step before the switch, to the end of the first step
  after it), and the bytes of layers and optimizer state moved;
* a restart of the same job (mover-launch's restart policy, a checkpoint every step, one
  SIGKILL): its downtime as the run summary reports it, and its ratio to the shrink's.

On a machine with fewer cores than ranks the ranks share cores, so a phase with fewer ranks
gets more of each: the throughput ratios then say little about hosts of their own (it prints a
note). Usage::

    python bench/templates_shrink.py --steps 500 --out runs/bench-templates
    python bench/templates_shrink.py --megatron-lm --steps 500 --out runs/bench-templates-lm
"""

from __future__ import annotations

import os
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from common import add_out_argument, benchmark_parser, job_folder, new_out_folder
from jobs import (EXAMPLES, GPT_EXAMPLE, checkpoint_flags, gpt_model_flags,
                  mover_launch_command, read_events, read_summary, run_job, summary_with_digest)

from mover_plugin.testing.template_run import JOB_PIPELINES
from mover_plugin.testing.megatron_lm import CPU_FLAGS
from mover_plugin.shrink import TemplateSpec

LAYERS = 8
NO_DROPOUT = ("--hidden-dropout", "0", "--attention-dropout", "0")
STEP_LINE = re.compile(r"^step\s+(\d+)/\d+ \|.*\| step time (\S+) ms", re.MULTILINE)


LM_STEP_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): "
                          r"(\S+) \|")
LM_FLAGS = [*CPU_FLAGS, "--max-position-embeddings", "64",
            "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--mock-data",
            "--split", "100,0,0", "--eval-iters", "0", "--eval-interval", "100000",
            "--log-interval", "1", "--seed", "1234", "--ckpt-format", "torch",
            "--resilient-params-digest"]
"""Megatron-LM's flags besides the model's: a CPU run's, its mock data, a step line per
iteration, checkpoints in its ``torch`` format."""


@dataclass(frozen=True)
class Job:
    """The job the benchmark runs: its script, flags, step times and restart."""

    script: str
    step_line: re.Pattern
    """An iteration's number and time (ms) in the job's output."""
    extra_flags: tuple[str, ...] = ()

    def flags(self, steps: int) -> list[str]:
        return [*gpt_model_flags(pipeline=2, layers=LAYERS, train_iters=steps), *NO_DROPOUT,
                *self.extra_flags]


EXAMPLE_JOB = Job(GPT_EXAMPLE, STEP_LINE)
LM_JOB = Job(str(EXAMPLES / "megatron_lm" / "pretrain_gpt.py"), LM_STEP_LINE, tuple(LM_FLAGS))


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


def resilient_job(job: Job, out: Path, name: str, steps: int, *options: str
                  ) -> tuple[dict, list[dict], dict[int, float]]:
    """A resilient run of the job with ``--standbys 0``: its summary, event log and each
    step's time (ms)."""
    folder = job_folder(out, name)
    options = ("--policy", "resilient", "--standbys", "0", *options)
    result = run_job([*mover_launch_command(folder, 4, *options), job.script,
                      *job.flags(steps), "--resilient"], f"the {name} run failed")
    times = {int(step): float(ms) for step, ms in job.step_line.findall(result.stdout)}
    return read_summary(folder), read_events(folder), times


def restart_downtime(job: Job, out: Path, steps: int, kill_at: int) -> float:
    folder = job_folder(out, "restart")
    options = ["--inject-failure", f"3:{kill_at}"]
    script = [job.script, *job.flags(steps), *checkpoint_flags(folder)]
    result = run_job([*mover_launch_command(folder, 4, *options, event_log=False), *script],
                     "the restart run failed")
    summary = summary_with_digest(folder, result)
    return statistics.median(i["downtime_s"] for i in summary["interruptions"])


def main() -> None:
    parser = benchmark_parser(__doc__, repeats=1)
    parser.add_argument("--steps", type=int, default=500,
                        help="steps of the job (default 500; the refilled standby needs about "
                        "10 s to be ready)")
    parser.add_argument("--kill-at", type=int, default=30,
                        help="the step at which rank 3 is killed (default 30)")
    parser.add_argument("--megatron-lm", action="store_true",
                        help="the job on Megatron-LM's own loop "
                        "(examples/megatron_lm/pretrain_gpt.py) instead of the example's")
    add_out_argument(parser, "bench-templates")
    args = parser.parse_args()
    out = new_out_folder(args.out)
    job = LM_JOB if args.megatron_lm else EXAMPLE_JOB

    _, _, baseline = resilient_job(job, out, "failure-free", args.steps)
    summary, events, times = resilient_job(job, out, "templates", args.steps,
                                           "--refill-delay-s", "0",
                                           "--inject-failure", f"3:{args.kill_at}")
    shrink, *rest = summary["interruptions"]
    if shrink["recovery"] != "shrink" or not rest or rest[0]["recovery"] != "grow":
        raise SystemExit(f"the job did not shrink and grow back: {summary['interruptions']}")
    grow = rest[0]
    (record,) = [e for e in events if e["event"] == "shrink"]
    if record["profile_source"] != "measured":
        raise SystemExit(f"the job planned from the {record['profile_source']} profile, not "
                         "the one its stages measured")
    profile = TemplateSpec(LAYERS, True, 4, profile=record["profile"]).planner_profile()
    print("profile the job measured (ms forward + backward):",
          " ".join(f"{c.name}={1000 * c.step_s:.1f}" for c in profile.layers))
    at_shrink, at_grow = shrink["step"], grow["step"]
    phases = {"full": range(2, at_shrink), "shrunk": range(at_shrink + 2, at_grow + 1),
              "grown": range(at_grow + 2, args.steps + 1)}
    medians = {name: (statistics.median(times[i] for i in span),
                      statistics.median(baseline[i] for i in span))
               for name, span in phases.items()}
    cores = os.cpu_count() or 1
    if cores < 4:
        print(f"note: {cores} cores for 4 ranks: the ranks share cores, so a phase with fewer "
              "ranks gets more of each; the planner assumes a host per stage")
    print(f"plans: shrunk {shrink['plan']} (steps {at_shrink}-{at_grow}); grown {grow['plan']}")
    for name, (median, failure_free) in medians.items():
        extra = (f"  (planner's prediction {predicted_ratio(profile, 4):.2f})"
                 if name == "shrunk" else "")
        print(f"{name:>7}: steps {phases[name].start}-{phases[name].stop - 1}: median step "
              f"{median:7.1f} ms, failure-free run {failure_free:7.1f} ms: throughput "
              f"x{failure_free / median:.2f}{extra}")
    moved = [sum(e.get("received_bytes", 0) for e in events if e["event"] == "switched"
                 and e["generation"] == item["generation"]) for item in (shrink, grow)]
    print(f"shrink: downtime {shrink['downtime_s']:.3f} s ({moved[0] / 1e6:.2f} MB moved); "
          f"grow back: downtime {grow['downtime_s']:.3f} s ({moved[1] / 1e6:.2f} MB moved)")
    restart = restart_downtime(job, out, 2 * args.kill_at, args.kill_at)
    print(f"restart of the same job after a SIGKILL: downtime {restart:.3f} s; the shrink's "
          f"downtime is x{restart / shrink['downtime_s']:.1f} shorter")


if __name__ == "__main__":
    main()
