"""An agent's settings, as the launcher (or a joining host's controller) gives them: JSON in
the environment variable ``MOVER_AGENT_CONFIG`` of ``python -m mover_plugin.launch.agent``."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from mover_plugin.launch.faults import FailureInjection, MigrationInjection
from mover_plugin.launch.hosts import NodeSpec
from mover_plugin.launch.liveness import BEAT_PERIOD_S


@dataclass(frozen=True)
class AgentConfig:
    node: NodeSpec
    world_size: int
    master_addr: str
    master_port: int
    command: tuple[str, ...]
    injections: tuple[FailureInjection, ...] = ()
    stop_grace_s: float = 5.0
    standbys: int = 0
    exit_timeout_s: float = 60.0
    """How long a rank's process may take to exit once every script on this host ended."""
    migrations: tuple[MigrationInjection, ...] = ()
    report_busy: bool = False
    """Send the controller each step's busy times of this host's ranks (slow-rank policy)."""
    gpus: int = 0
    """This host's GPUs, one per process (0: none; :mod:`mover_plugin.devices`)."""
    beat_period_s: float = BEAT_PERIOD_S
    """How often the agent beats (:func:`mover_plugin.launch.liveness.beat_period`)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "AgentConfig":
        raw = json.loads(text)
        return cls(
            node=NodeSpec(**raw["node"]),
            world_size=raw["world_size"],
            master_addr=raw["master_addr"],
            master_port=raw["master_port"],
            command=tuple(raw["command"]),
            injections=tuple(FailureInjection(**i) for i in raw["injections"]),
            stop_grace_s=raw["stop_grace_s"],
            standbys=raw["standbys"],
            exit_timeout_s=raw["exit_timeout_s"],
            migrations=tuple(MigrationInjection(**i) for i in raw["migrations"]),
            report_busy=raw["report_busy"],
            gpus=raw["gpus"],
            beat_period_s=raw.get("beat_period_s", BEAT_PERIOD_S),
        )
