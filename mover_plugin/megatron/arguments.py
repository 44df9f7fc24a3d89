"""Megatron-LM-style command-line flags for GPT pretraining, checked before anything starts.

The flag names are Megatron-LM's (``--tensor-model-parallel-size``, ``--num-layers``,
``--global-batch-size``, ``--lr``, ``--save``, ``--load``, ...). :func:`parse_args` checks the
values against each other and the world size (``WORLD_SIZE``, as torchrun and ``mover-launch``
set it) and raises :class:`ConfigError` naming the bad value and what would be valid.

This module imports neither torch nor Megatron, so a check costs milliseconds. Under
``mover-launch`` the script is first run with ``MOVER_PREFLIGHT=1``: :func:`parse_args_or_exit`
then checks the flags and exits, so that bad input stops the job before any worker starts.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Callable, Optional, Sequence

from mover_plugin.errors import ConfigError
from mover_plugin.layout import ParallelLayout
from mover_plugin.runtime.preflight import checked_or_exit
from mover_plugin.runtime.settings import ResilienceSettings, fault_tolerance_given
from mover_plugin.shrink import profile_record, shape_refusals
from mover_plugin.templates import (
    PlanningError,
    check_fault_tolerance,
    load_profile,
    plan_templates,
)

LR_DECAY_STYLES = ("constant", "linear", "cosine")
BACKENDS = ("gloo", "nccl")

ExtraArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message)


def build_parser(extra_args_provider: Optional[ExtraArgsProvider] = None
                 ) -> argparse.ArgumentParser:
    """The GPT pretraining flags; ``extra_args_provider`` adds more, as in Megatron-LM."""
    parser = _Parser(description="Megatron-Core GPT pretraining.", allow_abbrev=False)
    _add_model_args(parser.add_argument_group("model"))
    _add_parallel_args(parser.add_argument_group("distributed"))
    _add_training_args(parser.add_argument_group("training"))
    _add_data_args(parser.add_argument_group("data"))
    _add_checkpoint_args(parser.add_argument_group("checkpointing"))
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    return parser


def _add_model_args(group: argparse._ArgumentGroup) -> None:
    add = group.add_argument
    add("--num-layers", type=int, default=4)
    add("--hidden-size", type=int, default=64)
    add("--ffn-hidden-size", type=int, default=None, help="Default: 4 x hidden size.")
    add("--num-attention-heads", type=int, default=4)
    add("--seq-length", type=int, default=64)
    add("--max-position-embeddings", type=int, default=None, help="Default: --seq-length.")
    add("--hidden-dropout", type=float, default=0.1)
    add("--attention-dropout", type=float, default=0.1)
    add("--init-method-std", type=float, default=0.02)
    add("--untie-embeddings-and-output-weights", action="store_true")
    add("--make-vocab-size-divisible-by", type=int, default=128)


def _add_parallel_args(group: argparse._ArgumentGroup) -> None:
    add = group.add_argument
    add("--tensor-model-parallel-size", type=int, default=1)
    add("--pipeline-model-parallel-size", type=int, default=1)
    add("--use-distributed-optimizer", action="store_true")
    add("--overlap-grad-reduce", action="store_true")
    add("--disable-gloo-process-groups", dest="enable_gloo_process_groups",
        action="store_false",
        help="Do not create Megatron's extra gloo groups (CPU copies for the distributed "
        "optimizer). Implied by --resilient, whose groups are all abortable.")
    add("--distributed-backend", default=None, choices=BACKENDS,
        help="Default: nccl when CUDA is available, else gloo.")
    add("--distributed-timeout-minutes", type=float, default=10.0)


def _add_training_args(group: argparse._ArgumentGroup) -> None:
    add = group.add_argument
    add("--micro-batch-size", type=int, default=2)
    add("--global-batch-size", type=int, default=None,
        help="Default: micro-batch size x data-parallel size.")
    add("--train-iters", type=int, default=20)
    add("--lr", type=float, default=1e-3)
    add("--min-lr", type=float, default=0.0)
    add("--lr-decay-style", default="constant", choices=LR_DECAY_STYLES)
    add("--lr-warmup-iters", type=int, default=0)
    add("--lr-decay-iters", type=int, default=None, help="Default: --train-iters.")
    add("--weight-decay", type=float, default=0.01)
    add("--adam-beta1", type=float, default=0.9)
    add("--adam-beta2", type=float, default=0.999)
    add("--clip-grad", type=float, default=1.0)
    add("--seed", type=int, default=1234)
    add("--log-interval", type=int, default=1)


def _add_data_args(group: argparse._ArgumentGroup) -> None:
    add = group.add_argument
    add("--data-path", default=None,
        help="Prefix of an indexed dataset (PREFIX.bin and PREFIX.idx). Default: the corpus "
        "shipped with mover_plugin, built into --data-cache-path on first use.")
    add("--data-cache-path", default=None,
        help="Where the shipped corpus is built (default $MOVER_PLUGIN_CACHE or "
        "~/.cache/mover_plugin).")


def _add_checkpoint_args(group: argparse._ArgumentGroup) -> None:
    add = group.add_argument
    add("--save", default=None, help="Checkpoint folder to write.")
    add("--load", default=None, help="Checkpoint folder to resume from (if it holds one).")
    add("--save-interval", type=int, default=None, help="Save every N steps (and at the end).")


def parse_args(
    argv: Optional[Sequence[str]] = None,
    *,
    world_size: Optional[int] = None,
    extra_args_provider: Optional[ExtraArgsProvider] = None,
) -> argparse.Namespace:
    """Parses and checks the flags; fills in derived values (``data_parallel_size``, ...)."""
    args = build_parser(extra_args_provider).parse_args(argv)
    world_size = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", 1))
    layout = ParallelLayout.for_world(world_size, args.tensor_model_parallel_size,
                                      args.pipeline_model_parallel_size)
    args.world_size = world_size
    args.data_parallel_size = layout.dp
    _fill_defaults(args)
    for check in (_check_model, _check_batch, _check_schedule, _check_paths, _check_resilience):
        check(args)
    return args


def parse_args_or_exit(
    argv: Optional[Sequence[str]] = None,
    *,
    extra_args_provider: Optional[ExtraArgsProvider] = None,
) -> argparse.Namespace:
    """:func:`parse_args` for a script's ``main``: one error line and exit code 2 on bad input.

    With ``MOVER_PREFLIGHT=1`` (set by ``mover-launch`` for its check before the workers start)
    it reports the outcome in the form the launcher reads and exits either way.
    """
    return checked_or_exit(lambda: parse_args(argv, extra_args_provider=extra_args_provider))


def _fill_defaults(args: argparse.Namespace) -> None:
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters


def _check_model(args: argparse.Namespace) -> None:
    _positive(args, "num_layers", "hidden_size", "num_attention_heads", "seq_length",
              "ffn_hidden_size", "make_vocab_size_divisible_by")
    pp, tp = args.pipeline_model_parallel_size, args.tensor_model_parallel_size
    if args.num_layers % pp:
        raise ConfigError(
            f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size "
            f"{pp}; use a multiple of {pp} layers or a PP size dividing {args.num_layers}"
        )
    if args.hidden_size % args.num_attention_heads:
        raise ConfigError(
            f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
            f"{args.num_attention_heads}"
        )
    if args.num_attention_heads % tp:
        raise ConfigError(
            f"--num-attention-heads {args.num_attention_heads} is not divisible by "
            f"--tensor-model-parallel-size {tp}"
        )
    if args.seq_length > args.max_position_embeddings:
        raise ConfigError(
            f"--seq-length {args.seq_length} exceeds --max-position-embeddings "
            f"{args.max_position_embeddings}"
        )
    for name in ("hidden_dropout", "attention_dropout"):
        if not 0.0 <= getattr(args, name) < 1.0:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)} must be in [0, 1)")


def _check_batch(args: argparse.Namespace) -> None:
    _positive(args, "micro_batch_size", "global_batch_size", "train_iters", "log_interval")
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % per_step:
        raise ConfigError(
            f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
            f"{args.micro_batch_size} x data-parallel size {args.data_parallel_size} = "
            f"{per_step}; use a multiple of {per_step}"
        )


def _check_schedule(args: argparse.Namespace) -> None:
    if not args.lr > 0:
        raise ConfigError(f"--lr {args.lr} must be positive")
    if not 0 <= args.min_lr <= args.lr:
        raise ConfigError(f"--min-lr {args.min_lr} must be between 0 and --lr {args.lr}")
    if not 0 <= args.lr_warmup_iters <= args.lr_decay_iters:
        raise ConfigError(
            f"--lr-warmup-iters {args.lr_warmup_iters} must be between 0 and --lr-decay-iters "
            f"{args.lr_decay_iters}"
        )
    if args.save_interval is not None and args.save_interval < 1:
        raise ConfigError(f"--save-interval {args.save_interval} must be 1 or more")
    if args.save_interval is not None and args.save is None:
        raise ConfigError("--save-interval needs --save (the folder to write checkpoints to)")
    if args.distributed_timeout_minutes <= 0:
        raise ConfigError(
            f"--distributed-timeout-minutes {args.distributed_timeout_minutes} must be positive"
        )


def _check_paths(args: argparse.Namespace) -> None:
    if args.data_path is not None:
        prefix = args.data_path.removesuffix(".bin").removesuffix(".idx")
        missing = [p for p in (prefix + ".bin", prefix + ".idx") if not Path(p).is_file()]
        if missing:
            raise ConfigError(
                f"--data-path {args.data_path!r}: {', '.join(missing)} not found; give the prefix "
                "of an indexed dataset (build one with 'python -m mover_plugin.data.build_indexed "
                "--input corpus.jsonl --output-prefix PREFIX'), or omit --data-path to use the "
                "shipped corpus"
            )
        args.data_path = prefix
    for flag in ("save", "load"):
        path = getattr(args, flag)
        if path is not None and Path(path).exists() and not Path(path).is_dir():
            raise ConfigError(f"--{flag} {path!r} is a file; it must be a folder")


def _check_resilience(args: argparse.Namespace) -> None:
    """Checks the resilience flags when the script added them (``add_resilience_args``)."""
    if not hasattr(args, "resilient"):
        return
    args.resilience = ResilienceSettings.from_args(args)
    _check_templates(args)
    if args.resilient:
        # Plain gloo groups cannot be left when a peer dies, nor replaced in place.
        args.enable_gloo_process_groups = False


def _check_templates(args: argparse.Namespace) -> None:
    """``args.template_profile``: the checked record of ``--resilient-template-profile`` for
    the planner, or None (:func:`checked_template_profile`)."""
    args.template_profile = None
    if args.resilient:
        args.template_profile = checked_template_profile(args, args.resilience.fault_tolerance)


def checked_template_profile(args: argparse.Namespace, tolerance: int) -> Optional[dict]:
    """``--resilient-fault-tolerance F`` asks for F + 1 pipelines when a ``--resilient`` job of
    tensor-parallel size 1 shrinks onto pipeline templates: at least one rank (a host of the
    planner) each, and a micro-batch each. With ``--resilient-template-profile``, the profile
    must describe this model, fit some host count, and leave a plan after losing up to F hosts;
    its record for the planner is returned (None without one, or when the job never shrinks).
    A job that never shrinks (:func:`~mover_plugin.shrink.shape_refusals`) refuses an F it is
    given. Raises :class:`ConfigError` naming the bad value. Megatron-LM's ``args`` work too."""
    given = fault_tolerance_given(args)
    refused = shape_refusals(args.tensor_model_parallel_size,
                             bool(getattr(args, "num_experts", None)),
                             bool(getattr(args, "use_distributed_optimizer", False)),
                             given and _cuda_available())
    if refused:
        refuse_given_fault_tolerance(args, tolerance, refused)
        return None  # such a job never shrinks onto templates
    stages = args.world_size  # one rank per pipeline stage (tensor-parallel size 1)
    microbatches = args.global_batch_size // args.micro_batch_size
    if stages > 1 and tolerance + 1 > min(stages, microbatches):
        raise ConfigError(
            f"--resilient-fault-tolerance {tolerance} is too large: it needs {tolerance + 1} "
            f"pipelines of at least one rank and one micro-batch each, but the job has "
            f"{stages} ranks and {microbatches} micro-batches per global batch; give at most "
            f"{min(stages, microbatches) - 1}")
    path = getattr(args, "resilient_template_profile", None)
    if path is None:
        return None
    profile = load_profile(Path(path))
    expected = args.num_layers + 2
    if len(profile.layers) != expected:
        raise ConfigError(
            f"--resilient-template-profile {path}: {len(profile.layers)} layers, but this model "
            f"has {expected} (the embedding, {args.num_layers} transformer layers, the output "
            "layer)")
    try:
        check_fault_tolerance(plan_templates(profile, args.pipeline_model_parallel_size),
                              stages, microbatches, tolerance)
    except PlanningError as error:
        raise ConfigError(f"--resilient-template-profile {path}: {error}") from None
    return profile_record(profile)


def refuse_given_fault_tolerance(args: argparse.Namespace, tolerance: int,
                                 reasons: Sequence[str]) -> None:
    """A job that cannot shrink onto pipeline templates (``reasons``) refuses a
    ``--resilient-fault-tolerance`` given on its command line, with the reasons."""
    if reasons and fault_tolerance_given(args):
        raise ConfigError(
            f"--resilient-fault-tolerance {tolerance}: this job cannot shrink onto pipeline "
            f"templates ({', '.join(reasons)}), so a rank lost with no standby ready restarts "
            "it; leave the flag out")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _positive(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {value} must be 1 or more")
