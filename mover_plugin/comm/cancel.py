"""Giving up the construction of a generation's groups when that generation is superseded.

Building a group blocks until every member has reached the same point: gloo's rendezvous and
first connections, and the round in which the members of a kept group agree it is idle
(:func:`mover_plugin.comm.delta.agree_on_idle_groups`). A member lost in the middle of a switch
never arrives, and the alarm cannot end those waits (they are not collectives of a group). So
the runtime, while it builds the groups of generation ``g``, installs a *cancel check* — a
function that says why ``g`` is no longer wanted (the controller planned ``g + 1``), or None —
with :func:`cancel_when`, and the waits here poll it: instead of waiting for a dead member until
the group timeout, the builder leaves with :class:`BuildCancelled` and switches again.

Outside :func:`cancel_when`, the waits are the plain blocking ones.

The check is process-wide (the ``cancel`` of the process's
:class:`~mover_plugin.comm.context.CommContext`); it is called from the thread that builds the
groups, never from a backend's threads.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional, Sequence

from torch.distributed import Store

from mover_plugin.comm.context import default_context
from mover_plugin.comm.errors import CollectiveAborted

CancelCheck = Callable[[], Optional[str]]
"""Returns why the groups being built are no longer wanted, or None."""

CHECK_INTERVAL_S = 0.05
"""How often a polled wait asks the cancel check (it may ask the job's store)."""
_MAX_SLEEP_S = 0.005


class BuildCancelled(CollectiveAborted):
    """The groups being built belong to a generation that was superseded; whatever was built
    for it is abandoned."""


@contextmanager
def cancel_when(check: CancelCheck) -> Iterator[None]:
    """Within this block, the waits of group construction give up when ``check()`` names a
    reason (:class:`BuildCancelled`). Blocks do not nest."""
    state = default_context().cancel
    state.check = check
    try:
        yield
    finally:
        state.check = None


def cancellable() -> bool:
    """Whether a cancel check is installed (the waits poll only then)."""
    return default_context().cancel.check is not None


def raise_if_cancelled() -> None:
    """Raises :class:`BuildCancelled` if the installed check names a reason."""
    check = default_context().cancel.check
    reason = check() if check is not None else None
    if reason is not None:
        raise BuildCancelled(f"cancelled: {reason}", reason=reason)


def wait_polling(done: Callable[[], bool], timeout: timedelta, what: str) -> None:
    """Waits until ``done()``, asking the cancel check every :data:`CHECK_INTERVAL_S`; raises
    :class:`BuildCancelled` when it names a reason and :class:`TimeoutError` after
    ``timeout``. ``done`` is polled with a sleep that grows from 0.1 ms to 5 ms, so a wait
    that ends at once costs next to nothing."""
    started = time.monotonic()
    checked = started
    sleep_s = 0.0001
    while not done():
        now = time.monotonic()
        if now - checked >= CHECK_INTERVAL_S:
            checked = now
            raise_if_cancelled()
        if now - started > timeout.total_seconds():
            raise TimeoutError(f"{what}: not done within {timeout.total_seconds():.0f} s")
        time.sleep(sleep_s)
        sleep_s = min(sleep_s * 2, _MAX_SLEEP_S)


def wait_for_keys(store: Store, keys: Sequence[str], timeout: timedelta) -> None:
    """``store.wait(keys, timeout)``, given up when the cancel check names a reason."""
    if not cancellable():
        store.wait(list(keys), timeout)
        return
    raise_if_cancelled()
    wait_polling(lambda: store.check(list(keys)), timeout, f"keys {list(keys)[:3]}")


def wait_for_work(work: Any, timeout: timedelta, what: str) -> None:
    """``work.wait()`` for a backend's work, given up (the work left to finish on its own)
    when the cancel check names a reason."""
    if cancellable():
        wait_polling(work.is_completed, timeout, what)
    work.wait()
