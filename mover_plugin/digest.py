"""``PARAMS_DIGEST``: one hash of every rank's model parameters, to compare runs exactly.

Each rank hashes its parameters (name, dtype, shape and raw bytes, in name order); the digests
of all ranks are gathered and hashed in global-rank order. Two runs print the same
``PARAMS_DIGEST`` only if every parameter of every rank is bit-identical. The per-rank digests
also tell whether data-parallel replicas hold identical parameters.
"""

from __future__ import annotations

import hashlib
from typing import Iterable

import torch
import torch.distributed as dist

from mover_plugin.layout import ParallelLayout


def rank_digest(named_parameters: Iterable[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 over this rank's parameters, independent of their registration order."""
    digest = hashlib.sha256()
    for name, tensor in sorted(named_parameters, key=lambda item: item[0]):
        data = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{data.dtype}|{tuple(data.shape)}|".encode())
        digest.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return digest.hexdigest()


def combine_digests(rank_digests: list[str]) -> str:
    """The job digest: SHA-256 over the per-rank digests in global-rank order."""
    return hashlib.sha256("\n".join(rank_digests).encode()).hexdigest()


def gather_rank_digests(named_parameters: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Collective over the default group: every rank gets every rank's digest."""
    gathered: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rank_digest(named_parameters))
    return [str(item) for item in gathered]


def mismatched_replicas(layout: ParallelLayout, rank_digests: list[str]) -> list[list[int]]:
    """The data-parallel groups whose members do not all hold the same parameters."""
    return [group for group in layout.replica_sets()
            if len({rank_digests[rank] for rank in group}) > 1]


def report_params_digest(named_parameters: Iterable[tuple[str, torch.Tensor]],
                         layout: ParallelLayout) -> None:
    """Collective over the default group; rank 0 prints ``DP_REPLICAS`` (whether the
    data-parallel replicas are identical) and ``PARAMS_DIGEST <hex>``."""
    digests = gather_rank_digests(named_parameters)
    if dist.get_rank() == 0:
        mismatched = mismatched_replicas(layout, digests)
        print(f"DP_REPLICAS {'identical' if not mismatched else f'DIFFER in {mismatched}'}")
        print(f"PARAMS_DIGEST {combine_digests(digests)}", flush=True)
