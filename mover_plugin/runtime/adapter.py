"""What the resilience runtime asks of a training framework: the adapter protocol.

The runtime (:mod:`mover_plugin.runtime.resilience`) holds the protocol of generations,
alarms, commits, switches and state transfer; a framework adapter
(:mod:`mover_plugin.megatron.resilience`, :mod:`mover_plugin.deepspeed.resilience`) implements
:class:`FrameworkAdapter` and is handed to the runtime, which calls it at these points only:

- **groups** — :meth:`~FrameworkAdapter.init_groups` right after ``init_process_group``;
  :meth:`~FrameworkAdapter.group_holders`, the objects and modules whose cached references to
  replaced groups the runtime rewrites; :meth:`~FrameworkAdapter.after_switch` once the new
  generation's groups are in place; :meth:`~FrameworkAdapter.teardown` before a leaver exits;
- **the step** — :meth:`~FrameworkAdapter.capture_snapshot` at the start of every step (what a
  redone iteration starts from besides the model and optimizer: RNG states, the framework's
  counters) and :meth:`~FrameworkAdapter.restore_snapshot`; :meth:`~FrameworkAdapter.after_step`
  at the end of every completed step;
- **after a crash** — :meth:`~FrameworkAdapter.continue_after_crash` at a survivor and
  :meth:`~FrameworkAdapter.continue_as_joiner` at a joiner: the ranks agree on the iteration
  they continue from (or roll back), the survivor settles its interrupted step, and the
  answer names which live rank sends each joiner its state; the runtime then does the sending;
- **pipeline templates** — an optional participant, :attr:`FrameworkAdapter.templates`
  (``None`` where the framework cannot train on templates: such a job publishes no template
  spec, so the controller never plans it a shrink): after a shrink (no standby, and again
  after each loss while shrunk), :meth:`~TemplateParticipant.leave_templates` if on templates,
  then :meth:`~TemplateParticipant.continue_on_templates` at every survivor; growing back,
  :meth:`~TemplateParticipant.leave_templates` and
  :meth:`~TemplateParticipant.continue_after_growth` at a survivor and
  :meth:`~TemplateParticipant.join_after_growth` at a standby;
- **state** — :meth:`~FrameworkAdapter.state_tensors` (sent and received in place) and
  :meth:`~FrameworkAdapter.state_blob` / :meth:`~FrameworkAdapter.load_state` (everything
  else), for each kind of :class:`Transfer`.

An adapter reads and counts the rank's progress through the runtime's public
:class:`~mover_plugin.runtime.ledger.StepLedger` and enters the commit through
:meth:`ResilienceRuntime.commit <mover_plugin.runtime.resilience.ResilienceRuntime.commit>`.
"""

from __future__ import annotations

import enum
import types
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import torch

from mover_plugin.contract import GenerationPlan


class Transfer(enum.Enum):
    """Which state travels to a joiner, from whom."""

    HANDOVER_SENT = "handover sent"
    """A leaver sends its own state to the joiner that takes its rank (a planned migration);
    the two ends list the same tensors."""
    HANDOVER_RECEIVED = "handover received"
    """The joiner of a leaver receives that state."""
    COPY_SENT = "copy sent"
    """A survivor sends the copy it holds of a lost rank's state (its data-parallel twin's
    replica, or a peer copy of its shard)."""
    COPY_RECEIVED = "copy received"
    """The joiner of a lost rank receives that copy."""


@dataclass(frozen=True)
class Continuation:
    """Where the ranks of a new generation continue after a crash."""

    iteration: int
    """The iteration every rank is at (completed iterations)."""
    senders: dict[int, int] = field(default_factory=dict)
    """For each lost rank, the live rank that sends its joiner the state (empty after a
    rollback)."""
    rolled_back: bool = False
    """Every rank rolled back to the last checkpoint instead of continuing in place."""
    received_bytes: int = 0
    """What this rank received of layers and optimizer state when the job's layout changed
    (a shrink onto pipeline templates, or growing back)."""


class TemplateParticipant(Protocol):
    """An adapter's part in training on pipeline templates (see the module docstring)."""

    @property
    def on_templates(self) -> bool:
        """Whether this rank trains on pipeline templates (the job shrank)."""

    def continue_on_templates(self, plan: GenerationPlan,
                              snapshot: dict[str, Any]) -> Continuation:
        """A survivor's part of a shrink, once the survivors' world exists: agrees with the
        others on the iteration, moves its training onto the ``plan``'s pipeline templates
        (:mod:`mover_plugin.shrink`) from the job's layout or from the templates of the
        shrink before, and hands the runtime its step
        (:meth:`~mover_plugin.runtime.resilience.ResilienceRuntime.train_with`). Called only
        in a job whose first rank published a :class:`~mover_plugin.shrink.TemplateSpec`."""

    def leave_templates(self) -> None:
        """Growing back or shrinking again, at a survivor: releases the groups of the
        pipeline templates (their state is kept until the next layout takes it)."""

    def continue_after_growth(self, plan: GenerationPlan) -> int:
        """Growing back, at a survivor, once the job's groups exist again and the script's
        objects point at them: agrees on the iteration and moves the state of the templates
        back into the script's objects, sending the standbys theirs. Returns the bytes it
        received."""

    def join_after_growth(self, plan: GenerationPlan) -> Continuation:
        """Growing back, at a standby that takes a lost rank: its part of the same agreement
        and transfers."""


class FrameworkAdapter(Protocol):
    """The framework side of the resilience runtime (see the module docstring)."""

    templates: Optional[TemplateParticipant]
    """The adapter's part in pipeline templates; ``None``: the framework has none."""

    def init_groups(self) -> None:
        """The framework's own groups, right after ``init_process_group``."""

    def group_holders(self) -> tuple[list[Any], list[types.ModuleType]]:
        """The objects and modules whose cached references to groups are rewritten."""

    def after_switch(self) -> None:
        """Runs once this rank's groups of the new generation are in place."""

    def teardown(self) -> None:
        """Releases the framework's groups before a leaver exits."""

    def capture_snapshot(self) -> dict[str, Any]:
        """What a redone iteration starts from besides the model and optimizer."""

    def restore_snapshot(self, snapshot: dict[str, Any]) -> None: ...

    def after_step(self, iteration: int) -> None:
        """Runs at the end of every completed step, before a planned switch."""

    def continue_after_crash(self, plan: GenerationPlan,
                             snapshot: dict[str, Any]) -> Continuation:
        """A survivor's part once its groups are switched: agrees with the others (a
        collective of the new generation) and brings this rank to the iteration they continue
        from."""

    def continue_as_joiner(self) -> Continuation:
        """A joiner's part of the same agreement (it contributes no record of its own)."""

    def state_tensors(self, transfer: Transfer) -> list[torch.Tensor]:
        """The tensors sent (or received into, in place) for ``transfer``."""

    def state_blob(self) -> dict[str, Any]:
        """Everything else a joiner gets, besides the snapshot and the iteration."""

    def load_state(self, state: dict[str, Any], transfer: Transfer) -> None:
        """A joiner loads the blob it received."""
