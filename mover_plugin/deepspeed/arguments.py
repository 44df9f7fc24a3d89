"""Command-line flags of the example DeepSpeed GPT pretraining script, checked before anything
starts.

DeepSpeed takes batch sizes, optimizer, scheduler and ZeRO from its config file
(``--deepspeed_config``); the flags hold what the config does not: the model's shape, the
pipeline depth, the number of steps, the data and the checkpoint folder. :func:`parse_args`
checks them against each other, the world size (``WORLD_SIZE``) and the config file, whose
``"resilience"`` block is checked too (:mod:`mover_plugin.deepspeed.config`). This module
imports neither torch nor DeepSpeed.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Optional, Sequence

from mover_plugin.deepspeed.config import load_ds_config
from mover_plugin.errors import ConfigError
from mover_plugin.runtime.preflight import checked_or_exit

class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message)


def build_parser(default_config: Optional[str] = None) -> argparse.ArgumentParser:
    """The flags; ``default_config`` is the config used without ``--deepspeed_config``."""
    parser = _Parser(prog="ds_pretrain_gpt.py",
                     description="Pretrain a small GPT as a DeepSpeed PipelineModule.")
    add = parser.add_argument
    add("--deepspeed", action="store_true", help="Accepted for DeepSpeed scripts' sake; "
        "DeepSpeed is always used.")
    add("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config",
        default=default_config, required=default_config is None,
        help=f"DeepSpeed config (JSON; default {default_config}).")
    add("--local_rank", "--local-rank", dest="local_rank", type=int, default=None,
        help="Set by DeepSpeed's launcher; the environment's LOCAL_RANK is used.")
    add("--pipeline-parallel-size", dest="pipeline_parallel_size", type=int, default=2)
    add("--num-layers", dest="num_layers", type=int, default=4)
    add("--hidden-size", dest="hidden_size", type=int, default=64)
    add("--num-attention-heads", dest="num_attention_heads", type=int, default=4)
    add("--seq-length", dest="seq_length", type=int, default=64)
    add("--train-iters", dest="train_iters", type=int, default=20)
    add("--seed", type=int, default=1234)
    add("--log-interval", dest="log_interval", type=int, default=1)
    add("--data-path", dest="data_path", default=None,
        help="Prefix of an indexed dataset; default: the corpus shipped with mover_plugin.")
    add("--data-cache-path", dest="data_cache_path", default=None)
    add("--save", default=None, help="Checkpoint folder to save to.")
    add("--load", default=None, help="Checkpoint folder to resume from (if it has one).")
    add("--save-interval", dest="save_interval", type=int, default=None,
        help="Save every N steps (default: at the end).")
    return parser


def parse_args(argv: Optional[Sequence[str]] = None, *, world_size: Optional[int] = None,
               default_config: Optional[str] = None) -> argparse.Namespace:
    """Parses and checks the flags; reads the DeepSpeed config into ``args.ds_config`` (without
    its ``"resilience"`` block) and the block into ``args.resilience`` (None when absent)."""
    args = build_parser(default_config).parse_args(argv)
    args.world_size = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE",
                                                                                   1))
    for name in ("pipeline_parallel_size", "num_layers", "hidden_size", "num_attention_heads",
                 "seq_length", "train_iters", "log_interval"):
        _positive(args, name)
    if args.save_interval is not None:
        _positive(args, "save_interval")
    pp = args.pipeline_parallel_size
    if args.world_size % pp:
        raise ConfigError(f"--pipeline-parallel-size {pp} must divide the world size "
                          f"{args.world_size}")
    if args.num_layers < pp:
        raise ConfigError(f"--num-layers {args.num_layers} must be at least "
                          f"--pipeline-parallel-size {pp} (each stage holds a layer)")
    if args.hidden_size % args.num_attention_heads:
        raise ConfigError(f"--hidden-size {args.hidden_size} must be a multiple of "
                          f"--num-attention-heads {args.num_attention_heads}")
    args.data_parallel_size = args.world_size // pp
    args.ds_config, args.resilience = load_ds_config(args.deepspeed_config)
    _check_batch(args.ds_config, args.data_parallel_size, args.deepspeed_config)
    return args


def parse_args_or_exit(argv: Optional[Sequence[str]] = None, *,
                       default_config: Optional[str] = None) -> argparse.Namespace:
    """:func:`parse_args` for a script's ``main`` (one error line and exit 2 on bad input;
    the launcher's flag check, see :mod:`mover_plugin.runtime.preflight`)."""
    return checked_or_exit(lambda: parse_args(argv, default_config=default_config))


def _positive(args: argparse.Namespace, name: str) -> None:
    value = getattr(args, name)
    if value < 1:
        raise ConfigError(f"--{name.replace('_', '-')} {value} must be at least 1")


def _check_batch(config: dict[str, Any], dp: int, path: str) -> None:
    """The batch sizes DeepSpeed would reject, named before any process starts."""
    micro = config.get("train_micro_batch_size_per_gpu")
    accumulation = config.get("gradient_accumulation_steps", 1)
    for key, value in (("train_micro_batch_size_per_gpu", micro),
                       ("gradient_accumulation_steps", accumulation)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{path}: \"{key}\" {value!r} must be a whole number of at "
                              "least 1")
    total = config.get("train_batch_size")
    if total is not None and total != micro * accumulation * dp:
        raise ConfigError(f"{path}: \"train_batch_size\" {total!r} must equal "
                          f"train_micro_batch_size_per_gpu {micro} x gradient_accumulation_steps "
                          f"{accumulation} x data-parallel size {dp} = {micro * accumulation * dp}"
                          " (or be left out)")
