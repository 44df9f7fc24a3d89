#!/usr/bin/env python
"""Benchmark: downtime of a whole-host loss vs the loss of one rank vs the restart baseline.

The same Megatron-Core job (examples/pretrain_gpt.py, TP2 x PP1 x DP2, 30 steps) runs on the
hosts of a hostfile on this machine, each host with its own ``mover-launch`` (``--node-rank``),
three ways, interleaved, ``--repeats`` times each:

* host — hosts 127.0.0.1 and .2 run two workers each, 127.0.0.3 is a spare host with two
  standbys (``--policy resilient --standbys 0``); once rank 0 has reported step 5, host 1's
  ``mover-launch`` (its agent) and its two workers are SIGKILLed together: the controller finds
  the host silent for ``--agent-timeout-s`` (2 s) and the spare host takes both ranks;
* rank — the same hosts; rank 3 is SIGKILLed when it begins step 6 (``--inject-failure 3:6``)
  and a spare host's standby takes it;
* restart — the two worker hosts only, ``--policy restart``, a checkpoint at every step (so no
  work is lost), rank 3 SIGKILLed when it begins step 6: every worker starts again from the
  checkpoint.

Printed, from this one run: each way's downtime (by the run summary: the end of the last step
before the failure to the end of the first after it, less one step time) and the host loss's
phases, the ratios restart / host and host / rank, and the host loss's downtime less its
detection (what the recovery itself costs, to compare with one rank's).

Usage::

    python bench/host_loss.py --repeats 3
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import (CRASH_PHASES, check_same_digest, interleaved_in, print_downtime_medians,
                    print_phase_medians, repeats_argument)
from jobs import (GPT_EXAMPLE, JOB_TIMEOUT_S, checkpoint_flags, params_digest, read_events,
                  read_summary)

MODEL = ["--tensor-model-parallel-size", "2", "--num-layers", "4", "--hidden-size", "64",
         "--num-attention-heads", "4", "--seq-length", "64", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--train-iters", "30"]
HOSTS = ["127.0.0.1 slots=2", "127.0.0.2 slots=2", "127.0.0.3 slots=2 spare"]
KILL_AFTER_STEP = 5


def run_way(way: str, folder: Path) -> dict:
    hosts = HOSTS[:2] if way == "restart" else HOSTS
    hostfile = folder / "hosts"
    hostfile.write_text("\n".join(hosts) + "\n")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    options = ["--hostfile", str(hostfile), "--master-addr", "127.0.0.1", "--master-port",
               str(port), "--stop-grace-s", "2"]
    script = [GPT_EXAMPLE, *MODEL]
    if way == "restart":
        options += ["--policy", "restart", "--inject-failure", "3:6"]
        script += checkpoint_flags(folder)
    else:
        options += ["--policy", "resilient", "--standbys", "0"]
        options += ["--inject-failure", "3:6"] if way == "rank" else []
        script += ["--resilient"]
    launch = [sys.executable, "-m", "mover_plugin.launch.cli", *options]
    first = ["--summary", str(folder / "summary.json"), "--event-log", str(folder / "events.jsonl")]
    others = [_start([*launch, "--node-rank", str(node), *script], folder / f"host{node}.log")
              for node in range(1, len(hosts))]
    host0 = _start([*launch, "--node-rank", "0", *first, *script], folder / "host0.log")
    try:
        if way == "host":
            _wait_for_step(folder / "events.jsonl", KILL_AFTER_STEP, host0)
            doomed = others[0]
            for pid in [doomed.pid, *_children(doomed.pid)]:
                os.kill(pid, signal.SIGKILL)
        if host0.wait(timeout=JOB_TIMEOUT_S) != 0:
            raise SystemExit(f"{way} run failed:\n{(folder / 'host0.log').read_text()[-3000:]}")
    finally:
        for process in [host0, *others]:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    summary = read_summary(folder)
    summary["digest"] = params_digest((folder / "host0.log").read_text())
    if len(summary["interruptions"]) != 1:
        raise SystemExit(f"{way} run: expected one interruption, got {summary['interruptions']}")
    expected = {"host": "host_loss", "rank": "failure", "restart": "failure"}[way]
    if summary["interruptions"][0]["kind"] != expected:
        raise SystemExit(f"{way} run: a {summary['interruptions'][0]['kind']} interruption")
    summary["events"] = read_events(folder)
    return summary


JOB_SECRET = secrets.token_hex(32)


def _start(command: list[str], log: Path) -> subprocess.Popen:
    # Each host runs its own mover-launch: they share the job's secret, as srun would hand it.
    env = {**os.environ, "MOVER_JOB_SECRET": JOB_SECRET}
    return subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True, env=env)


def _wait_for_step(events_path: Path, step: int, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while time.monotonic() < deadline:
        if events_path.exists():
            for line in events_path.read_text().splitlines():
                record = json.loads(line)
                if record["event"] == "steps" and record["steps"][-1][0] >= step:
                    return
        if process.poll() is not None:
            raise SystemExit("the job ended before the host could be lost")
        time.sleep(0.05)
    raise SystemExit(f"rank 0 did not reach step {step}")


def _children(pid: int) -> list[int]:
    """The pids whose parent is ``pid`` (an agent's workers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def main() -> None:
    args = repeats_argument(__doc__, default=3)
    with tempfile.TemporaryDirectory(prefix="mover-bench-") as tmp:
        runs = interleaved_in(Path(tmp), ["host", "rank", "restart"], args.repeats, run_way,
                              lambda s: f"downtime {s['interruptions'][0]['downtime_s']:.3f} s")
    check_same_digest(runs)
    downtimes = {way: [s["interruptions"][0]["downtime_s"] for s in results]
                 for way, results in runs.items()}
    medians = print_downtime_medians(downtimes)
    hosts = [s["interruptions"][0] for s in runs["host"]]
    print_phase_medians("host loss phases, seconds after the host was last known alive "
                        "(median):", hosts, CRASH_PHASES)
    print(f"RESTART_OVER_HOST_LOSS {medians['restart'] / medians['host']:.1f}x")
    print(f"HOST_LOSS_OVER_ONE_RANK {medians['host'] / medians['rank']:.2f}x")
    recovery = statistics.median(i["downtime_s"] - i["phases_s"]["detected"] for i in hosts)
    print(f"HOST_LOSS_DOWNTIME_LESS_DETECTION_S {recovery:.3f} "
          f"(one rank's downtime {medians['rank']:.3f} s)")


if __name__ == "__main__":
    main()
