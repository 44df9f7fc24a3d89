#!/usr/bin/env python
"""Benchmark: Megatron-LM's own training loop, resilient under mover-launch vs a restart.

The same job (examples/megatron_lm/pretrain_gpt.py, Megatron-LM's ``pretrain``, TP1 x PP2 x
DP2 on 4 CPU processes, 12 iterations, a Megatron-LM checkpoint (``--ckpt-format torch``) after
every iteration) runs these ways, ``--repeats`` times each, interleaved:

* ``torchrun`` without a failure (the wall time a plain Megatron-LM run takes);
* the restart baseline, ``mover-launch --policy restart --max-restarts 1``: rank 3 SIGKILLed when
  it begins iteration 6 (``--inject-failure 3:6``), every rank stopped and started again, all
  resuming from the checkpoint of iteration 5 with Megatron-LM's ``--load``, as
  ``torchrun --max-restarts 1`` does; and the same without a failure. With ``--torchrun-restart``
  also ``torchrun --max-restarts 1`` itself, rank 3 SIGKILLed from outside right after that
  checkpoint is written (its c10d rendezvous with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: on
  torch 2.13 the restarted gloo workers cannot connect to each other over the shared store);
* ``mover-launch --policy resilient --standbys 1`` with ``--resilient``: without a failure, with
  rank 3 SIGKILLed when it begins iteration 6, and with rank 1 moved to the standby at iteration
  6 (``--inject-migration 1:6``, as ``mover migrate --rank 1`` asks). The standby warms up in
  the sandbox and adopts the objects of the rank's stage; with ``--cold-standby`` the crash and
  the migration also run with a standby that does not warm up
  (``--resilient-standby-shadow-iterations 0``: it builds its model once promoted).

With ``--recipe llama3`` the job is Megatron-LM's Llama 3 recipe scaled down instead
(``mover_plugin.testing.megatron_lm.LLAMA3_RECIPE``: TP2 x DP2, bf16, the distributed optimizer
with overlapped reductions and gathers, no dropout as in the recipe), with its own checkpoint
format (``torch_dist``); the resilient crash continues from the shard's peer copy.

Printed: each way's downtime (the interrupted run's wall time minus the median failure-free
wall time of the same launcher and policy; for mover-launch also the run summary's own measure,
detection included), the ratios of the restart's downtime to the crash's (goal >= 20x) and to
the migration's (goal >= 30x; with a restart launcher a planned move of a rank is the same
stop-and-restart), and whether every run ends with the same PARAMS_DIGEST.

Usage::

    python bench/megatron_lm_vs_torchrun.py --repeats 2 --out runs/bench-megatron-lm
    python bench/megatron_lm_vs_torchrun.py --recipe llama3 --repeats 1 --torchrun-restart
"""

from __future__ import annotations

import functools
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import add_out_argument, benchmark_parser, interleaved_in, joined, new_out_folder
from jobs import (EXAMPLES, JOB_TIMEOUT_S, mover_launch_command, params_digest, run_job,
                  summary_with_digest)

from mover_plugin.testing.megatron_lm import CPU_FLAGS, LLAMA3_RECIPE

SCRIPT = str(EXAMPLES / "megatron_lm" / "pretrain_gpt.py")
ITERATIONS = 12
FLAGS = ["--pipeline-model-parallel-size", "2", "--num-layers", "4", "--hidden-size", "64",
         "--num-attention-heads", "4", "--seq-length", "64", "--max-position-embeddings", "64",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(ITERATIONS),
         "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--mock-data",
         "--split", "100,0,0", "--eval-iters", "0", "--eval-interval", "1000",
         "--log-interval", "1", "--seed", "1234", *CPU_FLAGS, "--resilient-params-digest",
         "--ckpt-format", "torch", "--save-interval", "1",
         "--hidden-dropout", "0", "--attention-dropout", "0"]
"""Without dropout, so that a restart resumed from Megatron-LM's checkpoint ends bit-exact too
(Megatron-LM restores the checkpoint's RNG states before building its data loaders, whose
iterators then draw from torch's generator: with dropout its resume differs slightly)."""
RECIPES = {"tp1-pp2": FLAGS,
           "llama3": [*FLAGS[2:], *LLAMA3_RECIPE, "--ckpt-format", "torch_dist"]}
"""The job's flags by ``--recipe`` (later flags override earlier ones: the Llama 3 recipe drops
the pipeline and takes its own checkpoint format)."""
RANK, ITERATION = 3, 6
"""The interrupted rank, and the iteration it is interrupted at (1-based)."""
MODES = ("torchrun-clean", "restart-clean", "restart-crash", "mover-clean", "mover-crash",
         "mover-migration")
INJECTIONS = {"clean": [], "crash": ["--inject-failure", f"{RANK}:{ITERATION}"],
              "migration": ["--inject-migration", f"1:{ITERATION}"]}
COLD_MODES = ("cold-crash", "cold-migration")
"""With ``--cold-standby``: the resilient crash and migration with a standby that does not
warm up."""


def checkpoint_flags(folder: Path) -> list[str]:
    return ["--save", str(folder / "ckpt"), "--load", str(folder / "ckpt")]


def run_torchrun(folder: Path, crash: bool, flags: list[str]) -> dict:
    """torchrun --max-restarts 1; with ``crash``, rank ``RANK`` is SIGKILLed once the
    checkpoint of iteration ``ITERATION - 1`` is written."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "4", "--max-restarts", "1", "-m", "mover_plugin.launch.run",
               SCRIPT, *flags, *checkpoint_flags(folder)]
    trigger = f"successfully saved checkpoint from iteration {ITERATION - 1:7d}"
    started = time.monotonic()
    env = {**_environment(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    output = folder / "output.txt"
    # The output goes to a file, not a pipe: a process the killed rank started (a checkpoint
    # writer) outlives it with the output inherited, and a pipe would stay open for it.
    with output.open("w") as sink:
        process = subprocess.Popen(command, cwd=folder, stdout=sink, stderr=subprocess.STDOUT,
                                   text=True, env=env)
        killed = not crash
        while process.poll() is None and time.monotonic() - started < JOB_TIMEOUT_S:
            if not killed and trigger in output.read_text(errors="replace"):
                os.kill(_rank_pid(process.pid, RANK), signal.SIGKILL)
                killed = True
            time.sleep(0.05)
        process.wait(timeout=10)
    text = output.read_text(errors="replace")
    if process.returncode != 0 or not killed:
        raise SystemExit(f"torchrun {'crash' if crash else 'clean'} run failed:\n{text[-3000:]}")
    return {"wall_time_s": time.monotonic() - started, "digest": params_digest(text)}


def _environment() -> dict[str, str]:
    return {**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1", "OMP_NUM_THREADS": "1"}


def _rank_pid(torchrun_pid: int, rank: int) -> int:
    """The worker process of ``rank`` among torchrun's descendants."""
    for pid in _descendants(torchrun_pid):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return pid
    raise SystemExit(f"no worker of rank {rank} under torchrun (pid {torchrun_pid})")


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        found.extend(children.get(pid, []))
        frontier.extend(children.get(pid, []))
    return found


def run_mover(folder: Path, policy: str, injection: list[str], flags: list[str],
              warm: bool = True) -> dict:
    """mover-launch with ``policy`` (resilient: one standby and ``--resilient``; without
    ``warm``, a standby that does not warm up)."""
    if policy == "resilient":
        options, resilient = ["--policy", "resilient", "--standbys", "1"], ["--resilient"]
        if not warm:
            resilient += ["--resilient-standby-shadow-iterations", "0"]
    else:
        options, resilient = ["--policy", "restart", "--max-restarts", "1"], []
    command = [*mover_launch_command(folder, 4, *options, "--stop-grace-s", "2", *injection),
               SCRIPT, *flags, *checkpoint_flags(folder), *resilient]
    started = time.monotonic()
    result = run_job(command, f"mover-launch --policy {policy} {injection} failed")
    summary = summary_with_digest(folder, result)
    summary["wall_time_s"] = time.monotonic() - started
    return summary


def run_mode(mode: str, folder: Path, flags: list[str]) -> dict:
    launcher, interruption = mode.split("-")
    if launcher == "torchrun":
        return run_torchrun(folder, crash=interruption == "crash", flags=flags)
    return run_mover(folder, "restart" if launcher == "restart" else "resilient",
                     INJECTIONS[interruption], flags, warm=launcher != "cold")


def baseline_of(mode: str) -> str:
    """The launcher whose failure-free wall time ``mode``'s downtime is measured against."""
    launcher = mode.split("-")[0]
    return "mover" if launcher == "cold" else launcher


def report(runs: dict[str, list[dict]]) -> None:
    fell_back = [f"{mode} run {index}" for mode, results in runs.items()
                 for index, run in enumerate(results)
                 if any(item["downtime_s"] is None for item in run.get("interruptions", []))]
    if fell_back:
        raise SystemExit(f"an interruption did not end as planned (no downtime measured) in "
                         f"{', '.join(fell_back)}: see its run folder's events.jsonl")
    digests = {run["digest"] for results in runs.values() for run in results}
    print(f"\nPARAMS_DIGEST {'equal in every run' if len(digests) == 1 else 'DIFFERS'}: "
          f"{sorted(digests)}")
    if len(digests) > 1:
        for mode, results in runs.items():
            print(f"  {mode}: {', '.join(r['digest'][:12] for r in results)}")
    clean = {launcher: statistics.median(r["wall_time_s"] for r in runs[f"{launcher}-clean"])
             for launcher in ("torchrun", "restart", "mover")}
    print(f"failure-free wall time (median): torchrun {clean['torchrun']:.2f} s, mover-launch "
          f"--policy restart {clean['restart']:.2f} s, --policy resilient {clean['mover']:.2f} s")
    interrupted = [mode for mode in runs if not mode.endswith("clean")]
    by_wall = {mode: [r["wall_time_s"] - clean[baseline_of(mode)] for r in runs[mode]]
               for mode in interrupted}
    medians = {mode: statistics.median(values) for mode, values in by_wall.items()}
    for mode, values in by_wall.items():
        print(f"{mode:16s} downtime by wall time: median {medians[mode]:7.3f} s "
              f"({joined(values, '.2f')})")
    by_summary = {mode: [r["interruptions"][0]["downtime_s"] for r in runs[mode]]
                  for mode in interrupted if not mode.startswith("torchrun")}
    for mode, values in by_summary.items():
        recoveries = sorted({r["interruptions"][0]["recovery"] for r in runs[mode]})
        print(f"{mode:16s} downtime by run summary: median {statistics.median(values):7.3f} s "
              f"({joined(values)}); recovery {recoveries}; restarts "
              f"{sorted({r['restarts'] for r in runs[mode]})}")
    restart = statistics.median(by_summary["restart-crash"])
    for mode, goal in (("mover-crash", 20), ("mover-migration", 30)):
        by_wall_ratio = (f"{medians['restart-crash'] / medians[mode]:.1f}x" if medians[mode] > 0
                         else "n/a (within the run-to-run noise of the wall time)")
        print(f"RATIO_{mode.split('-')[1].upper()} restart / resilient downtime: "
              f"{restart / statistics.median(by_summary[mode]):.1f}x by run summary, "
              f"{by_wall_ratio} by wall time (goal >= {goal}x)")
    for kind, goal in (("crash", 20), ("migration", 30)):
        if "torchrun-crash" not in medians:
            break
        resilient = statistics.median(by_summary[f"mover-{kind}"])
        print(f"RATIO_TORCHRUN_{kind.upper()} torchrun --max-restarts 1 downtime by wall time / "
              f"resilient {kind} by run summary: {medians['torchrun-crash']:.2f} / "
              f"{resilient:.3f} s = {medians['torchrun-crash'] / resilient:.1f}x (goal >= {goal}x)")
    for cold in (mode for mode in COLD_MODES if mode in by_summary):
        warm = f"mover-{cold.split('-')[1]}"
        print(f"WARM_VS_COLD {cold.split('-')[1]}: downtime with a warmed-up standby / a cold "
              f"one: {statistics.median(by_summary[warm]):.3f} / "
              f"{statistics.median(by_summary[cold]):.3f} s = "
              f"{statistics.median(by_summary[warm]) / statistics.median(by_summary[cold]):.2f}x")


def main() -> None:
    parser = benchmark_parser(__doc__, repeats=2)
    add_out_argument(parser, "bench-megatron-lm")
    parser.add_argument("--torchrun-restart", action="store_true",
                        help="Also run torchrun --max-restarts 1 with rank 3 SIGKILLed.")
    parser.add_argument("--cold-standby", action="store_true",
                        help="Also run the resilient crash and migration with a standby that "
                        "does not warm up.")
    parser.add_argument("--recipe", choices=sorted(RECIPES), default="tp1-pp2",
                        help="The job: TP1 x PP2 x DP2 (default), or Megatron-LM's Llama 3 "
                        "recipe scaled down to TP2 x DP2.")
    args = parser.parse_args()
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"  # Megatron-LM's checks at TP > 1
    out = new_out_folder(args.out)
    modes = (*MODES, *(("torchrun-crash",) if args.torchrun_restart else ()),
             *(COLD_MODES if args.cold_standby else ()))
    runs = interleaved_in(out, modes, args.repeats,
                          functools.partial(run_mode, flags=RECIPES[args.recipe]),
                          lambda result: f"{result['wall_time_s']:.2f} s")
    report(runs)


if __name__ == "__main__":
    main()
