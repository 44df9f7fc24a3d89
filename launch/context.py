"""What the controller's units share: the state of its three lifetimes and the control store.

The controller (:mod:`mover_plugin.launch.controller`) divides its work among *units*, each
acting on some kinds of events (:class:`Unit`). They share one :class:`Context`: the job's
settings, its control store, the ``commands`` mailbox, the run summary and the event log, and
the state of three lifetimes:

* :class:`JobState` — the whole job: the nodes (and those lost), the node of each rank, which
  process holds each rank, the generation numbers and the interruption in progress;
* :class:`AttemptState` — one start of every worker (a restart begins a new one): the
  standbys each host started, its phase (training, ending, restarting), what the agents
  reported of them, its standby pool (and its target) and its rendezvous store;
* :class:`GenerationState` — one membership of the running workers: when each rank reported
  ready, its first step, and that it switched to the generation.

Generation ``g`` is one membership of the running workers; its process groups live under the
store prefix ``gen{g}/`` of the control store, so keys of an earlier generation can never
satisfy a new rendezvous. The context's operations on the store (:meth:`Context.begin_generation`,
:meth:`Context.plan_generation`, :meth:`Context.promote`, :meth:`Context.notify`) are the ones
every kind of recovery builds on.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Iterator, Mapping, Optional

import torch.distributed as dist

from mover_plugin.contract import (
    CURRENT_GENERATION_KEY,
    LAYOUT_KEY,
    NOTICE_KINDS,
    TEMPLATES_KEY,
    GenerationPlan,
    make_command,
    plan_key,
    promotion_key,
    stage_profile_key,
    successor_key,
)
from mover_plugin.generations import Membership, Replacement, StandbyPool
from mover_plugin.launch.config import LaunchConfig
from mover_plugin.launch.eventlog import EventLog
from mover_plugin.launch.store_gate import StoreGate, attempt_target, host_loopback_store
from mover_plugin.launch.summary import Interruption, RunSummary
from mover_plugin.layout import ParallelLayout
from mover_plugin.mailbox import Mailbox
from mover_plugin.shrink import TemplateSpec
from mover_plugin.templates import PlanningError

logger = logging.getLogger(__name__)

Event = dict[str, Any]
"""One event from an agent or a worker, valid by :func:`mover_plugin.contract.event_problem`."""
EventHandler = Callable[[Event], Optional[int]]
"""Acts on one event; returns the launcher's exit code when the job ends, else None."""


class Unit:
    """One part of the controller's work: it declares the event kinds it handles."""

    ANY_ATTEMPT: frozenset[str] = frozenset()
    """Kinds this unit takes whatever their attempt (the controller drops the other kinds'
    events of an earlier attempt: late reports about workers that are gone)."""

    def handlers(self) -> Mapping[str, EventHandler]:
        """The handler of each event kind this unit acts on."""
        raise NotImplementedError


@dataclass
class JobState:
    nodes: set[int]
    """The hosts in the job: every host of the launch but those lost."""
    node_of_rank: dict[int, int]
    """The node (host) each global rank runs on now."""
    lost_nodes: set[int] = field(default_factory=set)
    """Hosts lost with their agent, or that left the job on purpose
    (:mod:`mover_plugin.launch.host_loss`): out of the job."""
    left_nodes: set[int] = field(default_factory=set)
    """Those of :attr:`lost_nodes` that left on purpose, holding no rank (a planned
    departure)."""
    admitted_nodes: set[int] = field(default_factory=set)
    """Hosts admitted by a ``join_request`` whose agent has not joined yet."""
    leaving_ranks: dict[int, int] = field(default_factory=dict)
    """The ranks a planned migration in progress moves, each with the node it leaves, until
    it is handed over (:mod:`mover_plugin.launch.migration`)."""
    generation: int = -1
    last_generation: int = -1
    """The highest generation number planned so far (a cancelled one is never reused)."""
    membership: Membership = field(default_factory=lambda: Membership(0, {}))
    interruption: Optional[Interruption] = None
    """The interruption in progress, until every rank completed a step after it."""


class AttemptPhase(Enum):
    """Where an attempt stands. ``TRAINING`` -> ``ENDING`` once a rank's script ended (a
    worker exited 0): nothing new starts, and the standbys are stopped
    (:mod:`mover_plugin.launch.job_end`). ``TRAINING`` or ``ENDING`` -> ``RESTARTING`` when
    the job falls back to a restart (the next attempt starts in ``TRAINING``)."""

    TRAINING = "training"
    ENDING = "ending"
    RESTARTING = "restarting"


@dataclass
class AttemptState:
    number: int = -1
    store: Optional[dist.TCPStore] = None
    """The store the attempt's workers rendezvous on (env://)."""
    phase: AttemptPhase = AttemptPhase.TRAINING
    """Where the attempt stands: training, ending or restarting (:class:`AttemptPhase`)."""
    stopped: dict[int, list[Event]] = field(default_factory=dict)
    """Per node: the progress of each worker it stopped."""
    started: dict[int, float] = field(default_factory=dict)
    done: dict[int, Optional[int]] = field(default_factory=dict)
    """Per node whose workers all finished: the steps they completed."""
    finished_workers: list[Event] = field(default_factory=list)
    host_standbys: dict[int, int] = field(default_factory=dict)
    """The standby slots of each host in the job: the standbys it started (or was asked to,
    rejoining), less those promoted, plus the slots crashes freed there (see
    :mod:`mover_plugin.launch.refill`)."""
    pool: StandbyPool = field(default_factory=StandbyPool)
    refilling: dict[str, int] = field(default_factory=dict)
    """Standbys started to refill the pool that are not ready yet, with their node."""
    refills_started: int = 0
    rejoin_standbys: int = 0
    """Standbys started for hosts that came back, in this attempt."""
    shrunk: Optional[GenerationPlan] = None
    """The plan of the generation the survivors shrank to, when no standby was ready for a
    lost rank: the attempt trains on pipeline templates from then on."""

    def shrink_standby_slots(self, node: int) -> None:
        """One standby slot of ``node`` leaves the target (it holds a worker, or stays empty)."""
        if self.host_standbys.get(node, 0) > 0:
            self.host_standbys[node] -= 1

    @property
    def failed(self) -> bool:
        """A restart of this attempt is under way."""
        return self.phase is AttemptPhase.RESTARTING

    @property
    def ending(self) -> bool:
        """A rank's script ended: the job's end has begun."""
        return self.phase is AttemptPhase.ENDING

    @property
    def standby_target(self) -> int:
        """Standbys of the hosts in the job when every slot holds a ready one."""
        return sum(self.host_standbys.values())


@dataclass
class GenerationState:
    ready: dict[int, float] = field(default_factory=dict)
    first_step: dict[int, float] = field(default_factory=dict)
    switched: dict[int, float] = field(default_factory=dict)
    joiners: list[Replacement] = field(default_factory=list)
    """The replacements this generation was planned with after a crash (none for the first
    generation of an attempt or a migration's)."""


class Context:
    """The settings, the control plane and the state the controller's units share."""

    def __init__(self, config: LaunchConfig, store: dist.Store, summary: RunSummary,
                 log: EventLog, commands: Mailbox, gate: Optional[StoreGate] = None) -> None:
        self.config = config
        self.store = store
        self.gate = gate
        """The job's port (None when the controller runs in-process without one)."""
        self.summary = summary
        self.log = log
        self.commands = commands
        self._held: Optional[list[dict[str, Any]]] = None
        """The commands of a :meth:`one_turn`, not posted yet."""
        self._replaced: list[GenerationState] = []
        """The generation states replaced in this turn, freed at its end."""
        self.job = JobState(nodes={node.node_rank for node in config.nodes},
                            node_of_rank={r: n.node_rank for n in config.nodes for r in n.ranks})
        self.attempt = AttemptState()
        self.generation = GenerationState()

    def record(self, event: str, phase: str, **fields: Any) -> None:
        """An event-log record, of the current generation unless ``generation`` is given."""
        fields.setdefault("generation", self.job.generation)
        self.log.write(event, phase, **fields)

    def command(self, op: str, **fields: Any) -> None:
        """Sends the agents the command ``op`` (see :data:`mover_plugin.contract.COMMANDS`);
        within :meth:`one_turn`, at its end."""
        command = make_command(op, **fields)
        if self._held is not None:
            self._held.append(command)
        else:
            self.commands.post(command)

    @contextmanager
    def one_turn(self) -> Iterator[None]:
        """One turn of the controller's loop. The commands sent within it are posted together
        at its end, in order: every agent waiting for its next command is woken once for all
        of them (a recovery's alarm, promotions and generation reach thousands of hosts). What
        the turn's decisions replaced (a generation's reports, one per rank) is freed after
        them. Turns do not nest."""
        self._held = []
        try:
            yield
        finally:
            held, self._held = self._held, None
            self.commands.post_many(held)
            self._replaced.clear()

    def notify(self, generation: int, kind: str, **fields: Any) -> None:
        """A notice to generation ``generation``'s processes (the agents relay it)."""
        assert kind in NOTICE_KINDS, kind
        self.command("notice", generation=generation, kind=kind, **fields)

    def host_attempt_store(self, attempt: int) -> dist.TCPStore:
        """A fresh rendezvous store for attempt ``attempt``, on this host's loopback, that
        the job's port leads to."""
        store = host_loopback_store()
        if self.gate is not None:
            self.gate.route(attempt_target(attempt), store.port)
        return store

    def begin_generation(self, generation: int) -> None:
        self.job.generation = generation
        self.job.last_generation = max(self.job.last_generation, generation)
        self.store.set(CURRENT_GENERATION_KEY, str(generation))
        self._replaced.append(self.generation)  # freed once the turn's commands are out
        self.generation = GenerationState()

    def plan_generation(self, plan: GenerationPlan, *, link: bool = True) -> int:
        """Starts the generation after the current one with ``plan`` as its plan, and
        (with ``link``; a migration does it at its point of no return) tells the current one's
        processes which generation follows theirs. Returns the generation it follows."""
        old, new = self.job.generation, self.job.last_generation + 1
        self.begin_generation(new)
        plan = dataclasses.replace(plan, generation=new)
        self.store.set(plan_key(new), json.dumps(plan.to_record()))
        if link:
            self.store.set(successor_key(old), str(new))
        return old

    def restore_generation(self, generation: int) -> None:
        """Goes back to ``generation`` (a planned one was called off) and tells the agents."""
        self.job.generation = generation
        self.store.set(CURRENT_GENERATION_KEY, str(generation))
        self.command("generation", generation=generation)

    def promote(self, plan: list[Replacement], *, migration: bool) -> None:
        """Hands each planned rank to its standby (the agents relabel the processes) and moves
        the agents to the new generation. Each standby's slot holds a worker from now on: the
        pool's target counts one standby fewer on its host."""
        for item in plan:
            self.attempt.shrink_standby_slots(item.node)
            self.store.set(promotion_key(item.standby),
                           json.dumps({"rank": item.rank, "generation": self.job.generation,
                                       "migration": migration}))
            self.command("promote", standby=item.standby, rank=item.rank, migration=migration)
            self.job.node_of_rank[item.rank] = item.node
        self.command("generation", generation=self.job.generation)

    def layout(self) -> Optional[ParallelLayout]:
        """The parallel layout rank 0 published; None before the workers trained."""
        if not self.store.check([LAYOUT_KEY]):
            return None
        return ParallelLayout.of_record(json.loads(self.store.get(LAYOUT_KEY)))

    def template_spec(self) -> Optional[TemplateSpec]:
        """What rank 0 published about training on pipeline templates; None when the job
        cannot (or its workers have not trained yet)."""
        if not self.store.check([TEMPLATES_KEY]):
            return None
        spec = TemplateSpec.of_record(json.loads(self.store.get(TEMPLATES_KEY)))
        layout = self.layout()
        if spec.profile is not None or layout is None:
            return spec
        keys = [stage_profile_key(stage) for stage in range(layout.pp)]
        if not self.store.check(keys):
            logger.warning("not every pipeline stage measured its layers: the pipeline "
                           "templates are planned from a GPT-like estimate")
            return spec
        try:
            return spec.with_measured([json.loads(self.store.get(key)) for key in keys])
        except PlanningError as error:
            logger.warning("the stages' measured profile is not the model's (%s): the pipeline "
                           "templates are planned from a GPT-like estimate", error)
            return spec

    def interrupted(self) -> bool:
        """Whether an interruption is in progress or a restart under way."""
        return self.job.interruption is not None or self.attempt.failed
