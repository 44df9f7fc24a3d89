"""Where one rank is in training: the iterations whose update it applied and the one it runs.

The runtime opens a :class:`StepState` for each attempt at an iteration and closes it when
the iteration ends; the commit gate marks it as it passes. A framework adapter reads the
ledger to decide, after a crash, which side of the optimizer update this rank is on, and
counts the update once its optimizer has applied it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class StepState:
    """The commit record of the iteration this rank runs."""

    iteration: int
    reached_commit: bool = False
    """This rank entered the commit all-reduce: its gradients were complete."""
    passed_commit: bool = False
    """The commit all-reduce completed here: every rank had reached it."""


class StepLedger:
    """This rank's completed iterations and the iteration it runs (None between steps)."""

    def __init__(self, applied: int = 0) -> None:
        self.applied = applied
        """Iterations whose optimizer update this rank has applied."""
        self.step: Optional[StepState] = None

    def begin(self, iteration: int) -> StepState:
        """Opens the record of an attempt at ``iteration``."""
        self.step = StepState(iteration)
        return self.step

    def end(self) -> None:
        self.step = None

    def count_running_iteration(self) -> None:
        """The running iteration's update was applied: it counts as completed."""
        if self.step is not None:
            self.applied = self.step.iteration + 1
