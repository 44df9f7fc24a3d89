"""The fault-injection grammar of ``mover-launch``: what ``--inject-failure RANK:STEP[:SIGNAL]``
and ``--inject-migration RANK:STEP[:FAULT]`` ask for, parsed and checked before anything starts."""

from __future__ import annotations

import argparse
import signal
from dataclasses import dataclass
from typing import Optional, Sequence

from mover_plugin.errors import ConfigError


@dataclass(frozen=True)
class FailureInjection:
    """Deliver ``signal`` to the worker holding global ``rank`` when it begins ``step``."""

    rank: int
    step: int
    signal: int = signal.SIGKILL

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signal).name

    def spec(self) -> str:
        return f"{self.rank}:{self.step}:{self.signal_name}"


@dataclass(frozen=True)
class MigrationInjection:
    """Ask the controller to migrate global ``rank`` when its worker begins ``step``; with a
    ``fault``, a process of the migration is killed (SIGKILL) at a set point of it:
    ``joiner`` — the joiner, in phase 1 once its model is built; ``leaver`` — the leaving
    process, in phase 2 once the hand-over group is open, before its state is sent;
    ``stayer=S`` — rank S, in phase 2 right after it switched to the new groups; ``commit=S``
    — rank S (any rank of the old generation), at its commit all-reduce once the switch notice
    is there (it waits for it there), before it votes, so that no rank passes that commit;
    ``update=S`` — rank S, in the switch iteration right after that all-reduce agreed on the
    switch, before its optimizer update."""

    rank: int
    step: int
    fault: Optional[str] = None

    def spec(self) -> str:
        return f"{self.rank}:{self.step}" + (f":{self.fault}" if self.fault else "")

    @property
    def fault_rank(self) -> Optional[int]:
        """The rank a ``stayer=S``, ``commit=S`` or ``update=S`` fault kills, if any."""
        if self.fault is None or "=" not in self.fault:
            return None
        return int(self.fault.partition("=")[2])


def parse_injection(text: str) -> FailureInjection:
    """Parses ``RANK:STEP[:SIGNAL]``; SIGNAL is a name (``SIGKILL``, ``KILL``) or a number."""
    parts = text.split(":")
    if len(parts) not in (2, 3) or not all(part.isdigit() for part in parts[:2]):
        raise ConfigError(f"{text!r} is not RANK:STEP[:SIGNAL] (e.g. 3:6 or 3:6:SIGSTOP)")
    rank, step = int(parts[0]), int(parts[1])
    if step < 1:
        raise ConfigError(f"{text!r}: STEP must be 1 or more (steps count from 1)")
    sig = _signal(parts[2], text) if len(parts) == 3 else signal.SIGKILL
    return FailureInjection(rank, step, sig)


def injection_argument(text: str) -> FailureInjection:
    try:
        return parse_injection(text)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


MIGRATION_FAULTS = ("joiner", "leaver", "stayer=S", "commit=S", "update=S")


def migration_argument(text: str) -> MigrationInjection:
    parts = text.split(":")
    if (len(parts) not in (2, 3) or not all(part.isdigit() for part in parts[:2])
            or int(parts[1]) < 1):
        raise argparse.ArgumentTypeError(f"{text!r} is not RANK:STEP[:FAULT] with STEP >= 1 "
                                         "(e.g. 1:4 or 1:4:leaver)")
    rank, step = int(parts[0]), int(parts[1])
    fault = parts[2] if len(parts) == 3 else None
    if fault is not None and not _is_migration_fault(fault, rank):
        raise argparse.ArgumentTypeError(
            f"fault {fault!r} in {text!r} is not one of {', '.join(MIGRATION_FAULTS)} (S: a "
            f"rank; for stayer=S a staying one, not {rank})")
    return MigrationInjection(rank, step, fault)


def _is_migration_fault(fault: str, rank: int) -> bool:
    if fault in ("joiner", "leaver"):
        return True
    name, _, value = fault.partition("=")
    if name not in ("stayer", "commit", "update") or not value.isdigit():
        return False
    return name != "stayer" or int(value) != rank


def _signal(name: str, text: str) -> int:
    if name.isdigit():
        number = int(name)
        if number in {int(s) for s in signal.Signals}:
            return number
    else:
        upper = name.upper()
        upper = upper if upper.startswith("SIG") else "SIG" + upper
        if upper in signal.Signals.__members__:
            return int(signal.Signals[upper])
    raise ConfigError(
        f"{text!r}: unknown signal {name!r} (use a name like SIGKILL, SIGTERM, "
        "SIGSTOP, SIGSEGV or its number)"
    )


class FaultDelivery:
    """What an agent still has to inject, and when: failures and migrations wait until the
    controller says the job is fully provisioned (:meth:`arm`), then each is due once its
    rank begins its step."""

    def __init__(self, injections: Sequence[FailureInjection],
                 migrations: Sequence[MigrationInjection]) -> None:
        self._injections = sorted(injections, key=lambda i: (i.step, i.rank))
        self._migrations = sorted(migrations, key=lambda i: (i.step, i.rank))
        self._armed = False

    def arm(self) -> None:
        """The job is fully provisioned: injections may be delivered from now on."""
        self._armed = True

    def migrations_due(self, rank: int, step: int) -> list[MigrationInjection]:
        """The migrations of ``rank`` due at ``step`` (each returned once)."""
        if not self._armed:
            return []
        due = [m for m in self._migrations if m.rank == rank and m.step <= step]
        self._migrations = [m for m in self._migrations if m not in due]
        return due

    def injection_due(self, rank: int, step: int) -> Optional[FailureInjection]:
        """The first failure of ``rank`` due at ``step``, if any (returned once)."""
        if not self._armed:
            return None
        due = [i for i in self._injections if i.rank == rank and i.step <= step]
        if not due:
            return None
        self._injections.remove(due[0])
        return due[0]
