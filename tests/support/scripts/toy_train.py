"""A tiny torch.distributed job for launcher tests: no Megatron, starts in about a second.

Each step all-reduces a tensor and adds it to a running state; with ``--save DIR`` every rank
writes its state after each step and resumes from it on start. At the end rank 0 prints
``PARAMS_DIGEST`` of all ranks' states, so runs with and without interruptions compare exactly.
"""

import argparse
import hashlib
import os
import time

import torch
import torch.distributed as dist

from mover_plugin.progress import ProgressReporter


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--step-time", type=float, default=0.05)
    parser.add_argument("--save", default=None)
    parser.add_argument("--exit-code-at", default=None, help="RANK:STEP:CODE — exit with CODE")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    progress = ProgressReporter.from_env()
    state, start = torch.zeros(4, dtype=torch.float64), 0
    path = os.path.join(args.save, f"rank{rank}.pt") if args.save else None
    if args.save:
        os.makedirs(args.save, exist_ok=True)
    if path and os.path.exists(path):
        saved = torch.load(path)
        state, start = saved["state"], saved["step"]
    progress.ready(start)
    for step in range(start + 1, args.steps + 1):
        began = time.time()
        progress.step_begin(step)
        if args.exit_code_at:
            r, s, code = map(int, args.exit_code_at.split(":"))
            if (r, s) == (rank, step):
                os._exit(code)
        contribution = torch.full((4,), float(rank + step), dtype=torch.float64)
        dist.all_reduce(contribution)
        state = state * 0.5 + contribution
        time.sleep(args.step_time)
        if path:
            torch.save({"state": state, "step": step}, path + ".tmp")
            os.replace(path + ".tmp", path)
        progress.step_end(step, time.time() - began)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, state.tolist())
    if rank == 0:
        print("PARAMS_DIGEST", hashlib.sha256(repr(gathered).encode()).hexdigest(), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
