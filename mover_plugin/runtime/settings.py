"""Resilience settings: defaults, command-line flags and checks, in one place.

Megatron-LM-style scripts add the flags with :func:`add_resilience_args`, which has the shape
of Megatron-LM's ``extra_args_provider`` (it takes and returns the parser); the DeepSpeed
config block is read into the same :class:`ResilienceSettings`. Either way
:meth:`ResilienceSettings.validate` checks the values before anything starts.
"""

from __future__ import annotations

import argparse
from dataclasses import Field, dataclass, fields
from typing import Callable, Optional

from mover_plugin.errors import ConfigError


@dataclass(frozen=True)
class ResilienceSettings:
    enabled: bool = False
    """Run the training loop under the resilience runtime (``--resilient``)."""
    heartbeat_interval_s: float = 0.5
    """How often a worker tells its agent it is alive."""
    failure_timeout_s: float = 5.0
    """A worker silent for this long is declared hung, killed and replaced."""
    collective_timeout_s: float = 60.0
    """The communicators' own timeout: the last resort when no alarm arrives."""
    standby_shadow_iterations: int = 2
    """Training iterations a standby runs in the sandbox per pipeline role while it warms up
    (0: it only imports and waits)."""
    standby_memory_mb: int = 0
    """Memory (MB) a standby may keep for the pipeline roles it warmed up (0: as much as a
    worker of its largest role peaked at during the warm-up, measured on a GPU; with no GPU,
    no limit). A role over the budget is warmed and released."""
    fault_tolerance: int = 1
    """When no standby is ready and the job shrinks onto pipeline templates, the plan keeps at
    least this many pipelines more than one (each a full replica of the model), so that
    losing this many more ranks leaves a live replica of every layer, when the ranks left
    allow it."""

    def validate(self, name: Optional[Callable[[str], str]] = None) -> "ResilienceSettings":
        """Checks every value; errors name each setting with ``name`` (by default its
        command-line flag)."""
        label = name or _flag_of
        for item in fields(self):
            value = getattr(self, item.name)
            if item.name == "enabled":
                if not isinstance(value, bool):
                    raise ConfigError(f"{label(item.name)} {value!r} must be true or false")
                continue
            if _is_count(item):
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ConfigError(f"{label(item.name)} {value!r} must be a whole number "
                                      "of at least 0")
            elif isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"{label(item.name)} {value!r} must be a positive number "
                                  "of seconds")
        if self.heartbeat_interval_s >= self.failure_timeout_s:
            raise ConfigError(
                f"{label('heartbeat_interval_s')} {self.heartbeat_interval_s} must be below "
                f"{label('failure_timeout_s')} {self.failure_timeout_s}, or a live worker "
                "would be declared hung between two heartbeats"
            )
        if self.failure_timeout_s >= self.collective_timeout_s:
            raise ConfigError(
                f"{label('failure_timeout_s')} {self.failure_timeout_s} must be below "
                f"{label('collective_timeout_s')} {self.collective_timeout_s}, or survivors "
                "would give up on a collective before a hung peer is replaced"
            )
        return self

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ResilienceSettings":
        given = {f.name: getattr(args, _dest(f.name)) for f in fields(cls)}
        return cls(**{name: value for name, value in given.items()
                      if value is not None}).validate()


def fault_tolerance_given(args: argparse.Namespace) -> bool:
    """Whether ``--resilient-fault-tolerance`` was given on the command line."""
    return getattr(args, _dest("fault_tolerance"), None) is not None


def add_resilience_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds ``--resilient`` and its timeouts; usable as Megatron-LM's ``extra_args_provider``."""
    defaults = ResilienceSettings()
    group = parser.add_argument_group("resilience (mover_plugin)")
    group.add_argument("--resilient", dest=_dest("enabled"), action="store_true",
                       help="Survive rank failures in-process (with mover-launch --policy "
                       "resilient): a standby takes the lost rank's place.")
    group.add_argument("--resilient-no-peer-copy", action="store_true",
                       help="With --use-distributed-optimizer: keep no copy of each rank's "
                       "optimizer shard on a data-parallel peer (saves two shards of host "
                       "memory per rank; a crash then rolls every rank back to the last "
                       "checkpoint).")
    group.add_argument("--resilient-template-profile", metavar="PATH",
                       help="A measured per-layer profile (JSON, as 'mover templates --profile' "
                       "reads) for planning the pipeline templates a job shrinks onto when no "
                       "standby is ready; checked against the model and "
                       "--resilient-fault-tolerance before the job starts (default: a GPT-like "
                       "estimate).")
    for item in fields(ResilienceSettings):
        if item.name == "enabled":
            continue
        whole = _is_count(item)
        # None when not given (the setting's default then): a job that cannot shrink onto
        # pipeline templates refuses a --resilient-fault-tolerance it is given.
        default = None if item.name == "fault_tolerance" else getattr(defaults, item.name)
        group.add_argument(_flag_of(item.name), dest=_dest(item.name),
                           type=int if whole else float, default=default,
                           metavar="N" if whole else "SECONDS")
    return parser


def _is_count(item: Field) -> bool:
    """Whether a setting is a whole number (the others are seconds)."""
    return item.type in (int, "int")


def _dest(name: str) -> str:
    return "resilient" if name == "enabled" else f"resilient_{name}"


def _flag_of(name: str) -> str:
    return "--" + _dest(name).replace("_", "-")
