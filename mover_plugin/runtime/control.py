"""A worker's (or standby's) client of the controller: generations, plans, alarms, events.

The launcher gives every process it starts the controller's address, the attempt, the current
generation and, for a standby, its id, in the environment variables of
:mod:`mover_plugin.contract`. Blocking waits use their own store connection, because a TCPStore
client serialises its calls: a thread waiting on one would block every other call on it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

from mover_plugin.errors import LaunchError
from mover_plugin.mailbox import Mailbox, connect_to_controller
from mover_plugin.contract import (
    GenerationPlan,
    ATTEMPT_ENV,
    CONTROL_ADDR_ENV,
    CONTROL_PORT_ENV,
    EVENTS_MAILBOX,
    GENERATION_ENV,
    LAYOUT_KEY,
    STANDBY_ID_ENV,
    SWITCH_GO,
    TEMPLATES_KEY,
    generation_prefix,
    plan_key,
    promotion_key,
    stage_profile_key,
    standbys_ready_key,
    successor_key,
    switch_decision_key,
)
from mover_plugin.layout import ParallelLayout

logger = logging.getLogger(__name__)

_WAIT_CHUNK = timedelta(seconds=3600)


class ControlClient:
    def __init__(self, addr: str, port: int, timeout_s: float = 300.0) -> None:
        self._addr, self._port, self._timeout_s = addr, port, timeout_s
        self.store = self._connect()
        self._events = Mailbox(self.store, EVENTS_MAILBOX)
        self.attempt = int(os.environ.get(ATTEMPT_ENV, "0"))
        self.generation = int(os.environ.get(GENERATION_ENV, "0"))
        self.standby_id = os.environ.get(STANDBY_ID_ENV)

    def clone(self) -> "ControlClient":
        """A client of the same process on a connection of its own (for a thread that must
        not wait behind this client's blocking calls)."""
        other = ControlClient(self._addr, self._port, self._timeout_s)
        other.attempt, other.generation = self.attempt, self.generation
        other.standby_id = self.standby_id
        return other

    @classmethod
    def from_env(cls) -> Optional["ControlClient"]:
        """The client for a process started by ``mover-launch``; None for any other process."""
        addr, port = os.environ.get(CONTROL_ADDR_ENV), os.environ.get(CONTROL_PORT_ENV)
        return cls(addr, int(port)) if addr and port else None

    def _connect(self) -> dist.TCPStore:
        return connect_to_controller(self._addr, self._port, self._timeout_s)

    def generation_store(self, generation: int) -> dist.Store:
        """The namespace generation ``generation``'s process groups rendezvous in, on a
        connection of its own. A gloo backend waits there for a peer's address (a pair that
        connects on first use, in one of its threads) and holds the connection while it waits:
        that must hold up neither this client's calls nor the next attempt at a switch when
        the peer is dead."""
        return dist.PrefixStore(generation_prefix(generation), self._connect())

    def publish_layout(self, layout: ParallelLayout) -> None:
        self.store.set(LAYOUT_KEY, json.dumps(layout.record()))

    def wait_for_layout(self, timeout_s: float) -> Optional[ParallelLayout]:
        """The parallel layout the job's first rank published, waiting at most ``timeout_s``
        for it; None if it was not published by then."""
        try:
            self.store.wait([LAYOUT_KEY], timedelta(seconds=timeout_s))
        except dist.DistStoreError:
            return None
        return ParallelLayout.of_record(json.loads(self.store.get(LAYOUT_KEY)))

    def publish_templates(self, spec: dict[str, Any]) -> None:
        """Tells the controller the job can shrink onto pipeline templates, and what the
        planner needs (:class:`mover_plugin.shrink.TemplateSpec`)."""
        self.store.set(TEMPLATES_KEY, json.dumps(spec))

    def publish_stage_profile(self, stage: int, record: dict[str, Any]) -> None:
        """The per-layer costs pipeline stage ``stage`` measured (a profile record of its
        layers), for the controller to plan from."""
        self.store.set(stage_profile_key(stage), json.dumps(record))

    def post(self, kind: str, **fields: Any) -> None:
        """Posts an event to the controller (a few per interruption, never per step)."""
        fields.setdefault("time", time.time())
        fields.setdefault("generation", self.generation)
        self._events.post({"kind": kind, "attempt": self.attempt, **fields})

    def wait_for_plan(self, generation: int) -> GenerationPlan:
        """Blocks until the controller has planned ``generation``; returns the plan."""
        return GenerationPlan.from_record(json.loads(self._wait_and_get(plan_key(generation))))

    def wait_for_standbys(self, timeout_s: float) -> bool:
        """Blocks until every standby of this attempt is ready, at most ``timeout_s``;
        returns whether they are."""
        try:
            self.store.wait([standbys_ready_key(self.attempt)], timedelta(seconds=timeout_s))
        except dist.DistStoreError:
            return False
        return True

    def wait_for_successor(self, generation: int) -> int:
        """Blocks until the controller has planned the generation after ``generation``;
        returns its number."""
        return int(self._wait_and_get(successor_key(generation)))

    def successor_within(self, generation: int, timeout_s: float) -> bool:
        """Whether the controller plans the generation after ``generation`` within
        ``timeout_s`` seconds."""
        try:
            self.store.wait([successor_key(generation)], timedelta(seconds=timeout_s))
        except dist.DistStoreError:
            return False
        return True

    def has_successor(self, generation: int) -> bool:
        """Whether the controller has planned the generation after ``generation`` (without
        blocking)."""
        return self.store.check([successor_key(generation)])

    def wait_for_switch(self, generation: int) -> bool:
        """Blocks until the controller has decided whether the migration to ``generation``
        goes ahead (True) or was cancelled (False)."""
        return self._wait_and_get(switch_decision_key(generation)).decode() == SWITCH_GO

    def wait_for_promotion(self) -> dict[str, Any]:
        """A standby blocks here until promoted; returns ``{"rank", "generation"}``."""
        if self.standby_id is None:
            raise LaunchError(f"this process is not a standby ({STANDBY_ID_ENV} is not set)")
        return json.loads(self._wait_and_get(promotion_key(self.standby_id)))

    def _wait_and_get(self, key: str) -> bytes:
        while True:
            try:
                self.store.wait([key], _WAIT_CHUNK)
                return self.store.get(key)
            except dist.DistStoreError as error:  # the chunk timed out; wait again
                if "timeout" not in str(error).lower():
                    raise
