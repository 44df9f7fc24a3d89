"""The NCCL environment an abortable group needs, set before its first NCCL communicator.

``ProcessGroupNCCL`` reads these variables when it is constructed. Their defaults suit a job
that stops at the first fault: on a peer's error or a collective's timeout, its watchdog
thread ends the process (``TORCH_NCCL_ASYNC_ERROR_HANDLING`` 3, tear down without cleanup)
and rethrows CUDA errors it sees (``TORCH_NCCL_RETHROW_CUDA_ERRORS`` 1), which also ends it.
A resilient job's survivors must live through a peer's loss: its own timers decide (the
alarm after ``--resilient-failure-timeout-s``, always below the groups' collective timeout,
which is the watchdog's), and :class:`~mover_plugin.comm.process_group.MoverProcessGroup`
aborts the communicators itself. So both are set to 0 — the setting torch's
``_abort_process_group`` is meant for — unless the job's environment sets them; a value of
its own that would end the process is kept and named in a warning.

The watchdog's heartbeat monitor (``TORCH_NCCL_ENABLE_MONITORING``, ending a process whose
watchdog is stuck for ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC``, 480 s by default) is left as it
is: its bound is far above any wait of the recovery.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping

logger = logging.getLogger(__name__)

RESILIENT_NCCL_ENV: dict[str, str] = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
    "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0",
}
"""What an abortable group sets where the environment does not."""

ENDS_THE_PROCESS: dict[str, frozenset[str]] = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": frozenset({"1", "3"}),
    "TORCH_NCCL_RETHROW_CUDA_ERRORS": frozenset({"1", "true", "True", "TRUE"}),
}
"""The values of a variable with which NCCL's watchdog ends a survivor."""


def set_resilient_nccl_env(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Sets every variable of :data:`RESILIENT_NCCL_ENV` that ``environ`` lacks; returns what
    it set. A value already there that ends the process is kept, with a warning."""
    changed = {}
    for name, value in RESILIENT_NCCL_ENV.items():
        if name not in environ:
            environ[name] = changed[name] = value
        elif environ[name] in ENDS_THE_PROCESS[name]:
            logger.warning("%s=%s: NCCL's watchdog ends this process when a peer is lost, so "
                           "it cannot be recovered in place; leave it unset (mover sets %s)",
                           name, environ[name], value)
    return changed
