#!/usr/bin/env python
"""A DeepSpeed user's pipeline training script: DeepSpeed's and PyTorch's API, nothing else.

``deepspeed.init_distributed``, a ``PipelineModule``, ``deepspeed.initialize`` with the config
named by ``--deepspeed_config``, a ``DataLoader`` over this rank's share of a fixed dataset
(``DistributedSampler`` over the data-parallel ranks, no shuffling; with ``--engine-loader`` the
engine's own loader, which reads it in the same order) and ``engine.train_batch`` once per
step (``--dropout P`` in every block); with ``--save``/``--load``, DeepSpeed's checkpoints,
resuming at the step the checkpoint holds. The last rank prints ``step N/M | loss L`` per step;
at the end rank 0 prints ``PARAMS_DIGEST <hex>``: a SHA-256 of every parameter, stage after
stage, taken on the first data-parallel rank of each stage, so equal for two runs only if they
ended bit-identical.
"""

from __future__ import annotations

import argparse
import hashlib
import os

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.pipe import LayerSpec, PipelineModule
from deepspeed.utils import RepeatingLoader
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from tiny_lm import HIDDEN, VOCAB, Block, dataset, next_token_loss


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--save", default=None)
    parser.add_argument("--load", default=None)
    parser.add_argument("--save-interval", type=int, default=0)
    parser.add_argument("--engine-loader", action="store_true",
                        help="hand the dataset to deepspeed.initialize (training_data) and call "
                             "train_batch() without an iterator; no --load then")
    parser.add_argument("--loader-workers", type=int, default=0,
                        help="worker processes of the script's own DataLoader")
    parser.add_argument("--spawn-workers", action="store_true",
                        help="start the loader's workers with 'spawn' instead of 'fork'")
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--local_rank", type=int, default=-1)
    return deepspeed.add_config_arguments(parser).parse_args()


class Embedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, HIDDEN)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tokens(tokens)


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.output = nn.Linear(HIDDEN, VOCAB)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.output(hidden)


def main() -> None:
    args = parse_args()
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    blocks = [LayerSpec(Block, args.dropout) for _ in range(args.layers)]
    layers = [LayerSpec(Embedding), *blocks, LayerSpec(Head)]
    model = PipelineModule(layers=layers, num_stages=args.stages, loss_fn=next_token_loss,
                           partition_method="uniform", seed_layers=True, base_seed=1234,
                           activation_checkpoint_interval=0)
    engine, _, _, _ = deepspeed.initialize(args=args, model=model,
                                           model_parameters=model.parameters(),
                                           training_data=dataset() if args.engine_loader else None)
    start = 0
    if args.load and os.path.exists(os.path.join(args.load, "latest")):
        engine.load_checkpoint(args.load)
        start = engine.global_steps
    batches = None if args.engine_loader else iter(RepeatingLoader(data_loader(engine, args)))
    for _ in range(start * engine.gradient_accumulation_steps()):
        next(batches)  # resume where the checkpoint's step left the data
    for step in range(start, args.steps):
        loss = engine.train_batch(data_iter=batches)
        if dist.get_rank() == dist.get_world_size() - 1:
            print(f"step {step + 1}/{args.steps} | loss {loss.item():.6f}", flush=True)
        if args.save and args.save_interval and (step + 1) % args.save_interval == 0:
            engine.save_checkpoint(args.save)
    report_digest(engine)
    dist.destroy_process_group()


def data_loader(engine, args: argparse.Namespace) -> DataLoader:
    grid = engine.grid
    sampler = DistributedSampler(dataset(), num_replicas=grid.get_data_parallel_world_size(),
                                 rank=grid.get_data_parallel_rank(), shuffle=False)
    context = "spawn" if args.spawn_workers and args.loader_workers else None
    return DataLoader(sampler.dataset, batch_size=engine.train_micro_batch_size_per_gpu(),
                      sampler=sampler, drop_last=True, num_workers=args.loader_workers,
                      multiprocessing_context=context)


def report_digest(engine) -> None:
    grid = engine.grid
    mine = None
    if grid.get_data_parallel_rank() == 0:
        sha = hashlib.sha256()
        for _, parameter in engine.module.named_parameters():
            sha.update(parameter.detach().cpu().contiguous().numpy().tobytes())
        mine = (grid.get_stage_id(), sha.hexdigest())
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() == 0:
        stages = sorted(entry for entry in gathered if entry is not None)
        total = hashlib.sha256("".join(digest for _, digest in stages).encode()).hexdigest()
        print(f"PARAMS_DIGEST {total}", flush=True)


if __name__ == "__main__":
    main()
