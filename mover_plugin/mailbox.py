"""Ordered JSON messages over a c10d store, and the connection to the controller's store.

A mailbox is a counter key plus one key per message. Any number of writers post; each reader
keeps its own cursor and reads every message once, in posting order. The controller posts
commands to the ``commands`` mailbox (every agent reads all of them) and the agents and workers
post events to the ``events`` mailbox (the controller reads them). ``poll`` never blocks: it
returns what has arrived. ``next`` blocks until the next message arrives: the store answers
the read when it is written, so a reader that waits costs the store one call per message and
nothing while none comes (each agent waits for its commands so: one poll every few
milliseconds from each of thousands of hosts would be the store's whole load).

Posting takes a number, then writes the message under it. A writer killed between the two (a
worker killed while it reports something) leaves a hole; a reader steps over a number that has
been taken but not written for :data:`HOLE_TIMEOUT_S`, so the messages after it still arrive.
"""

from __future__ import annotations

import json
import logging
import time
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

logger = logging.getLogger(__name__)

HOLE_TIMEOUT_S = 2.0
"""How long a reader waits for a message whose number was taken before stepping over it (a
live writer writes it right after taking the number)."""


def connect_to_controller(addr: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A client of the controller's store; waits up to ``timeout_s`` for it to listen (and
    uses that timeout for every call)."""
    return dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


class Mailbox:
    def __init__(self, store: dist.Store, name: str) -> None:
        self._store = store
        self._name = name
        self._next = 1
        self._missing_since: Optional[float] = None
        """When the reader first found message ``_next`` taken but not written."""

    def post(self, message: dict[str, Any]) -> int:
        """Appends ``message``; returns its sequence number (1-based)."""
        number = self._store.add(f"{self._name}/count", 1)
        self._store.set(f"{self._name}/{number}", json.dumps(message))
        return number

    def post_many(self, messages: list[dict[str, Any]]) -> None:
        """Appends ``messages`` in order with two store calls: a reader waiting for the first
        is woken once for all of them (the controller's commands reach thousands of agents)."""
        if not messages:
            return
        last = self._store.add(f"{self._name}/count", len(messages))
        first = last - len(messages) + 1
        self._store.multi_set([f"{self._name}/{number}" for number in range(first, last + 1)],
                              [json.dumps(message) for message in messages])

    def skip_to_end(self) -> None:
        """The next poll returns only messages posted from now on."""
        self._next = self._store.add(f"{self._name}/count", 0) + 1
        self._missing_since = None

    def next(self) -> dict[str, Any]:
        """Blocks until the next message is written and returns it: the store answers the read
        when the key is written (no polling), or raises ``DistStoreError`` after the store
        client's timeout. For a mailbox with one writer, where no hole can hold it up."""
        message = json.loads(self._store.get(f"{self._name}/{self._next}"))
        self._next += 1
        self._missing_since = None
        return message

    def poll(self) -> list[dict[str, Any]]:
        """Returns the messages posted since the last poll, in order."""
        messages = []
        posted = self._store.add(f"{self._name}/count", 0)
        if self._next > posted:
            return messages
        keys = [f"{self._name}/{number}" for number in range(self._next, posted + 1)]
        if self._store.check(keys):  # all written: read in one round trip
            self._next, self._missing_since = posted + 1, None
            return [json.loads(value) for value in self._store.multi_get(keys)]
        while self._next <= posted:
            key = f"{self._name}/{self._next}"
            if self._store.check([key]):
                messages.append(json.loads(self._store.get(key)))
                self._next += 1
                self._missing_since = None
            elif not self._step_over_hole():
                break
        return messages

    def _step_over_hole(self) -> bool:
        """Whether message ``_next``, whose number was taken but which is not written, is a
        hole stepped over now: it has been missing for :data:`HOLE_TIMEOUT_S` or more."""
        now = time.monotonic()
        if self._missing_since is None:
            self._missing_since = now
        if now - self._missing_since < HOLE_TIMEOUT_S:
            return False
        logger.warning("mailbox %r: message %d was never written (its writer died while "
                       "posting it); reading on", self._name, self._next)
        self._next += 1
        self._missing_since = None
        return True
