"""The process-wide alarm that makes every abortable collective give up.

A controller (through the notice a rank's ``NoticeWatcher`` thread reads) or the runtime itself
calls :func:`raise_alarm` when a peer is gone. From then on every process group of the
``mover`` backend created before the alarm refuses new operations and every ``wait()`` on its
work raises :class:`~mover_plugin.comm.errors.CollectiveAborted`.

The alarm counts *epochs*: each transition from "clear" to "raised" starts a new epoch. A group
remembers the epoch it was created in and is aborted as soon as the epoch moves on, so groups of
the old generation stay aborted after :func:`clear_alarm`, while groups built after the alarm
(the next generation) work whether or not the alarm has been cleared yet. Raising an alarm that
is already raised changes nothing (several detectors may report the same incident); call
:func:`clear_alarm` once the next generation exists to re-arm it.

Waiters block on one condition variable, so raising the alarm wakes them at once, as does the
completion of the work they wait for; listeners
(e.g. NCCL communicator aborts) run synchronously in the raising thread.

The alarm's state is the ``alarm`` of the process's
:class:`~mover_plugin.comm.context.CommContext`.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

from mover_plugin.comm.context import AlarmState, default_context

logger = logging.getLogger(__name__)


def _state() -> AlarmState:
    return default_context().alarm


def raise_alarm(reason: str) -> int:
    """Raises the alarm; returns the epoch it started (or the current one if already raised).

    Wakes every thread blocked in an abortable ``wait()`` and runs the listeners in this thread.
    Safe to call from any thread, including signal handlers' Python callbacks.
    """
    state = _state()
    with state.cond:
        if state.raised:
            return state.epoch
        state.epoch += 1
        state.raised = True
        state.reason = reason
        state.raised_at = time.monotonic()
        state.reasons[state.epoch] = reason
        epoch = state.epoch
        listeners = list(state.listeners)
        state.cond.notify_all()
    logger.warning("alarm raised (epoch %d): %s", epoch, reason)
    for listener in listeners:
        try:
            listener(reason)
        except Exception:  # one failing listener must not keep the others from running
            logger.exception("alarm listener %r failed", listener)
    return epoch


def clear_alarm() -> None:
    """Re-arms the alarm. Groups created before the last alarm stay aborted."""
    state = _state()
    with state.cond:
        state.raised = False
        state.reason = None
        state.raised_at = None


def is_raised() -> bool:
    """Whether the alarm is raised now."""
    return _state().raised


def reason() -> Optional[str]:
    """The reason given to the raised alarm, or ``None`` when clear."""
    return _state().reason


def raised_at() -> Optional[float]:
    """``time.monotonic()`` when the raised alarm was raised, or ``None`` when clear."""
    return _state().raised_at


def current_epoch() -> int:
    """The number of alarms raised so far in this process."""
    return _state().epoch


def reason_after(epoch: int) -> Optional[str]:
    """The reason of the first alarm raised after ``epoch``, or ``None`` if there was none."""
    return _state().reasons.get(epoch + 1)


def wait_for_alarm(timeout_s: Optional[float] = None) -> bool:
    """Blocks until the alarm is raised or ``timeout_s`` passes; returns whether it is raised."""
    state = _state()
    with state.cond:
        return state.cond.wait_for(lambda: state.raised, timeout=timeout_s)


def wait_until(done: Callable[[], bool], epoch: int, timeout_s: float) -> bool:
    """Blocks up to ``timeout_s`` until ``done()`` is true or the epoch differs from ``epoch``;
    returns whether either is the case.

    ``done`` is evaluated under the alarm's lock, so a completion that sets its flag and then
    calls :func:`wake_waiters` cannot slip between the check and the sleep.
    """
    state = _state()
    with state.cond:
        return state.cond.wait_for(lambda: state.epoch != epoch or done(), timeout_s)


def wake_waiters() -> None:
    """Wakes every thread sleeping in :func:`wait_until` so it re-checks its work (called when
    a backend work completes, and when one group is aborted on its own, without an alarm)."""
    state = _state()
    with state.cond:
        state.cond.notify_all()


def add_listener(listener: Callable[[str], None]) -> None:
    """Calls ``listener(reason)`` in the raising thread at every future alarm."""
    state = _state()
    with state.cond:
        if listener not in state.listeners:
            state.listeners.append(listener)


def remove_listener(listener: Callable[[str], None]) -> None:
    """Undoes :func:`add_listener` (no error if it was not added)."""
    state = _state()
    with state.cond:
        if listener in state.listeners:
            state.listeners.remove(listener)
