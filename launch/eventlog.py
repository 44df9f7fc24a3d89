"""The controller's event log: one JSON object per line, appended as things happen.

Each line has ``time`` (wall clock), ``generation``, ``rank`` (or null), ``event`` and
``phase`` (``detect``, ``switch``, ``resume``, ``fallback``, ``restart``, ``pool``, ``job``),
plus event-specific fields. The log is flushed at every line, so it can be followed while the
job runs (``tail -f``) and survives a killed launcher.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Optional, TextIO


class EventLog:
    def __init__(self, path: Optional[str | Path]) -> None:
        self._file: Optional[TextIO] = None
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")

    def write(self, event: str, phase: str, *, generation: int, rank: Optional[int] = None,
              when: Optional[float] = None, **fields: Any) -> dict[str, Any]:
        record = {"time": time.time() if when is None else when, "generation": generation,
                  "rank": rank, "event": event, "phase": phase, **fields}
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        return record

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
