"""How a training process tells a lost peer from a bug of its own, how it leaves when its rank
lives on elsewhere, and how it ends when an abandoned operation still blocks a thread.

Whether an error means a lost peer is decided on what the controller knows, never on the
error's text: the controller raises the alarm of the rank's generation once a rank is lost
(its process exited, or it was found hung and killed), and the agent relays it within
milliseconds. An error with no alarm raised within the grace period (the failure timeout, the
time the controller may take to declare a hung peer lost) is the training code's own: the
process reports it to the controller (``worker_error``), which then follows the job's policy
rather than replacing the rank, and the error ends the process with its traceback.
"""

from __future__ import annotations

import atexit
import gc
import io
import logging
import os
import sys
import threading
import traceback
import weakref
from typing import Optional

from mover_plugin.comm import CollectiveAborted
from mover_plugin.comm.alarm import wait_for_alarm
from mover_plugin.comm.work import blocked_waits
from mover_plugin.devices import DeviceFault, synchronize_device
from mover_plugin.processes import exit_status

logger = logging.getLogger(__name__)


def is_lost_peer(error: BaseException, grace_s: float) -> bool:
    """True when ``error`` comes from a lost peer: the collective was abandoned by the
    plugin (the alarm or an explicit abort), or the controller's alarm arrives within
    ``grace_s`` seconds; False for an error of this process's own."""
    if isinstance(error, CollectiveAborted):
        return True
    return wait_for_alarm(grace_s)


def device_ready_or_exit(rank: int, before: str) -> None:
    """Waits for this process's GPU work before ``before`` (a commit vote: the gradients'
    reductions must have ended, not just been queued; a redo or a rollback: the aborted
    communicators' kernels must be gone). A CUDA error there is sticky: the rank is lost, and
    the process ends with status 1, as a crash would, so that a standby takes the rank."""
    try:
        synchronize_device()
    except DeviceFault as fault:
        logger.error("rank %d: the GPU failed before %s (%s); this rank is lost, exiting", rank,
                     before, fault)
        exit_now(status=1)


def describe_error(error: BaseException, limit: int = 4000) -> dict[str, str]:
    """The fields of a ``worker_error`` event: the error in one line and the end of its
    traceback."""
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    return {"error": f"{type(error).__name__}: {error}"[:500], "traceback": text[-limit:]}


def exit_now(status: int = 0) -> None:
    """Ends a process whose rank lives on elsewhere (a leaver, or a joiner whose hand-over
    failed) or that cannot go on. ``atexit`` callbacks run and every open file is flushed, but
    the interpreter's teardown is skipped: for a training process it takes seconds of CPU that
    the ranks still training on this host can use better."""
    atexit._run_exitfuncs()
    _flush_open_files()
    os._exit(status)


def end_of_script(end: Optional[BaseException] = None) -> None:
    """The training script ended: normally (``end`` None), by ``SystemExit`` or by an uncaught
    error. Returns, for the interpreter's usual teardown, unless a thread is still blocked in
    the backend wait of an operation abandoned with its group (a receive from a peer that went
    on in a new generation): the peer's exit ends that wait at any moment, and a thread that
    wakes during the teardown cannot take the interpreter back; CPython 3.12 then ends it by
    unwinding its C++ frames, which aborts the process (SIGABRT, "terminate called without an
    active exception"). In that case the process reports ``end`` as Python would (an error's
    traceback, a ``sys.exit`` message), waits for its other non-daemon threads, as the teardown
    would, and leaves through :func:`exit_now` with the exit status Python would give."""
    blocked = blocked_waits()
    if not blocked:
        return
    logger.info("%d wait(s) of abandoned operations still blocked at the end of the script; "
                "exiting without the interpreter's teardown", blocked)
    status = _exit_status(end)
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    exit_now(status)


def _exit_status(end: Optional[BaseException]) -> int:
    """The exit status Python gives a script that ended with ``end``, printing what it would."""
    if isinstance(end, SystemExit):
        if end.code is not None and not isinstance(end.code, int):
            print(end.code, file=sys.stderr)
    elif end is not None:
        sys.excepthook(type(end), end, end.__traceback__)
    return exit_status(end)


def _flush_open_files() -> None:
    """Flushes every open file object (what the interpreter's teardown would write out)."""
    sys.stdout.flush()
    sys.stderr.flush()
    for item in gc.get_objects():
        # A weak proxy answers isinstance() for its referent, and raises once that is gone.
        if type(item) not in weakref.ProxyTypes and isinstance(item, io.IOBase):
            try:
                if not item.closed and item.writable():
                    item.flush()
            except (OSError, ValueError):
                pass  # closed underneath, or not flushable: nothing to write out
