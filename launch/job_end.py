"""The end of the job: the controller's unit that winds the job down and ends it.

An attempt ends in two steps (:class:`~mover_plugin.launch.context.AttemptPhase`):

* **Ending.** The first worker of the attempt that exits 0 has finished its script: the job's
  end has begun. From then on a lost rank is not replaced in place (the new generation's groups
  would wait for the finished ranks forever; :mod:`mover_plugin.launch.recovery` restarts
  instead), so no standby has work left. This unit records ``job_ending`` (the rank, the ready
  standbys and the refills it stops) and posts ``wind_down``: every agent stops the processes
  of the attempt that hold no rank (ready standbys, standbys still starting or warming up,
  refills) and starts none from then on. The other units start nothing new either: no
  refill (:mod:`mover_plugin.launch.refill`), no migration (a migration in phase 1 is
  cancelled, :mod:`mover_plugin.launch.migration`), no growing back (one not switched yet is
  called off, :mod:`mover_plugin.launch.grow_back`), and a host that asks to join is refused
  (:mod:`mover_plugin.launch.host_loss`). Refills still starting are marked stopped in the
  summary.
* **Done.** Each agent reports ``node_done`` once every rank on its host exited 0, or ended its
  script with status 0 (a teardown that hangs is stopped after ``--exit-timeout-s``; see
  :mod:`mover_plugin.launch.agent`). A host whose ranks all moved away reports it at once, and
  ``node_busy`` when a standby promoted there takes it back. Once every host in the job did,
  the job ends with exit code 0, the summary gets the workers' statistics, and the launcher
  tells the agents to ``finish``.

A restart (a rank lost after another finished) begins a new attempt, which trains again.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Mapping, Optional

from mover_plugin.launch.context import AttemptPhase, Context, Event, EventHandler, Unit

logger = logging.getLogger(__name__)


class JobEnd(Unit):
    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx

    def handlers(self) -> Mapping[str, EventHandler]:
        return {"node_busy": self._on_node_busy, "node_done": self._on_node_done}

    def rank_finished(self, rank: int) -> None:
        """The worker of ``rank`` exited 0: the first one begins the end of the attempt."""
        ctx = self._ctx
        attempt = ctx.attempt
        if attempt.phase is not AttemptPhase.TRAINING:
            return
        attempt.phase = AttemptPhase.ENDING
        now = time.time()
        standbys, refills = sorted(attempt.pool.hosts), sorted(attempt.refilling)
        for refill in ctx.summary.refills:
            if refill.standby in attempt.refilling:
                refill.stopped_at = now
        attempt.pool.hosts.clear()
        attempt.refilling.clear()
        ctx.command("wind_down", attempt=attempt.number)
        ctx.record("job_ending", "job", when=now, rank=rank, standbys_stopped=standbys,
                   refills_stopped=refills)
        logger.info("rank %d finished training: the job is ending; its standbys are stopped",
                    rank)

    def check(self) -> Optional[int]:
        """Ends the job (exit code 0) once every host in it reported its workers done;
        returns the launcher's exit code then, else None."""
        attempt = self._ctx.attempt
        if not attempt.done or set(attempt.done) != self._ctx.job.nodes:
            return None
        summary = self._ctx.summary
        summary.steps_completed = min(
            (steps for steps in attempt.done.values() if steps is not None), default=None)
        workers = attempt.finished_workers
        rss = [w["peak_rss_mb"] for w in workers if w["peak_rss_mb"] is not None]
        steps = [w["median_step_s"] for w in workers if w["median_step_s"] is not None]
        summary.worker_peak_rss_mb = max(rss) if rss else None
        summary.median_step_time_s = statistics.median(steps) if steps else None
        cpu = [w["cpu_per_step_s"] for w in workers if w.get("cpu_per_step_s") is not None]
        summary.median_cpu_per_step_s = statistics.median(cpu) if cpu else None
        return 0

    def _on_node_busy(self, event: Event) -> Optional[int]:
        """A host whose ranks had all moved away got one again (a standby promoted there)."""
        self._ctx.attempt.done.pop(event["node"], None)
        return None

    def _on_node_done(self, event: Event) -> Optional[int]:
        attempt = self._ctx.attempt
        attempt.done[event["node"]] = event["steps_completed"]
        attempt.finished_workers.extend(event["workers"])
        return self.check()
