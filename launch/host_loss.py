"""Whole-host loss: the controller's unit that takes a host lost with its agent out of the job,
and back in as a spare host when its agent returns; a new host joins the same way.

A host is lost when its agent stops beating (:mod:`mover_plugin.launch.liveness`: a crashed
machine, a cut network, the agent SIGKILLed with its workers) or, for an agent this
``mover-launch`` started, when the agent process exits while the job runs. Its workers' exits
will never be reported, so the controller acts for them, once per host:

* the host leaves the job for good: no wait (for its workers to finish or stop, for its
  standbys to be ready) counts it any more, its standbys leave the pool and their share of the
  pool's target, its events that still arrive are dropped, and a ``fence`` command tells its
  agent, should it still hear the controller, to stop its processes and exit (an agent this
  process started is killed);
* every rank it held is recovered in one generation (``host_loss`` interruption,
  :meth:`~mover_plugin.launch.recovery.CrashRecovery.on_host_lost`): the ranks of the host go
  together onto one host with as many standbys, a spare host first, in local-rank order, so a
  tensor-parallel group inside the host stays inside one; survivors stay in their processes;
* without standbys enough the job falls back to a restart, which places the lost host's ranks
  on a spare host with as many slots, or ends when none is left
  (:meth:`~mover_plugin.launch.attempts.Attempts.placement`).

A lost host comes back when its agent is started again (``mover-launch --node-rank N`` with
the job's flags) and joins: it is back in the job as a spare host, whatever it was before —
its ranks run elsewhere now — and its agent starts one standby per slot (ids
``a{attempt}.n{node}.j{index}``), which join the pool and are taken first, like a spare
host's. A restart places every rank on its own host again. The event log has ``host_joined``;
an agent that joins for a host still in the job is refused (``join_refused``).

A host not in the hostfile asks to join (``mover-launch --join``, :mod:`mover_plugin.launch.join`;
a ``join_request`` event): the controller admits it (``host_admitted``) as a new spare node, or
as the lost node of the same name and slot count, answers with what its agent needs, and the
agent then joins as above. A job under the restart policy refuses it.

The event log has ``host_lost`` (node, host, how, its ranks, when its last beat was seen). The
interruption's ``step`` is the one after the last step rank 0 reported; its last step before
the failure, and its ``failed`` when later than the last beat, come from rank 0's step ends
(:meth:`~mover_plugin.launch.timing.InterruptionTiming.on_steps`).

A host also leaves on purpose: its ``mover-launch`` stopped with SIGTERM (a Kubernetes pod
evicted after its ``preStop`` hook migrated its ranks away, a Slurm node stopped after its
wrapper did) posts ``leaving`` first (:mod:`mover_plugin.launch.departure`). A host that holds
no rank then leaves the job as a planned departure, ``host_left`` in the event log: it is out
of the job as a lost host is (its standbys leave the pool, no wait counts it, it may come back
as a spare host), but nothing is recovered and nothing restarts. A host that still holds ranks,
or whose ranks are being migrated away and not all handed over yet, is lost at once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, replace
from typing import Mapping, Optional

from mover_plugin.launch.attempts import Attempts
from mover_plugin.launch.hosts import NodeSpec
from mover_plugin.launch.context import Context, Event, EventHandler, Unit
from mover_plugin.launch.job_end import JobEnd
from mover_plugin.launch.liveness import AgentWatch
from mover_plugin.launch.recovery import CrashRecovery
from mover_plugin.launch.step_times import StepTimeline

logger = logging.getLogger(__name__)


class HostLoss(Unit):
    ANY_ATTEMPT = frozenset({"joined", "join_request", "leaving"})
    """An agent that comes back, or a host that asks to join, has not heard of any attempt; a
    host's departure is the host's, whatever the attempt."""

    def __init__(self, ctx: Context, recovery: CrashRecovery, attempts: Attempts,
                 job_end: JobEnd, steps: StepTimeline, agents: AgentWatch) -> None:
        self._ctx = ctx
        self._recovery = recovery
        self._attempts = attempts
        self._job_end = job_end
        self._steps = steps
        self._agents = agents

    def handlers(self) -> Mapping[str, EventHandler]:
        # A loss is told by the controller (its watch of the agents); a return and a planned
        # departure are events.
        return {"joined": self._on_joined, "join_request": self._on_join_request,
                "leaving": self._on_leaving}

    def _on_leaving(self, event: Event) -> Optional[int]:
        """A host's ``mover-launch`` got SIGTERM: a planned departure when the host holds no
        rank (nor a rank still being handed over from it), else a host lost now."""
        ctx, node = self._ctx, event["node"]
        if node not in ctx.job.nodes:
            return None
        held = sorted(r for r, n in ctx.job.node_of_rank.items() if n == node)
        moving = sorted(r for r, n in ctx.job.leaving_ranks.items() if n == node)
        if held or moving:
            how = f"{event['how']} while it held rank(s) {held or moving}"
            exit_code = self.lost(node, how)
            return exit_code if exit_code is not None else self._leavers_lost(node, moving, how)
        return self._left(node, event["how"])

    def _left(self, node: int, how: str) -> Optional[int]:
        """Host ``node``, holding no rank, leaves the job on purpose; returns the launcher's
        exit code when the job ends with it."""
        ctx = self._ctx
        host = ctx.config.nodes[node].host
        ctx.job.nodes.discard(node)
        ctx.job.lost_nodes.add(node)  # it may come back, as a lost host does
        ctx.job.left_nodes.add(node)
        self._agents.forget(node)
        standbys = sorted(s for s, where in ctx.attempt.pool.hosts.items() if where == node)
        ctx.record("host_left", "pool", node=node, host=host, how=how, standbys=standbys)
        logger.info("host %s (node %d) left the job: %s; it held no rank", host, node, how)
        self._attempts.drop_node(node, how="its host left the job")
        exit_code = self._job_end.check()
        return exit_code if exit_code is not None else self._recovery.restart_if_stopped()

    def _leavers_lost(self, node: int, moving: list[int], how: str) -> Optional[int]:
        """The processes that were handing ``moving`` over from ``node`` stopped with it: each
        is a leaver lost (the migration is called off or abandoned, :mod:`migration`); a rank
        that the migration's end put back on ``node`` is recovered as a lost worker. Once a
        restart is under way, it places them all."""
        ctx = self._ctx
        for rank in moving:
            if ctx.attempt.failed:
                break
            leaver = rank in ctx.job.leaving_ranks
            if not leaver and ctx.job.node_of_rank.get(rank) != node:
                continue  # recovered with another one already
            event = {"rank": rank, "attempt": ctx.attempt.number, "time": time.time(),
                     "how": how, "returncode": -15, "step_begun": self._steps.last_step + 1}
            exit_code = self._recovery.on_failure(event, leaver=leaver)
            if exit_code is not None:
                return exit_code
        return None

    def _on_join_request(self, event: Event) -> Optional[int]:
        """A host asks to join (``mover-launch --join``): it is admitted as a spare host, a
        node of its own or the lost node of its name and slot count (its agent then joins,
        :meth:`_on_joined`), or refused."""
        ctx, host, slots = self._ctx, event["host"], event["slots"]
        reason = self._join_refusal(slots)
        if reason is not None:
            ctx.command("join_refused", token=event["token"], reason=reason)
            ctx.record("join_refused", "pool", node=None, host=host, reason=reason)
            logger.warning("host %s (pid %d) asked to join: %s", host, event["pid"], reason)
            return None
        spec = self._node_for(host, slots)
        ctx.job.admitted_nodes.add(spec.node_rank)
        config = ctx.config
        ctx.command("admit", token=event["token"], node=asdict(spec), world_size=config.world_size,
                    command=list(config.worker_command), standbys=config.standbys_of(spec),
                    stop_grace_s=config.stop_grace_s, exit_timeout_s=config.exit_timeout_s,
                    report_busy=config.report_busy)
        ctx.record("host_admitted", "pool", node=spec.node_rank, host=host, slots=slots)
        logger.info("host %s asked to join: admitted as node %d", host, spec.node_rank)
        return None

    def _join_refusal(self, slots: int) -> Optional[str]:
        if self._ctx.attempt.ending:
            return "the job is ending: a rank finished training"
        if self._ctx.config.policy != "resilient":
            return (f"the job runs --policy {self._ctx.config.policy}; a joining host serves "
                    "as standbys, which only --policy resilient uses")
        if slots < 1:
            return f"{slots} slots: a joining host needs at least one (--nproc-per-node)"
        return None

    def _node_for(self, host: str, slots: int) -> NodeSpec:
        """The lost node named ``host`` with ``slots`` slots not admitted yet, else a new
        spare node, added to the job's hosts."""
        ctx = self._ctx
        for node in sorted(ctx.job.lost_nodes - ctx.job.admitted_nodes):
            spec = ctx.config.nodes[node]
            if spec.host == host and spec.local_world_size == slots:
                return spec
        nodes = ctx.config.nodes
        spec = NodeSpec(len(nodes), host, 0, ctx.config.world_size, spare_slots=slots)
        ctx.config = replace(ctx.config, nodes=(*nodes, spec))
        return spec

    def _on_joined(self, event: Event) -> Optional[int]:
        """An agent joined the running job: a lost or newly admitted host, as a spare
        host."""
        ctx, node = self._ctx, event["node"]
        if node not in ctx.job.lost_nodes | ctx.job.admitted_nodes:
            reason = (f"node {node} is in the job already; a host rejoins only once it was "
                      "lost")
            ctx.record("join_refused", "pool", node=node, host=event["host"], reason=reason)
            logger.warning("an agent of node %d (%s, pid %d) joined: %s", node, event["host"],
                           event["pid"], reason)
            return None
        ctx.job.lost_nodes.discard(node)
        ctx.job.left_nodes.discard(node)
        ctx.job.admitted_nodes.discard(node)
        ctx.job.nodes.add(node)
        self._agents.watch(node)
        if ctx.attempt.failed:
            ctx.attempt.stopped[node] = []  # a restart under way: nothing of it to stop here
        # A host admitted just before the job began to end joins with no standby to start.
        slots = 0 if ctx.attempt.ending else ctx.config.nodes[node].local_world_size
        standbys = self._attempts.add_spare_host(node, slots)
        ctx.command("rejoin", node=node, attempt=ctx.attempt.number, generation=ctx.job.generation,
                    standbys=standbys)
        ctx.record("host_joined", "pool", node=node, host=event["host"], standbys=standbys)
        logger.info("host %s (node %d) is back: a spare host with standbys %s", event["host"],
                    node, ", ".join(standbys))
        return None

    def lost(self, node: int, how: str, last_seen: Optional[float] = None) -> Optional[int]:
        """Host ``node`` was lost (``how``; its agent was last seen alive at ``last_seen``,
        wall-clock, now when unknown); returns the launcher's exit code when the job ends."""
        ctx = self._ctx
        if node in ctx.job.lost_nodes or node not in ctx.job.nodes:
            return None
        now = time.time()
        last_seen = now if last_seen is None else last_seen
        ctx.job.nodes.discard(node)
        ctx.job.lost_nodes.add(node)
        ranks = sorted(r for r, n in ctx.job.node_of_rank.items() if n == node)
        host = ctx.config.nodes[node].host
        ctx.record("host_lost", "detect", node=node, host=host, how=how, ranks=ranks, when=now,
                   last_seen=last_seen)
        logger.error("host %s (node %d) lost: %s; its ranks: %s", host, node, how,
                     ranks or "none")
        ctx.command("fence", node=node)
        self._attempts.drop_node(node)
        exit_code = self._job_end.check()
        if exit_code is not None:
            return exit_code
        if ranks:
            event = {"rank": ranks[0], "attempt": ctx.attempt.number, "time": last_seen,
                     "detected": now, "how": f"host {host} lost: {how}",
                     "step_begun": self._steps.last_step + 1}
            exit_code = self._recovery.on_host_lost(event, ranks)
            if exit_code is not None:
                return exit_code
        return self._recovery.restart_if_stopped()
