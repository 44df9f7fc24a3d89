#!/usr/bin/env python
"""Benchmark: DeepSpeed crash downtime with a standby vs torchrun restarting the whole group.

The same DeepSpeed job (examples/ds_pretrain_gpt.py: PipelineModule PP2 x DP2, ZeRO-1, 4 CPU
processes, 10 steps, a checkpoint every step) and the same failure (SIGKILL of rank 3 when it
begins step 6) run three ways, interleaved, ``--repeats`` times each:

* ``resilient``: ``mover-launch`` with a ``"resilience"`` block and ``peer_copy`` on — the
  standby takes rank 3's place in the running job (downtime from the run summary, detection
  included);
* ``torchrun``: ``torchrun --standalone --max-restarts 1`` restarts all four workers, which
  resume from the checkpoint (the c10d rendezvous with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``:
  with a static ``--master-port`` restarted gloo workers cannot reconnect). This script
  delivers the SIGKILL itself and timestamps the workers' step lines as they arrive;
* ``restart``: ``mover-launch --policy restart`` (the same, under our launcher).

Downtime everywhere = (first step completed after the failure - the failure) - one median
step time. Printed: each policy's median downtime, ``DOWNTIME_RATIO`` torchrun/resilient (goal
>= 20x), the resilient phases, worker peak RSS and step time with the peer copy on vs off
(failure-free), and the peer copy's size per rank; every run must end with the same
``PARAMS_DIGEST``.

Usage::

    python bench/ds_resilient_vs_restart.py --repeats 3
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import (CRASH_PHASES, WORKER_COSTS, check_same_digest, interleaved_in, median_of,
                    percent_more, print_downtime_medians, print_phase_medians, repeats_argument)
from jobs import (EXAMPLES, checkpoint_flags, mover_launch_command, params_digest, run_job,
                  summary_with_digest)

EXAMPLE = str(EXAMPLES / "ds_pretrain_gpt.py")
STEPS = 10
FAILED_RANK, FAILED_STEP = 3, 6
STEP_LINE = re.compile(r"^step\s+(\d+)/")


def script_flags(folder: Path, config: Path) -> list[str]:
    return [EXAMPLE, "--train-iters", str(STEPS), "--deepspeed_config", str(config),
            *checkpoint_flags(folder)]


def write_config(out: Path, name: str, block: dict | None) -> Path:
    config = json.loads((EXAMPLES / "ds_config.json").read_text())
    if block is not None:
        config["resilience"] = block
    path = out / f"{name}.json"
    path.write_text(json.dumps(config, indent=2))
    return path


def run_mover(folder: Path, config: Path, failure: bool) -> dict:
    options = ["--inject-failure", f"{FAILED_RANK}:{FAILED_STEP}"] if failure else []
    result = run_job([*mover_launch_command(folder, 4, *options), *script_flags(folder, config)],
                     f"{folder.name} failed")
    summary = summary_with_digest(folder, result)
    peer = result.lines_starting("PEER_COPY_MB")
    summary["peer_copy_mb"] = peer[0].split()[1] if peer else None
    (interruption,) = summary["interruptions"] or [None]
    summary["downtime_s"] = interruption["downtime_s"] if interruption else None
    return summary


def run_torchrun(folder: Path, config: Path) -> dict:
    """torchrun with one restart; the SIGKILL goes to rank 3 once step 5 is reported."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "4", "--max-restarts", "1", *script_flags(folder, config)]
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=env, start_new_session=True)
    arrivals: list[tuple[int, float]] = []
    killed_at = None
    output = []
    for line in process.stdout:
        now = time.time()
        output.append(line)
        match = STEP_LINE.match(line)
        if match:
            arrivals.append((int(match.group(1)), now))
            if killed_at is None and int(match.group(1)) == FAILED_STEP - 1:
                os.kill(worker_pid(process.pid, FAILED_RANK), signal.SIGKILL)
                killed_at = time.time()
    process.wait(timeout=600)
    text = "".join(output)
    if process.returncode != 0 or killed_at is None:
        raise SystemExit(f"{folder.name} failed (rc {process.returncode}):\n{text[-3000:]}")
    step_times = [b[1] - a[1] for a, b in zip(arrivals, arrivals[1:])
                  if b[0] == a[0] + 1 and a[1] < killed_at]
    resumed = next(t for step, t in arrivals if t > killed_at)
    return {"downtime_s": resumed - killed_at - statistics.median(step_times),
            "digest": params_digest(text)}


def worker_pid(root: int, rank: int) -> int:
    """The descendant of ``root`` whose environment says RANK=rank."""
    parents = {}
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit():
                stat = (entry / "stat").read_text()
                parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
    descendants, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - descendants
        descendants |= frontier
    for pid in sorted(descendants):
        try:
            if f"RANK={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                return pid
        except OSError:
            continue
    raise SystemExit(f"no worker with RANK={rank} under {root}")


def main() -> None:
    args = repeats_argument(__doc__, default=3)
    with tempfile.TemporaryDirectory(prefix="bench-ds-") as tmp:
        out = Path(tmp)
        configs = {"resilient": write_config(out, "resilient", {"peer_copy": True}),
                   "no-copy": write_config(out, "no-copy", {"peer_copy": False}),
                   "plain": write_config(out, "plain", None)}
        jobs = {
            "resilient": lambda folder: run_mover(folder, configs["resilient"], failure=True),
            "torchrun": lambda folder: run_torchrun(folder, configs["plain"]),
            "restart": lambda folder: run_mover(folder, configs["plain"], failure=True),
            "clean-peer-copy": lambda folder: run_mover(folder, configs["resilient"],
                                                        failure=False),
            "clean-no-copy": lambda folder: run_mover(folder, configs["no-copy"],
                                                      failure=False),
        }
        runs = interleaved_in(out, list(jobs), args.repeats,
                              lambda mode, folder: jobs[mode](folder), describe)
    check_same_digest(runs)
    report(runs)


def describe(result: dict) -> str:
    downtime = result["downtime_s"]
    return "no failure" if downtime is None else f"downtime {downtime:.3f} s"


def report(runs: dict[str, list[dict]]) -> None:
    median = print_downtime_medians({name: [r["downtime_s"] for r in runs[name]]
                                     for name in ("resilient", "torchrun", "restart")})
    print(f"DOWNTIME_RATIO torchrun/resilient {median['torchrun'] / median['resilient']:.1f}x "
          "(goal >= 20x)")
    print(f"DOWNTIME_RATIO restart/resilient {median['restart'] / median['resilient']:.1f}x")
    print_phase_medians("resilient phases, seconds after the failure (median):",
                        [r["interruptions"][0] for r in runs["resilient"]], CRASH_PHASES)
    for field, label in WORKER_COSTS:
        on = median_of(runs["clean-peer-copy"], field)
        off = median_of(runs["clean-no-copy"], field)
        print(f"{label}: peer copy off {off:.4f}, on {on:.4f} ({percent_more(on, off):+.1f} %)")
    print(f"PEER_COPY_MB per rank (ranks 0..3): {runs['clean-peer-copy'][0]['peer_copy_mb']}")


if __name__ == "__main__":
    main()
