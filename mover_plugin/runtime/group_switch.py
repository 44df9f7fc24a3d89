"""A process's groups from one generation to the next.

:class:`GroupSwitcher` builds a generation's world (``init_process_group`` with the ``mover``
backend on the generation's store namespace, then the adapter's groups), rebuilds after a
crash only the groups that need it (:mod:`mover_plugin.comm.delta`), installs a prepared delta,
and points every cached reference the script's objects hold to a replaced group at its
replacement (:mod:`mover_plugin.runtime.rewire`). It holds no generation of its own: the
runtime names the generation, rank and world size of each call.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist

from mover_plugin.comm import BACKEND_NAME, clear_alarm
from mover_plugin.comm.cancel import BuildCancelled, raise_if_cancelled
from mover_plugin.comm.delta import (
    PreparedDelta,
    agree_on_idle_groups,
    discard_delta,
    install_delta,
    member_groups,
    member_groups_in_order,
    pair_rebuilt_groups,
    prepare_delta,
)
from mover_plugin.comm.world import WorldOptions
from mover_plugin.contract import GenerationPlan
from mover_plugin.runtime.adapter import FrameworkAdapter
from mover_plugin.runtime.control import ControlClient
from mover_plugin.runtime.rewire import rewire, rewire_module_globals


class GroupSwitcher:
    """Builds, rebuilds and installs the groups of a process's generations."""

    def __init__(self, control: ControlClient, adapter: FrameworkAdapter,
                 timeout: Callable[[], timedelta]) -> None:
        self._control = control
        self._adapter = adapter
        self._timeout = timeout
        self._job_groups: list[Any] = []
        """The groups of the job's own layout when it shrank, to rewire once they are built
        again on growing back."""

    def init_world(self, generation: int, rank: int, world_size: int, *,
                   connect: bool) -> None:
        """Generation ``generation``'s world and the adapter's groups; ``connect=False``: the
        default group gets no connections of its own (its members' other groups cover it,
        :mod:`mover_plugin.comm.world`)."""
        self._init_default_group(generation, rank, world_size, connect=connect)
        self._adapter.init_groups()

    def _init_default_group(self, generation: int, rank: int, world_size: int, *,
                            connect: bool) -> None:
        dist.init_process_group(BACKEND_NAME, store=self._control.generation_store(generation),
                                rank=rank, world_size=world_size, timeout=self._timeout(),
                                pg_options=WorldOptions(connect=connect))

    def tear_down(self) -> None:
        """Drops whatever was built of a superseded generation's groups."""
        self._adapter.teardown()
        if dist.is_initialized():
            dist.destroy_process_group()

    def rebuild_after_crash(self, generation: int, world_size: int,
                            plan: GenerationPlan) -> int:
        """Rebuilds generation ``generation``'s groups that contain a replaced rank or that
        some member left in the middle of an operation, and keeps the others — or rebuilds them
        all when the plan says so (it follows a switch that did not complete, whose groups some
        ranks may have and others not). Returns how many cached references to the old groups
        were rewritten."""
        store = self._control.generation_store(generation)
        if plan.rebuild_all:
            lost, unsettled = set(range(world_size)), []
        else:
            lost = set(plan.replaced_ranks)
            candidates = {name: entry for name, entry in member_groups().items()
                          if not entry[1].is_default and not lost & set(entry[1].global_ranks)}
            unsettled = agree_on_idle_groups(store, candidates, timeout=self._timeout())
        delta = prepare_delta(store, lost, timeout=self._timeout(), unsettled=unsettled)
        return self.install(delta)

    def install(self, delta: PreparedDelta) -> int:
        """Puts the next generation's groups in place; returns how many cached references
        to replaced groups were rewritten."""
        clear_alarm()
        try:
            raise_if_cancelled()  # an alarm for this generation that came before the clearing
        except BuildCancelled:
            discard_delta(delta)
            raise
        count = self._rewire(install_delta(delta))
        self._adapter.after_switch()
        return count

    def leave_job_layout(self) -> None:
        """A shrink: remembers the job's groups (to rewire on growing back), then shuts every
        group of the old world down, never waiting on a lost peer."""
        self._job_groups = member_groups_in_order()
        self._adapter.teardown()
        dist.destroy_process_group()
        clear_alarm()
        raise_if_cancelled()

    def leave_survivors_world(self) -> None:
        """Another shrink: every group of the survivors' world shut down, never waiting on a
        lost peer (the job's groups remembered at the first shrink are kept)."""
        dist.destroy_process_group()
        clear_alarm()
        raise_if_cancelled()

    def init_survivors_world(self, generation: int, rank: int, world_size: int) -> None:
        """A shrink: the survivors' world of their own (the adapter builds the templates'
        groups in it)."""
        self._init_default_group(generation, rank, world_size, connect=True)

    def regrow_job_layout(self, generation: int, rank: int, world_size: int) -> int:
        """Growing back: the job's world and groups built again, every reference to a group
        of the job before the shrink pointed at its new counterpart; returns how many."""
        dist.destroy_process_group()
        clear_alarm()
        self.init_world(generation, rank, world_size, connect=False)
        count = self._rewire(pair_rebuilt_groups(self._job_groups, member_groups_in_order()))
        self._job_groups = []
        return count

    def _rewire(self, replaced: dict[int, Any]) -> int:
        objects, modules = self._adapter.group_holders()
        return (sum(rewire_module_globals(module, replaced) for module in modules)
                + rewire(objects, replaced))
