#!/usr/bin/env python
"""Benchmark: the control plane at 16 to 2,048 hosts — the real controller and gate, with
simulated agents and workers.

One process runs what ``mover-launch`` runs on a job's first host: the control store, the gate
(the job's one port) and the controller, with a job of N hosts of K ranks each (resilient
policy, one standby per host, agent timeout 2 s). Simulator processes play the N agents, many
per process: each speaks the real protocol with the real code — a host's relay
(:class:`~mover_plugin.launch.store_gate.StoreRelay`, one per simulator process), the agent's
heartbeat (:class:`~mover_plugin.launch.liveness.AgentBeat`), its command inbox
(:class:`~mover_plugin.launch.inbox.CommandInbox`), its events
(:class:`~mover_plugin.mailbox.Mailbox`) and global rank 0's batched step ends
(:class:`~mover_plugin.launch.step_times.StepBatch`, one step per second) — with three store
connections per agent, as an agent holds. Its workers are simulated only where they use the
store: rank 0 publishes the layout (TP = K, PP 4, DP the rest), and after a crash every rank
does its store work of the next generation's rendezvous: it reads the plan, agrees with the
members of each group it keeps that the group is idle
(:func:`mover_plugin.comm.delta.agree_on_idle`, with the cancel check installed, as a
worker's switch does) and, in each group that holds the lost rank, publishes its address and
reads its ring neighbours'. The workers of a simulator process share 8 connections (a real
worker has its own), so the switch's store work runs 8 ranks at a time per process.

Each run measures, in order:

* steady state (10 s after the job started): the store operations per second (every
  simulated agent's, and the controller's own), the gate's bytes per second, the CPU share
  of the controller's process (the controller, its store) and of the gate's process, and the
  resident memory of the two;
* a crash: a worker's exit (SIGKILL) reported as its agent reports it (from the driver's
  process: a real agent has its host to itself); *decision* is the time from the exit to the
  controller's plan (its ``promote`` record: the plan written, the alarm and the promotion
  posted); ``exit_read_ms``: to the controller's read of the exit; ``alarm_delivered_ms``:
  to the moment the lost rank's host (a simulated agent) receives the alarm;
* the switch: from the plan to the moment the last simulated rank finished its rendezvous
  store work;
* a host loss: one agent stops beating; ``host_loss_ms`` is the time from its last beat
  answered to the controller's plan for its ranks; ``host_loss_heard_ms`` to the moment
  another agent receives that plan's alarm.

It prints one line per size (the medians over ``--repeats`` runs)::

    SCALE hosts N ranks R decision_ms D switch_ms S steady_ops_per_s O controller_cpu_pct C \
gate_cpu_pct G rss_mb M

then ``SCALE_DETAIL`` lines with each run's figures (the host-loss decision among them) and
the ratios of the largest size to the smallest. The simulators share this machine's cores
with the controller and the gate: what they wait for (``alarm_delivered_ms``, the switch) is
an upper bound of what hosts of their own would see. Usage::

    python bench/control_plane_scale.py [--hosts 16 128 512 2048] [--ranks-per-host 8]
        [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import selectors
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from common import benchmark_parser  # noqa: E402

from mover_plugin.comm.cancel import cancel_when, wait_for_keys  # noqa: E402
from mover_plugin.comm.delta import post_idle, read_idle  # noqa: E402
from mover_plugin.contract import (  # noqa: E402
    ALARM,
    EVENTS_MAILBOX,
    LAYOUT_KEY,
    generation_prefix,
    plan_key,
    successor_key,
)
from mover_plugin.launch.config import LaunchConfig  # noqa: E402
from mover_plugin.launch.controller import Controller  # noqa: E402
from mover_plugin.launch.hosts import NodeSpec  # noqa: E402
from mover_plugin.launch.inbox import CommandInbox  # noqa: E402
from mover_plugin.launch.liveness import AgentBeat, beat_period  # noqa: E402
from mover_plugin.launch.step_times import StepBatch  # noqa: E402
from mover_plugin.launch.store_gate import (  # noqa: E402
    CONTROL_TARGET,
    LOOPBACK,
    StoreGate,
    StoreRelay,
    attempt_target,
    host_loopback_store,
    raise_open_file_limit,
)
from mover_plugin.layout import ParallelLayout  # noqa: E402
from mover_plugin.mailbox import Mailbox  # noqa: E402

PIPELINE = 4
STEADY_S = 10.0
SETTLE_S = 3.0
SAMPLE_S = 0.25
SWITCH_CONNECTIONS = 8
"""Store connections the simulated workers of one simulator process share."""
AGENTS_PER_PROCESS = 256
TIMEOUT = timedelta(seconds=600)
STEP_S = 1.0
AGENT_TIMEOUT_S = 2.0
"""``mover-launch``'s default."""


# -- counting what the store is asked ---------------------------------------------------------

class Tally:
    """A count of store calls, shared by threads."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()

    def add(self) -> None:
        with self._lock:
            self.count += 1


STORE_CALLS = Tally()
"""Every store call of this process (the agents', or the controller's)."""
SWITCH_CALLS = Tally()
"""The simulated workers' calls during a switch."""


class Counted:
    """A store whose calls are counted (one per operation, as the store serves them)."""

    def __init__(self, store: Any, *tallies: Tally) -> None:
        self._store = store
        self._tallies = (STORE_CALLS, *tallies)

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            for tally in self._tallies:
                tally.add()
            return method(*args, **kwargs)
        return counted


class BeatClock(Counted):
    """The heartbeat's store: remembers when its last beat was answered."""

    def __init__(self, store: Any) -> None:
        super().__init__(store)
        self.last_answered = 0.0

    def add(self, key: str, value: int) -> int:
        STORE_CALLS.add()
        result = self._store.add(key, value)
        self.last_answered = time.time()
        return result


def cpu_s(pid: int) -> float:
    """CPU seconds process ``pid`` used so far (its threads', user and system)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def sample_forever(path: Path, sample: Callable[[], dict[str, float]]) -> None:
    with path.open("a") as out:
        while True:
            out.write(json.dumps({"t": time.time(), **sample()}) + "\n")
            out.flush()
            time.sleep(SAMPLE_S)


# -- the controller's process ------------------------------------------------------------------

def serve_controller(args: argparse.Namespace) -> None:
    raise_open_file_limit()
    folder = Path(args.dir)
    store = host_loopback_store()
    gate = StoreGate(bytes.fromhex(args.secret), LOOPBACK, 0, {CONTROL_TARGET: store.port})
    nodes = tuple(NodeSpec(n, f"sim{n}", args.ranks_per_host, n * args.ranks_per_host)
                  for n in range(args.hosts))
    config = LaunchConfig(
        nodes=nodes, local_node_ranks=(), runs_controller=True, master_addr=LOOPBACK,
        master_port=gate.port, command=("python", "train.py"), policy="resilient",
        standbys=1, event_log_path=str(folder / "events.jsonl"), join_timeout_s=600.0,
        agent_timeout_s=AGENT_TIMEOUT_S, refill_delay_s=3600.0, preflight=False)
    controller = Controller(config, Counted(store), gate=gate)
    events, seen = controller._events, folder / "exits_seen"

    def poll_events() -> list[dict]:
        """The controller's read of its events, noting when it reads a worker's exit."""
        batch = Mailbox.poll(events)
        if any(event.get("kind") == "worker_exit" for event in batch):
            with seen.open("a") as out:
                out.write(f"{time.time()!r}\n")
        return batch
    events.poll = poll_events  # type: ignore[method-assign]

    def sample() -> dict[str, float]:
        return {"cpu": cpu_s(os.getpid()), "gate_cpu": cpu_s(gate.pid),
                "rss_mb": rss_mb(os.getpid()) + rss_mb(gate.pid), "ops": STORE_CALLS.count,
                "bytes": gate.bytes_forwarded}
    threading.Thread(target=sample_forever, args=(folder / "controller.samples", sample),
                     daemon=True).start()
    print(f"GATE_PORT {gate.port}", flush=True)
    controller.run()


# -- the simulated agents' process -------------------------------------------------------------

def group_members(layout: ParallelLayout, rank: int) -> dict[str, list[int]]:
    """The groups a rank belongs to besides the default one (which is not rebuilt)."""
    coords = layout.coordinates(rank)
    model = [layout.rank(t, coords.dp, p) for p in range(layout.pp) for t in range(layout.tp)]
    return {f"tp{layout.tensor_parallel_group(rank)[0]}": layout.tensor_parallel_group(rank),
            f"dp{layout.data_parallel_group(rank)[0]}": layout.data_parallel_group(rank),
            f"pp{layout.pipeline_group(rank)[0]}": layout.pipeline_group(rank),
            f"mp{min(model)}": sorted(model)}


class Simulation:
    """The agents of hosts ``first .. first + count - 1`` and their workers' store work."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.secret = bytes.fromhex(args.secret)
        self.relay = StoreRelay(self.secret, LOOPBACK, args.gate_port)
        self.layout = ParallelLayout.for_world(args.hosts * args.ranks_per_host,
                                               args.ranks_per_host, PIPELINE)
        self.lock = threading.Lock()
        self.attempt = 0
        self.agents = [SimAgent(self, node) for node in
                       range(args.first, args.first + args.count)]
        self.lost: Optional[int] = None
        """The rank whose crash the driver announced (every process's ranks then switch)."""
        self.switched = False
        self.watching = False
        """A host was silenced: the first alarm or stop heard here is reported."""
        self.started = 0
        self.local = threading.local()
        self._cancel = ExitStack()
        self._cancel.enter_context(cancel_when(self._superseded))

    def _superseded(self) -> Optional[str]:
        """The cancel check a worker's switch installs: the generation it builds was
        superseded (asked of the store, as a worker asks it)."""
        generation = getattr(self.local, "generation", None)
        stores = getattr(self.local, "stores", None)
        if generation is None or stores is None:
            return None
        if stores[0].check([successor_key(generation)]):  # the control store
            return f"generation {generation} was superseded"
        return None

    def started_one(self) -> None:
        with self.lock:
            self.started += 1
            if self.started == len(self.agents):
                self.report(kind="started", time=time.time())

    def connect(self, target: int = CONTROL_TARGET,
                timeout_s: float = TIMEOUT.total_seconds()) -> dist.Store:
        return self.relay.client(target, timeout_s)

    def run(self) -> None:
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda agent: agent.join(), self.agents))
        threading.Thread(target=self._obey_driver, daemon=True).start()
        threading.Thread(target=sample_forever, args=(
            Path(self.args.dir) / f"agents{self.args.index}.samples",
            lambda: {"ops": STORE_CALLS.count}), daemon=True).start()
        selector = selectors.DefaultSelector()
        for agent in self.agents:
            selector.register(agent.inbox.fileno, selectors.EVENT_READ, agent)
        while True:
            for key, _ in selector.select(0.05):
                for command in key.data.inbox.take():
                    key.data.obey(command)
            for agent in self.agents:
                agent.tick()

    def _obey_driver(self) -> None:
        by_node = {agent.node: agent for agent in self.agents}
        for line in sys.stdin:
            word, node, *rest = line.split()
            agent = by_node.get(int(node))
            if word == "crash":
                self.lost = int(rest[0])
                if agent is not None:
                    agent.crash(int(rest[0]))
            elif word == "silence":
                self.watching = True
                if agent is not None:
                    agent.silence()
        os._exit(0)

    def report(self, **fields: Any) -> None:
        print(json.dumps(fields), flush=True)

    def alarmed(self, generation: int, op: str) -> None:
        """A command that reacts to a loss reached an agent here (first one only)."""
        with self.lock:
            crash = self.lost is not None and not self.switched and op == "notice"
            watched = self.watching and op != "fence"  # the recovery's plan, not the fence
            self.watching = self.watching and not watched
            self.switched = self.switched or crash
        if watched:
            self.report(kind="reaction", op=op, time=time.time())
        if crash:
            assert self.lost is not None
            threading.Thread(target=self.switch, args=(generation + 1, self.lost, None),
                             daemon=True).start()

    def switch(self, generation: int, lost: int, joiner: Optional[int]) -> None:
        """Every rank here (or the joiner alone) does its store work of the rendezvous of
        ``generation`` after ``lost``'s crash; reports when the last one is done. A worker
        posts its keys, then waits for its peers'; the simulated ones of this process take
        turns on a few connections, so all of them post before any waits."""
        ranks = [joiner] if joiner is not None else [
            rank for agent in self.agents for rank in agent.ranks if rank != lost]
        before = SWITCH_CALLS.count
        with ThreadPoolExecutor(SWITCH_CONNECTIONS) as pool:
            for half in (self._post_half, self._wait_half):
                list(pool.map(lambda rank: half(generation, lost, rank), ranks))
        self.report(kind="switch_done", time=time.time(), ranks=len(ranks),
                    ops=SWITCH_CALLS.count - before)

    def _stores(self, generation: int) -> tuple[Any, Any]:
        """This thread's connections: the control store's, the generation's namespace."""
        if getattr(self.local, "generation", None) != generation:
            self.local.generation = generation
            self.local.stores = (Counted(self.connect(), SWITCH_CALLS), Counted(dist.PrefixStore(
                generation_prefix(generation), self.connect(attempt_target(self.attempt))),
                SWITCH_CALLS))
        return self.local.stores

    def _groups(self, lost: int, rank: int) -> tuple[dict, dict]:
        """The groups of ``rank`` it keeps (idle here) and those it rebuilds."""
        groups = group_members(self.layout, rank)
        kept = {name: (True, members) for name, members in groups.items()
                if lost not in members and rank != lost}
        return kept, {name: members for name, members in groups.items() if lost in members}

    def _post_half(self, generation: int, lost: int, rank: int) -> None:
        control, store = self._stores(generation)
        control.wait([plan_key(generation)], TIMEOUT)
        control.get(plan_key(generation))
        kept, rebuilt = self._groups(lost, rank)
        post_idle(store, kept)
        for name in rebuilt:
            store.set(f"{name}/addr/{rank}", f"{LOOPBACK}:{rank}")

    def _wait_half(self, generation: int, lost: int, rank: int) -> None:
        _, store = self._stores(generation)
        kept, rebuilt = self._groups(lost, rank)
        read_idle(store, kept, timeout=TIMEOUT)
        for name, members in rebuilt.items():
            index = members.index(rank)
            neighbours = {members[(index - 1) % len(members)],
                          members[(index + 1) % len(members)]} - {rank}
            keys = [f"{name}/addr/{member}" for member in sorted(neighbours)]
            if keys:
                wait_for_keys(store, keys, TIMEOUT)
                store.multi_get(keys)


class SimAgent:
    """One simulated host's agent."""

    def __init__(self, sim: Simulation, node: int) -> None:
        self.sim = sim
        self.node = node
        per_host = sim.args.ranks_per_host
        self.ranks = list(range(node * per_host, (node + 1) * per_host))
        self.generation = 0
        self.store: Any = None
        self.events: Optional[Mailbox] = None
        self.beat_clock: Optional[BeatClock] = None
        self.beat: Optional[AgentBeat] = None
        self.inbox = CommandInbox(lambda timeout_s: Counted(sim.connect(timeout_s=timeout_s)))
        self.steps = StepBatch(self._post)
        self.step = 0
        self.next_step = 0.0
        self.crashed = False
        self.standby = ""

    def join(self) -> None:
        self.store = Counted(self.sim.connect())
        self.events = Mailbox(self.store, EVENTS_MAILBOX)
        self.beat = AgentBeat(self._beat_store, self.node, unreachable_after_s=3600.0,
                              on_unreachable=lambda _: None,
                              period_s=beat_period(AGENT_TIMEOUT_S))
        self.beat.start()
        self.inbox.start()
        self._post("joined", host=f"sim{self.node}", nproc=len(self.ranks), pid=os.getpid())

    def _beat_store(self) -> Any:
        self.beat_clock = BeatClock(self.sim.connect())
        return self.beat_clock

    def _post(self, kind: str, **fields: Any) -> None:
        fields.setdefault("time", time.time())
        assert self.events is not None
        self.events.post({"kind": kind, "node": self.node, "attempt": self.sim.attempt,
                          "generation": self.generation, **fields})

    def tick(self) -> None:
        """Global rank 0's steps, one per :data:`STEP_S`, batched as an agent does."""
        if 0 not in self.ranks or self.next_step == 0.0 or time.monotonic() < self.next_step:
            return
        self.next_step += STEP_S
        self.step += 1
        self.steps.add(0, self.step, time.time(), STEP_S)
        self.steps.post_if_due()

    def obey(self, command: dict[str, Any]) -> None:
        op = command["op"]
        if op == "start":
            self._start(command)
        elif op == "notice" and command["kind"] == ALARM:
            self._alarmed(command)
        elif op in ("stop", "fence"):
            self.sim.alarmed(self.generation, op)
        elif op == "promote" and command["standby"] == self.standby:
            self.ranks.append(command["rank"])
            threading.Thread(target=self.sim.switch, args=(
                self.generation + 1, command["rank"], command["rank"]), daemon=True).start()
        elif op == "generation":
            self.generation = command["generation"]

    def _start(self, command: dict[str, Any]) -> None:
        self.sim.attempt = command["attempt"]
        self.generation = command["generation"]
        if 0 in self.ranks:
            self.store.set(LAYOUT_KEY, json.dumps(self.sim.layout.record()))
            self.next_step = time.monotonic() + STEP_S
        self._post("started", pids={str(rank): 0 for rank in self.ranks})
        self.standby = f"a{self.sim.attempt}.n{self.node}.s0"
        self._post("standby_ready", standby=self.standby)
        for rank in self.ranks:
            self._post("ready", rank=rank, step=0)
        for rank in self.ranks:
            self._post("first_step", rank=rank, step=1, duration=STEP_S)
        self.sim.started_one()

    def crash(self, rank: int) -> None:
        """A worker of this host is killed (the driver posts its exit as this agent would,
        from a process of its own)."""
        self.ranks.remove(rank)
        self.crashed = True

    def silence(self) -> None:
        """The host falls silent: its heartbeat stops (its machine is gone)."""
        assert self.beat is not None and self.beat_clock is not None
        self.beat.stop()
        self.beat.join(5.0)
        self.sim.report(kind="silenced", node=self.node, last_beat=self.beat_clock.last_answered)

    def _alarmed(self, command: dict[str, Any]) -> None:
        if self.crashed:
            self.crashed = False
            self.sim.report(kind="crash_alarm", time=time.time())
        self.sim.alarmed(command["generation"], "notice")


def simulate_agents(args: argparse.Namespace) -> None:
    raise_open_file_limit()
    Simulation(args).run()


# -- the driver ----------------------------------------------------------------------------------

class Run:
    """One job of ``hosts`` simulated hosts against a real controller."""

    def __init__(self, hosts: int, per_host: int, folder: Path) -> None:
        self.hosts, self.per_host, self.folder = hosts, per_host, folder
        self.secret = secrets.token_hex(16)
        self.reports: list[tuple[int, dict[str, Any]]] = []
        self.cond = threading.Condition()
        self.processes: list[subprocess.Popen] = []

    def _spawn(self, role: str, *extra: str, stdin: bool = False) -> subprocess.Popen:
        name = role if role == "controller" else f"{role}{len(self.processes)}"
        process = subprocess.Popen(
            [sys.executable, __file__, "--role", role, "--hosts", str(self.hosts),
             "--ranks-per-host", str(self.per_host), "--dir", str(self.folder),
             "--secret", self.secret, *extra],
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=(self.folder / f"{name}.err").open("w"), text=True)
        self.processes.append(process)
        return process

    def _read(self, index: int, process: subprocess.Popen) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            if line.startswith("{"):
                with self.cond:
                    self.reports.append((index, json.loads(line)))
                    self.cond.notify_all()

    def _wait_for(self, kind: str, count: int, timeout_s: float) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while True:
                found = [r for _, r in self.reports if r["kind"] == kind]
                if len(found) >= count:
                    return found
                left = deadline - time.monotonic()
                if left <= 0 or any(p.poll() is not None for p in self.processes):
                    raise RuntimeError(f"{self.hosts} hosts: {len(found)} of {count} "
                                       f"{kind!r} reports (see {self.folder})")
                self.cond.wait(min(left, 1.0))

    def _progress(self, what: str) -> None:
        print(f"[{self.hosts} hosts] {what}", file=sys.stderr, flush=True)

    def _tell(self, line: str) -> None:
        for process in self.processes[1:]:
            assert process.stdin is not None
            process.stdin.write(line + "\n")
            process.stdin.flush()

    def measure(self) -> dict[str, float]:
        controller = self._spawn("controller")
        assert controller.stdout is not None
        gate_port = controller.stdout.readline().split()[1]
        sims = range(0, self.hosts, AGENTS_PER_PROCESS)
        for index, first in enumerate(sims):
            count = min(AGENTS_PER_PROCESS, self.hosts - first)
            process = self._spawn("agents", "--gate-port", gate_port, "--first", str(first),
                                  "--count", str(count), "--index", str(index), stdin=True)
            threading.Thread(target=self._read, args=(index, process), daemon=True).start()
        self._wait_for("started", len(sims), 900)
        self._progress("the job runs; steady state")
        time.sleep(SETTLE_S)
        steady = (time.time(), time.time() + STEADY_S)
        time.sleep(STEADY_S + SAMPLE_S * 2)
        victim = self.hosts // 2
        self._tell(f"crash {victim} {victim * self.per_host + 1}")
        time.sleep(SETTLE_S)  # every simulator knows the lost rank before the exit is posted
        exited = self._report_exit(int(gate_port), victim, victim * self.per_host + 1)
        heard = self._wait_for("crash_alarm", 1, 120)[0]["time"]
        self._progress(f"the crash's alarm reached its host in {(heard - exited) * 1e3:.1f} ms")
        done = self._wait_for("switch_done", len(sims) + 1, 300)
        self._progress("switched")
        time.sleep(SETTLE_S)
        self._tell(f"silence {self.hosts // 4}")
        silenced = self._wait_for("silenced", 1, 60)[0]
        reaction = min((r for r in self._wait_for("reaction", 1, 60)),
                       key=lambda r: r["time"])
        crash_plan, host_plan = self._plans()
        seen = float((self.folder / "exits_seen").read_text().split()[0])
        return {"decision_ms": (crash_plan[1] - crash_plan[0]) * 1e3,
                "exit_read_ms": (seen - crash_plan[0]) * 1e3,
                "alarm_delivered_ms": (heard - exited) * 1e3,
                "switch_ms": (max(r["time"] for r in done) - crash_plan[1]) * 1e3,
                "switch_ops_per_rank": sum(r["ops"] for r in done) / sum(r["ranks"] for r in done),
                "host_loss_ms": (host_plan - silenced["last_beat"]) * 1e3,
                "host_loss_heard_ms": (reaction["time"] - silenced["last_beat"]) * 1e3,
                **self._steady(*steady, len(sims))}

    def _report_exit(self, gate_port: int, node: int, rank: int) -> float:
        """Posts a SIGKILLed worker's exit as its host's agent does, from this process (a real
        agent has its host to itself: its report does not wait for the simulator's turn);
        returns the exit's time."""
        relay = StoreRelay(bytes.fromhex(self.secret), LOOPBACK, gate_port)
        events = Mailbox(relay.client(CONTROL_TARGET, 60), EVENTS_MAILBOX)
        exited = time.time()
        events.post({"kind": "worker_exit", "node": node, "attempt": 0, "generation": 0,
                     "time": exited, "returncode": -9, "how": "killed by SIGKILL",
                     "rank": rank, "standby": None, "step_begun": 2, "step_completed": 1,
                     "last_step_end": exited, "last_step_duration": STEP_S,
                     "median_step_s": STEP_S, "peak_rss_mb": None, "cpu_per_step_s": None})
        relay.close()
        return exited

    def _plans(self) -> tuple[tuple[float, float], float]:
        """From the controller's event log: the crash's exit and plan times, and the time of
        the host loss's plan (its first promotion)."""
        deadline = time.monotonic() + 30
        while True:
            records = [json.loads(line) for line in
                       (self.folder / "events.jsonl").read_text().splitlines()]
            failed = next(r for r in records if r["event"] == "worker_failed")
            lost = [r for r in records if r["event"] == "host_lost"]
            promotions = [r["time"] for r in records if r["event"] == "promote"]
            host_plan = [t for t in promotions if lost and t >= lost[0]["time"]]
            if any(r["event"] == "restart" for r in records):
                raise RuntimeError(f"the job restarted (see {self.folder})")
            if host_plan:
                crash_plan = min(t for t in promotions if t >= failed["time"])
                return (failed["time"], crash_plan), min(host_plan)
            if time.monotonic() > deadline:
                raise RuntimeError(f"no recovery of the lost host in {self.folder}")
            time.sleep(0.5)

    def _steady(self, start: float, end: float, sims: int) -> dict[str, float]:
        controller = _window(self.folder / "controller.samples", start, end)
        agents = [_window(self.folder / f"agents{i}.samples", start, end) for i in range(sims)]
        seconds = controller[1]["t"] - controller[0]["t"]

        def rate(samples: tuple[dict, dict], field: str) -> float:
            return (samples[1][field] - samples[0][field]) / seconds
        gate = rate(controller, "gate_cpu")
        return {"steady_ops_per_s": rate(controller, "ops") + sum(rate(a, "ops") for a in agents),
                "steady_bytes_per_s": rate(controller, "bytes"),
                "controller_cpu_pct": rate(controller, "cpu") * 100,
                "gate_cpu_pct": gate * 100, "rss_mb": controller[1]["rss_mb"]}

    def close(self) -> None:
        for process in self.processes[1:]:
            if process.stdin is not None:
                try:
                    process.stdin.close()
                except OSError:
                    pass
        self.processes[0].send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _window(path: Path, start: float, end: float) -> tuple[dict, dict]:
    """The samples nearest the window's ends."""
    samples = [json.loads(line) for line in path.read_text().splitlines() if line]
    first = min(samples, key=lambda s: abs(s["t"] - start))
    last = min(samples, key=lambda s: abs(s["t"] - end))
    return first, last


FIELDS = ("decision_ms", "switch_ms", "steady_ops_per_s", "controller_cpu_pct", "gate_cpu_pct",
          "rss_mb")


def main() -> None:
    parser = benchmark_parser(__doc__, repeats=2)
    parser.add_argument("--hosts", type=int, nargs="+", default=[16, 128, 512, 2048])
    parser.add_argument("--ranks-per-host", type=int, default=8)
    parser.add_argument("--role", choices=("driver", "controller", "agents"), default="driver",
                        help=argparse.SUPPRESS)
    for hidden in ("--dir", "--secret", "--gate-port"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    for hidden in ("--first", "--count", "--index"):
        parser.add_argument(hidden, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "controller":
        args.hosts = args.hosts[0]
        return serve_controller(args)
    if args.role == "agents":
        args.hosts, args.gate_port = args.hosts[0], int(args.gate_port)
        return simulate_agents(args)
    results: dict[int, list[dict[str, float]]] = {}
    for hosts in args.hosts:
        for repeat in range(args.repeats):
            folder = Path(tempfile.mkdtemp(prefix=f"scale{hosts}-"))
            run = Run(hosts, args.ranks_per_host, folder)
            try:
                result = run.measure()
            finally:
                run.close()
            results.setdefault(hosts, []).append(result)
            print("SCALE_DETAIL hosts", hosts, "run", repeat + 1, " ".join(
                f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                for k, v in result.items()), flush=True)
    for hosts, runs in results.items():
        medians = {field: statistics.median(r[field] for r in runs) for field in FIELDS}
        print(f"SCALE hosts {hosts} ranks {hosts * args.ranks_per_host} "
              + " ".join(f"{field} {medians[field]:.1f}" for field in FIELDS), flush=True)
    small, large = min(results), max(results)
    for field in ("decision_ms", "host_loss_ms"):
        ratio = (statistics.median(r[field] for r in results[large])
                 / statistics.median(r[field] for r in results[small]))
        print(f"SCALE_DETAIL {field} at {large} hosts / at {small} hosts: {ratio:.2f}x")


if __name__ == "__main__":
    main()
