#!/usr/bin/env python
"""A DeepSpeed user's data-parallel training script: DeepSpeed's and PyTorch's API, nothing else.

``deepspeed.init_distributed`` (unless ``--no-init-distributed``: then ``deepspeed.initialize``
makes the call), a small next-token model, ``deepspeed.initialize`` with the
config named by ``--deepspeed_config`` (any ZeRO stage), a ``DataLoader`` over this rank's share
of a fixed dataset (``DistributedSampler``; with ``--shuffle`` shuffled, ``set_epoch`` every
epoch; ``--samples N`` of them, ``--workers N`` worker processes), and per step
``gradient_accumulation_steps`` times ``engine(tokens)``, the loss computed by the script from
the logits, ``engine.backward(loss)`` and ``engine.step()``; with ``--save``/``--load``,
DeepSpeed's checkpoints, resuming at the step the checkpoint holds. Rank 0 prints
``step N/M | loss L`` per step (its micro-batches' mean loss); at the end ``PARAMS_DIGEST
<hex>``: a SHA-256 of every parameter as rank 0 sees it (gathered at ZeRO stage 3), so equal for
two runs only if they ended bit-identical.

The randomness users' scripts have: ``--dropout P`` in every block (torch's CPU generator, the
GPU's with CUDA); ``--augment`` shifts each micro-batch's token ids (and labels) by an offset
drawn from Python's ``random`` and one from NumPy's global state, between the calls;
``--seed-by-rank`` seeds all three with ``1234 + rank`` instead of 1234 on every rank (the rank from
torch.distributed, or before ``deepspeed.initialize`` from ``RANK``); ``--worker-augment`` shifts
each sample's token ids by an offset the loader's worker process draws from its own streams
(seeded by the loader from the main process's torch stream, each epoch).

``--step-min-s S`` makes every step last at least S seconds (a test's room for a migration's
standby to get ready while the job trains).

Given ``--local_rank=N`` (the deepspeed launcher's argument), it prints ``LOCAL_RANK_ARG N`` and
checks that N is the process's ``LOCAL_RANK``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import random
import sys
import time

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from tiny_lm import HIDDEN, SAMPLES, VOCAB, Block, dataset, next_token_loss


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--save", default=None)
    parser.add_argument("--load", default=None)
    parser.add_argument("--save-interval", type=int, default=0)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--no-init-distributed", action="store_true",
                        help="leave torch.distributed to deepspeed.initialize")
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--augment", action="store_true")
    parser.add_argument("--shuffle", action="store_true")
    parser.add_argument("--seed-by-rank", action="store_true")
    parser.add_argument("--samples", type=int, default=SAMPLES)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--worker-augment", action="store_true")
    parser.add_argument("--step-min-s", type=float, default=0.0)
    return deepspeed.add_config_arguments(parser).parse_args()


class NextTokenModel(nn.Module):
    def __init__(self, layers: int, dropout: float) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block(dropout) for _ in range(layers))
        self.output = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embedding(tokens)
        for block in self.blocks:
            hidden = block(hidden)
        return self.output(hidden)


def main() -> None:
    args = parse_args()
    if args.local_rank != -1:  # the deepspeed launcher's argument: it must be LOCAL_RANK
        # One write for the whole line: every process prints it at start, at once (print
        # may write the text and its newline apart, and another line can come between).
        sys.stdout.write(f"LOCAL_RANK_ARG {args.local_rank}\n")
        sys.stdout.flush()
        if str(args.local_rank) != os.environ.get("LOCAL_RANK"):
            raise SystemExit(f"--local_rank={args.local_rank} but LOCAL_RANK="
                             f"{os.environ.get('LOCAL_RANK')}")
    if not args.no_init_distributed:
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    seed(1234 + (rank() if args.seed_by_rank else 0))
    model = NextTokenModel(args.layers, args.dropout)
    engine, _, _, _ = deepspeed.initialize(args=args, model=model,
                                           model_parameters=model.parameters())
    start = 0
    if args.load and os.path.exists(os.path.join(args.load, "latest")):
        engine.load_checkpoint(args.load)
        start = engine.global_steps
    accumulation = engine.gradient_accumulation_steps()
    batches = repeat(data_loader(engine, args), args.augment)
    for _ in range(start * accumulation):
        next(batches)  # resume where the checkpoint's step left the data
    for step in range(start, args.steps):
        began = time.perf_counter()
        total = 0.0
        for _ in range(accumulation):
            tokens, labels = next(batches)
            loss = next_token_loss(engine(tokens), labels)
            engine.backward(loss)
            engine.step()
            total += loss.item()
        if dist.get_rank() == 0:
            print(f"step {step + 1}/{args.steps} | loss {total / accumulation:.6f}", flush=True)
        if args.save and args.save_interval and (step + 1) % args.save_interval == 0:
            engine.save_checkpoint(args.save)
        time.sleep(max(0.0, began + args.step_min_s - time.perf_counter()))
    report_digest(engine)
    dist.destroy_process_group()


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def seed(value: int) -> None:
    random.seed(value)
    np.random.seed(value)
    torch.manual_seed(value)


class Shifted(Dataset):
    """Each sample's tokens and labels shifted by an offset drawn where it is read."""

    def __init__(self, samples: Dataset) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        tokens, labels = self.samples[index]
        shift = int(torch.randint(VOCAB, ()))
        return (tokens + shift) % VOCAB, (labels + shift) % VOCAB


def data_loader(engine, args: argparse.Namespace) -> DataLoader:
    samples = dataset(args.samples)
    if args.worker_augment:
        samples = Shifted(samples)
    sampler = DistributedSampler(samples, num_replicas=dist.get_world_size(),
                                 rank=dist.get_rank(), shuffle=args.shuffle, seed=1234)
    return DataLoader(samples, batch_size=engine.train_micro_batch_size_per_gpu(),
                      sampler=sampler, drop_last=True, num_workers=args.workers)


def repeat(loader: DataLoader, augment: bool):
    epoch = 0
    while True:
        loader.sampler.set_epoch(epoch)
        for tokens, labels in loader:
            if augment:
                shift = random.randrange(VOCAB) + int(np.random.randint(VOCAB))
                tokens, labels = (tokens + shift) % VOCAB, (labels + shift) % VOCAB
            yield tokens, labels
        epoch += 1


def report_digest(engine) -> None:
    parameters = list(engine.module.parameters())
    gathered = (deepspeed.zero.GatheredParameters(parameters)
                if engine.zero_optimization_stage() == 3 else contextlib.nullcontext())
    with gathered:
        sha = hashlib.sha256()
        for parameter in parameters:
            sha.update(parameter.detach().cpu().contiguous().numpy().tobytes())
    if dist.get_rank() == 0:
        print(f"PARAMS_DIGEST {sha.hexdigest()}", flush=True)


if __name__ == "__main__":
    main()
