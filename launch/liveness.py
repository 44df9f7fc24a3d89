"""Agent liveness: each agent's heartbeat on the control store, and the controller's watch.

A host can be lost whole — its machine crashes, or its network is cut — and its agent with
it. The exits of its workers then never reach the controller (the agent is the one who reports
them), so every agent also beats: a thread of its own, on a store connection of its own
(:class:`AgentBeat`), adds 1 to ``agent/{node}/beat`` four times per timeout
(:func:`beat_period`); an agent
whose beats go unanswered for long (its own network cut) gives up on the controller. The
controller (:class:`AgentWatch`) reads the counters of the hosts still in the job every
:data:`CHECK_PERIOD_S`, in one ``multi_get``, and declares a host lost once its counter has
not moved for ``--agent-timeout-s`` (default 2 s). That timeout must stay below the workers'
``--resilient-failure-timeout-s`` (default 5 s): a survivor whose peer vanished waits that
long for the controller's alarm before it takes the failure for an error of its own.

Only the controller's clock counts: a beat is *seen* when the controller sees the counter
change, so the hosts' clocks never matter. A controller that was itself held up (its previous
look at the counters longer ago than half the timeout) blames no agent for the silence: it
starts counting again from that look.

An agent that this ``mover-launch`` started (a host naming this machine) is watched through its
process too: its exit is a lost host at once (:mod:`mover_plugin.launch.controller`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterable, Optional

import torch.distributed as dist

logger = logging.getLogger(__name__)

BEAT_PERIOD_S = 0.25
"""The shortest beat period (and the period of an agent told no timeout: a joining host's)."""
MAX_BEAT_PERIOD_S = 0.5
BEATS_PER_TIMEOUT = 4
CHECK_PERIOD_S = 0.1


def beat_period(timeout_s: float) -> float:
    """How often the agents of a job whose hosts are declared lost after ``timeout_s`` of
    silence beat: four times per timeout, between :data:`BEAT_PERIOD_S` and
    :data:`MAX_BEAT_PERIOD_S` (0.5 s at the default 2 s). At steady state the beats are
    nearly all the control plane's traffic: 4,096 store calls a second at 2,048 hosts."""
    return min(MAX_BEAT_PERIOD_S, max(BEAT_PERIOD_S, timeout_s / BEATS_PER_TIMEOUT))


def beat_key(node: int) -> str:
    return f"agent/{node}/beat"


class AgentBeat:
    """An agent's heartbeat: a daemon thread adding 1 to its host's counter every period, and
    a watchdog that calls ``on_unreachable(seconds)`` once, from its own thread, when no beat
    has been answered for ``unreachable_after_s`` (a call to a store cut off by its network
    waits instead of failing, so only the time since the last answer tells)."""

    def __init__(self, connect: Callable[[], dist.Store], node: int, *,
                 unreachable_after_s: float, on_unreachable: Callable[[float], None],
                 period_s: float = BEAT_PERIOD_S) -> None:
        self._connect = connect
        self._key = beat_key(node)
        self._period_s = period_s
        self._unreachable_after_s = unreachable_after_s
        self._on_unreachable = on_unreachable
        self._answered = time.monotonic()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._beat, name="mover-agent-beat",
                                          daemon=True),
                         threading.Thread(target=self._watch, name="mover-agent-watchdog",
                                          daemon=True)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout_s: float) -> bool:
        """Waits for both threads to end; returns whether they did."""
        for thread in self._threads:
            thread.join(timeout_s)
        return not any(thread.is_alive() for thread in self._threads)

    def _beat(self) -> None:
        try:
            store = self._connect()
            while not self._stop.is_set():
                store.add(self._key, 1)
                self._answered = time.monotonic()
                self._stop.wait(self._period_s)
        except (RuntimeError, ConnectionError, OSError) as error:
            # The agent's own loop notices the lost controller and stops the workers.
            logger.warning("the heartbeat to the controller stopped (%s)", error)

    def _watch(self) -> None:
        while not self._stop.wait(self._period_s):
            silent = time.monotonic() - self._answered
            if silent > self._unreachable_after_s:
                self._on_unreachable(silent)
                return


class AgentWatch:
    """The controller's view of every host's heartbeat."""

    def __init__(self, store: dist.Store, nodes: Iterable[int], timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._store = store
        self._timeout_s = timeout_s
        self._clock = clock
        self._watched: dict[int, tuple[bytes, float, float]] = {}
        """node -> (its counter, when the controller saw it change: monotonic, wall-clock)."""
        self._nodes = sorted(nodes)
        self._last_check: Optional[float] = None

    def prepare(self) -> None:
        """Creates every host's counter (before the agents join, so a read never waits)."""
        for node in self._nodes:
            self._store.set(beat_key(node), "0")

    def start(self) -> None:
        """Starts the watch: every host counts as just seen."""
        now, wall = self._clock(), time.time()
        self._watched = {node: (b"", now, wall) for node in self._nodes}
        self._last_check = None
        self.lost()

    def watch(self, node: int) -> None:
        """Watches ``node`` (again: its agent came back), as just seen."""
        self._watched[node] = (b"", self._clock(), time.time())

    def forget(self, node: int) -> None:
        """Stops watching ``node`` (it left the job)."""
        self._watched.pop(node, None)

    def lost(self) -> list[tuple[int, float, float]]:
        """The hosts found silent past the timeout at this look, each as (node, seconds of
        silence, wall-clock time its last beat was seen); each is reported once (then
        forgotten). Looks at most every :data:`CHECK_PERIOD_S`."""
        now = self._clock()
        if self._last_check is not None and now - self._last_check < CHECK_PERIOD_S:
            return []
        held_up = self._last_check is not None and now - self._last_check > self._timeout_s / 2
        self._last_check = now
        nodes = list(self._watched)
        if not nodes:
            return []
        values = self._store.multi_get([beat_key(node) for node in nodes])
        wall = time.time()
        silent = []
        for node, value in zip(nodes, values):
            previous, seen, seen_wall = self._watched[node]
            if value != previous or held_up:
                self._watched[node] = (value, now, wall)
            elif now - seen > self._timeout_s:
                silent.append((node, now - seen, seen_wall))
                del self._watched[node]
        return silent
