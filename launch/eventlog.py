"""The controller's event log: one JSON object per line, appended as things happen.

Each line has ``time`` (wall clock), ``generation``, ``rank`` (or null), ``event`` and
``phase`` (``detect``, ``switch``, ``migrate``, ``grow``, ``resume``, ``fallback``,
``restart``, ``pool``, ``job``),
plus event-specific fields. The log is flushed at every line, so it can be followed while the
job runs (``tail -f``) and survives a killed launcher.
"""

from __future__ import annotations

import collections
import json
import time
from pathlib import Path
from typing import Any, Optional, TextIO


class EventLog:
    def __init__(self, path: Optional[str | Path], *, keep: int = 50) -> None:
        self._recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=keep)
        self._file: Optional[TextIO] = None
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")

    def write(self, event: str, phase: str, *, generation: int, rank: Optional[int] = None,
              when: Optional[float] = None, recent: bool = True,
              **fields: Any) -> dict[str, Any]:
        """Appends one record; ``recent=False`` keeps it out of :meth:`recent` (the step
        times, which would crowd out everything else)."""
        record = {"time": time.time() if when is None else when, "generation": generation,
                  "rank": rank, "event": event, "phase": phase, **fields}
        if recent:
            self._recent.append(record)
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        return record

    def recent(self, count: int) -> list[dict[str, Any]]:
        """The last ``count`` records (kept in memory whether or not a file is written)."""
        return list(self._recent)[-count:]

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
