"""The controller driven in-process: no agents, no workers, no processes.

The control store is an in-process ``HashStore``; each test posts into the ``events`` and
``requests`` mailboxes exactly what the agents (``launch/agent.py``) and the workers'
control clients (``mover_plugin/runtime/control.py``) post, runs the controller's serve loop
one iteration at a time (:meth:`Controller.poll_once`), and reads back what the controller
posts to the ``commands`` mailbox, the store keys it sets, its event log and its summary.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import pytest
import torch.distributed as dist

from mover_plugin.contract import (
    COMMANDS_MAILBOX,
    CURRENT_GENERATION_KEY,
    EVENTS,
    EVENTS_MAILBOX,
    LAYOUT_KEY,
    REQUESTS_MAILBOX,
    TEMPLATES_KEY,
    plan_key,
    promotion_key,
    request_done_key,
    request_reply_key,
    stage_profile_key,
    standbys_ready_key,
    successor_key,
    switch_decision_key,
)
from mover_plugin.launch import controller as controller_module
from mover_plugin.launch.config import LaunchConfig
from mover_plugin.launch.hosts import NodeSpec
from mover_plugin.launch.context import Unit
from mover_plugin.launch.controller import Controller, handler_table
from mover_plugin.mailbox import Mailbox

T0 = 1000.0
"""Event times are made up: the interruption timing is checked to the second."""


@pytest.fixture(autouse=True)
def requests_at_every_poll(monkeypatch):
    monkeypatch.setattr(controller_module, "REQUEST_POLL_PERIOD_S", 0.0)


class Job:
    """A controller of 2 hosts x 2 ranks (data-parallel 4), started, and the mailboxes and
    store that its agents and workers would use. No agent beats: the agents' heartbeat
    timeout is an hour, unless a test sets ``agent_timeout_s``. ``nodes`` replaces the hosts,
    ``local_agents`` are processes standing for agents this controller started."""

    def __init__(self, tmp_path: Path, *, policy: str = "resilient", standbys: int = 1,
                 max_restarts: int = 3, nodes: Optional[tuple[NodeSpec, ...]] = None,
                 local_agents: Optional[dict[int, subprocess.Popen]] = None,
                 **settings: Any) -> None:
        self.log_path = tmp_path / "events.jsonl"
        nodes = nodes or (NodeSpec(0, "host0", 2, 0), NodeSpec(1, "host1", 2, 2))
        settings.setdefault("agent_timeout_s", 3600.0)
        self.config = LaunchConfig(
            nodes=nodes, local_node_ranks=(), runs_controller=True, master_addr="127.0.0.1",
            master_port=0, command=("python", "train.py"), policy=policy,
            standbys=standbys, max_restarts=max_restarts,
            event_log_path=str(self.log_path), join_timeout_s=5.0, **settings)
        self.store = dist.HashStore()
        self._events = Mailbox(self.store, EVENTS_MAILBOX)
        self._requests = Mailbox(self.store, REQUESTS_MAILBOX)
        self._commands = Mailbox(self.store, COMMANDS_MAILBOX)
        self.controller = Controller(self.config, self.store, local_agents)
        self.attempt, self.generation = -1, 0
        for node in nodes:
            self.agent(node.node_rank, "joined", host=node.host, nproc=node.nproc,
                       pid=100 + node.node_rank)
        self.controller.start()
        self.attempt = 0

    # -- posting as agents, workers and operators do --------------------------------------

    def agent(self, node: int, kind: str, *, attempt: Optional[int] = None,
              **fields: Any) -> None:
        fields.setdefault("time", T0)
        self._events.post({"kind": kind, "node": node,
                           "attempt": self.attempt if attempt is None else attempt,
                           "generation": self.generation, **fields})

    def worker(self, kind: str, **fields: Any) -> None:
        fields.setdefault("time", T0)
        fields.setdefault("generation", self.generation)
        fields.setdefault("attempt", self.attempt)
        self._events.post({"kind": kind, **fields})

    def raw(self, event: Any) -> None:
        self._events.post(event)

    def request(self, op: str, request_id: str, **fields: Any) -> Optional[dict[str, Any]]:
        self._requests.post({"op": op, "id": request_id, **fields})
        self.poll()
        return self.json(request_reply_key(request_id))

    def poll(self) -> Optional[int]:
        return self.controller.poll_once()

    # -- what the controller did ------------------------------------------------------------

    def commands(self) -> list[dict[str, Any]]:
        """The commands posted since the last call."""
        return self._commands.poll()

    def key(self, key: str) -> Optional[str]:
        return self.store.get(key).decode() if self.store.check([key]) else None

    def json(self, key: str) -> Optional[Any]:
        value = self.key(key)
        return None if value is None else json.loads(value)

    def log(self, event: Optional[str] = None) -> list[dict[str, Any]]:
        records = [json.loads(line) for line in self.log_path.read_text().splitlines()]
        return [r for r in records if event is None or r["event"] == event]

    # -- common steps ---------------------------------------------------------------------

    def provision(self) -> None:
        """Every standby ready and the layout published: the job trains."""
        for node in (0, 1):
            for index in range(self.config.standbys):
                self.agent(node, "standby_ready", standby=f"a{self.attempt}.n{node}.s{index}")
        self.store.set(LAYOUT_KEY, json.dumps({"tp": 1, "pp": 1, "dp": 4}))
        assert self.poll() is None

    def exit(self, rank: int, *, returncode: int = -9, how: str = "signal SIGKILL",
             standby: Optional[str] = None, kind: str = "worker_exit", step: int = 5,
             when: float = T0 + 5.5) -> None:
        self.agent(rank // 2, kind, rank=rank, returncode=returncode, how=how,
                   step_begun=step, step_completed=step - 1, standby=standby,
                   last_step_end=T0 + 4.0, last_step_duration=1.0, time=when)

    def all_ranks(self, kind: str, *, when: float, **fields: Any) -> None:
        for rank in range(4):
            self.worker(kind, rank=rank, time=when + rank * 0.01, **fields)

    def first_steps(self, *, when: float) -> None:
        for rank in range(4):
            self.agent(rank // 2, "first_step", rank=rank, step=6, time=when + rank * 0.01)


@pytest.fixture
def job(tmp_path):
    return Job(tmp_path)


def test_start_posts_the_first_attempt_and_arms_once_every_standby_is_ready(job):
    (start,) = job.commands()
    assert start["op"] == "start" and start["attempt"] == 0 and start["generation"] == 0
    assert start["ranks"] == {}  # every host runs its own ranks
    assert job.controller._ctx.attempt.store is not None and "store_port" not in start
    assert job.key(CURRENT_GENERATION_KEY) == "0"
    assert job.key(standbys_ready_key(0)) is None
    job.agent(0, "standby_ready", standby="a0.n0.s0")
    job.poll()
    assert job.commands() == [] and job.key(standbys_ready_key(0)) is None
    job.agent(1, "standby_ready", standby="a0.n1.s0")
    job.poll()
    assert job.commands() == [{"op": "arm"}]
    assert job.key(standbys_ready_key(0)) == "1"
    assert [r["pool"] for r in job.log("standby_ready")] == [1, 2]


def test_a_crash_with_a_ready_standby_switches_generation(job):
    job.provision()
    job.commands()
    job.agent(0, "injected", rank=1, step=5, signal="SIGKILL", time=T0 + 5.0)
    job.exit(1)
    assert job.poll() is None
    plan = job.json(plan_key(1))
    assert plan == {"generation": 1, "kind": "crash", "world_size": 4, "rebuild_all": False,
                    "replacements": [{"rank": 1, "standby": "a0.n1.s0", "twin": 0, "node": 1}],
                    "fault": None, "survivors": [], "lost": [], "placement": None, "moves": [],
                    "describe": ""}
    assert job.key(successor_key(0)) == "1" and job.key(CURRENT_GENERATION_KEY) == "1"
    assert job.json(promotion_key("a0.n1.s0")) == {"rank": 1, "generation": 1,
                                                    "migration": False}
    assert job.commands() == [
        {"op": "notice", "generation": 0, "kind": "alarm", "reason": "rank 1 lost"},
        {"op": "promote", "standby": "a0.n1.s0", "rank": 1, "migration": False},
        {"op": "generation", "generation": 1},
    ]
    for rank in (0, 2, 3):
        job.worker("left_step", rank=rank, generation=0, time=T0 + 5.6 + rank * 0.1)
    job.generation = 1
    job.all_ranks("switched", when=T0 + 7.0)
    job.first_steps(when=T0 + 8.0)
    assert job.poll() is None
    (item,) = job.controller.summary.to_dict()["interruptions"]
    assert item["kind"] == "failure" and item["recovery"] == "standby" and item["injected"]
    assert item["generation"] == 1 and item["step"] == 5
    assert list(item["phases_s"]) == ["failed", "detected", "alarm", "left", "switched",
                                      "first_step_completed"]
    assert item["phases_s"]["left"] == pytest.approx(0.9)
    assert item["phases_s"]["switched"] == pytest.approx(2.03)
    assert item["left_s"] == {"0": pytest.approx(0.6), "2": pytest.approx(0.8),
                              "3": pytest.approx(0.9)}
    # downtime: first step after (T0 + 8.03) - last step before (T0 + 4) - its duration (1)
    assert item["downtime_s"] == pytest.approx(3.03)
    (resumed,) = job.log("resumed")
    assert resumed["generation"] == 1 and resumed["downtime_s"] == pytest.approx(3.03)
    assert [r["standby"] for r in job.log("promote")] == ["a0.n1.s0"]
    assert job.controller.summary.restarts == 0


def test_a_second_loss_during_the_switch_carries_the_unfinished_joiner_over(tmp_path):
    """Rank 1 is lost, its standby promoted; before that joiner reports its switch, rank 2 is
    lost too. The next generation replaces rank 2 with a fresh standby, keeps rank 1 with the
    standby it has (copying again from a twin that is neither lost nor a joiner), and has
    every process rebuild all its groups; a joiner that reported its switch is not carried."""
    job = Job(tmp_path, standbys=2)
    job.provision()
    job.commands()
    job.exit(1)
    assert job.poll() is None
    assert job.json(plan_key(1))["replacements"] == [
        {"rank": 1, "standby": "a0.n1.s0", "twin": 0, "node": 1}]
    job.commands()
    job.generation = 1
    for rank in (0, 3):
        job.worker("switched", rank=rank, role="survivor", time=T0 + 6.0)
    job.exit(2, when=T0 + 6.1)
    assert job.poll() is None
    plan = job.json(plan_key(2))
    assert plan["rebuild_all"] is True
    assert plan["replacements"] == [
        {"rank": 1, "standby": "a0.n1.s0", "twin": 0, "node": 1},
        {"rank": 2, "standby": "a0.n0.s0", "twin": 0, "node": 0}]
    assert job.key(successor_key(1)) == "2"
    assert job.commands() == [
        {"op": "notice", "generation": 1, "kind": "alarm", "reason": "rank 2 lost"},
        {"op": "promote", "standby": "a0.n0.s0", "rank": 2, "migration": False},
        {"op": "generation", "generation": 2},
    ]
    assert [(r["rank"], r["standby"]) for r in job.log("carried")] == [(1, "a0.n1.s0")]
    assert [r["standby"] for r in job.log("promote")] == ["a0.n1.s0", "a0.n0.s0"]
    # Generation 2 completes its switch; a later loss carries no one over.
    job.generation = 2
    job.all_ranks("switched", when=T0 + 7.0)
    job.first_steps(when=T0 + 8.0)
    job.exit(3, when=T0 + 9.0)
    assert job.poll() is None
    plan = job.json(plan_key(3))
    assert plan["rebuild_all"] is False and [r["rank"] for r in plan["replacements"]] == [3]


def test_a_second_loss_falls_back_when_the_joiners_only_twin_is_lost(tmp_path):
    """Rank 3's joiner has no state yet when rank 1, its only data-parallel twin (TP2·DP2),
    is lost: neither can get its state from a live rank, so the job restarts."""
    job = Job(tmp_path, standbys=2)
    job.provision()
    job.store.set(LAYOUT_KEY, json.dumps({"tp": 2, "pp": 1, "dp": 2}))
    job.commands()
    job.exit(3)
    assert job.poll() is None
    job.generation = 1
    job.exit(1, when=T0 + 6.1)
    assert job.poll() is None
    (fallback,) = job.log("fallback")
    assert fallback["reason"] == ("rank 1 has no live data-parallel twin (every data-parallel "
                                  "twin was lost too or has no state yet)")


@pytest.mark.parametrize("delay_s", [0.0, 3600.0])
def test_the_pool_refills_on_the_lost_ranks_host_once_training_resumed(tmp_path, delay_s):
    job = Job(tmp_path, refill_delay_s=delay_s)
    job.provision()
    job.commands()
    job.exit(3)  # node 1's rank; the standby of node 0 is taken (the other host's first)
    job.poll()
    promoted = job.json(plan_key(1))["replacements"][0]["standby"]
    job.commands()
    job.generation = 1
    job.all_ranks("switched", when=T0 + 7.0)
    assert job.poll() is None
    assert [c for c in job.commands() if c["op"] == "refill"] == []  # not before resuming
    job.first_steps(when=T0 + 8.0)
    job.poll()
    if delay_s:  # not before --refill-delay-s after resuming
        assert [c for c in job.commands() if c["op"] == "refill"] == []
        return
    (refill,) = [c for c in job.commands() if c["op"] == "refill"]
    assert refill == {"op": "refill", "attempt": 0, "node": 1, "standby": "a0.n1.r0"}
    assert job.request("status", "s1")["refilling"] == {"a0.n1.r0": 1}
    job.agent(1, "standby_ready", standby="a0.n1.r0", time=T0 + 20.0)
    job.poll()
    assert job.request("status", "s2")["standbys"] == {
        s: n for s, n in {"a0.n0.s0": 0, "a0.n1.s0": 1, "a0.n1.r0": 1}.items() if s != promoted}
    (item,) = job.controller.summary.to_dict()["refills"]
    assert item["standby"] == "a0.n1.r0" and item["node"] == 1 and item["ready_at"] is not None
    assert [r["pool"] for r in job.log("standby_refill")] == [1]


@pytest.mark.parametrize("delay_s", [0.0, 3600.0])
def test_a_ready_standby_that_exits_is_replaced_on_its_host(tmp_path, delay_s):
    job = Job(tmp_path, refill_delay_s=delay_s)
    job.provision()
    job.commands()
    job.agent(1, "standby_exit", standby="a0.n1.s0", returncode=-9, how="signal SIGKILL")
    job.poll()
    refills = [c for c in job.commands() if c["op"] == "refill"]
    if delay_s:  # not before --refill-delay-s after the exit
        assert refills == []
        return
    assert refills == [{"op": "refill", "attempt": 0, "node": 1, "standby": "a0.n1.r0"}]
    # The replacement exits before it is ready: it is not replaced again.
    job.agent(1, "standby_exit", standby="a0.n1.r0", returncode=1, how="exit code 1")
    job.poll()
    assert [c for c in job.commands() if c["op"] == "refill"] == []
    (item,) = job.controller.summary.to_dict()["refills"]
    assert item["lost_at"] is not None and item["ready_at"] is None
    status = job.request("status", "s1")  # the slot left empty leaves the target
    assert status["standby_target"] == 1 and list(status["standbys"]) == ["a0.n0.s0"]


def test_a_hung_rank_is_recovered_as_a_hang(job):
    job.provision()
    job.agent(0, "hung", rank=1, standby=None, silent_s=12.5)
    job.exit(1)
    job.poll()
    (item,) = job.controller.summary.interruptions
    assert item.kind == "hang" and not item.injected
    (hung,) = job.log("hung")
    assert hung["rank"] == 1 and hung["silent_s"] == 12.5


def test_a_crash_without_a_standby_falls_back_to_a_restart(tmp_path):
    job = Job(tmp_path, standbys=0)
    job.provision()
    assert job.commands()[-1] == {"op": "arm"}
    job.exit(2)
    job.poll()
    (fallback,) = job.log("fallback")
    assert fallback["rank"] == 2 and fallback["reason"] == "1 rank(s) lost but 0 standby(s) ready"
    assert job.commands() == [{"op": "stop", "attempt": 0}]
    job.exit(3, how="signal SIGTERM", returncode=-15)  # stopped with the others: no new failure
    job.agent(0, "stopped", workers=[{"rank": 0, "last_step_end": T0 + 4.5,
                                      "last_step_duration": 1.5}])
    job.poll()
    assert job.commands() == [] and job.controller.summary.restarts == 0
    job.agent(1, "stopped", workers=[])
    job.poll()
    (start,) = job.commands()
    assert start["op"] == "start" and start["attempt"] == 1 and start["generation"] == 1
    assert job.key(CURRENT_GENERATION_KEY) == "1"
    assert job.controller.summary.restarts == 1 and len(job.log("restart")) == 1
    job.attempt, job.generation = 1, 1
    job.agent(0, "worker_exit", attempt=0, rank=0, returncode=1, how="exit code 1",
              step_begun=5, time=T0 + 6.0)  # a late report of the first attempt: ignored
    for node in (0, 1):
        job.agent(node, "started", pids={}, time=T0 + 7.0 + node)
    for rank in range(4):
        job.agent(rank // 2, "ready", rank=rank, step=4, time=T0 + 9.0 + rank)
    job.first_steps(when=T0 + 20.0)
    job.poll()
    assert job.commands() == []
    (item,) = job.controller.summary.to_dict()["interruptions"]
    assert item["recovery"] == "restart" and item["rank"] == 2
    assert list(item["phases_s"]) == ["failed", "detected", "stopped", "started", "recovered",
                                      "first_step_completed"]
    assert item["phases_s"]["started"] == pytest.approx(2.5)
    assert item["phases_s"]["recovered"] == pytest.approx(6.5)
    # the last step before came from the stopped report of rank 0 (T0 + 4.5, 1.5 s long)
    assert item["downtime_s"] == pytest.approx(20.03 - 4.5 - 1.5)
    assert len(job.log("worker_ready")) == 4


def test_a_loss_after_a_rank_finished_the_script_restarts_rather_than_promote(job):
    """Ranks that ended their script take part in no new generation: the standbys' groups
    would wait for them forever. The job takes the restart path, with the reason."""
    job.provision()
    job.commands()
    for rank in (1, 2):
        job.exit(rank, returncode=0, how="exit code 0", step=11)
    job.exit(3)
    job.poll()
    (fallback,) = job.log("fallback")
    assert fallback["rank"] == 3 and fallback["reason"] == (
        "rank(s) [1, 2] already finished the script, and a new generation needs every rank")
    assert job.log("promote") == []
    # The first rank that finished wound the job down; the loss then restarts it.
    assert job.commands() == [{"op": "wind_down", "attempt": 0}, {"op": "stop", "attempt": 0}]


def shrinkable(job: "Job") -> None:
    """The job trains TP1 x PP2 x DP2 and its rank 0 said it can shrink onto templates."""
    job.provision()
    job.store.set(LAYOUT_KEY, json.dumps({"tp": 1, "pp": 2, "dp": 2}))
    job.store.set(TEMPLATES_KEY, json.dumps({"num_layers": 4, "tied": True,
                                             "microbatches": 4, "fault_tolerance": 1}))
    job.commands()


def test_a_crash_without_a_standby_shrinks_onto_pipeline_templates(tmp_path):
    job = Job(tmp_path, standbys=0)
    shrinkable(job)
    job.exit(1, when=T0 + 5.5)
    assert job.poll() is None
    plan = job.json(plan_key(1))
    assert plan["kind"] == "shrink" and plan["world_size"] == 3
    assert plan["survivors"] == [0, 2, 3] and plan["lost"] == [1]
    assert plan["describe"] == "[0 1] layers 0-2|3 x 2 + [2] layers 0-3 x 2"
    # rank 3 of the job (2 of the survivors) was the last stage: it takes the first stage's
    # layers from rank 0; rank 0 takes layer 2 from rank 2 of the job (1 of the survivors)
    assert plan["moves"] == [["position", 0, 2], ["layer 0", 0, 2], ["layer 1", 0, 2],
                             ["layer 2", 1, 0]]
    assert job.key(successor_key(0)) == "1"
    commands = job.commands()
    assert {"op": "drop", "ranks": [1]} in commands
    assert [c for c in commands if c["op"] == "notice"][0]["kind"] == "alarm"
    assert not [c for c in commands if c["op"] in ("promote", "stop")]
    assert job.log("fallback") == []
    (shrink,) = job.log("shrink")
    assert shrink["survivors"] == [0, 2, 3] and shrink["moved"] == 4
    # the three survivors leave, switch and train: the interruption ends without rank 1
    job.generation = 1
    for rank in (0, 2, 3):
        job.worker("left_step", rank=rank, cause="alarm", generation=0, time=T0 + 6.0)
        job.worker("switched", rank=rank, role="survivor", time=T0 + 7.0)
        job.agent(rank // 2, "first_step", rank=rank, step=6, time=T0 + 8.0)
    job.poll()
    (item,) = job.controller.summary.to_dict()["interruptions"]
    assert item["recovery"] == "shrink" and item["plan"] == plan["describe"]
    assert list(item["phases_s"]) == ["failed", "detected", "alarm", "left", "switched",
                                      "first_step_completed"]
    assert job.controller.summary.restarts == 0
    # no rank can be moved while the job runs on templates
    reply = job.request("migrate", "m1", ranks=[0])
    assert reply["ok"] is False and "pipeline templates" in reply["error"]
    # a second loss while shrunk shrinks again, from the templates: job rank 3 (2 of the
    # first survivors' world) held every layer, job rank 2 takes all but layer 3 from it
    job.exit(0, when=T0 + 9.0)
    job.poll()
    assert job.log("fallback") == []
    again = job.json(plan_key(2))
    assert again["kind"] == "shrink" and again["world_size"] == 2
    assert again["survivors"] == [2, 3] and again["lost"] == [0, 1]
    assert again["describe"] == "[0] layers 0-3 x 2 + [1] layers 0-3 x 2"
    assert again["moves"] == [["position", 1, 0], ["layer 0", 1, 0], ["layer 1", 1, 0],
                              ["layer 2", 1, 0]]
    assert job.key(successor_key(1)) == "2"
    assert {"op": "drop", "ranks": [0]} in job.commands()
    (_, second) = job.log("shrink")
    assert second["lost"] == [0] and second["survivors"] == [2, 3]
    # a loss before every survivor moved onto the new templates restarts the job (rank 2
    # may hold the first templates' state or the second's)
    restarts_on_loss(job, 3, T0 + 10.5,
                     "a rank was lost before rank(s) [2] had moved onto the pipeline templates")


def restarts_on_loss(job: "Job", rank: int, when: float, reason: str) -> None:
    """Losing ``rank`` at ``when`` restarts the job for ``reason``."""
    job.exit(rank, when=when)
    job.poll()
    (fallback,) = job.log("fallback")
    assert fallback["reason"] == reason
    assert {"op": "stop", "attempt": 0} in job.commands()


@pytest.mark.parametrize("measured_stages", [2, 1])
def test_a_shrink_plans_from_the_profile_the_stages_measured(tmp_path, measured_stages):
    """Both stages published their layers' costs: the plan follows them (the first stage's
    layers are slow, so it keeps fewer); one stage's are missing: the GPT-like estimate."""
    from support.profiles import slow_first_layers, stage_records

    job = Job(tmp_path, standbys=0)
    shrinkable(job)
    records = stage_records(slow_first_layers(), (80 << 30, 80 << 30))
    for stage, record in enumerate(records[:measured_stages]):
        job.store.set(stage_profile_key(stage), json.dumps(record))
    job.exit(1, when=T0 + 5.5)
    assert job.poll() is None
    (shrink,) = job.log("shrink")
    if measured_stages == 2:
        assert shrink["profile_source"] == "measured"
        assert shrink["profile"]["layers"] == records[0]["layers"] + records[1]["layers"]
        assert shrink["plan"] == "[0 1] layers 0-1|2-3 x 2 + [2] layers 0-3 x 2"
    else:
        assert shrink["profile_source"] == "estimate" and shrink["profile"] is None
        assert shrink["plan"] == "[0 1] layers 0-2|3 x 2 + [2] layers 0-3 x 2"


def shrunk_and_refilled(tmp_path: Path) -> tuple["Job", dict[str, Any]]:
    """Rank 1 lost with no standby, the survivors training shrunk, and the refill of its slot
    (at once, on node 0) asked for."""
    job = Job(tmp_path, standbys=0, refill_delay_s=0.0)
    shrinkable(job)
    job.exit(1, when=T0 + 5.5)
    job.poll()
    job.generation = 1
    for rank in (0, 2, 3):
        job.worker("switched", rank=rank, role="survivor", time=T0 + 7.0)
        job.agent(rank // 2, "first_step", rank=rank, step=6, time=T0 + 8.0)
    job.poll()
    (refill,) = [c for c in job.commands() if c["op"] == "refill"]
    assert refill["node"] == 0
    return job, refill


def test_a_shrunk_job_grows_back_once_a_standby_is_ready_for_the_lost_rank(tmp_path):
    job, refill = shrunk_and_refilled(tmp_path)
    job.agent(0, "standby_ready", standby=refill["standby"], time=T0 + 20.0)
    assert job.poll() is None
    plan = job.json(plan_key(2))
    assert plan["kind"] == "grow" and plan["world_size"] == 4
    assert plan["replacements"] == [{"rank": 1, "standby": refill["standby"], "twin": -1,
                                     "node": 0}]
    assert plan["describe"] == "[0 2] layers 0-1|2-3 x 2 + [1 3] layers 0-1|2-3 x 2"
    # the lost rank's standby gets everything of its stage from rank 0; rank 2 held only
    # layer 3 on the templates, and gets layer 2 from rank 0 too
    assert plan["moves"] == [["embedding", 0, 1], ["position", 0, 1], ["layer 0", 0, 1],
                             ["layer 1", 0, 1], ["layer 2", 0, 2]]
    commands = job.commands()
    assert {"op": "promote", "standby": refill["standby"], "rank": 1,
            "migration": False} in commands
    (switch,) = [c for c in commands if c["op"] == "notice"]
    assert switch["kind"] == "switch" and switch["generation"] == 1
    # the survivors switch at the end of step 40; the standby joins; all train
    job.generation = 2
    for rank in (0, 2, 3):
        job.worker("switched", rank=rank, role="survivor", time=T0 + 25.0,
                   boundary_end=T0 + 24.8, boundary_step_s=0.1, boundary_step=40)
    job.worker("switched", rank=1, role="joiner", time=T0 + 25.1)
    job.first_steps(when=T0 + 25.5)
    job.poll()
    _, grow = job.controller.summary.to_dict()["interruptions"]
    assert grow["kind"] == grow["recovery"] == "grow" and grow["step"] == 40
    assert list(grow["phases_s"]) == ["requested", "switched", "first_step_completed"]
    assert grow["downtime_s"] == pytest.approx(25.53 - 24.8 - 0.1)
    (grown,) = job.log("grown")
    assert job.controller._ctx.attempt.shrunk is None
    # a loss now is recovered by the job's own means again (here: no standby, a shrink)
    job.exit(3, when=T0 + 30.0)
    job.poll()
    assert len(job.log("shrink")) == 2


def test_a_survivor_that_finishes_before_the_switch_calls_the_growing_back_off(tmp_path):
    job, refill = shrunk_and_refilled(tmp_path)
    job.agent(0, "standby_ready", standby=refill["standby"], time=T0 + 20.0)
    job.poll()
    job.commands()
    # the survivors end training in the iteration the switch was asked in
    job.exit(0, returncode=0, how="exit code 0", when=T0 + 21.0)
    job.poll()
    assert {"op": "cancel_promotion", "standby": refill["standby"], "rank": 1} in job.commands()
    (abandoned,) = job.log("grow_abandoned")
    assert abandoned["ranks"] == [1] and "rank 0 finished training" in abandoned["reason"]
    # the job stays in its shrunk generation, without rank 1, and the summary keeps only the
    # shrink
    assert job.key(CURRENT_GENERATION_KEY) == "1"
    assert sorted(job.controller._ctx.job.membership.members) == [0, 2, 3]
    (shrink,) = job.controller.summary.to_dict()["interruptions"]
    assert shrink["recovery"] == "shrink"
    # the standby, stopped or failing on its own, is no failure of the job
    job.exit(1, standby=refill["standby"], when=T0 + 22.0)
    assert job.poll() is None
    assert job.log("fallback") == [] and job.commands() == []


def test_a_survivor_that_finishes_after_the_switch_keeps_the_growing_back(tmp_path):
    job, refill = shrunk_and_refilled(tmp_path)
    job.agent(0, "standby_ready", standby=refill["standby"], time=T0 + 20.0)
    job.poll()
    job.commands()
    job.generation = 2
    job.worker("switched", rank=0, role="survivor", time=T0 + 21.0, boundary_end=T0 + 20.5)
    job.exit(2, returncode=0, how="exit code 0", when=T0 + 21.5)  # its last step came first
    job.poll()
    # the joiner holds its rank: winding the job down leaves it alone
    assert job.log("grow_abandoned") == []
    assert job.commands() == [{"op": "wind_down", "attempt": 0}]
    assert job.key(CURRENT_GENERATION_KEY) == "2"


def test_a_loss_while_the_job_grows_back_restarts_it(tmp_path):
    job, refill = shrunk_and_refilled(tmp_path)
    job.agent(0, "standby_ready", standby=refill["standby"], time=T0 + 20.0)
    job.poll()
    job.commands()
    restarts_on_loss(job, 2, T0 + 21.0,
                     "a rank was lost while the job grows back from pipeline templates")


def test_a_loss_no_template_plan_covers_falls_back_with_both_reasons(tmp_path):
    job = Job(tmp_path, standbys=0)
    shrinkable(job)
    job.store.set(LAYOUT_KEY, json.dumps({"tp": 2, "pp": 2, "dp": 1}))
    job.exit(3)
    job.poll()
    assert job.log("shrink") == []
    (fallback,) = job.log("fallback")
    assert fallback["reason"] == ("1 rank(s) lost but 0 standby(s) ready; pipeline templates "
                                  "need tensor-parallel size 1, not 2")
    assert job.commands() == [{"op": "stop", "attempt": 0}]


def test_a_rank_ending_with_an_error_of_its_own_is_restarted_not_replaced(job):
    job.provision()
    job.commands()
    job.worker("worker_error", rank=1, error="ValueError: bad batch", traceback="Traceback ...")
    job.exit(1, returncode=1, how="exit code 1")
    assert job.poll() is None
    (fallback,) = job.log("fallback")
    assert fallback["rank"] == 1 and "ValueError: bad batch" in fallback["reason"]
    assert job.commands() == [{"op": "stop", "attempt": 0}]
    assert job.key(plan_key(1)) is None and job.log("promote") == []
    (reported,) = job.log("worker_error")
    assert reported["rank"] == 1 and reported["error"] == "ValueError: bad batch"


def test_an_error_of_its_own_in_an_earlier_attempt_leaves_later_crashes_to_standbys(job):
    job.provision()
    job.worker("worker_error", rank=1, error="ValueError: bad batch", traceback="")
    job.exit(1, returncode=1, how="exit code 1")
    job.poll()
    for node in (0, 1):
        job.agent(node, "stopped", workers=[])
    job.poll()
    job.attempt = 1
    job.provision()
    job.commands()
    job.exit(1)  # the same rank SIGKILLed in the next attempt: a lost peer
    job.poll()
    assert len(job.log("fallback")) == 1 and len(job.log("promote")) == 1
    assert job.controller.summary.restarts == 1


def test_step_times_go_to_the_event_log_but_not_to_the_recent_events(job):
    job.provision()
    job.agent(0, "steps", steps=[[1, T0 + 1.0, 0.9], [2, T0 + 2.0, 1.0]], time=T0 + 2.1)
    job.poll()
    (record,) = job.log("steps")
    assert record["steps"] == [[1, T0 + 1.0, 0.9], [2, T0 + 2.0, 1.0]]
    assert record["attempt"] == 0 and record["phase"] == "job"
    assert "steps" not in {e["event"] for e in job.controller.log.recent(50)}


def test_the_restart_limit_ends_the_job(tmp_path):
    job = Job(tmp_path, policy="restart", standbys=0, max_restarts=1)
    job.commands()
    job.exit(1)
    assert job.poll() is None
    assert job.commands() == [{"op": "stop", "attempt": 0}]
    assert job.log("fallback") == []  # the restart policy restarts without falling back
    for node in (0, 1):
        job.agent(node, "stopped", workers=[])
    job.poll()
    assert [c["attempt"] for c in job.commands() if c["op"] == "start"] == [1]
    job.attempt = 1
    job.exit(3, how="exit code 1", returncode=1)
    assert job.poll() == 1
    assert job.commands() == []
    job.controller.finish(1)
    assert job.commands() == [{"op": "abort"}]
    summary = job.controller.summary
    assert summary.exit_code == 1 and summary.restarts == 1
    assert [i.attempt for i in summary.interruptions] == [0, 1]
    assert job.log()[-1]["event"] == "job_end" and job.log()[-1]["exit_code"] == 1


def test_every_node_done_ends_the_job_with_its_step_statistics(job):
    job.commands()
    workers = [{"rank": r, "peak_rss_mb": 100.0 + r, "median_step_s": 1.0 + r,
                "cpu_per_step_s": 0.5} for r in range(2)]
    job.agent(0, "node_done", steps_completed=10, workers=workers)
    assert job.poll() is None
    job.agent(1, "node_done", steps_completed=9, workers=[])
    assert job.poll() == 0
    job.controller.finish(0)
    assert job.commands() == [{"op": "finish"}]
    summary = job.controller.summary
    assert summary.steps_completed == 9 and summary.worker_peak_rss_mb == 101.0
    assert summary.median_step_time_s == 1.5 and summary.median_cpu_per_step_s == 0.5
    assert summary.exit_code == 0


def _resumed_after_a_crash(job: Job) -> None:
    """Rank 3 crashed and its replacement trains: its slot on node 1 waits for a refill."""
    job.provision()
    job.commands()
    job.exit(3)
    job.poll()
    job.generation = 1
    job.all_ranks("switched", when=T0 + 7.0)
    job.first_steps(when=T0 + 8.0)
    job.poll()


def test_the_first_rank_that_finishes_winds_the_job_down_and_no_refill_starts(tmp_path):
    """A refill due at the last step: the rank that finished first ends the attempt's
    training phase; the refill is never asked for, and every agent stops its standbys."""
    job = Job(tmp_path, refill_delay_s=0.5)
    _resumed_after_a_crash(job)
    assert [c for c in job.commands() if c["op"] == "refill"] == []  # not due yet
    job.exit(0, returncode=0, how="exit code 0", step=11, when=T0 + 9.0)
    job.poll()
    assert job.commands() == [{"op": "wind_down", "attempt": 0}]
    (ending,) = job.log("job_ending")
    assert ending["rank"] == 0 and ending["refills_stopped"] == []
    assert ending["standbys_stopped"] == ["a0.n1.s0"]  # the ready one left
    time.sleep(0.6)
    job.poll()  # the refill would be due now
    assert job.commands() == [] and job.controller.summary.refills == []
    assert job.request("status", "s1")["standbys"] == {}
    # a standby that still reports ready is being stopped: no pool, no use
    job.agent(1, "standby_ready", standby="a0.n1.s9")
    job.poll()
    assert job.request("status", "s2")["standbys"] == {} and job.commands() == []


def test_a_refill_in_flight_when_training_ends_is_stopped_and_the_job_ends(tmp_path):
    """A refill started at the last step: the wind-down stops it (the summary says so) and
    the job ends once every host's ranks are done."""
    job = Job(tmp_path, refill_delay_s=0.0)
    _resumed_after_a_crash(job)
    (refill,) = [c for c in job.commands() if c["op"] == "refill"]
    for rank in (0, 1, 2, 3):
        job.exit(rank, returncode=0, how="exit code 0", step=11, when=T0 + 9.0)
    job.poll()
    assert job.commands() == [{"op": "wind_down", "attempt": 0}]
    assert job.log("job_ending")[0]["refills_stopped"] == [refill["standby"]]
    job.agent(0, "node_done", steps_completed=11, workers=[])
    job.agent(1, "node_done", steps_completed=11, workers=[])
    assert job.poll() == 0
    (item,) = job.controller.summary.to_dict()["refills"]
    assert item["stopped_at"] is not None and item["ready_at"] is None
    assert job.request("status", "s1")["refilling"] == {}


def test_an_ending_job_refuses_a_host_that_asks_to_join_and_a_migration(job):
    """A join or a migration asked for at the last step: refused with the reason; a host
    admitted just before the end joins with no standby to start."""
    job.provision()
    job.worker("join_request", attempt=-1, host="host9", slots=1, pid=400, token="t9")
    job.poll()
    (admit,) = [c for c in job.commands() if c["op"] == "admit"]
    job.exit(1, returncode=0, how="exit code 0", step=11, when=T0 + 9.0)
    job.poll()
    job.worker("join_request", attempt=-1, host="host8", slots=1, pid=401, token="t8")
    job.poll()
    (refused,) = [c for c in job.commands() if c["op"] == "join_refused"]
    assert refused["token"] == "t8" and refused["reason"] == (
        "the job is ending: a rank finished training")
    assert job.request("migrate", "m1", ranks=[2]) == {
        "ok": False, "error": "the job is ending: a rank finished training"}
    job.agent(admit["node"]["node_rank"], "joined", attempt=-1, host="host9", nproc=0,
              pid=400)
    job.poll()
    (rejoin,) = job.commands()
    assert rejoin["op"] == "rejoin" and rejoin["standbys"] == []
    for node in (0, 1):
        job.agent(node, "node_done", steps_completed=11, workers=[])
    assert job.poll() is None  # the joined host is in the job: its agent reports too
    job.agent(admit["node"]["node_rank"], "node_done", steps_completed=None, workers=[])
    assert job.poll() == 0
    assert job.controller.summary.steps_completed == 11


def test_a_standby_ready_for_a_shrunk_job_at_its_end_does_not_grow_it_back(tmp_path):
    """The refill a shrunk job waited for becomes ready after a rank finished: the job ends
    shrunk; no growing back starts."""
    job, refill = shrunk_and_refilled(tmp_path)
    job.exit(0, returncode=0, how="exit code 0", when=T0 + 21.0)
    job.poll()
    job.agent(0, "standby_ready", standby=refill["standby"], time=T0 + 22.0)
    job.poll()
    assert job.commands() == [{"op": "wind_down", "attempt": 0}]
    assert job.log("grow") == [] and job.key(plan_key(2)) is None


def _migrate_rank_1(job: Job) -> None:
    job.provision()
    job.commands()
    reply = job.request("migrate", "m1", ranks=[1])
    assert reply == {"ok": True, "ranks": [1], "standbys": ["a0.n1.s0"], "generation": 1}


def test_a_planned_migration_runs_through_both_phases(job):
    _migrate_rank_1(job)
    assert job.commands() == [
        {"op": "promote", "standby": "a0.n1.s0", "rank": 1, "migration": True},
        {"op": "generation", "generation": 1},
        {"op": "notice", "generation": 0, "kind": "prepare", "next": 1},
    ]
    assert job.json(plan_key(1))["kind"] == "migration"
    assert job.json(promotion_key("a0.n1.s0"))["migration"] is True
    assert job.key(successor_key(0)) is None  # set only at the point of no return
    job.worker("prepared", rank=1, generation=1, time=T0 + 1.0)
    for rank in (0, 2):
        job.worker("groups_prepared", rank=rank, generation=1, build_s=0.1, rebuilt=1, kept=2,
                   time=T0 + 1.2)
    job.poll()
    assert job.commands() == []
    assert job.request("status", "s1")["migrations"][0]["state"].startswith("phase 1")
    job.worker("groups_prepared", rank=3, generation=1, build_s=0.1, rebuilt=1, kept=2,
               time=T0 + 1.5)
    job.poll()
    assert job.commands() == [{"op": "notice", "generation": 0, "kind": "switch"}]
    for rank in range(4):
        job.worker("boundary", rank=rank, generation=0, iteration=7, step_s=1.0, migration=1,
                   time=T0 + 2.0 + rank * 0.1)
        job.poll()
        assert job.key(switch_decision_key(1)) == (None if rank < 3 else "go")
    assert job.key(successor_key(0)) == "1"
    assert job.log("switch_committed")[0]["ranks"] == [1]
    job.worker("left", rank=1, generation=0, migration=1, handover_s=0.2, transfer_s=0.1,
               time=T0 + 2.5)
    job.generation = 1
    job.all_ranks("switched", when=T0 + 2.6)
    job.poll()
    assert job.key(request_done_key("m1")) is None
    job.first_steps(when=T0 + 3.4)
    job.poll()
    # The slot the migration freed is on the leaver's host, which may be drained: no refill.
    assert [c for c in job.commands() if c["op"] == "refill"] == []
    assert job.controller.summary.refills == []
    done = job.json(request_done_key("m1"))
    # first step after (T0 + 3.43) - the last boundary (T0 + 2.3) - its step (1.0)
    assert done == {"ok": True, "generation": 1, "downtime_s": pytest.approx(0.13)}
    (item,) = job.controller.summary.to_dict()["interruptions"]
    assert item["kind"] == "migration" and item["step"] == 7 and item["recovery"] == "standby"
    assert list(item["phases_s"]) == ["requested", "prepared", "boundary", "handed_over",
                                      "switched", "first_step_completed"]
    assert [r["rank"] for r in job.log("handed_over")] == [1]
    assert len(job.log("migration_done")) == 1
    status = job.request("status", "s2")
    assert status["migrations"] == [] and status["generation"] == 1
    assert status["membership"]["1"] == {"process": "a0.n1.s0", "node": 1}
    # The joiner's slot holds a worker now and the leaver's is not refilled: the target of
    # the pool counts one standby fewer, and the pool is at it.
    assert status["standby_target"] == 1 and list(status["standbys"]) == ["a0.n0.s0"]


def test_a_migration_whose_joiner_is_lost_in_phase_1_is_cancelled(job):
    _migrate_rank_1(job)
    job.commands()
    job.exit(1, standby="a0.n1.s0")
    assert job.poll() is None
    assert job.key(switch_decision_key(1)) == "cancel"
    assert job.key(CURRENT_GENERATION_KEY) == "0"
    assert job.commands() == [
        {"op": "cancel_promotion", "standby": "a0.n1.s0", "rank": 1},
        {"op": "generation", "generation": 0},
    ]
    done = job.json(request_done_key("m1"))
    assert done["ok"] is False and done["generation"] == 0
    assert done["error"] == ("cancelled: the joiner of rank 1 was lost in phase 1 "
                             "(signal SIGKILL)")
    (lost,) = job.log("joiner_lost")
    assert lost["rank"] == 1 and lost["generation"] == 0
    assert job.log("worker_failed") == []  # the rank itself runs on in generation 0
    status = job.request("status", "s1")
    assert status["generation"] == 0 and status["migrations"] == []
    assert status["membership"]["1"] == {"process": "a0.r1", "node": 0}
    # The generation the migration planned is skipped: the next one is 2.
    job.exit(3)
    job.poll()
    assert job.key(successor_key(0)) == "2" and job.json(plan_key(2))["replacements"][0][
        "rank"] == 3


def test_a_staying_rank_lost_before_the_commit_cancels_and_is_recovered(job):
    _migrate_rank_1(job)
    job.commands()
    job.exit(2)
    job.poll()
    assert job.key(switch_decision_key(1)) == "cancel"
    done = job.json(request_done_key("m1"))
    assert done["error"] == "cancelled: rank 2 was lost in phase 1 (signal SIGKILL)"
    commands = job.commands()
    assert commands[0] == {"op": "cancel_promotion", "standby": "a0.n1.s0", "rank": 1}
    assert {"op": "notice", "generation": 0, "kind": "alarm", "reason": "rank 2 lost"} in commands
    # the migration's standby was stopped with its joiner: the other one (node 0) takes rank 2
    assert job.json(plan_key(2))["replacements"] == [
        {"rank": 2, "standby": "a0.n0.s0", "twin": 0, "node": 0}]
    kinds = [i.kind for i in job.controller.summary.interruptions]
    assert kinds == ["migration", "failure"]


@pytest.mark.parametrize("settings, fields, reason", [
    ({}, {"ranks": [9]}, "rank 9 does not exist; this job has ranks 0..3"),
    ({}, {"ranks": []}, "name the ranks to move, or a host"),
    ({}, {"host": "host7"}, "host 'host7' is not one host of this job; hosts: host0, host1"),
    ({"policy": "restart"}, {"ranks": [1]},
     "the job runs with --policy restart; migration needs --policy resilient (and "
     "--resilient in the script)"),
])
def test_a_migration_request_is_rejected_with_its_reason(tmp_path, settings, fields, reason):
    job = Job(tmp_path, **settings)
    job.provision()
    job.commands()
    assert job.request("migrate", "bad", **fields) == {"ok": False, "error": reason}
    (rejected,) = job.log("migration_rejected")
    assert rejected["request"] == "bad" and rejected["reason"] == reason
    assert job.commands() == []


def test_a_migration_request_waits_for_training_and_for_the_one_in_progress(job):
    reply = job.request("migrate", "early", ranks=[1])
    assert reply["error"] == "the job has not started training yet; retry in a moment"
    _migrate_rank_1(job)
    assert job.request("migrate", "same", ranks=[1])["error"] == (
        "rank(s) [1] are already being moved; wait until that migration is done")
    assert job.request("migrate", "other", ranks=[2])["error"] == (
        "a migration of rank(s) [1] is in progress; retry when it is done")
    assert job.request("launch", "x")["error"] == "unknown request 'launch'; valid: status, migrate"
    assert len(job.log("migration_rejected")) == 3  # an unknown request is not a migration's


def test_a_migration_needs_a_free_standby(tmp_path):
    job = Job(tmp_path, standbys=0)
    job.provision()
    reply = job.request("migrate", "m", ranks=[0, 1])
    assert reply["error"] == ("no free standby: 2 rank(s) to move but 0 standby(s) ready; start "
                              "the job with more --standbys or wait for one to be ready")


def test_status_describes_the_job(job):
    job.provision()
    status = job.request("status", "s")
    assert status["ok"] and status["policy"] == "resilient" and status["training"]
    assert status["generation"] == 0 and status["attempt"] == 0 and status["world_size"] == 4
    assert status["membership"]["3"] == {"process": "a0.r3", "node": 1}
    assert status["standbys"] == {"a0.n0.s0": 0, "a0.n1.s0": 1}
    assert status["migrations"] == []
    assert [r["event"] for r in status["recent_events"]][:2] == ["attempt_start",
                                                                 "standby_ready"]


def test_events_the_controller_cannot_act_on_are_rejected_and_counted(job):
    job.provision()
    job.commands()
    job.raw({"kind": "bogus", "attempt": 0, "time": T0})
    job.raw({"kind": "worker_exit", "attempt": 0, "time": T0, "node": 0, "returncode": -9,
             "how": "signal SIGKILL", "step_begun": 3})  # no rank
    job.raw({"kind": "failure", "attempt": 0, "time": T0, "node": 0, "rank": 1})
    job.raw({"kind": "request", "attempt": 0, "time": T0, "op": "migrate", "ranks": [1]})
    job.raw({"kind": "ready", "attempt": "0", "time": T0, "node": 0, "rank": 1, "step": 1})
    job.raw(["worker_exit"])
    assert job.poll() is None
    assert job.controller.summary.rejected_events == 6
    assert job.controller.summary.to_dict()["rejected_events"] == 6
    reasons = [r["reason"] for r in job.log("event_rejected")]
    assert reasons == [
        "unknown event kind 'bogus'",
        "worker_exit event without its field 'rank'",
        "unknown event kind 'failure'",
        "unknown event kind 'request'",
        "ready event: field 'attempt' is str, expected int",
        "an event must be a JSON object, got list",
    ]
    assert job.commands() == [] and job.controller.summary.interruptions == []
    assert job.log("worker_ready") == []


def test_events_of_an_earlier_attempt_are_ignored(job):
    job.provision()
    job.commands()
    job.agent(0, "worker_exit", attempt=-1, rank=1, returncode=-9, how="signal SIGKILL",
              step_begun=2)
    job.agent(1, "node_done", attempt=-1, steps_completed=3, workers=[])
    job.agent(0, "node_done", attempt=-1, steps_completed=3, workers=[])
    assert job.poll() is None
    assert job.commands() == [] and job.controller.summary.interruptions == []
    assert job.controller.summary.rejected_events == 0


def test_an_injected_migration_waits_for_the_recovery_in_progress(job):
    job.provision()
    job.exit(1)
    job.agent(1, "migration_due", rank=3, step=5, fault=None)
    job.poll()
    assert job.key(request_reply_key("injected-r3-s5")) is None
    job.generation = 1
    job.all_ranks("switched", when=T0 + 7.0)
    job.first_steps(when=T0 + 8.0)
    job.poll()
    reply = job.json(request_reply_key("injected-r3-s5"))
    assert reply["ok"] is True and reply["ranks"] == [3] and reply["generation"] == 2
    (plan,) = job.json(plan_key(2))["replacements"]
    assert plan["rank"] == 3 and plan["standby"] == "a0.n0.s0"


def test_a_slow_rank_is_migrated(tmp_path):
    job = Job(tmp_path, slow_rank_factor=2.0, slow_rank_steps=2)
    job.provision()
    job.commands()
    for step in (3, 4):
        job.agent(0, "busy", step=step, ranks={"0": 0.1, "1": 0.1})
        job.agent(1, "busy", step=step, ranks={"2": 0.1, "3": 0.5})
        job.poll()
    (slow,) = job.log("slow_rank")
    assert slow["rank"] == 3 and slow["step"] == 4 and slow["factor"] == 2.0
    reply = job.json(request_reply_key("slow-rank-3-4"))
    assert reply is None  # the controller's own request gets no reply key ...
    assert job.json(plan_key(1))["replacements"][0]["rank"] == 3  # ... but it is carried out
    assert {"op": "notice", "generation": 0, "kind": "prepare", "next": 1} in job.commands()


def _commit_migration_of_rank_1(job: Job) -> None:
    _migrate_rank_1(job)
    job.worker("prepared", rank=1, generation=1)
    for rank in (0, 2, 3):
        job.worker("groups_prepared", rank=rank, generation=1, build_s=0.1, rebuilt=1, kept=2)
    for rank in range(4):
        job.worker("boundary", rank=rank, generation=0, iteration=7, step_s=1.0, migration=1)
    job.poll()
    assert job.key(switch_decision_key(1)) == "go"
    job.commands()


def test_a_leaver_lost_after_the_commit_abandons_the_migration(job):
    _commit_migration_of_rank_1(job)
    job.exit(1, kind="leaver_exit")
    job.poll()
    commands = job.commands()
    assert commands[:2] == [{"op": "discard_leaver", "rank": 1},
                            {"op": "cancel_promotion", "standby": "a0.n1.s0", "rank": 1}]
    done = job.json(request_done_key("m1"))
    assert done["ok"] is False and done["error"].startswith(
        "abandoned: the leaver of rank 1 was lost before the hand-over (signal SIGKILL)")
    assert job.key(successor_key(1)) == "2"
    assert job.json(plan_key(2))["replacements"] == [
        {"rank": 1, "standby": "a0.n0.s0", "twin": 0, "node": 0}]
    (failed,) = job.log("worker_failed")
    assert failed["rank"] == 1 and failed["leaver"] is True


def test_a_staying_rank_lost_after_the_commit_is_recovered_once_handed_over(job):
    _commit_migration_of_rank_1(job)
    job.exit(3)
    job.poll()
    assert job.commands() == [] and job.key(plan_key(2)) is None
    (deferred,) = job.log("failure_deferred")
    assert deferred["rank"] == 3
    job.worker("left", rank=1, generation=0, migration=1)
    job.poll()
    assert job.json(request_done_key("m1"))["ok"] is True
    assert job.json(plan_key(2))["replacements"][0]["rank"] == 3
    assert job.commands()[0] == {"op": "notice", "generation": 1, "kind": "alarm",
                                 "reason": "rank 3 lost"}
    assert [i.kind for i in job.controller.summary.interruptions] == ["migration", "failure"]


def test_a_rank_finishing_training_before_the_switch_cancels_the_migration(job):
    _migrate_rank_1(job)
    job.exit(2, returncode=0, how="exit code 0")
    job.poll()
    done = job.json(request_done_key("m1"))
    assert done["error"] == "cancelled: rank 2 finished training before the switch"
    assert job.controller.summary.interruptions == []  # nothing was interrupted
    assert job.log("worker_failed") == []


def test_the_job_ending_during_a_migration_fails_its_request(job):
    _migrate_rank_1(job)
    job.commands()
    job.controller.finish(0)
    assert job.commands() == [{"op": "finish"}]
    done = job.json(request_done_key("m1"))
    assert done == {"ok": False, "generation": 1,
                    "error": "the job ended before the migration completed"}
    assert [r["event"] for r in job.log()[-2:]] == ["migration_failed", "job_end"]


class _Claims(Unit):
    def __init__(self, *kinds: str, any_attempt: frozenset[str] = frozenset()) -> None:
        self._kinds = kinds
        self.ANY_ATTEMPT = any_attempt

    def handlers(self):
        return {kind: (lambda event: None) for kind in self._kinds}


def test_the_handler_table_covers_every_event_kind_once(job):
    assert set(job.controller.handlers) == set(EVENTS)


def test_the_handler_table_refuses_a_kind_claimed_twice_or_unknown_to_the_contract():
    table, any_attempt = handler_table([_Claims("ready"), _Claims("left", any_attempt=
                                                                  frozenset({"left"}))])
    assert set(table) == {"ready", "left"} and any_attempt == {"left"}
    with pytest.raises(ValueError, match="'ready' is claimed by _Claims and _Claims"):
        handler_table([_Claims("ready"), _Claims("ready")])
    with pytest.raises(ValueError, match="'failure', which is no event kind of the contract"):
        handler_table([_Claims("failure")])
    with pytest.raises(ValueError, match="of any attempt without handling them"):
        handler_table([_Claims("ready", any_attempt=frozenset({"injected"}))])


# -- a host lost with its agent --------------------------------------------------------------

SPARE_HOSTS = (NodeSpec(0, "host0", 2, 0), NodeSpec(1, "host1", 2, 2),
               NodeSpec(2, "host2", 0, 4, spare_slots=2))
"""Two worker hosts of 2 ranks and a spare host of 2 slots."""


@pytest.fixture
def agent_process():
    """A real process standing for the agent of a host this controller started; the test
    kills it as a lost host's agent dies."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                               start_new_session=True)
    yield process
    process.kill()
    process.wait()


def _spare_job(tmp_path, agent: Optional[subprocess.Popen], **settings) -> Job:
    """TP2 x DP2 on hosts 0 and 1, the spare host's two standbys ready, training; ``agent``
    stands for host 1's agent started by this controller (None: every host starts its own
    mover-launch)."""
    job = Job(tmp_path, standbys=0, nodes=SPARE_HOSTS,
              local_agents=None if agent is None else {1: agent}, **settings)
    for index in (0, 1):
        job.agent(2, "standby_ready", standby=f"a0.n2.s{index}")
    job.store.set(LAYOUT_KEY, json.dumps({"tp": 2, "pp": 1, "dp": 2}))
    assert job.poll() is None
    job.commands()
    return job


def _kill(process: subprocess.Popen) -> None:
    process.kill()
    process.wait()


def test_a_lost_hosts_ranks_go_together_to_the_spare_host_in_one_generation(tmp_path,
                                                                          agent_process):
    job = _spare_job(tmp_path, agent_process)
    job.agent(0, "steps", steps=[[4, T0 + 4.0, 1.0], [5, T0 + 5.0, 1.0]])
    job.poll()
    _kill(agent_process)
    assert job.poll() is None
    commands = job.commands()
    assert commands[0] == {"op": "fence", "node": 1}
    assert commands[1]["op"] == "notice" and commands[1]["kind"] == "alarm"
    assert commands[2:] == [
        {"op": "promote", "standby": "a0.n2.s0", "rank": 2, "migration": False},
        {"op": "promote", "standby": "a0.n2.s1", "rank": 3, "migration": False},
        {"op": "generation", "generation": 1}]
    assert job.json(plan_key(1))["replacements"] == [
        {"rank": 2, "standby": "a0.n2.s0", "twin": 0, "node": 2},
        {"rank": 3, "standby": "a0.n2.s1", "twin": 1, "node": 2}]
    (lost,) = job.log("host_lost")
    assert lost["node"] == 1 and lost["host"] == "host1" and lost["ranks"] == [2, 3]
    assert lost["how"] == "its agent exited (signal SIGKILL)"
    (item,) = job.controller.summary.interruptions
    assert item.kind == "host_loss" and item.ranks == [2, 3] and item.step == 6
    assert item.recovery == "standby" and item.generation == 1
    # what the lost host's agent still says counts no more
    job.exit(2)
    job.agent(1, "node_done", steps_completed=10, workers=[])
    assert job.poll() is None and job.commands() == []
    # survivors left the failed step; rank 0's agent sends the steps it had read
    for rank in (0, 1):
        job.worker("left_step", rank=rank, generation=0, time=time.time() + 0.1)
    job.agent(0, "steps", steps=[[6, time.time() - 30.0, 1.0]])
    job.generation = 1
    job.all_ranks("switched", when=time.time() + 0.5)
    for rank in range(4):
        job.agent(0 if rank < 2 else 2, "first_step", rank=rank, step=7, time=time.time() + 1)
    job.poll()
    (item,) = job.controller.summary.to_dict()["interruptions"]
    assert item["ranks"] == [2, 3] and "left" in item["phases_s"]
    assert item["downtime_s"] == pytest.approx(30.0, abs=2.0)  # from the last step end, 6
    assert job.request("status", "s1")["lost_hosts"] == {"1": "host1"}
    # the job ends when the hosts left are done: node 1 is not waited for
    job.agent(2, "node_busy")
    for node in (0, 2):
        job.agent(node, "node_done", steps_completed=10, workers=[])
    assert job.poll() == 0


def _host_1_lost(tmp_path, agent_process) -> Job:
    """:func:`_spare_job` after host 1 was lost: its ranks train on the spare host's standbys
    in generation 1, whose first step is done."""
    job = _spare_job(tmp_path, agent_process)
    _kill(agent_process)
    job.poll()
    job.commands()
    job.generation = 1
    job.all_ranks("switched", when=time.time())
    for rank in range(4):
        job.agent(0 if rank < 2 else 2, "first_step", rank=rank, step=7, time=time.time())
    job.agent(2, "node_busy")
    job.poll()
    return job


def _fail_rank_2_on_the_spare_host(job: Job) -> list[dict]:
    """Rank 2's process, a promoted standby of the spare host, exits; the promotions."""
    job.agent(2, "worker_exit", rank=2, returncode=-9, how="signal SIGKILL", step_begun=9,
              step_completed=8, standby="a0.n2.s0", last_step_end=time.time(),
              last_step_duration=0.2)
    assert job.poll() is None
    return [c for c in job.commands() if c["op"] == "promote"]


def test_a_lost_host_whose_agent_comes_back_is_a_spare_host_used_by_the_next_failure(
        tmp_path, agent_process):
    job = _host_1_lost(tmp_path, agent_process)
    # a second agent of a host in the job is refused
    job.agent(0, "joined", attempt=-1, host="host0", nproc=2, pid=300)
    job.poll()
    assert job.commands() == [] and len(job.log("join_refused")) == 1
    # host 1's agent started again joins the running job: a spare host now
    job.agent(1, "joined", attempt=-1, host="host1", nproc=2, pid=301)
    job.poll()
    (rejoin,) = job.commands()
    assert rejoin["op"] == "rejoin" and rejoin["node"] == 1 and rejoin["attempt"] == 0
    assert rejoin["generation"] == 1 and rejoin["standbys"] == ["a0.n1.j0", "a0.n1.j1"]
    status = job.request("status", "s1")
    # the target: the two of the host back (the spare host's two slots hold its ranks now)
    assert status["lost_hosts"] == {} and status["standby_target"] == 2
    (joined,) = job.log("host_joined")
    assert joined["node"] == 1 and joined["standbys"] == ["a0.n1.j0", "a0.n1.j1"]
    job.agent(1, "node_done", steps_completed=None, workers=[])
    for standby in rejoin["standbys"]:
        job.agent(1, "standby_ready", standby=standby)
    job.poll()
    # the next failure, a rank now on the spare host, takes a standby of the host that came back
    assert _fail_rank_2_on_the_spare_host(job) == [
        {"op": "promote", "standby": "a0.n1.j0", "rank": 2, "migration": False}]


def test_a_host_that_asks_to_join_is_admitted_as_a_spare_host_used_by_the_next_failure(
        tmp_path, agent_process):
    """mover-launch --join: a host not in the hostfile gets the next node; one named like the
    lost host, with its slots, gets that node back; their agents join as spare hosts'."""
    job = _host_1_lost(tmp_path, agent_process)
    job.worker("join_request", attempt=-1, host="host9", slots=1, pid=400, token="t9")
    job.worker("join_request", attempt=-1, host="host1", slots=2, pid=401, token="t1")
    job.poll()
    new, back = job.commands()
    assert new["op"] == back["op"] == "admit" and (new["token"], back["token"]) == ("t9", "t1")
    assert new["node"] == {"node_rank": 3, "host": "host9", "nproc": 0, "first_rank": 4,
                           "spare_slots": 1, "devices": []}
    assert back["node"] == {"node_rank": 1, "host": "host1", "nproc": 2, "first_rank": 2,
                            "spare_slots": 0, "devices": []}
    assert new["world_size"] == 4 and new["command"] == list(job.config.worker_command)
    assert (new["standbys"], back["standbys"]) == (1, 0)  # one per slot; host 1's --standbys
    assert [e["node"] for e in job.log("host_admitted")] == [3, 1]
    job.agent(3, "joined", attempt=-1, host="host9", nproc=0, pid=400)
    job.poll()
    (rejoin,) = job.commands()
    assert rejoin["op"] == "rejoin" and rejoin["node"] == 3 and rejoin["standbys"] == ["a0.n3.j0"]
    job.agent(3, "node_done", steps_completed=None, workers=[])
    job.agent(3, "standby_ready", standby="a0.n3.j0")
    job.poll()
    # the target: host 9's one (the spare host's two slots hold host 1's ranks now)
    assert job.request("status", "s1")["standby_target"] == 1
    assert _fail_rank_2_on_the_spare_host(job) == [
        {"op": "promote", "standby": "a0.n3.j0", "rank": 2, "migration": False}]


def test_a_restart_policy_job_refuses_a_host_that_asks_to_join(tmp_path):
    job = Job(tmp_path, policy="restart", standbys=0)
    job.commands()
    job.worker("join_request", attempt=-1, host="host9", slots=2, pid=400, token="t9")
    assert job.poll() is None
    (refused,) = job.commands()
    assert refused["op"] == "join_refused" and refused["token"] == "t9"
    assert "--policy restart" in refused["reason"]
    assert len(job.log("join_refused")) == 1 and len(job.config.nodes) == 2


def test_a_silent_agent_loses_its_host_after_the_agent_timeout(tmp_path, agent_process):
    job = _spare_job(tmp_path, agent_process, agent_timeout_s=0.5)
    deadline = time.monotonic() + 30
    while not job.log("host_lost") and time.monotonic() < deadline:
        job.store.add("agent/0/beat", 1)
        job.store.add("agent/2/beat", 1)
        job.poll()
        time.sleep(0.05)
    (lost,) = job.log("host_lost")
    assert lost["node"] == 1 and lost["how"].startswith("no heartbeat from its agent for ")
    assert agent_process.wait(timeout=10) == -signal.SIGKILL  # fenced: killed, being local
    assert [c["standby"] for c in job.commands() if c["op"] == "promote"] == [
        "a0.n2.s0", "a0.n2.s1"]


def test_a_lost_host_without_standbys_restarts_with_its_ranks_on_the_spare_host(
        tmp_path, agent_process):
    job = _spare_job(tmp_path, agent_process)
    job.agent(2, "standby_exit", standby="a0.n2.s0", returncode=-9, how="signal SIGKILL")
    job.poll()
    _kill(agent_process)
    job.poll()
    (fallback,) = job.log("fallback")
    assert fallback["reason"] == "2 rank(s) lost but 1 standby(s) ready"
    assert job.commands()[-1] == {"op": "stop", "attempt": 0}
    for node in (0, 2):
        job.agent(node, "stopped", workers=[])
    job.poll()
    (start,) = [c for c in job.commands() if c["op"] == "start"]
    # Node 0 runs its own ranks (not named: every host reads the command); the spare host
    # runs the lost host's.
    assert start["attempt"] == 1 and start["ranks"] == {"2": [2, 3]}
    assert job.request("status", "s1")["standby_target"] == 0
    assert {r: m["node"] for r, m in job.request("status", "s2")["membership"].items()} == {
        "0": 0, "1": 0, "2": 2, "3": 2}


def test_a_lost_host_whose_ranks_fit_nowhere_ends_the_job(tmp_path, agent_process):
    job = Job(tmp_path, policy="restart", standbys=0, local_agents={1: agent_process})
    job.provision()
    _kill(agent_process)
    assert job.poll() == 1
    (reason,) = job.log("job_unplaceable")
    assert "lost host(s) [1] fit on no spare host left" in reason["reason"]


# -- a host that leaves on purpose: its mover-launch stopped with SIGTERM --------------------

LEAVING = "its mover-launch got SIGTERM"
"""How a host's ``leaving`` event says it goes (``launch/departure.py``)."""


def _drain_host_1(job: Job) -> None:
    """``mover migrate --host host1``, through to training on the spare host's standbys."""
    reply = job.request("migrate", "drain", host="host1")
    assert reply["ranks"] == [2, 3] and reply["standbys"] == ["a0.n2.s0", "a0.n2.s1"]
    for rank in (2, 3):
        job.worker("prepared", rank=rank, generation=1, time=T0 + 1.0)
    for rank in (0, 1):
        job.worker("groups_prepared", rank=rank, generation=1, build_s=0.1, rebuilt=1, kept=1,
                   time=T0 + 1.1)
    job.poll()
    for rank in range(4):
        job.worker("boundary", rank=rank, generation=0, iteration=7, step_s=1.0, migration=1,
                   time=T0 + 2.0)
    job.poll()
    for rank in (2, 3):
        job.worker("left", rank=rank, generation=0, migration=1, time=T0 + 2.5)
    job.generation = 1
    job.all_ranks("switched", when=T0 + 2.6)
    job.agent(2, "node_busy")
    for rank in range(4):
        job.agent(0 if rank < 2 else 2, "first_step", rank=rank, step=8, time=T0 + 3.0)
    job.poll()
    assert job.json(request_done_key("drain"))["ok"] is True
    job.commands()


def test_a_host_whose_ranks_were_migrated_away_leaves_on_sigterm_with_no_recovery(tmp_path):
    """A drained pod's preStop hook moved its ranks, then its mover-launch got SIGTERM: the host
    leaves the job as planned (no fence, no alarm, no recovery, no restart) and the job ends
    without it."""
    job = _spare_job(tmp_path, None)
    _drain_host_1(job)
    job.agent(1, "node_done", steps_completed=None, workers=[])
    job.agent(1, "leaving", attempt=-1, host="host1", how=LEAVING)
    assert job.poll() is None
    assert job.commands() == []
    (left,) = job.log("host_left")
    assert (left["node"], left["host"], left["how"], left["standbys"]) == (
        1, "host1", LEAVING, [])
    for kind in ("host_lost", "worker_failed", "fallback", "restart"):
        assert job.log(kind) == [], kind
    assert [i.kind for i in job.controller.summary.interruptions] == ["migration"]
    status = job.request("status", "s1")
    assert status["left_hosts"] == {"1": "host1"} and status["lost_hosts"] == {}
    assert job.request("migrate", "again", host="host1")["error"] == (
        "host 'host1' holds no rank now (its ranks moved away, or it is a spare host): "
        "nothing to move")
    # what the host that left still says counts no more; the job ends without it
    job.agent(1, "leaving", attempt=-1, host="host1", how=LEAVING)
    for node in (0, 2):
        job.agent(node, "node_done", steps_completed=10, workers=[])
    assert job.poll() == 0
    assert len(job.log("host_left")) == 1 and job.controller.summary.restarts == 0


def test_a_host_stopped_while_it_holds_ranks_is_lost_at_once(tmp_path):
    """No hook moved its ranks: the host is lost when its mover-launch says it goes, without
    waiting for its heartbeat to stop, and its ranks go to the spare host's standbys."""
    job = _spare_job(tmp_path, None)
    job.agent(1, "leaving", attempt=-1, host="host1", how=LEAVING)
    assert job.poll() is None
    (lost,) = job.log("host_lost")
    assert lost["ranks"] == [2, 3]
    assert lost["how"] == f"{LEAVING} while it held rank(s) [2, 3]"
    assert [c["standby"] for c in job.commands() if c["op"] == "promote"] == [
        "a0.n2.s0", "a0.n2.s1"]
    assert job.log("host_left") == []
    (item,) = job.controller.summary.interruptions
    assert item.kind == "host_loss" and item.ranks == [2, 3]


def test_a_host_stopped_while_its_ranks_are_being_migrated_away_calls_the_migration_off(
        tmp_path):
    """The hook's time ran out in phase 1: the host's processes stop with it, its leavers
    among them. The migration is called off, its joiners stopped with it, and with no other
    standby the job restarts, placing the host's ranks on the spare host."""
    job = _spare_job(tmp_path, None)
    assert job.request("migrate", "drain", host="host1")["ok"]
    job.commands()
    job.agent(1, "leaving", attempt=-1, host="host1", how=LEAVING)
    job.poll()
    done = job.json(request_done_key("drain"))
    assert done["ok"] is False and done["error"].startswith("cancelled: the leaver of rank 2")
    (lost,) = job.log("host_lost")
    assert lost["node"] == 1 and lost["how"] == f"{LEAVING} while it held rank(s) [2, 3]"
    (failed,) = job.log("worker_failed")
    assert failed["rank"] == 2 and failed["leaver"] is True
    assert job.log("fallback")[0]["reason"] == "1 rank(s) lost but 0 standby(s) ready"
    assert [c["op"] for c in job.commands()] == [
        "fence", "cancel_promotion", "cancel_promotion", "generation", "stop"]
    assert job.log("host_left") == []
    for node in (0, 2):
        job.agent(node, "stopped", workers=[])
    job.poll()
    (start,) = [c for c in job.commands() if c["op"] == "start"]
    # Node 0 runs its own ranks (not named: every host reads the command); the spare host
    # runs the lost host's.
    assert start["attempt"] == 1 and start["ranks"] == {"2": [2, 3]}
