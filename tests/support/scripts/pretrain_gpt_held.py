"""examples/pretrain_gpt.py whose rank 0 can be held between steps, for tests that must act
(a kill once a refilled standby is ready) while the job still trains, however slow the machine.

``HOLD_FILE=PATH``: once it has finished a step in its current generation (the job has
resumed), rank 0 waits before each next step while PATH holds that generation's number; the
other ranks wait for it in their collectives, so a hold must end within the collective timeout
(60 s). The test writes the next generation's number to release it, so a hold never outlasts
the generation it was meant for.
"""

import os
import time
from pathlib import Path

from pretrain_gpt_with_a_bug import load_example

POLL_S = 0.02


def add_hold(example, hold_file: Path) -> None:
    train, train_step = example.train, example.train_step
    progress = {}
    first_step = {}  # generation -> the first iteration rank 0 began in it

    def train_capturing_progress(args, model, optimizer, scheduler, dataset, iteration,
                                 resilience):
        progress["reporter"] = resilience.progress
        return train(args, model, optimizer, scheduler, dataset, iteration, resilience)

    def held_train_step(args, model, optimizer, scheduler, dataset, iteration: int):
        import torch.distributed as dist

        generation = progress["reporter"].generation
        if dist.get_rank() == 0 and first_step.setdefault(generation, iteration) < iteration:
            while _read(hold_file) == str(generation):
                time.sleep(POLL_S)
        return train_step(args, model, optimizer, scheduler, dataset, iteration)

    example.train, example.train_step = train_capturing_progress, held_train_step


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        return ""


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    example = load_example()
    add_hold(example, Path(os.environ["HOLD_FILE"]))
    example.main()
