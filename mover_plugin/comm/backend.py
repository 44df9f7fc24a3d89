"""Registration of the ``mover`` c10d backend.

After :func:`register_backend`, ``dist.init_process_group("mover", store=..., rank=...,
world_size=..., timeout=...)`` makes the default group a
:class:`~mover_plugin.comm.process_group.MoverProcessGroup`, and every later
``dist.new_group(...)`` without an explicit backend (Megatron-Core's
``initialize_model_parallel`` creates its groups this way) inherits the default group's backend
and gets one too.

How c10d uses the creator (torch 2.13 and 2.14, ``_new_process_group_helper``): for a
registered plugin it calls the creator once per device type of the backend's capability, with
the group's prefix store; a creator that returns a ``ProcessGroup`` subclass (rather than a
``Backend``) ends that loop and its return value *becomes* the group, which c10d names and
registers in its world maps. With ``extended_api=True`` the creator receives
``_DistributedBackendOptions`` (store, group rank and size, timeout, group name, global ranks)
and the backend options.

Nothing is registered at import time: callers opt in. Registration takes the
``registration_lock`` of the process's :class:`~mover_plugin.comm.context.CommContext`.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from mover_plugin.comm import forked_children, retired
from mover_plugin.comm.context import default_context
from mover_plugin.comm.nccl_env import set_resilient_nccl_env
from mover_plugin.comm.process_group import BACKEND_NAME, MoverProcessGroup
from mover_plugin.comm.world import WorldGroup, WorldOptions, group_members
from mover_plugin.patches import apply_inactive_patches
from mover_plugin.patches.mover_comm import GROUP as MOVER_COMM

logger = logging.getLogger(__name__)


def is_registered(name: str = BACKEND_NAME) -> bool:
    """Whether the backend ``name`` (by default ``mover``) is registered with c10d here."""
    return name.upper() in dist.Backend._plugins


def register_backend() -> str:
    """Registers the ``mover`` backend with c10d (idempotent); returns its name.

    The backend is declared for ``cpu`` and ``cuda``; it never becomes the default backend of a
    device, it is used only where asked for by name (or inherited by ``new_group``). The process
    also gets the NCCL environment a survivor needs (:mod:`~mover_plugin.comm.nccl_env`) and
    the ``mover-comm`` patches (:mod:`mover_plugin.patches.mover_comm`: ``batch_isend_irecv``
    batches on a ``mover`` group).
    """
    forked_children.install()  # a data loader's forked workers must not hold its connections
    set_resilient_nccl_env()  # before any NCCL communicator of the process, the job's too
    apply_inactive_patches(MOVER_COMM)  # batch_isend_irecv batches on a mover group
    return register_plugin(BACKEND_NAME, _create_group)


def register_plugin(name: str, creator: Callable[..., dist.ProcessGroup]) -> str:
    """Registers a c10d backend whose ``creator`` (extended API) returns the group itself, for
    ``cpu`` and ``cuda`` (idempotent); returns ``name``."""
    with default_context().registration_lock:
        if not is_registered(name):
            dist.Backend.register_backend(name, creator, extended_api=True,
                                          devices=["cpu", "cuda"])
            logger.debug("registered the %s c10d backend", name)
    return name


def _create_group(options: Any, backend_options: Any = None) -> MoverProcessGroup:
    """c10d's creator hook: ``options`` is a ``_DistributedBackendOptions``, ``backend_options``
    the ``pg_options`` given to ``init_process_group`` or ``new_group`` (a
    :class:`~mover_plugin.comm.world.WorldOptions` for the default group; used for NCCL when
    they are NCCL's). The default group (created while c10d has none) is a
    :class:`~mover_plugin.comm.world.WorldGroup`."""
    retired.reap()  # a new generation is a good moment to release finished old ones
    if not dist.is_initialized():
        connect = not isinstance(backend_options, WorldOptions) or backend_options.connect
        return WorldGroup(options.store, options.group_rank, options.group_size,
                          options.timeout, connect=connect, group_name=str(options.group_id),
                          global_ranks=list(options.global_ranks_in_group),
                          nccl_options=backend_options)
    global_ranks = list(options.global_ranks_in_group)
    return MoverProcessGroup(
        options.store,
        options.group_rank,
        options.group_size,
        options.timeout,
        group_name=str(options.group_id),
        global_ranks=global_ranks,
        nccl_options=backend_options,
        share_with=_group_with_members(global_ranks),
    )


def _group_with_members(global_ranks: list[int]) -> Optional[MoverProcessGroup]:
    """A registered ``mover`` group (not the default one) whose members are ``global_ranks`` in
    this order: a new group with the same members shares its gloo backend."""
    for group in c10d._world.pg_group_ranks:
        if (isinstance(group, MoverProcessGroup) and not group.is_default_group
                and list(group_members(group)) == global_ranks):
            return group
    return None
