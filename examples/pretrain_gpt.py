#!/usr/bin/env python
"""Pretrain a small GPT with Megatron-Core: tensor, pipeline and data parallel, on CPU or GPU.

The flags are Megatron-LM's; for example, on 4 CPU processes with TP1 x PP2 x DP2::

    mover-launch --standalone --nproc-per-node 4 examples/pretrain_gpt.py \\
        --pipeline-model-parallel-size 2 --num-layers 4 --hidden-size 64 \\
        --num-attention-heads 4 --seq-length 64 --micro-batch-size 2 --global-batch-size 8 \\
        --train-iters 10 --lr 1e-3 --save ckpt --load ckpt --save-interval 1

(``torchrun`` in place of ``mover-launch`` works too.) With ``--resilient`` under
``mover-launch --policy resilient`` a rank that dies is replaced in the running job by a
standby (see mover_plugin.megatron.resilience). Without ``--data-path`` it trains on the
corpus shipped with mover_plugin, tokenized as bytes and built into an indexed dataset on first
use. It prints one line per step and, at the end, ``PARAMS_DIGEST <hex>``: a hash of every
parameter of every rank, equal for two runs only if they ended bit-identical.

The flags are checked before Megatron-Core is imported (the import takes seconds), so bad
input fails at once; that is why the framework imports sit inside the functions below.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import time
import warnings
from datetime import timedelta
from functools import partial

from mover_plugin.megatron.arguments import parse_args_or_exit
from mover_plugin.runtime.settings import add_resilience_args


def main() -> None:
    args = parse_args_or_exit(extra_args_provider=add_resilience_args)
    quiet_known_warnings()
    apply_cpu_patches_if_needed()
    dataset = build_dataset(args)
    # None without --resilient; a standby warms up and waits in here.
    resilience = start_resilience(args, dataset)
    initialize_distributed(args, resilience)
    if resilience is None:
        model, optimizer, scheduler = setup_model_and_optimizer(args)
    else:  # a promoted standby may have its model built already
        model, optimizer, scheduler = resilience.build_model(partial(setup_model_and_optimizer,
                                                                     args))
    iteration = first_iteration(args, resilience, model, optimizer, scheduler)
    train(args, model, optimizer, scheduler, dataset, iteration, resilience)
    if resilience is not None and resilience.on_templates:
        # The job ended on pipeline templates: the parameters went to --save, by unit.
        if is_logging_rank():
            print("PARAMS_DIGEST none: the job ended on pipeline templates", flush=True)
    else:
        report_params_digest(args, model)
    shutdown(resilience)


# -- setup ----------------------------------------------------------------------------------


def quiet_known_warnings() -> None:
    """Megatron-Core warns on every rank about optional CUDA extensions this run does not use,
    and about experimental or deprecated parts it does not use either."""
    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings("ignore", message=".*Apex (is|are) not installed")
    warnings.filterwarnings("ignore", message="full scope is deprecated")
    warnings.filterwarnings("ignore", message="MimoModelConfig is experimental")
    warnings.filterwarnings("ignore", message="Only transformer-engine>=")
    warnings.filterwarnings("ignore", message="absl.logging is not installed")
    logging.getLogger("megatron.core.datasets.gpt_dataset").setLevel(logging.ERROR)
    # Megatron-Core 0.19 announces on every rank that GPTModel takes only bug fixes from now on.
    logging.getLogger("megatron.core.models.gpt.gpt_model").setLevel(logging.ERROR)


def apply_cpu_patches_if_needed() -> None:
    """Megatron-Core assumes CUDA in a few places; the opt-in CPU patches stand in for it."""
    import torch

    if not torch.cuda.is_available():
        from mover_plugin.patches import apply_inactive_patches

        # Those mover-launch's worker command has not applied already (notriton).
        apply_inactive_patches("megatron-cpu")


def start_resilience(args: argparse.Namespace, dataset):
    """The resilience runtime; a standby warms up in the sandbox by building the model of each
    pipeline stage and running a few training steps on it, with this script's own code."""
    from mover_plugin.megatron.resilience import MegatronResilience
    from mover_plugin.megatron.standby import StandbyWarmUp

    def build():
        seed_for_stage(args)
        return setup_model_and_optimizer(args)

    warm = StandbyWarmUp(
        parallel=parallel_kwargs(args),
        build=build,
        shadow_step=lambda model, optimizer, scheduler: train_step(
            args, model, optimizer, scheduler, dataset, 0),
    )
    resilience = MegatronResilience.start(args, warm)
    if resilience is not None:
        # Without a ready standby, a lost rank's survivors go on alone on pipeline templates.
        resilience.enable_templates(stage_recipe(args, dataset))
    return resilience


def parallel_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
        create_gloo_process_groups=args.enable_gloo_process_groups,
    )


def initialize_distributed(args: argparse.Namespace, resilience) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel = parallel_kwargs(args)
    if resilience is not None:
        # Abortable groups in the namespace of the current generation.
        resilience.initialize_distributed(**parallel)
    else:
        backend = args.distributed_backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(backend,
                                timeout=timedelta(minutes=args.distributed_timeout_minutes))
        parallel_state.initialize_model_parallel(**parallel)
    seed_for_stage(args)


def seed_for_stage(args: argparse.Namespace) -> None:
    """As Megatron-LM: one seed per pipeline stage; data-parallel replicas draw the same
    numbers."""
    import numpy as np
    import torch
    from megatron.core import parallel_state, tensor_parallel

    seed = args.seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def build_dataset(args: argparse.Namespace):
    """The same dataset on every rank, built without any collective (a standby builds it while
    it waits). The shipped corpus is built into the cache on first use; concurrent builds are
    safe (files are written under temporary names and renamed)."""
    from mover_plugin.data import build_gpt_dataset, ensure_default_dataset, make_byte_tokenizer

    tokenizer = make_byte_tokenizer()
    prefix = args.data_path or ensure_default_dataset(args.data_cache_path)
    args.padded_vocab_size = padded_vocab_size(tokenizer.vocab_size, args)
    return build_gpt_dataset(
        prefix,
        seq_length=args.seq_length,
        num_samples=args.train_iters * args.global_batch_size,
        seed=args.seed,
        tokenizer=tokenizer,
    )


def padded_vocab_size(vocab_size: int, args: argparse.Namespace) -> int:
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return -(-vocab_size // multiple) * multiple


def setup_model_and_optimizer(args: argparse.Namespace):
    import torch
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer

    model = build_gpt(args, num_layers=args.num_layers,
                      pre_process=parallel_state.is_pipeline_first_stage(),
                      post_process=parallel_state.is_pipeline_last_stage(),
                      pipeline_size=args.pipeline_model_parallel_size)
    config = model.config
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    ddp_config = DistributedDataParallelConfig(
        overlap_grad_reduce=args.overlap_grad_reduce,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    optimizer = get_megatron_optimizer(optimizer_config(args), [model],
                                       use_gloo_process_groups=args.enable_gloo_process_groups)
    scheduler = build_scheduler(args, optimizer)
    # The schedule calls these between micro-batches and after the last one.
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = model.no_sync
    return model, optimizer, scheduler


def build_gpt(args: argparse.Namespace, *, num_layers: int, pre_process: bool,
              post_process: bool, pipeline_size: int = 1, pg_collection=None):
    """The GPT model of one pipeline stage of ``num_layers`` transformer layers; with
    ``pg_collection`` a stage of a pipeline template (its groups given, not parallel_state's)."""
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_size,
        pipeline_dtype=torch.float32,
        params_dtype=torch.float32,
        use_cpu_initialization=not torch.cuda.is_available(),
    )
    extra = {} if pg_collection is None else {"pg_collection": pg_collection}
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type="learned_absolute",
        **extra,
    )


def optimizer_config(args: argparse.Namespace):
    import torch
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer="adam",
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        clip_grad=args.clip_grad,
        params_dtype=torch.float32,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )


def build_scheduler(args: argparse.Namespace, optimizer):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    samples = args.global_batch_size
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if args.lr_warmup_iters else args.lr,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * samples,
        lr_decay_steps=args.lr_decay_iters * samples,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * samples,
        wd_incr_style="constant",
    )


def stage_recipe(args: argparse.Namespace, dataset):
    """How a stage of a pipeline template is built and trained, with this script's model,
    optimizer, schedule and data (mover_plugin.megatron.templates.stage)."""
    from mover_plugin.data import get_microbatch, microbatch_sample_indices
    from mover_plugin.megatron.templates.stage import StageRecipe

    def microbatch(iteration: int, slot: int):
        # Slot s of the global batch is Megatron's micro-batch s // DP of data-parallel rank
        # s % DP: the same samples, whichever pipeline trains on it.
        index, dp_rank = divmod(slot, args.data_parallel_size)
        return get_microbatch(dataset, microbatch_sample_indices(
            iteration, index, dp_rank, micro_batch_size=args.micro_batch_size,
            data_parallel_size=args.data_parallel_size,
            global_batch_size=args.global_batch_size))

    return StageRecipe(
        build_model=partial(build_gpt, args),
        optimizer_config=optimizer_config(args),
        build_scheduler=partial(build_scheduler, args),
        forward_step=forward_step,
        microbatch=microbatch,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        global_batch_size=args.global_batch_size,
    )


def first_iteration(args, resilience, model, optimizer, scheduler) -> int:
    """0, or the checkpoint's iteration; a joining standby gets everything from its twin."""
    def load() -> int:
        return load_checkpoint(args, model, optimizer, scheduler) if args.load else 0

    if resilience is None:
        return load()
    resilience.attach(model, optimizer, scheduler)
    return resilience.first_iteration(load)


def shard_id():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from mover_plugin.megatron.checkpoint import ShardId

    return ShardId(
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        dp_rank=dist.get_rank(ps.get_data_parallel_group()),
    )


def load_checkpoint(args, model, optimizer, scheduler) -> int:
    from mover_plugin.megatron import checkpoint

    iteration = checkpoint.load_checkpoint(args.load, shard_id(), model=model,
                                           optimizer=optimizer, scheduler=scheduler)
    if iteration and is_logging_rank():
        print(f"resumed from {args.load} at step {iteration}", flush=True)
    return iteration


def save_checkpoint(args, iteration: int, model, optimizer, scheduler) -> None:
    from megatron.core import parallel_state

    from mover_plugin.megatron import checkpoint

    checkpoint.save_checkpoint(args.save, iteration, shard_id(), model=model,
                               optimizer=optimizer, scheduler=scheduler,
                               data_parallel_group=parallel_state.get_data_parallel_group())


# -- training -------------------------------------------------------------------------------


def train(args, model, optimizer, scheduler, dataset, iteration: int, resilience) -> None:
    from mover_plugin.progress import ProgressReporter

    progress = resilience.progress if resilience else ProgressReporter.from_env()
    progress.ready(iteration)

    def step(iteration: int):
        result = train_step(args, model, optimizer, scheduler, dataset, iteration)
        if args.save and ((iteration + 1) % (args.save_interval or args.train_iters) == 0
                          or iteration + 1 == args.train_iters):
            save_checkpoint(args, iteration + 1, model, optimizer, scheduler)
        return result

    while iteration < args.train_iters:
        started = time.perf_counter()
        progress.step_begin(iteration + 1)
        if resilience is None:
            result, iteration = step(iteration), iteration + 1
        else:
            # Redone in the next generation if a rank is lost; None if completed in a switch.
            result, iteration = resilience.run_step(iteration, step)
        step_time = time.perf_counter() - started
        if is_logging_rank() and iteration % args.log_interval == 0:
            log_step(args, iteration, result, optimizer, step_time)
        progress.step_end(iteration, time.perf_counter() - started)


def log_step(args, iteration: int, result, optimizer, step_time: float) -> None:
    loss, grad_norm = result if result is not None else (float("nan"), float("nan"))
    lr = optimizer.param_groups[0]["lr"]
    print(f"step {iteration:5d}/{args.train_iters} | loss {loss:.6f} | lr {lr:.3e} | "
          f"grad norm {grad_norm:.4f} | step time {step_time * 1000:.1f} ms", flush=True)


def train_step(args, model, optimizer, scheduler, dataset, iteration: int):
    """One optimizer step on global batch ``iteration``; returns (DP-mean loss, grad norm)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    num_microbatches = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    model.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=microbatches(args, dataset, iteration, num_microbatches),
        model=[model],
        num_microbatches=num_microbatches,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        forward_only=False,
    )
    applied, grad_norm, _ = optimizer.step()
    if applied:  # as Megatron-LM's train_step: a skipped update (fp16 overflow) keeps the lr
        scheduler.step(increment=args.global_batch_size)
    return data_parallel_mean_loss(losses), grad_norm or 0.0


def microbatches(args, dataset, iteration: int, num_microbatches: int):
    """This rank's micro-batches of global batch ``iteration``, in Megatron's sample order."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from mover_plugin.data import get_microbatch, microbatch_sample_indices

    dp_rank = dist.get_rank(parallel_state.get_data_parallel_group())
    for index in range(num_microbatches):
        samples = microbatch_sample_indices(
            iteration, index, dp_rank,
            micro_batch_size=args.micro_batch_size,
            data_parallel_size=args.data_parallel_size,
            global_batch_size=args.global_batch_size,
        )
        yield get_microbatch(dataset, samples)


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=batch["labels"])
    return output, partial(masked_mean_loss, batch["loss_mask"])


def masked_mean_loss(loss_mask, output_tensor):
    mask = loss_mask.view(-1).float()
    loss = (output_tensor.view(-1).float() * mask).sum() / mask.sum()
    # The schedule divides the returned loss in place: report a copy.
    return loss, {"lm loss": loss.detach().clone()}


def data_parallel_mean_loss(losses) -> float:
    """The step's loss averaged over micro-batches and data-parallel ranks (last stage only)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not parallel_state.is_pipeline_last_stage():
        return float("nan")
    loss = torch.stack([item["lm loss"] for item in losses]).mean()
    dist.all_reduce(loss, group=parallel_state.get_data_parallel_group())
    return loss.item() / parallel_state.get_data_parallel_world_size()


# -- reporting ------------------------------------------------------------------------------


def is_logging_rank() -> bool:
    """Megatron-LM logs from the last rank, which holds the last pipeline stage."""
    import torch.distributed as dist

    return dist.get_rank() == dist.get_world_size() - 1


def report_params_digest(args, model) -> None:
    from mover_plugin.digest import report_params_digest as report
    from mover_plugin.layout import ParallelLayout

    report(model.module.named_parameters(),
           ParallelLayout.for_world(args.world_size, args.tensor_model_parallel_size,
                                    args.pipeline_model_parallel_size))


def shutdown(resilience) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    if resilience is not None:
        resilience.finish()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
