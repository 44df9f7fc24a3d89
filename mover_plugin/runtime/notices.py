"""The controller's notices to a worker, relayed by the agent on its host.

The controller posts a notice for a generation (``alarm``: a rank is lost, leave the step you
are in; ``prepare``: a planned migration to generation ``next`` begins, build your part of its
groups; ``switch``: switch to the next generation at the next iteration boundary; the kinds are
in :mod:`mover_plugin.contract`) as a command; every agent reads its commands anyway and writes the
notice as one JSON line into each local process's notice pipe, whose read end the process
inherited (``MOVER_NOTICE_FD``). The control store thus serves one reader per host, not one
per rank, and a worker waits on a local pipe: a :class:`NoticeWatcher` thread blocks in
``select`` on it and on a pipe of its own that :meth:`NoticeWatcher.stop` writes to, so it can
always be ended before the interpreter shuts down.

A process follows one generation at a time (:meth:`NoticeWatcher.follow`); notices for earlier
generations are ignored, and notices for a later one are kept until the process follows it (a
rank still ending its last step of generation ``g`` may be sent an alarm for ``g + 1``).
Following the next generation and acting on an alarm of the current one are serialised, so an
alarm read late can never reach the next generation's groups.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import threading
from typing import Any, Callable, Optional

from mover_plugin.contract import ALARM, NOTICE_FD_ENV, PREPARE, SWITCH

logger = logging.getLogger(__name__)


class NoticeWatcher:
    """Reads this process's notice pipe from a thread and acts on its generation's notices.

    Args:
        fd: the read end of the notice pipe.
        generation: the generation followed at first.
        on_alarm: called with the reason when the followed generation gets an alarm.
        on_switch: called when the followed generation gets a planned switch.
        on_prepare: called with the migration's generation when a planned migration of the
            followed generation begins (in the watcher's thread: it must not block).
    """

    def __init__(self, fd: int, generation: int, on_alarm: Callable[[str], None],
                 on_switch: Callable[[], None],
                 on_prepare: Callable[[int], None] = lambda generation: None) -> None:
        self._fd = fd
        self._generation = generation
        self._on_alarm = on_alarm
        self._on_switch = on_switch
        self._on_prepare = on_prepare
        self._lock = threading.Lock()
        self._later: list[dict[str, Any]] = []
        """Notices for generations after the followed one, in order of arrival."""
        self._wake_read, self._wake_write = os.pipe()
        self._thread = threading.Thread(target=self._run, name="mover-notices", daemon=True)
        self._thread.start()

    @classmethod
    def from_env(cls, generation: int, on_alarm: Callable[[str], None],
                 on_switch: Callable[[], None],
                 on_prepare: Callable[[int], None] = lambda generation: None,
                 ) -> Optional["NoticeWatcher"]:
        """The watcher of a process started by ``mover-launch``; None for any other."""
        raw = os.environ.get(NOTICE_FD_ENV)
        return cls(int(raw), generation, on_alarm, on_switch, on_prepare) if raw else None

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def running(self) -> bool:
        """Whether the thread still reads the pipe."""
        return self._thread.is_alive()

    def join(self, timeout: Optional[float] = None) -> None:
        self._thread.join(timeout)

    def follow(self, generation: int) -> None:
        """From now on, act on ``generation``'s notices only (waits for a notice being
        acted on to be done)."""
        with self._lock:
            self._generation = generation
            now = [n for n in self._later if n["generation"] == generation]
            self._later = [n for n in self._later if n["generation"] > generation]
            for notice in now:
                self._dispatch(notice)

    def stop(self) -> None:
        """Ends the thread (promptly: it wakes up for this)."""
        os.write(self._wake_write, b"x")
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    def _run(self) -> None:
        pending = b""
        with selectors.DefaultSelector() as selector:
            selector.register(self._fd, selectors.EVENT_READ)
            selector.register(self._wake_read, selectors.EVENT_READ)
            while True:
                ready = {key.fd for key, _ in selector.select()}
                if self._wake_read in ready:
                    return
                data = os.read(self._fd, 65536)
                if not data:
                    return  # the agent is gone: the process is being stopped
                *lines, pending = (pending + data).split(b"\n")
                for line in lines:
                    if line.strip():
                        self._act(json.loads(line))

    def _act(self, notice: dict[str, Any]) -> None:
        with self._lock:
            generation = notice.get("generation", -1)
            if generation > self._generation:
                self._later.append(notice)
            elif generation == self._generation:
                self._dispatch(notice)

    def _dispatch(self, notice: dict[str, Any]) -> None:
        if notice["kind"] == ALARM:
            self._on_alarm(notice.get("reason", "alarm"))
        elif notice["kind"] == SWITCH:
            self._on_switch()
        elif notice["kind"] == PREPARE:
            self._on_prepare(notice["next"])
        else:
            logger.warning("ignored a notice of unknown kind %r", notice["kind"])
