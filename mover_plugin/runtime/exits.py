"""How a training process tells a lost peer from a bug of its own, and how it leaves when its
rank lives on elsewhere.

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
import os
import sys
import traceback

from mover_plugin.comm import CollectiveAborted
from mover_plugin.comm.alarm import wait_for_alarm


def is_lost_peer(error: BaseException, grace_s: float) -> bool:
    """True when ``error`` comes from a lost peer: the collective was abandoned by the
    plugin (the alarm or an explicit abort), or the controller's alarm arrives within
    ``grace_s`` seconds; False for an error of this process's own."""
    if isinstance(error, CollectiveAborted):
        return True
    return wait_for_alarm(grace_s)


def describe_error(error: BaseException, limit: int = 4000) -> dict[str, str]:
    """The fields of a ``worker_error`` event: the error in one line and the end of its
    traceback."""
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    return {"error": f"{type(error).__name__}: {error}"[:500], "traceback": text[-limit:]}


def exit_now(status: int = 0) -> None:
    """Ends a process whose rank lives on elsewhere (a leaver, or a joiner whose hand-over
    failed) or that cannot go on. ``atexit`` callbacks run and output is flushed, but the
    interpreter's teardown is skipped: for a training process it takes seconds of CPU that the
    ranks still training on this host can use better."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
