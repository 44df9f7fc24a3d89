"""Ordered JSON messages over a c10d store.

A mailbox is a counter key plus one key per message. Any number of writers post; each reader
keeps its own cursor and reads every message once, in posting order. The controller posts
commands to the ``commands`` mailbox (every agent reads all of them) and the agents post events
to the ``events`` mailbox (the controller reads them). Reads never block: ``poll`` returns what
has arrived.
"""

from __future__ import annotations

import json
from typing import Any

import torch.distributed as dist


class Mailbox:
    def __init__(self, store: dist.Store, name: str) -> None:
        self._store = store
        self._name = name
        self._next = 1

    def post(self, message: dict[str, Any]) -> int:
        """Appends ``message``; returns its sequence number (1-based)."""
        number = self._store.add(f"{self._name}/count", 1)
        self._store.set(f"{self._name}/{number}", json.dumps(message))
        return number

    def poll(self) -> list[dict[str, Any]]:
        """Returns the messages posted since the last poll, in order."""
        messages = []
        while self._store.check([f"{self._name}/{self._next}"]):
            messages.append(json.loads(self._store.get(f"{self._name}/{self._next}")))
            self._next += 1
        return messages
