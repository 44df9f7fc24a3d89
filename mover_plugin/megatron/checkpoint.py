"""Checkpoints of a Megatron-Core training run that resume bit-exactly.

The folder layout is Megatron-LM's: ``SAVE/iter_0000010/mp_rank_TT[_PPP]/model_optim_rng.pt``
for each tensor/pipeline shard (written by data-parallel rank 0 of that shard) and
``SAVE/latest_checkpointed_iteration.txt``. A shard file holds the model, optimizer and
learning-rate scheduler states, the iteration, and the RNG states of every data-parallel rank
of the shard (Python, NumPy, torch and Megatron's model-parallel RNG tracker), so a resumed run
draws the same dropout masks and reads the same samples as an uninterrupted one.

With Megatron-Core's distributed optimizer (``--use-distributed-optimizer``) the shard file
holds the optimizer's common state (parameter groups, step), and every data-parallel rank also
writes its own optimizer shard (:mod:`mover_plugin.megatron.distributed_optimizer`) to
``distrib_optim_dpDDD.pt`` beside it; such a checkpoint loads with the same data-parallel size.

Every file is written under a temporary name and renamed; the tracker file is replaced only
after every rank finished writing, so a run killed in the middle of a save resumes from the
previous complete checkpoint. Loading works into a fresh model and optimizer and into ones
that trained on (a rollback in place).
"""

from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

TRACKER_FILE = "latest_checkpointed_iteration.txt"
SHARD_FILE = "model_optim_rng.pt"


def optimizer_shard_file(dp_rank: int) -> str:
    return f"distrib_optim_dp{dp_rank:03d}.pt"


@dataclass(frozen=True)
class ShardId:
    """Which shard this rank holds: tensor- and pipeline-parallel index, data-parallel rank."""

    tp_rank: int
    pp_rank: int
    pp_size: int
    dp_rank: int

    def folder(self, root: Path, iteration: int) -> Path:
        name = f"mp_rank_{self.tp_rank:02d}"
        if self.pp_size > 1:
            name += f"_{self.pp_rank:03d}"
        return root / f"iter_{iteration:07d}" / name


def capture_rng_state() -> dict[str, Any]:
    """This rank's RNG states, Megatron's model-parallel tracker included, and with CUDA the
    default generator of the rank's device (dropout outside the tracker draws from it: the
    embedding's and the hidden states' without sequence parallelism). The current device's
    only: the process that restores it, a joiner perhaps, may own another device index."""
    from megatron.core import tensor_parallel

    state = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Puts this rank's RNG states back to ``state``, which stays unchanged: the tracker gets
    copies (its ``set_states`` keeps the dictionary it is given and its ``fork`` replaces
    entries there, so a snapshot restored once would follow the RNG from then on, and a
    second restore — an iteration dropped twice — would not go back)."""
    from megatron.core import tensor_parallel

    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(
        {name: rng.clone() for name, rng in state["tracker"].items()})


def latest_iteration(root: str | os.PathLike) -> Optional[int]:
    """The iteration of the latest complete checkpoint under ``root``, or None."""
    tracker = Path(root) / TRACKER_FILE
    if not tracker.is_file():
        return None
    return int(tracker.read_text().strip())


def save_checkpoint(
    root: str | os.PathLike,
    iteration: int,
    shard: ShardId,
    *,
    model: torch.nn.Module,
    optimizer: Any,
    scheduler: Any,
    data_parallel_group: dist.ProcessGroup,
) -> None:
    """Collective over the default group: every rank calls it at the same iteration."""
    from mover_plugin.megatron.distributed_optimizer import shard_tensors

    root = Path(root)
    rng_states: list[Any] = [None] * dist.get_world_size(data_parallel_group)
    dist.all_gather_object(rng_states, capture_rng_state(), group=data_parallel_group)
    folder = shard.folder(root, iteration)
    own_shard = shard_tensors(optimizer)
    if own_shard:
        folder.mkdir(parents=True, exist_ok=True)
        _atomic_save({"shard": [tensor.detach().cpu() for tensor in own_shard]},
                     folder / optimizer_shard_file(shard.dp_rank))
    if shard.dp_rank == 0:
        state = {
            "iteration": iteration,
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "opt_param_scheduler": scheduler.state_dict(),
            "rng_state": rng_states,
        }
        folder.mkdir(parents=True, exist_ok=True)
        _atomic_save(state, folder / SHARD_FILE)
    dist.barrier()
    if dist.get_rank() == 0:
        _atomic_write_text(root / TRACKER_FILE, f"{iteration}\n")
    dist.barrier()


def load_checkpoint(
    root: str | os.PathLike,
    shard: ShardId,
    *,
    model: torch.nn.Module,
    optimizer: Any,
    scheduler: Any,
) -> int:
    """Restores the latest checkpoint under ``root``; returns its iteration (0 if none)."""
    iteration = latest_iteration(root)
    if iteration is None:
        logger.info("no checkpoint in %s; starting from scratch", root)
        return 0
    from mover_plugin.megatron.distributed_optimizer import (
        ensure_shard_state,
        restore_step_counters,
        shard_tensors,
        uses_distributed_optimizer,
    )

    folder = shard.folder(Path(root), iteration)
    state = torch.load(folder / SHARD_FILE, map_location="cpu", weights_only=False)
    sharded = uses_distributed_optimizer(optimizer)
    if sharded:
        # The common state loads into existing shard tensors, which the file then fills. They
        # are created (by a dummy step, which with weight decay changes the parameters)
        # before the parameters are loaded.
        ensure_shard_state(optimizer)
    model.load_state_dict(state["model"])
    if sharded:
        optimizer.load_state_dict(state["optimizer"])
        restore_step_counters(optimizer)
        saved = torch.load(folder / optimizer_shard_file(shard.dp_rank), map_location="cpu",
                           weights_only=True)["shard"]
        with torch.no_grad():
            for tensor, value in zip(shard_tensors(optimizer), saved, strict=True):
                tensor.copy_(value)
    else:
        optimizer.load_state_dict(state["optimizer"])
    # Megatron-Core's scheduler loads its state by stepping on from where it is.
    scheduler.num_steps = 0
    scheduler.load_state_dict(state["opt_param_scheduler"])
    restore_rng_state(state["rng_state"][shard.dp_rank])
    return int(state["iteration"])


def _atomic_save(obj: Any, path: Path) -> None:
    temporary = path.with_name(path.name + f".tmp{os.getpid()}")
    torch.save(obj, temporary)
    os.replace(temporary, path)


def _atomic_write_text(path: Path, text: str) -> None:
    temporary = path.with_name(path.name + f".tmp{os.getpid()}")
    temporary.write_text(text)
    os.replace(temporary, path)
