"""A survivor's moves onto pipeline templates and back: the runtime's shrink and growth.

When a rank is lost and no standby is ready, the controller may plan a *shrink*
(:mod:`mover_plugin.shrink`): :meth:`TemplateSwitch.shrink` shuts every group of the old
world down (never waiting on the lost peer), makes a world of the survivors, numbered in the
order of their job ranks (the process keeps its job rank towards the controller), and hands
the training to the adapter's template participant
(:class:`~mover_plugin.runtime.adapter.TemplateParticipant`), which trains the plan's pipeline
templates with a step of its own. Another loss while shrunk shrinks again the same way, from the
survivors' world and the templates' state. When standbys are ready again the survivors agree in an
iteration to grow back; before the next, :meth:`TemplateSwitch.grow_back` builds the job's
world and groups again (with the standbys that take the lost ranks), points every reference
the script's objects hold to the groups of the job before the shrink at their new
counterparts, and the participant moves the state back; each standby's part is
:meth:`TemplateSwitch.join`.

It sees the generation's groups (:class:`~mover_plugin.runtime.group_switch.GroupSwitcher`)
and the adapter only; the runtime moves to the generation, keeps the world size and reports
the switch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mover_plugin.contract import GenerationPlan
from mover_plugin.errors import LaunchError
from mover_plugin.runtime.adapter import Continuation, FrameworkAdapter, TemplateParticipant
from mover_plugin.runtime.group_switch import GroupSwitcher


@dataclass(frozen=True)
class GrownBack:
    """What a survivor's switch back to the job's layout did."""

    references: int
    """Cached references to the job's groups pointed at their new counterparts."""
    received_bytes: int
    """State received from other survivors."""


class TemplateSwitch:
    """One rank's shrink and growth (module docstring)."""

    def __init__(self, groups: GroupSwitcher, adapter: FrameworkAdapter) -> None:
        self._groups = groups
        self._adapter = adapter

    def shrink(self, generation: int, rank: int, plan: GenerationPlan,
               snapshot: dict[str, Any]) -> Continuation:
        """The part of the survivor of job rank ``rank`` in a shrink into ``generation``: the
        survivors' world, then the training on ``plan``'s templates from the iteration the
        survivors agree on. A rank lost while the job trains on templates shrinks it again:
        the templates' world is left as the job's was, and the next plan's templates take
        their state from this rank's stage."""
        templates = self._templates()
        if templates.on_templates:
            templates.leave_templates()
            self._groups.leave_survivors_world()
        else:
            self._groups.leave_job_layout()
        self._groups.init_survivors_world(generation, plan.survivors.index(rank),
                                          plan.world_size)
        return templates.continue_on_templates(plan, snapshot)

    def grow_back(self, generation: int, rank: int, plan: GenerationPlan) -> GrownBack:
        """The switch of the survivor of job rank ``rank`` from the templates back to the
        job's own layout in ``generation``."""
        templates = self._templates()
        templates.leave_templates()
        references = self._groups.regrow_job_layout(generation, rank, plan.world_size)
        received = templates.continue_after_growth(plan)
        self._adapter.after_switch()
        return GrownBack(references, received)

    def join(self, plan: GenerationPlan) -> Continuation:
        """A standby's part of growing back: it takes a lost rank with the state the
        survivors send."""
        return self._templates().join_after_growth(plan)

    def _templates(self) -> TemplateParticipant:
        templates = self._adapter.templates
        if templates is None:
            raise LaunchError("a shrink or a growth was planned for a job whose framework cannot "
                              "train on pipeline templates")
        return templates
