"""Faults injected into a planned migration, for tests of its failure windows.

``mover-launch --inject-migration RANK:STEP:FAULT`` puts a fault name into the migration's
plan; every process of the migration arms its :class:`FaultInjector` with it, and the process
that reaches the named point kills itself with SIGKILL. The points are ``joiner`` (a joiner
before it asks for its state), ``leaver`` (a leaver once its hand-over group is open),
``commit=R`` (rank R at the commit of the switch iteration, before its vote), ``update=R``
(rank R right after the commit that agreed on the switch) and ``stayer=R`` (rank R once it
switched). Without a fault armed, reaching a point does nothing.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from typing import Callable, Optional

logger = logging.getLogger(__name__)


class FaultInjector:
    """The fault this process may inject (None: none)."""

    def __init__(self) -> None:
        self.fault: Optional[str] = None

    def arm(self, fault: Optional[str]) -> None:
        self.fault = fault

    def at(self, point: str, rank: int) -> None:
        """Kills this process if the armed fault is ``point``."""
        if self.fault == point:
            logger.warning("rank %d: injected fault %r: killing this process", rank, point)
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    def before_vote(self, rank: int, switch_requested: Callable[[], bool],
                    timeout_s: float) -> None:
        """The ``commit=R`` fault: rank R waits at the commit for the migration's switch
        notice and dies before voting, so no rank passes the commit of the iteration that was
        to be the switch's (a rank that sees the notice late would vote an iteration after the
        others, past the switch iteration)."""
        point = f"commit={rank}"
        if self.fault != point:
            return
        deadline = time.monotonic() + timeout_s
        while not switch_requested() and time.monotonic() < deadline:
            time.sleep(0.005)
        if switch_requested():
            self.at(point, rank)
