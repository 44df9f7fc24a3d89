"""Progress reports from a training rank to the agent that started it.

A worker started by ``mover-launch`` inherits one end of a pipe whose file descriptor is in
``MOVER_PROGRESS_FD`` (:data:`mover_plugin.contract.PROGRESS_FD_ENV`). At each step boundary
(and once when its script ended, with the script's exit status) the worker writes one JSON
line; the agent on the same host reads them to deliver injected failures at a given step and to
time interruptions. The agent forwards only the few events the controller needs (the first step
of an attempt, the last step before an exit); with the slow-rank policy on, also one report per
step for all ranks of its host with their busy times (``busy_s``: the step minus the rank's
waits for its peers).

Outside ``mover-launch`` (plain ``torchrun`` or a single process) every report is a no-op.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Callable, Optional

from mover_plugin.contract import PROGRESS_FD_ENV

STEP_BEGIN = "step_begin"
STEP_END = "step_end"
READY = "ready"
STANDBY_READY = "standby_ready"
HEARTBEAT = "heartbeat"
SCRIPT_END = "script_end"
KINDS = (STEP_BEGIN, STEP_END, READY, STANDBY_READY, HEARTBEAT, SCRIPT_END)


@dataclass(frozen=True)
class ProgressEvent:
    """One report: ``kind`` is one of :data:`KINDS`; ``step`` is 1-based (for ``ready``, the
    number of steps already completed; for ``script_end``, the script's exit status);
    ``duration_s`` is the step time of a ``step_end`` and, for a ``heartbeat``, the silence
    after which the agent may declare the process hung."""

    kind: str
    step: int
    time: float
    duration_s: float = 0.0
    generation: int = -1
    """The worker's generation when it reported (-1: not a resilient worker)."""
    busy_s: float = -1.0
    """For a ``step_end``: the step's duration minus the time the rank waited for its peers
    (-1: not measured)."""

    def encode(self) -> bytes:
        return (json.dumps(self.__dict__, separators=(",", ":")) + "\n").encode()

    @classmethod
    def decode(cls, line: bytes) -> "ProgressEvent":
        fields = json.loads(line)
        if fields.get("kind") not in KINDS:
            raise ValueError(f"unknown progress event kind in {line!r}")
        return cls(**fields)


class ProgressReporter:
    """Writes progress events to the agent's pipe, or does nothing when there is none."""

    def __init__(self, fd: Optional[int]) -> None:
        self._fd = fd
        self.generation = -1
        self._waited: Optional[Callable[[], float]] = None
        self._waited_at_begin = 0.0

    @classmethod
    def from_env(cls) -> "ProgressReporter":
        raw = os.environ.get(PROGRESS_FD_ENV)
        return cls(int(raw) if raw else None)

    @property
    def enabled(self) -> bool:
        return self._fd is not None

    def ready(self, completed_steps: int) -> None:
        """The rank has built everything and is about to run step ``completed_steps + 1``."""
        self._send(ProgressEvent(READY, completed_steps, time.time(), generation=self.generation))

    def standby_ready(self) -> None:
        """A standby has warmed up and waits to be promoted."""
        self._send(ProgressEvent(STANDBY_READY, 0, time.time(), generation=self.generation))

    def script_end(self, status: int) -> None:
        """The script ended with exit status ``status``: what follows is the process's
        teardown, which the agent bounds (:mod:`mover_plugin.launch.agent`)."""
        self._send(ProgressEvent(SCRIPT_END, status, time.time(), generation=self.generation))

    def heartbeat(self, failure_timeout_s: float) -> None:
        self._send(ProgressEvent(HEARTBEAT, 0, time.time(), failure_timeout_s, self.generation))

    def measure_busy_time(self, waited_s: Callable[[], float]) -> None:
        """From now on each ``step_end`` carries the step's busy time: its duration minus the
        growth of ``waited_s()`` (seconds spent waiting for peers) since ``step_begin``."""
        self._waited = waited_s

    def step_begin(self, step: int) -> None:
        if self._waited is not None:
            self._waited_at_begin = self._waited()
        self._send(ProgressEvent(STEP_BEGIN, step, time.time(), generation=self.generation))

    def step_end(self, step: int, duration_s: float) -> None:
        busy = -1.0
        if self._waited is not None:
            busy = max(0.0, duration_s - (self._waited() - self._waited_at_begin))
        self._send(ProgressEvent(STEP_END, step, time.time(), duration_s, self.generation,
                                 busy))

    def _send(self, event: ProgressEvent) -> None:
        if self._fd is None:
            return
        try:
            # One write of a short line is atomic on a pipe, so the heartbeat thread and the
            # training loop never interleave their lines.
            os.write(self._fd, event.encode())
        except OSError:
            # The agent is gone; the worker is about to be stopped anyway.
            self._fd = None


class ProgressLineReader:
    """Splits the bytes read from one worker's pipe into events (agent side)."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, data: bytes) -> list[ProgressEvent]:
        self._pending += data
        *lines, self._pending = self._pending.split(b"\n")
        return [ProgressEvent.decode(line) for line in lines if line.strip()]
