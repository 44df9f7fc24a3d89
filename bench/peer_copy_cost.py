#!/usr/bin/env python
"""Benchmark: what the distributed optimizer's peer copy costs in step time and host memory.

The same failure-free job (examples/megatron_lm/pretrain_gpt.py, Megatron-LM's ``pretrain``,
TP1 x PP2 x DP2 on 4 CPU processes, ``--use-distributed-optimizer``) runs under
``mover-launch --policy resilient --standbys 1 ... --resilient``, with the peer copy (the
default: after every step each rank sends its optimizer shard to its data-parallel peer, which
keeps it in host memory) and with ``--resilient-no-peer-copy``, alternating, ``--repeats``
times each. A run's step time is the median over its workers of each worker's median step
duration (the launcher's summary). Printed: every run's figure, the medians, their ratio (goal:
<= 2 % more with the copy), the paired differences of the runs of each repeat, the host
memory each rank spends on the copy (its own packed shard and the copy of its peer's, as the
workers report at their end), and the time each rank's training thread spent in the copy per
step (packing the shard, waiting for the last exchange before the next step) against the run's
step time: the copy's cost on the step's critical path, measured inside the steps rather than
as a difference of two runs, which on a shared machine the scheduling noise can swamp. The copy lives in host memory only: on a GPU its buffers are
pinned host memory, so it uses no GPU memory by construction (this machine has no GPU).

With ``--recipe llama3`` the job is Megatron-LM's Llama 3 recipe scaled down (TP2 x DP2, bf16,
both overlaps; :mod:`megatron_lm_vs_torchrun`).

Usage::

    python bench/peer_copy_cost.py --repeats 3 --train-iters 30
"""

from __future__ import annotations

import os
import statistics
import tempfile
from pathlib import Path

from common import benchmark_parser, check_same_digest, interleaved_in, joined, percent_more
from jobs import mover_launch_command, read_events, run_job, summary_with_digest
from megatron_lm_vs_torchrun import RECIPES, SCRIPT

MODES = ("peer-copy", "no-copy")


def run_mode(folder: Path, mode: str, train_iters: int, flags: list[str]) -> dict:
    script = [SCRIPT, *flags, "--train-iters", str(train_iters), "--use-distributed-optimizer",
              "--resilient"]
    if mode == "no-copy":
        script.append("--resilient-no-peer-copy")
    command = [*mover_launch_command(folder, 4, "--policy", "resilient", "--standbys", "1"),
               *script]
    summary = summary_with_digest(folder, run_job(command, f"{mode} run failed"))
    copies = [e for e in read_events(folder) if e["event"] == "peer_copy"]
    summary["copy_bytes"] = {e["rank"]: e["bytes"] for e in copies}
    summary["copy_critical_s"] = {e["rank"]: e["critical_s"] / e["exchanges"] for e in copies
                                  if e["exchanges"]}
    return summary


def main() -> None:
    parser = benchmark_parser(__doc__, repeats=3)
    parser.add_argument("--train-iters", type=int, default=30)
    parser.add_argument("--recipe", choices=sorted(RECIPES), default="tp1-pp2",
                        help="The job: TP1 x PP2 x DP2 (default), or Megatron-LM's Llama 3 "
                        "recipe scaled down to TP2 x DP2.")
    args = parser.parse_args()
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"  # Megatron-LM's checks at TP > 1
    flags = RECIPES[args.recipe]
    with tempfile.TemporaryDirectory(prefix="peer-copy-") as parent:
        runs = interleaved_in(Path(parent), MODES, args.repeats,
                              lambda mode, folder: run_mode(folder, mode, args.train_iters,
                                                            flags),
                              lambda s: f"step {s['median_step_time_s'] * 1000:.1f} ms")
    check_same_digest(runs, blank_line=True)
    steps = {mode: [run["median_step_time_s"] for run in runs[mode]] for mode in MODES}
    medians = {mode: statistics.median(values) for mode, values in steps.items()}
    for mode in MODES:
        print(f"{mode:9s} step time median {medians[mode] * 1000:7.2f} ms "
              f"({joined((v * 1000 for v in steps[mode]), '.2f')})")
    print(f"STEP_TIME_RATIO peer-copy/no-copy {medians['peer-copy'] / medians['no-copy']:.4f} "
          f"({percent_more(medians['peer-copy'], medians['no-copy']):+.2f} %)")
    paired = [percent_more(a, b) for a, b in zip(steps["peer-copy"], steps["no-copy"])]
    print(f"STEP_TIME_PAIRED {joined(paired, '+.2f')} % (mean {statistics.mean(paired):+.2f} %)")
    copies = [run["copy_bytes"] for run in runs["peer-copy"]]
    per_rank = {rank: max(c.get(rank, 0) for c in copies) for rank in range(4)}
    print("PEER_COPY_HOST_BYTES " + ", ".join(f"rank {r}: {b}" for r, b in per_rank.items()))
    print(f"no-copy runs reported a copy: {any(run['copy_bytes'] for run in runs['no-copy'])}")
    print_critical_path(runs["peer-copy"])


def print_critical_path(runs: list[dict]) -> None:
    """Each rank's time in the copy per step, and the slowest rank's share of the step time
    (each run against its own median step time; the median over the runs)."""
    for rank in range(4):
        per_step = [run["copy_critical_s"][rank] * 1000 for run in runs
                    if rank in run["copy_critical_s"]]
        print(f"rank {rank}: {joined(per_step, '.3f')} ms in the copy per step")
    shares = [100 * max(run["copy_critical_s"].values()) / run["median_step_time_s"]
              for run in runs]
    print(f"PEER_COPY_CRITICAL_PATH slowest rank {statistics.median(shares):.2f} % of the step "
          f"time ({joined(shares, '.2f')} %; goal <= 2 %)")


if __name__ == "__main__":
    main()
