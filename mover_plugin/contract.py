"""The contract between the launcher (controller and agents) and the processes it starts.

Both sides import this module and nothing of each other: the environment variables an agent
sets for a worker or standby, the keys of the control-plane store, the names of its
mailboxes, the notices the controller sends a generation's processes, and the events the
agents and workers post to the controller, each kind with the fields it carries.

**Store keys.**

* ``gen/current`` — the current generation number;
* ``gen{g}/...`` — generation ``g``'s namespace: its process groups rendezvous under it;
* ``gen{g}/plan`` — how generation ``g`` was formed (JSON of a :class:`GenerationPlan`:
  replacements with their twins, or a shrink's or a growth's layout);
* ``gen{g}/next`` — the generation that follows ``g`` (a planned generation that was
  abandoned, e.g. a migration whose joiner died, is skipped, its namespace never reused). For a
  migration it is set only at the migration's point of no return, once every rank of ``g`` has
  ended the switch iteration: until then a rank lost in ``g`` is recovered in a generation
  planned from ``g``;
* ``gen{g}/switch`` — for a migration's generation ``g``: ``go`` once every rank of the old
  generation ended the switch iteration (the leavers exit, the others switch), or ``cancel``
  (the processes of the old generation go on in it; a crash that cancelled it is recovered
  from there);
* ``gen{g}/handover/{rank}/`` — the two-process group over which the process that hands
  ``rank`` over (the leaver, or a data-parallel twin after a crash) sends its state to the
  process that takes it;
* ``gen{g}/peercopy/{src}-{dst}/`` — the two-process group over which rank ``src`` sends the
  copy of its optimizer shard to ``dst``, the next rank of its data-parallel group, after every
  step (:mod:`mover_plugin.runtime.peer_copy`);
* ``standby/{id}/promote`` — the rank and generation a standby takes over (JSON);
* ``attempt{a}/standbys_ready`` — set once every standby of attempt ``a`` is ready (a resilient
  job's workers wait for it, bounded, before their first step);
* ``job/layout`` — the parallel layout (JSON ``tp``, ``pp``, ``dp``) published by rank 0;
* ``job/templates`` — published by rank 0 when the job can train on pipeline templates: what
  the planner needs of its model and batch (JSON, :class:`mover_plugin.shrink.TemplateSpec`);
* ``job/profile/stage{s}`` — the per-layer costs of pipeline stage ``s`` (JSON, a profile
  record of its layers), measured by the stage's first rank before its first step when the job
  trains on pipeline templates without a given profile;
* the mailboxes (:mod:`mover_plugin.mailbox`): ``commands`` (controller to agents; they include
  the notices to a generation's processes, which the agents relay to their workers), ``events``
  (agents and workers to the controller) and ``requests`` (operator requests: ``mover status``,
  ``mover migrate``), answered under ``request/{id}/reply`` (accepted or rejected) and
  ``request/{id}/done`` (finished).

**Events** form a closed set (:data:`EVENTS`): each kind names the fields it must carry and
their JSON types. :func:`event_problem` says what is wrong with an event that the controller
must not act on (an unknown kind, a missing field, a field of the wrong type).

**Commands** (controller to agents, and to a host asking to join) form a closed set too
(:data:`COMMANDS`): the controller builds each with :func:`make_command`, which refuses an
unknown ``op`` or a missing or mistyped field, and an agent ignores (and logs) a command
:func:`command_problem` finds fault with.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, TypeVar, Union

from mover_plugin.generations import Replacement

# -- environment of a process started by an agent ---------------------------------------------

CONTROL_ADDR_ENV = "MOVER_CONTROL_ADDR"
CONTROL_PORT_ENV = "MOVER_CONTROL_PORT"
"""The controller's store, which outlives every rank."""
ATTEMPT_ENV = "MOVER_ATTEMPT"
"""The attempt (one start of every worker) the process belongs to."""
GENERATION_ENV = "MOVER_GENERATION"
"""The generation current when the process was started."""
STANDBY_ID_ENV = "MOVER_STANDBY_ID"
"""Set for a standby only: its id in the controller's pool."""
NOTICE_FD_ENV = "MOVER_NOTICE_FD"
"""The read end of the pipe the agent writes the controller's notices into."""
PROGRESS_FD_ENV = "MOVER_PROGRESS_FD"
"""The write end of the pipe the process reports its progress and heartbeats on."""
PREFLIGHT_ENV = "MOVER_PREFLIGHT"
"""``1`` when the launcher runs the script once to check its flags, before any worker."""
PREFLIGHT_OK = "MOVER_PREFLIGHT_OK"
PREFLIGHT_ERROR = "MOVER_PREFLIGHT_ERROR"
"""The line prefixes a flag check answers with (stdout, stderr)."""

# -- store keys ---------------------------------------------------------------------------------

CURRENT_GENERATION_KEY = "gen/current"
LAYOUT_KEY = "job/layout"
TEMPLATES_KEY = "job/templates"
SWITCH_GO = "go"
SWITCH_CANCEL = "cancel"

COMMANDS_MAILBOX = "commands"
EVENTS_MAILBOX = "events"
REQUESTS_MAILBOX = "requests"


def generation_prefix(generation: int) -> str:
    return f"gen{generation}"


def stage_profile_key(stage: int) -> str:
    return f"job/profile/stage{stage}"


def plan_key(generation: int) -> str:
    return f"gen{generation}/plan"


def standbys_ready_key(attempt: int) -> str:
    return f"attempt{attempt}/standbys_ready"


def successor_key(generation: int) -> str:
    return f"gen{generation}/next"


def switch_decision_key(generation: int) -> str:
    return f"gen{generation}/switch"


def promotion_key(standby: str) -> str:
    return f"standby/{standby}/promote"


def handover_prefix(generation: int, rank: int) -> str:
    return f"gen{generation}/handover/{rank}/"


def peer_copy_prefix(generation: int, source: int, destination: int) -> str:
    return f"gen{generation}/peercopy/{source}-{destination}/"


def request_reply_key(request_id: str) -> str:
    return f"request/{request_id}/reply"


def request_done_key(request_id: str) -> str:
    return f"request/{request_id}/done"


# -- notices: controller to a generation's processes ----------------------------------------------

ALARM = "alarm"
"""A rank of the generation is lost: leave the step you are in (field ``reason``)."""
PREPARE = "prepare"
"""A planned migration to generation ``next`` begins: build your part of its groups."""
SWITCH = "switch"
"""Switch to the migration's generation at the next iteration boundary."""
NOTICE_KINDS = (ALARM, PREPARE, SWITCH)

# -- a generation's plan (``gen{g}/plan``): the controller to the generation's processes ---------


class PlanKind(enum.Enum):
    """How a generation was formed."""

    CRASH = "crash"
    """Standbys take lost ranks (with replacements carried over from a switch under way)."""
    MIGRATION = "migration"
    """Standbys take ranks that leave (a planned migration)."""
    SHRINK = "shrink"
    """No standby was ready: the survivors form a world of their own on pipeline templates."""
    GROW = "grow"
    """A shrunk job returns to its own layout, standbys taking the lost ranks."""


Move = tuple[str, int, int]
"""One unit of a pipeline-template relayout: (unit, source rank, destination rank)."""


@dataclass(frozen=True)
class GenerationPlan:
    """How generation ``generation`` is formed: the controller writes it before the
    generation's processes need it, and every one of them reads it.

    ``replacements`` name the standbys that take ranks (crash, migration, grow).
    ``rebuild_all`` (crash): the switch before did not complete, so every group is rebuilt.
    ``fault`` (migration): a fault injected into its phases. ``survivors`` (shrink, grow):
    the job ranks that trained on through the shrink, the i-th being rank i of its world.
    ``lost`` (shrink): the ranks it went on without. ``placement`` (shrink): the templates'
    placement record in the survivors' ranks. ``moves`` (shrink, grow): the units every rank
    sends and receives, in order. ``describe``: the placement in words, for logs."""

    kind: PlanKind
    world_size: int
    replacements: tuple[Replacement, ...] = ()
    rebuild_all: bool = False
    fault: Optional[str] = None
    survivors: tuple[int, ...] = ()
    lost: tuple[int, ...] = ()
    placement: Optional[Mapping[str, Any]] = None
    moves: tuple[Move, ...] = ()
    describe: str = ""
    generation: int = -1
    """Set by the controller when it writes the plan."""

    @property
    def replaced_ranks(self) -> frozenset[int]:
        """The ranks standbys take."""
        return frozenset(item.rank for item in self.replacements)

    def replacement_of(self, rank: int) -> Optional[Replacement]:
        """The replacement that gives ``rank`` to a standby, or None."""
        return next((item for item in self.replacements if item.rank == rank), None)

    def to_record(self) -> dict[str, Any]:
        """The plan as JSON-ready data (what ``gen{g}/plan`` holds)."""
        return {"generation": self.generation, "kind": self.kind.value,
                "world_size": self.world_size,
                "replacements": [dataclasses.asdict(item) for item in self.replacements],
                "rebuild_all": self.rebuild_all, "fault": self.fault,
                "survivors": list(self.survivors), "lost": list(self.lost),
                "placement": None if self.placement is None else dict(self.placement),
                "moves": [list(move) for move in self.moves], "describe": self.describe}

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> "GenerationPlan":
        """The plan :meth:`to_record` wrote; raises ``ValueError`` naming what is wrong."""
        problem = _fields_problem("a generation plan", record, {
            "generation": int, "kind": str, "world_size": int, "replacements": LIST,
            "rebuild_all": bool, "fault": OPTIONAL_STR, "survivors": LIST, "lost": LIST,
            "placement": (dict, type(None)), "moves": LIST, "describe": str})
        if problem is not None:
            raise ValueError(problem)
        try:
            kind = PlanKind(record["kind"])
        except ValueError:
            raise ValueError(f"a generation plan of unknown kind {record['kind']!r}; kinds: "
                             f"{', '.join(k.value for k in PlanKind)}") from None
        return cls(kind=kind, world_size=record["world_size"],
                   replacements=tuple(Replacement(**item) for item in record["replacements"]),
                   rebuild_all=record["rebuild_all"], fault=record["fault"],
                   survivors=tuple(record["survivors"]), lost=tuple(record["lost"]),
                   placement=record["placement"],
                   moves=tuple((str(unit), int(source), int(destination))
                               for unit, source, destination in record["moves"]),
                   describe=record["describe"], generation=record["generation"])


def encode_notice(notice: dict[str, Any]) -> bytes:
    """One notice as the line the agent writes into a worker's notice pipe."""
    return (json.dumps(notice, separators=(",", ":")) + "\n").encode()

# -- events: agents and workers to the controller -------------------------------------------------

JsonType = Union[type, tuple[type, ...]]
NUMBER: tuple[type, ...] = (int, float)
OPTIONAL_INT: tuple[type, ...] = (int, type(None))
OPTIONAL_STR: tuple[type, ...] = (str, type(None))


@dataclass(frozen=True)
class EventSchema:
    """The fields an event kind must carry, with their JSON types (besides the envelope:
    ``kind``, ``attempt`` and ``time`` on every event, and ``node`` on an agent's). Other
    fields may come along; the controller reads only these."""

    required: Mapping[str, JsonType] = field(default_factory=dict)
    from_agent: bool = True


ENVELOPE: Mapping[str, JsonType] = {"kind": str, "attempt": int, "time": NUMBER}
_EXIT = {"rank": OPTIONAL_INT, "returncode": int, "how": str, "step_begun": int}

EVENTS: Mapping[str, EventSchema] = {
    # posted by an agent about its host and the processes it started
    "joined": EventSchema({"host": str, "nproc": int, "pid": int}),
    "started": EventSchema({"pids": dict}),
    "stopped": EventSchema({"workers": list}),
    "node_busy": EventSchema(),
    "node_done": EventSchema({"steps_completed": OPTIONAL_INT, "workers": list}),
    "ready": EventSchema({"rank": int, "step": int}),
    "first_step": EventSchema({"rank": int, "step": int}),
    "busy": EventSchema({"step": int, "ranks": dict}),
    "steps": EventSchema({"steps": list}),
    "injected": EventSchema({"rank": int, "step": int, "signal": str}),
    "migration_due": EventSchema({"rank": int, "step": int, "fault": OPTIONAL_STR}),
    "worker_exit": EventSchema(_EXIT),
    "leaver_exit": EventSchema(_EXIT),
    "hung": EventSchema({"rank": OPTIONAL_INT, "silent_s": NUMBER}),
    "standby_ready": EventSchema({"standby": str}),
    "standby_exit": EventSchema({"standby": str, "returncode": int, "how": str}),
    # posted by a mover-launch that runs its host's agent, when SIGTERM stops it
    "leaving": EventSchema({"host": str, "how": str}),
    # posted by the mover-launch --join of a host that asks to join (it has no node yet)
    "join_request": EventSchema({"host": str, "slots": int, "pid": int, "token": str},
                                from_agent=False),
    # posted by a worker or standby through its control client
    "standby_warmed": EventSchema({"standby": str}, from_agent=False),
    "left_step": EventSchema({"rank": int, "generation": int}, from_agent=False),
    "worker_error": EventSchema({"rank": OPTIONAL_INT, "error": str, "traceback": str},
                                from_agent=False),
    "switched": EventSchema({"rank": int, "generation": int}, from_agent=False),
    "rolled_back": EventSchema({"rank": int, "generation": int, "iteration": int,
                                "reason": str, "load_s": NUMBER, "inexact": OPTIONAL_STR},
                               from_agent=False),
    "caught_up": EventSchema({"rank": int, "generation": int, "steps": int,
                              "catch_up_s": NUMBER, "replayed": int,
                              "inexact": OPTIONAL_STR},
                             from_agent=False),
    "prepared": EventSchema({"rank": int, "generation": int}, from_agent=False),
    "peer_copy": EventSchema({"rank": int, "generation": int, "bytes": int,
                              "critical_s": NUMBER, "exchanges": int}, from_agent=False),
    "groups_prepared": EventSchema({"rank": int, "generation": int, "build_s": NUMBER,
                                    "rebuilt": int, "kept": int}, from_agent=False),
    "boundary": EventSchema({"rank": int, "generation": int, "iteration": int,
                             "step_s": NUMBER, "migration": int}, from_agent=False),
    "switch_cancelled": EventSchema({"rank": int, "generation": int, "migration": int},
                                    from_agent=False),
    "left": EventSchema({"rank": int, "generation": int, "migration": int}, from_agent=False),
}
"""Every event kind the controller acts on."""


def event_problem(event: Any) -> Optional[str]:
    """What makes ``event`` one the controller must not act on, or None when it is valid."""
    schema = _schema(event, "kind", EVENTS, "an event", "event kind")
    if isinstance(schema, str):
        return schema
    required = {**ENVELOPE, **({"node": int} if schema.from_agent else {}), **schema.required}
    return _fields_problem(f"{event['kind']} event", event, required)


Schema = TypeVar("Schema")


def _schema(message: Any, key: str, schemas: Mapping[str, Schema], a_message: str,
            name: str) -> Union[Schema, str]:
    """The schema of ``message`` (named by its field ``key``), or what is wrong with it."""
    if not isinstance(message, dict):
        return f"{a_message} must be a JSON object, got {type(message).__name__}"
    value = message.get(key)
    schema = schemas.get(value) if isinstance(value, str) else None
    return f"unknown {name} {value!r}" if schema is None else schema


def _fields_problem(what: str, message: Mapping[str, Any],
                    required: Mapping[str, JsonType]) -> Optional[str]:
    for name, expected in required.items():
        if name not in message:
            return f"{what} without its field {name!r}"
        if not _is_json_type(message[name], expected):
            return (f"{what}: field {name!r} is {type(message[name]).__name__}, "
                    f"expected {_type_names(expected)}")
    return None


def _is_json_type(value: Any, expected: JsonType) -> bool:
    types = expected if isinstance(expected, tuple) else (expected,)
    if isinstance(value, bool) and bool not in types:
        return False  # JSON true is not a number
    return isinstance(value, types)


def _type_names(expected: JsonType) -> str:
    types = expected if isinstance(expected, tuple) else (expected,)
    return " or ".join("null" if t is type(None) else t.__name__ for t in types)


# -- commands: the controller to the agents -------------------------------------------------------

LIST: tuple[type, ...] = (list, tuple)
"""A JSON array (a tuple is one once encoded)."""


@dataclass(frozen=True)
class CommandSchema:
    """The fields a command carries besides its ``op``, with their JSON types; ``open``: it
    may carry more (a notice's own fields, which the agent relays as they are)."""

    required: Mapping[str, JsonType] = field(default_factory=dict)
    open: bool = False


COMMANDS: Mapping[str, CommandSchema] = {
    # an attempt: its workers, and when they may start their first step
    "start": CommandSchema({"attempt": int, "generation": int, "ranks": dict}),
    "arm": CommandSchema(),
    "stop": CommandSchema({"attempt": int}),
    # a generation's processes
    "generation": CommandSchema({"generation": int}),
    "notice": CommandSchema({"generation": int, "kind": str}, open=True),
    "promote": CommandSchema({"standby": str, "rank": int, "migration": bool}),
    "cancel_promotion": CommandSchema({"standby": str, "rank": int}),
    "discard_leaver": CommandSchema({"rank": int}),
    "drop": CommandSchema({"ranks": LIST}),
    # the standby pool and the hosts
    "refill": CommandSchema({"attempt": int, "node": int, "standby": str}),
    "admit": CommandSchema({"token": str, "node": dict, "world_size": int, "command": LIST,
                            "standbys": int, "stop_grace_s": NUMBER,
                            "exit_timeout_s": NUMBER, "report_busy": bool}),
    "join_refused": CommandSchema({"token": str, "reason": str}),
    "rejoin": CommandSchema({"node": int, "attempt": int, "generation": int,
                             "standbys": LIST}),
    "fence": CommandSchema({"node": int}),
    # the end of the job
    "wind_down": CommandSchema({"attempt": int}),
    "finish": CommandSchema(),
    "abort": CommandSchema(),
}
"""Every command the controller sends."""


def command_problem(command: Any) -> Optional[str]:
    """What makes ``command`` one an agent must not obey, or None when it is valid."""
    schema = _schema(command, "op", COMMANDS, "a command", "command")
    if isinstance(schema, str):
        return schema
    op = command["op"]
    problem = _fields_problem(f"{op} command", command, schema.required)
    if problem is None and not schema.open:
        extra = sorted(set(command) - set(schema.required) - {"op"})
        if extra:
            return f"{op} command: unknown field(s) {', '.join(map(repr, extra))}"
    return problem


def make_command(op: str, **fields: Any) -> dict[str, Any]:
    """The command ``op`` with ``fields``; raises ``ValueError`` naming what is wrong."""
    command = {"op": op, **fields}
    problem = command_problem(command)
    if problem is not None:
        raise ValueError(problem)
    return command
