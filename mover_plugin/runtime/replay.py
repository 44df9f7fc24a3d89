"""Micro-batches that can be served again: a failed iteration is redone with the same data.

A training loop that owns its data iterator draws an iteration's micro-batches from it while
the iteration runs. If a peer is lost in the middle, the survivors redo that iteration in the
next generation, and must feed it the micro-batches it already drew, not the next ones.
:class:`ReplayableIterator` wraps the loop's iterator and records what the current attempt
draws; after :meth:`~ReplayableIterator.rewind` it serves those again, in order, before reading
on. The Megatron-LM and DeepSpeed drop-ins wrap their frameworks' iterators with it.
"""

from __future__ import annotations

import collections
import copy
from typing import Any, Iterator


class ReplayableIterator:
    """Wraps a training loop's data iterator (Megatron-LM: the one inside its
    ``RerunDataIterator``): records the micro-batches of the current attempt, and after
    :meth:`rewind` serves them again before reading on."""

    def __init__(self, source: Iterator[Any]) -> None:
        self.source = source
        self._taken: list[Any] = []
        self._pending: collections.deque[Any] = collections.deque()

    def __iter__(self) -> "ReplayableIterator":
        return self

    def __next__(self) -> Any:
        item = self._pending.popleft() if self._pending else next(self.source)
        # A shallow copy, as Megatron's RerunDataIterator keeps: the consumer may edit a dict.
        self._taken.append(copy.copy(item))
        return item

    def begin(self) -> None:
        """A new iteration starts: what the last one read is not needed again."""
        self._taken = []

    def rewind(self) -> None:
        """The attempt failed: its micro-batches are served again, in order."""
        self._pending.extendleft(reversed(self._taken))
        self._taken = []
