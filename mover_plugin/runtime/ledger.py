"""Where one rank is in training: the iterations whose update it applied and the one it runs.

The runtime opens a :class:`StepState` for each attempt at an iteration and closes it when
the iteration ends; the commit gate marks it as it passes. A framework adapter reads the
ledger to decide, after a crash, which side of the optimizer update this rank is on, and
counts the update once its optimizer has applied it.

**The commit rule**, read here only: a rank that passed the commit all-reduce of an iteration
knows every rank had complete gradients, so the iteration counts as done for the whole job
even where the update is not applied yet (:attr:`StepLedger.update_pending`,
:meth:`StepLedger.completed_by_commit`); a rank that reached the commit but was interrupted
before it passed applied nothing, and may finish the update only once some rank passed it
(:meth:`StepLedger.may_finish_update`).
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

    @property
    def update_pending(self) -> bool:
        """This rank passed the commit of the running iteration and has not counted its
        update yet (it may be applying it, or not have begun)."""
        step = self.step
        return step is not None and step.passed_commit and self.applied == step.iteration

    def completed_by_commit(self) -> int:
        """The iterations this rank counts as completed for the job: those it applied, and the
        running one once it passed the commit."""
        return self.applied + (1 if self.update_pending else 0)

    def may_finish_update(self, target: int) -> bool:
        """Whether this rank, interrupted in the iteration before ``target`` after its
        gradients were complete (it reached the commit), applies that update during the
        switch: the job continues from ``target``, so some rank passed the commit."""
        step = self.step
        return self.applied == target - 1 and step is not None and step.reached_commit

    def count_running_iteration(self) -> None:
        """The running iteration's update was applied: it counts as completed."""
        if self.step is not None:
            self.applied = self.step.iteration + 1
