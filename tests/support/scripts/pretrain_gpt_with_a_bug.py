"""examples/pretrain_gpt.py with a bug in its training code, for the tests of errors that are
not lost peers.

``BUG_AT=RANK:ITERATION`` makes global rank RANK raise, in the forward pass of its second
micro-batch of ITERATION (counted from 0), a RuntimeError whose text reads like gloo's error
for a lost peer. No peer is lost: the launcher must not replace the rank.
"""

import importlib.util
import os
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "pretrain_gpt.py"


def load_example():
    spec = importlib.util.spec_from_file_location("pretrain_gpt_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def add_bug(example, rank: int, iteration: int) -> None:
    train_step, forward_step = example.train_step, example.forward_step
    now = {"iteration": -1, "forwards": 0}

    def counting_train_step(args, model, optimizer, scheduler, dataset, at: int):
        now.update(iteration=at, forwards=0)
        return train_step(args, model, optimizer, scheduler, dataset, at)

    def buggy_forward_step(data_iterator, model):
        import torch.distributed as dist

        now["forwards"] += 1
        if (dist.get_rank(), now["iteration"], now["forwards"]) == (rank, iteration, 2):
            raise RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                               "(a bug in the training code: no peer was lost)")
        return forward_step(data_iterator, model)

    example.train_step, example.forward_step = counting_train_step, buggy_forward_step


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    example = load_example()
    rank, iteration = map(int, os.environ["BUG_AT"].split(":"))
    add_bug(example, rank, iteration)
    example.main()
