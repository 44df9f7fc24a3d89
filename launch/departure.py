"""A host's planned departure: a ``mover-launch`` stopped with SIGTERM tells the controller first.

A host's ``mover-launch`` gets SIGTERM when the host goes on purpose: from Kubernetes when it
drains, evicts or deletes the pod (after the pod's ``preStop`` hook, which moves the host's
ranks away with ``mover migrate --host``: ``examples/kubernetes/prestop.sh``), or from the
``srun`` wrapper ``examples/slurm/mover_node.sh`` once it has done the same. A
``mover-launch`` that runs its host's agent itself (any host but the first of a job whose hosts
start their own ``mover-launch``, and a host that joined with ``--join``) then posts a
``leaving`` event before its agent stops the host's processes, and exits with status 143.

The controller (:mod:`mover_plugin.launch.host_loss`) takes a host that holds no rank any more
out of the job as a planned departure: ``host_left`` in the event log, no recovery, no restart;
its standbys leave the pool, and started again it joins as a spare host. A host that still
holds ranks is lost, and its ranks recovered, at once, without waiting for its heartbeat to
stop. The first host cannot leave so: it runs the controller, and its SIGTERM ends the job
(see ``docs/operators.md``).
"""

from __future__ import annotations

import functools
import logging
import signal
import sys
import time
from types import FrameType
from typing import NoReturn, Optional

import torch.distributed as dist

from mover_plugin.contract import EVENTS_MAILBOX
from mover_plugin.launch.hosts import NodeSpec
from mover_plugin.mailbox import Mailbox

logger = logging.getLogger(__name__)

EXIT_STATUS = 143
"""A ``mover-launch`` stopped with SIGTERM exits with 128 + 15, as a shell reports it."""
HOW = "its mover-launch got SIGTERM"


def leave_on_sigterm(store: dist.Store, node: NodeSpec) -> None:
    """From now on, SIGTERM posts ``leaving`` for ``node`` on ``store`` (the agent's own
    connection to the controller's store: the handler runs on the thread that uses it) and
    exits with :data:`EXIT_STATUS`; a second SIGTERM is ignored while the agent stops the
    host's processes."""
    signal.signal(signal.SIGTERM, functools.partial(_leave, store, node))


def _leave(store: dist.Store, node: NodeSpec, signum: int,
           frame: Optional[FrameType]) -> NoReturn:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        Mailbox(store, EVENTS_MAILBOX).post({
            "kind": "leaving", "node": node.node_rank, "attempt": -1, "time": time.time(),
            "host": node.host, "how": HOW})
        logger.info("node %d (%s) leaves the job: %s", node.node_rank, node.host, HOW)
    except (RuntimeError, OSError) as error:  # the controller is gone: nobody left to tell
        logger.warning("node %d could not tell the controller that it leaves (%s)",
                       node.node_rank, error)
    sys.exit(EXIT_STATUS)
