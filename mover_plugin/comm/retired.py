"""Keeps abandoned communicators alive until their pending operations end.

When a survivor leaves a blocked gloo collective, the operation is still running in one of the
backend's worker threads (waiting for a peer that may never answer). Destroying that
``ProcessGroupGloo`` would join its worker threads, i.e. block until the operation fails at the
group timeout. So a process group of an aborted generation hands its backends here instead of
dropping them: :func:`retire` keeps a reference, :func:`reap` drops the ones whose operations
have all ended (their destructors are then quick), and at interpreter exit whatever is still
pending is deliberately leaked so that process exit never waits for a dead peer.

The retired groups are the ``retired`` of the process's
:class:`~mover_plugin.comm.context.CommContext`.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from mover_plugin.comm.context import RetiredState, default_context

logger = logging.getLogger(__name__)


@dataclass
class RetiredGroup:
    """The backends of one shut-down group, held while ``pending`` operations run."""

    name: str
    backends: list[Any]
    pending: list[Any]
    since: float = field(default_factory=time.monotonic)

    def finished(self) -> bool:
        return all(item.done() for item in self.pending)


def retire(name: str, backends: Sequence[Any], pending: Sequence[Any]) -> None:
    """Takes over ``backends`` (c10d backend objects) of group ``name`` while any of
    ``pending`` (objects with a ``done()`` method) has not finished. With nothing pending, the
    backends are simply released by the caller.
    """
    pending = [item for item in pending if not item.done()]
    if not pending:
        return
    logger.info("group %s retired with %d pending operation(s)", name, len(pending))
    state = default_context().retired
    with state.lock:
        state.groups.append(RetiredGroup(name, list(backends), pending))
        if not state.exit_hook_installed:
            atexit.register(_leak_pending_at_exit, state)
            state.exit_hook_installed = True
    _reap(state)


def reap() -> int:
    """Releases retired backends whose operations all ended; returns how many are still held."""
    return _reap(default_context().retired)


def held() -> int:
    """How many retired groups still have pending operations."""
    state = default_context().retired
    with state.lock:
        return len(state.groups)


def _reap(state: RetiredState) -> int:
    with state.lock:
        done = [entry for entry in state.groups if entry.finished()]
        for entry in done:
            state.groups.remove(entry)
        remaining = len(state.groups)
    for entry in done:
        logger.debug("released group %s after %.1f s", entry.name,
                     time.monotonic() - entry.since)
    del done  # the backends' destructors run here, with idle worker threads
    return remaining


def _leak_pending_at_exit(state: RetiredState) -> None:
    """Takes an extra reference to every backend still pending, so that interpreter teardown
    never runs their destructors (which would wait for the stuck operations)."""
    _reap(state)
    with state.lock:
        for entry in state.groups:
            for backend in entry.backends:
                ctypes.pythonapi.Py_IncRef(ctypes.py_object(backend))
        if state.groups:
            logger.info("leaving %d retired group(s) with pending operations to process exit",
                        len(state.groups))
