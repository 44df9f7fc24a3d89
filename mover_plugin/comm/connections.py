"""The real backends a :class:`~mover_plugin.comm.process_group.MoverProcessGroup` is made of.

A ``ProcessGroupNCCL`` for CUDA tensors, configured as c10d configures its own, and a
``ProcessGroupGloo`` for CPU tensors whose members connect to their ring neighbours only at
creation (see :func:`make_gloo`).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch.distributed import Store

from mover_plugin.comm import cancel, retired
from mover_plugin.comm.work import asked

GLOO_SOCKET_IFNAME_ENV = "GLOO_SOCKET_IFNAME"
"""The interfaces gloo uses, as with c10d's own gloo backend."""


def is_nccl_options(options: Any) -> bool:
    return dist.is_nccl_available() and isinstance(options, dist.ProcessGroupNCCL.Options)


def make_nccl(store: Store, rank: int, size: int, timeout: timedelta,
               global_ranks: Sequence[int], group_name: str, options: Any = None) -> Any:
    """A ``ProcessGroupNCCL`` configured as c10d configures its own (no split, no eager init);
    ``options`` are the ``ProcessGroupNCCL.Options`` given to ``new_group``, if any."""
    if not is_nccl_options(options):
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
    options._timeout = timeout
    options.global_ranks_in_group = list(global_ranks)
    options.group_name = group_name
    return dist.ProcessGroupNCCL(store, rank, size, options)


def make_gloo(store: Store, rank: int, size: int, timeout: timedelta, *,
               full_mesh: bool) -> Any:
    """A ``ProcessGroupGloo`` whose members are connected to their ring neighbours.

    c10d's gloo group connects every member to every other at creation (``size - 1``
    connections each), so rebuilding a group that holds a replaced rank costs every member
    more as the group grows. Here a group of two ranks or more is created with pairs that
    connect on first use, and a one-element all-reduce (gloo's ring) connects each member to
    group ranks ``rank - 1`` and ``rank + 1`` before the constructor returns: the pairs that
    ring all-reduce and all-gather and a pipeline's point-to-point traffic use. Pairs that
    other operations need (broadcast and barrier trees, point-to-point beyond a neighbour)
    connect inside the first such operation. ``full_mesh`` keeps c10d's way. Within
    :func:`mover_plugin.comm.cancel.cancel_when`, the first connections are given up (the
    backend kept until its own timeout ends them) when the check names a reason.
    """
    if full_mesh or size == 1:
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = _gloo_devices()
    gloo = dist.ProcessGroupGloo(store, rank, size, options)
    connect = gloo.allreduce([torch.zeros(1)])
    try:
        cancel.wait_for_work(connect, timeout, "connecting to the ring neighbours")
    except cancel.BuildCancelled:
        # The connection may still be waiting for a member that never comes: the backend is
        # kept until it gives up, so that dropping it does not join a blocked thread (the
        # observer that asks the work itself whether it is done).
        retired.retire("(cancelled)", [gloo], [asked(connect)])
        raise
    return gloo


def _gloo_devices() -> list[Any]:
    """Gloo devices that connect on first use: one per interface ``GLOO_SOCKET_IFNAME`` names
    (comma-separated, as c10d reads it), else the default one (the host name's address)."""
    names = [name for name in os.environ.get(GLOO_SOCKET_IFNAME_ENV, "").split(",") if name]
    if names:
        return [dist.ProcessGroupGloo.create_device(interface=name, lazy_init=True)
                for name in names]
    return [dist.ProcessGroupGloo.create_default_device(lazy_init=True)]


def register_per_device(group: Any, gloo: Any, nccl: Any) -> None:
    """Registers ``group``'s backends per device type, as c10d registers its own groups':
    ``_get_backend(cpu)`` is the gloo backend, ``_get_backend(cuda)`` the NCCL one.

    The group's own methods still carry every operation. What registration adds is for torch
    functions that look a backend up by device (``batch_isend_irecv``'s coalescing check,
    ``init_process_group``'s ``device_id``, the group's uid in c10d's logs, Megatron-Core's
    NCCL user buffers): they find the backend c10d would have given them, instead of failing
    with "No backend type associated with device type". The registration holds a reference: a
    backend lives as long as the group object, after its shutdown too. A group without
    connections registers none."""
    backend_type = dist.ProcessGroup.BackendType
    if gloo is not None:
        group._register_backend(torch.device("cpu"), backend_type.GLOO, gloo)
        group._set_default_backend(backend_type.GLOO)
    if nccl is not None:
        group._register_backend(torch.device("cuda"), backend_type.NCCL, nccl)
        group._set_default_backend(backend_type.NCCL)
