"""The live groups of a process, and the alarm's listener that aborts their NCCL communicators.

The groups not shut down yet are the ``live`` groups of the process's
:class:`~mover_plugin.comm.context.CommContext`. The first group added registers
:func:`_abort_live_groups` with the alarm: it aborts the NCCL communicators of the groups the
alarm aborted, all at once.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import TYPE_CHECKING, Callable

from mover_plugin.comm import alarm
from mover_plugin.comm.context import LiveGroups, default_context

if TYPE_CHECKING:
    from mover_plugin.comm.process_group import MoverProcessGroup

logger = logging.getLogger(__name__)


def _live() -> LiveGroups:
    return default_context().live


ABORT_WAIT_S = 10.0
"""How long the alarm's listener waits for the NCCL aborts it started."""


def _abort_live_groups(reason: str) -> None:
    """Alarm listener: aborts the NCCL communicators of the groups the alarm aborted, each in a
    thread of its own: ``ncclCommAbort`` can block behind another communicator's hung kernel,
    and ``ProcessGroupNCCL.abort``'s own timeout does not bound it."""
    groups = [group for group in list(_live().groups) if group.uses_nccl]
    stuck = run_concurrently({group.label: functools.partial(group.on_alarm, reason)
                              for group in groups}, ABORT_WAIT_S)
    if stuck:
        logger.error("NCCL aborts still running after %.0f s (left to finish in their "
                     "threads): groups %s", ABORT_WAIT_S, ", ".join(stuck))


def run_concurrently(calls: dict[str, Callable[[], None]], wait_s: float) -> list[str]:
    """Runs each call in a daemon thread of its own, all at once; waits for them at most
    ``wait_s`` in all and returns the names of those still running (an error is logged)."""

    def run(name: str, call: Callable[[], None]) -> None:
        try:
            call()
        except Exception:  # noqa: BLE001 - logged; one failing call must not stop the others
            logger.exception("%s failed", name)

    threads = {name: threading.Thread(target=run, args=(name, call), daemon=True,
                                      name=f"mover-abort-{name}")
               for name, call in calls.items()}
    for thread in threads.values():
        thread.start()
    deadline = time.monotonic() + wait_s
    for thread in threads.values():
        thread.join(max(0.0, deadline - time.monotonic()))
    return [name for name, thread in threads.items() if thread.is_alive()]


def _ensure_alarm_listener() -> None:
    live = _live()
    with live.listener_lock:
        if not live.listener_added:
            alarm.add_listener(_abort_live_groups)
            live.listener_added = True


def add(group: "MoverProcessGroup") -> None:
    """Counts ``group`` among the live groups (the alarm's listener reaches it)."""
    _ensure_alarm_listener()
    _live().groups.add(group)


def discard(group: "MoverProcessGroup") -> None:
    """``group`` was shut down: the alarm no longer reaches it."""
    _live().groups.discard(group)
