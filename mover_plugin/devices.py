"""Which GPU each process of a job owns.

Every process an agent starts holds one *slot* of its host, and slot ``s`` is the host's GPU
``s`` as the job sees it (index ``s`` among ``CUDA_VISIBLE_DEVICES`` as the job set it). A
worker's slot is its local rank; a standby's is the lowest slot no live process of its host
holds: on a worker host a GPU no worker uses, on a spare host its own slot's. A process sees
its slot as ``LOCAL_RANK`` from its start, a standby too, so it warms up on its own GPU and,
once promoted, presents the environment a worker of that slot would (``RANK`` is then added).

This module holds the parts: the number of GPUs of a host (:func:`gpus_on_host`), the check
that a host's workers and standbys fit them before anything starts (:func:`check_host_fits`),
the slot for a new standby (:func:`free_slot`), the binding a process makes as soon as it
imports torch, before any model, optimizer or communicator exists (:func:`bind_device`), and
the wait for the device's work that a rank makes before a commit vote, a redo or a rollback
(:func:`synchronize_device`). On a host without GPUs the slots are numbers only and nothing is
bound.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Optional

from mover_plugin.errors import ConfigError, MoverError

logger = logging.getLogger(__name__)

VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"


class DeviceError(ConfigError):
    """A process's slot names no GPU it can see."""


class DeviceFault(MoverError):
    """The process's GPU reported an error: CUDA errors are sticky, the device is unusable."""


@dataclass(frozen=True)
class HostGpus:
    """The GPUs of a host the job may use, and where that count came from (for messages)."""

    count: int
    source: str


def gpus_on_host(flag: Optional[int], env: Mapping[str, str],
                 driver_count: Callable[[], int]) -> HostGpus:
    """``--gpus-per-node`` when given, else the entries of ``CUDA_VISIBLE_DEVICES`` when set,
    else what the driver counts (0 without CUDA)."""
    if flag is not None:
        return HostGpus(flag, "--gpus-per-node")
    ids = visible_ids(env)
    if ids is not None:
        return HostGpus(len(ids), f"{VISIBLE_ENV}={env[VISIBLE_ENV]}")
    return HostGpus(driver_count(), "the CUDA driver")


def visible_ids(env: Mapping[str, str]) -> Optional[list[str]]:
    """The GPU ids ``CUDA_VISIBLE_DEVICES`` lists in ``env`` (None when it is not set)."""
    visible = env.get(VISIBLE_ENV)
    return None if visible is None else [e.strip() for e in visible.split(",") if e.strip()]


def driver_gpu_count() -> int:
    """The GPUs the CUDA driver reports (0 on a machine without CUDA)."""
    import torch

    return torch.cuda.device_count()


def check_host_fits(host: str, workers: int, standbys: int, gpus: HostGpus) -> None:
    """Raises :class:`ConfigError` when ``workers`` + ``standbys`` processes, one GPU each,
    need more GPUs than the host has (a host without GPUs runs any number)."""
    if gpus.count == 0 or workers + standbys <= gpus.count:
        return
    raise ConfigError(
        f"host {host} would run {workers} worker(s) and {standbys} standby(s), one GPU each, "
        f"but has {gpus.count} GPU(s) ({gpus.source}); lower --nproc-per-node or --standbys "
        f"(standbys can run on spare hosts: --spare-hosts), or set --gpus-per-node")


def visible_subset(devices: Iterable[int], env: Mapping[str, str]) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` that shows a process exactly ``devices``: indices among the
    GPUs ``env`` shows (its ``CUDA_VISIBLE_DEVICES``, else all the driver's)."""
    ids = visible_ids(env)
    return ",".join(ids[d] if ids is not None else str(d) for d in devices)


def free_slot(held: Iterable[int], gpus: int) -> Optional[int]:
    """The lowest slot not in ``held``; None when all ``gpus`` GPUs are held (0: a host
    without GPUs, whose slots are numbers only)."""
    taken = set(held)
    slot = next(s for s in range(len(taken) + 1) if s not in taken)
    return None if gpus and slot >= gpus else slot


def bind_device(env: Mapping[str, str] = os.environ) -> Optional[int]:
    """Makes the process's slot (``LOCAL_RANK``) its current CUDA device; returns the device
    index, or None without CUDA or without a slot. A process that sees one GPU only (its own,
    through ``CUDA_VISIBLE_DEVICES``) uses it whatever its slot."""
    import torch

    if "LOCAL_RANK" not in env or not torch.cuda.is_available():
        return None
    slot, count = int(env["LOCAL_RANK"]), torch.cuda.device_count()
    index = 0 if count == 1 else slot
    if index >= count:
        raise DeviceError(f"LOCAL_RANK {slot} names no GPU this process sees: it sees {count} "
                          f"({VISIBLE_ENV}={env.get(VISIBLE_ENV, '(not set)')})")
    torch.cuda.set_device(index)
    logger.info("bound to cuda:%d (slot %d)", index, slot)
    return index


def synchronize_device() -> None:
    """Waits until the GPU work this process queued has ended (nothing to wait for without
    CUDA, or before the process used it); raises :class:`DeviceFault` on a CUDA error."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return
    try:
        torch.cuda.synchronize()
    except RuntimeError as error:
        raise DeviceFault(str(error)) from error
