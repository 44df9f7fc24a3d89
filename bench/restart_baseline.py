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

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from mover_plugin.testing import run_command

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "pretrain_gpt.py")
MODEL = ["--pipeline-model-parallel-size", "2", "--num-layers", "4", "--hidden-size", "64",
         "--num-attention-heads", "4", "--seq-length", "64", "--micro-batch-size", "2",
         "--global-batch-size", "8"]


def run_job(out: Path, name: str, steps: int, failure: str | None) -> dict:
    folder = out / name
    folder.mkdir(parents=True)
    launcher = [sys.executable, "-m", "mover_plugin.launch.cli", "--standalone",
                "--nproc-per-node", "4", "--summary", str(folder / "summary.json")]
    if failure:
        launcher += ["--inject-failure", failure]
    ckpt = str(folder / "ckpt")
    result = run_command(
        [*launcher, EXAMPLE, *MODEL, "--train-iters", str(steps), "--save", ckpt, "--load", ckpt,
         "--save-interval", "1"],
        timeout_s=600,
    )
    if result.returncode != 0:
        raise SystemExit(f"{name} failed:\n{result.output[-3000:]}")
    summary = json.loads((folder / "summary.json").read_text())
    digest = result.lines_starting("PARAMS_DIGEST")[0].split()[1]
    return {"summary": summary, "digest": digest}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--failure", default="3:6", help="RANK:STEP[:SIGNAL] to inject")
    parser.add_argument("--out", default=f"runs/bench-restart-{time.strftime('%Y%m%d-%H%M%S')}")
    args = parser.parse_args()
    out = Path(args.out)
    if out.exists():
        raise SystemExit(f"--out {out} exists; give a new folder (nothing is overwritten)")
    clean_walls, failures = [], []
    for repeat in range(args.repeats):
        clean = run_job(out, f"clean-{repeat}", args.steps, None)
        failed = run_job(out, f"failure-{repeat}", args.steps, args.failure)
        if failed["digest"] != clean["digest"]:
            raise SystemExit(f"repeat {repeat}: PARAMS_DIGEST differs after the failure")
        clean_walls.append(clean["summary"]["wall_time_s"])
        failures.append(failed["summary"])
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
          f"(runs: {', '.join(f'{d:.2f}' for d in by_wall)})")
    print(f"restart downtime by summary:   median {statistics.median(by_summary):.2f} s "
          f"(runs: {', '.join(f'{d:.2f}' for d in by_summary)})")
    print("phases, seconds after the failure (median):")
    for phase in interruptions[0]["phases_s"]:
        values = [i["phases_s"][phase] for i in interruptions if phase in i["phases_s"]]
        print(f"  {phase:22s} {statistics.median(values):8.3f}")
    print(f"RESTART_DOWNTIME_S {statistics.median(by_wall):.3f}")


if __name__ == "__main__":
    main()
