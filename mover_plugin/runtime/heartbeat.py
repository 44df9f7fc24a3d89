"""A thread that tells the agent, at a fixed interval, that this process is alive.

Each heartbeat also carries the failure timeout, so the agent knows how long a silence it may
tolerate before it declares the process hung and kills it. :meth:`Heartbeat.stop` sends a last
heartbeat with timeout 0, which tells the agent to stop watching: a process that has finished
training may take a while to exit (interpreter teardown) without being hung.
"""

from __future__ import annotations

import threading

from mover_plugin.progress import ProgressReporter


class Heartbeat:
    def __init__(self, reporter: ProgressReporter, interval_s: float,
                 failure_timeout_s: float) -> None:
        self._reporter = reporter
        self._interval_s = interval_s
        self._failure_timeout_s = failure_timeout_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mover-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        if self._reporter.enabled:
            self._thread.start()
        return self

    def stop(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        self._reporter.heartbeat(0.0)

    def _run(self) -> None:
        while not self._stopped.is_set():
            self._reporter.heartbeat(self._failure_timeout_s)
            self._stopped.wait(self._interval_s)
