#!/usr/bin/env python
"""Pretrain a small GPT with DeepSpeed: a ``PipelineModule`` with pipeline and data parallelism
and ZeRO stage 1, on CPU or GPU.

With no arguments it trains 20 steps with ``examples/ds_config.json`` (ZeRO-1, Adam, warm-up
schedule) and two pipeline stages; under four processes that is PP2 x DP2::

    mover-launch --num_gpus 4 examples/ds_pretrain_gpt.py
    deepspeed --num_gpus 4 examples/ds_pretrain_gpt.py          # or torchrun --nproc-per-node 4

With a ``"resilience"`` block in the config (``examples/ds_config_resilient.json``) and
``mover-launch``, a rank that dies is replaced in the running job by a standby, and
``mover migrate`` moves a rank to one (see mover_plugin.deepspeed.resilience). It trains on the
corpus shipped with mover_plugin, in the same sample order as ``examples/pretrain_gpt.py``
(Megatron-LM's), and prints one line per step and, at the end, ``PARAMS_DIGEST <hex>``: a hash
of every parameter of every rank, equal for two runs only if they ended bit-identical.

The flags and the config are checked before DeepSpeed is imported (it takes seconds), so bad
input fails at once; that is why DeepSpeed's imports sit inside the functions below.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from mover_plugin.deepspeed.arguments import parse_args_or_exit

DEFAULT_CONFIG = str(Path(__file__).resolve().with_name("ds_config.json"))


def main() -> None:
    args = parse_args_or_exit(default_config=DEFAULT_CONFIG)
    quiet_known_warnings()
    apply_cpu_patches_if_needed()
    dataset = build_dataset(args)
    # None without a "resilience" block; a standby waits in here until it is promoted.
    resilience = start_resilience(args)
    initialize_distributed(resilience)
    if resilience is None:
        engine = build_engine(args)
    else:  # a promoted standby builds with its collectives kept local
        engine = resilience.build_engine(lambda: build_engine(args))
    iteration = first_iteration(args, resilience, engine)
    train(args, engine, dataset, iteration, resilience)
    report_params_digest(engine)
    if resilience is not None and resilience.peer_copy:
        report_peer_copy(resilience)
    shutdown(resilience)


# -- setup ----------------------------------------------------------------------------------


def quiet_known_warnings() -> None:
    """Megatron-Core's dataset (the shared data pipeline) warns on every rank about its index
    cache, which this script does not use."""
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("megatron.core.datasets.gpt_dataset").setLevel(logging.ERROR)


def apply_cpu_patches_if_needed() -> None:
    """DeepSpeed builds a shared-memory op and expects LOCAL_RANK on CPU; the opt-in patches
    stand in for both (and let a step that lost a peer be entered again). Under
    ``mover-launch`` the worker command has applied them already."""
    from mover_plugin.patches import apply_inactive_patches

    if not torch.cuda.is_available():
        apply_inactive_patches("deepspeed-cpu")


def start_resilience(args: argparse.Namespace):
    if args.resilience is None or not args.resilience.settings.enabled:
        return None
    from mover_plugin.deepspeed.resilience import DeepSpeedResilience

    return DeepSpeedResilience.start(args.resilience,
                                     pipeline_parallel_size=args.pipeline_parallel_size)


def initialize_distributed(resilience) -> None:
    import deepspeed

    if resilience is not None:
        # Abortable groups in the namespace of the current generation.
        resilience.initialize_distributed()
    deepspeed.init_distributed()


def build_dataset(args: argparse.Namespace):
    """The same dataset on every rank, built without any collective."""
    from mover_plugin.data import build_gpt_dataset, ensure_default_dataset, make_byte_tokenizer

    tokenizer = make_byte_tokenizer()
    prefix = args.data_path or ensure_default_dataset(args.data_cache_path)
    args.padded_vocab_size = -(-tokenizer.vocab_size // 128) * 128
    micro = args.ds_config["train_micro_batch_size_per_gpu"]
    accumulation = args.ds_config.get("gradient_accumulation_steps", 1)
    args.global_batch_size = micro * accumulation * args.data_parallel_size
    return build_gpt_dataset(prefix, seq_length=args.seq_length,
                             num_samples=args.train_iters * args.global_batch_size,
                             seed=args.seed, tokenizer=tokenizer)


def build_engine(args: argparse.Namespace):
    """The GPT as a PipelineModule, wrapped by ``deepspeed.initialize``."""
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule

    layers = [LayerSpec(Embedding, args.padded_vocab_size, args.hidden_size, args.seq_length)]
    layers += [LayerSpec(Block, args.hidden_size, args.num_attention_heads)
               for _ in range(args.num_layers)]
    layers.append(LayerSpec(Head, args.hidden_size, args.padded_vocab_size))
    # seed_layers: each layer's initial weights depend on its index only, not on the stage
    # that builds it.
    module = PipelineModule(layers=layers, num_stages=args.pipeline_parallel_size,
                            loss_fn=masked_mean_loss, partition_method="uniform",
                            seed_layers=True, base_seed=args.seed, activation_checkpoint_interval=0)
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=module.parameters(),
                                           config=args.ds_config)
    return engine


def first_iteration(args: argparse.Namespace, resilience, engine) -> int:
    """0, or the checkpoint's iteration; a joining standby gets its state from a live rank
    (or, after a rollback, from the checkpoint)."""
    def load():
        return load_checkpoint(args, engine)

    if resilience is None:
        return load() or 0
    resilience.attach(engine, load=load)
    return resilience.first_iteration()


def load_checkpoint(args: argparse.Namespace, engine):
    """The iteration of the latest checkpoint in ``--load``, loaded; None if there is none."""
    if not args.load or not (Path(args.load) / "latest").exists():
        return None
    _, client_state = engine.load_checkpoint(args.load)
    iteration = int(client_state["iteration"])
    if is_logging_rank():
        print(f"resumed from {args.load} at step {iteration}", flush=True)
    return iteration


def save_checkpoint(args: argparse.Namespace, engine, iteration: int) -> None:
    engine.save_checkpoint(args.save, tag=f"iter_{iteration:07d}",
                           client_state={"iteration": iteration})


# -- the model ------------------------------------------------------------------------------


class Embedding(nn.Module):
    """Token and learned position embeddings."""

    def __init__(self, vocab_size: int, hidden_size: int, seq_length: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, hidden_size)
        self.positions = nn.Embedding(seq_length, hidden_size)

    def forward(self, tokens):
        positions = torch.arange(tokens.size(1), device=tokens.device)
        return self.tokens(tokens) + self.positions(positions)[None]


class Block(nn.Module):
    """A pre-norm transformer layer with causal self-attention."""

    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(hidden_size)
        self.attention = nn.MultiheadAttention(hidden_size, num_heads, batch_first=True)
        self.mlp_norm = nn.LayerNorm(hidden_size)
        self.mlp = nn.Sequential(nn.Linear(hidden_size, 4 * hidden_size), nn.GELU(),
                                 nn.Linear(4 * hidden_size, hidden_size))

    def forward(self, hidden):
        length = hidden.size(1)
        causal = torch.ones(length, length, dtype=torch.bool, device=hidden.device).triu(1)
        normed = self.attention_norm(hidden)
        attended, _ = self.attention(normed, normed, normed, attn_mask=causal,
                                     need_weights=False)
        hidden = hidden + attended
        return hidden + self.mlp(self.mlp_norm(hidden))


class Head(nn.Module):
    """Final norm and the output projection to the vocabulary."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden_size)
        self.output = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, hidden):
        return self.output(self.norm(hidden))


def masked_mean_loss(logits, targets):
    labels, loss_mask = targets
    losses = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1),
                             reduction="none")
    mask = loss_mask.reshape(-1).float()
    return (losses * mask).sum() / mask.sum()


# -- training -------------------------------------------------------------------------------


def train(args: argparse.Namespace, engine, dataset, iteration: int, resilience) -> None:
    from mover_plugin.progress import ProgressReporter

    progress = resilience.progress if resilience else ProgressReporter.from_env()
    progress.ready(iteration)

    def step(iteration: int):
        loss = engine.train_batch(data_iter=microbatches(engine, dataset, iteration))
        if args.save and ((iteration + 1) % (args.save_interval or args.train_iters) == 0
                          or iteration + 1 == args.train_iters):
            save_checkpoint(args, engine, iteration + 1)
        return float(loss)

    while iteration < args.train_iters:
        started = time.perf_counter()
        if resilience is not None:
            resilience.before_step()  # the last step's peer copy is complete from here on
        progress.step_begin(iteration + 1)
        if resilience is None:
            loss, iteration = step(iteration), iteration + 1
        else:
            # Redone in the next generation if a rank is lost; None if completed in a switch.
            loss, iteration = resilience.run_step(iteration, step)
        step_time = time.perf_counter() - started
        if is_logging_rank() and iteration % args.log_interval == 0:
            shown = f"{loss:.6f}" if loss is not None else "nan"
            print(f"step {iteration:5d}/{args.train_iters} | loss {shown} | "
                  f"lr {engine.get_lr()[0]:.3e} | step time {step_time * 1000:.1f} ms", flush=True)
        progress.step_end(iteration, time.perf_counter() - started)


def microbatches(engine, dataset, iteration: int):
    """This rank's micro-batches of global batch ``iteration`` as (tokens, (labels, mask)), in
    Megatron-LM's sample order."""
    from mover_plugin.data import get_microbatch, microbatch_sample_indices

    grid = engine.grid
    micro = engine.train_micro_batch_size_per_gpu()
    for index in range(engine.gradient_accumulation_steps()):
        samples = microbatch_sample_indices(
            iteration, index, grid.get_data_parallel_rank(), micro_batch_size=micro,
            data_parallel_size=grid.get_data_parallel_world_size(),
            global_batch_size=engine.train_batch_size())
        batch = get_microbatch(dataset, samples)
        yield batch["tokens"], (batch["labels"], batch["loss_mask"])


# -- reporting ------------------------------------------------------------------------------


def is_logging_rank() -> bool:
    import torch.distributed as dist

    return dist.get_rank() == dist.get_world_size() - 1


def report_params_digest(engine) -> None:
    import torch.distributed as dist

    from mover_plugin.digest import report_params_digest as report
    from mover_plugin.layout import ParallelLayout

    report(engine.module.named_parameters(),
           ParallelLayout.for_world(dist.get_world_size(), 1, engine.num_stages))


def report_peer_copy(resilience) -> None:
    """The memory each rank spends on the optimizer shard it keeps for a peer."""
    import torch.distributed as dist

    sizes = [None] * dist.get_world_size()
    dist.all_gather_object(sizes, resilience.peer_copy_bytes)
    if dist.get_rank() == 0:
        print("PEER_COPY_MB " + ",".join(f"{size / 2**20:.3f}" for size in sizes), flush=True)


def shutdown(resilience) -> None:
    import torch.distributed as dist

    if resilience is not None:
        resilience.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
