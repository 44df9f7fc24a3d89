#!/usr/bin/env python
"""Chaos soak: one long resilient run of the Megatron-Core example on three hosts with N random
faults, on a refilling standby pool, that must end with the failure-free PARAMS_DIGEST.

The job runs on a hostfile of three hosts on this machine, each with its own ``mover-launch
--node-rank N`` (as ``srun`` would start them): 127.0.0.1 and 127.0.0.2 with two workers each and
one standby each (``--standbys 1``), 127.0.0.3 a spare host with two standbys;
``examples/pretrain_gpt.py --resilient`` (2 layers, a global batch of 4) at TP2·PP1·DP2 (a
tensor-parallel group on each worker host), ``--refill-delay-s 1``, a checkpoint every
``--save-interval`` steps (what a restart would fall back to). Before each fault the soak waits until the job trains, undisturbed, with its
standby pool full and every lost host back, then a random 0–2 s more, and picks one fault at
random among those the job can survive (one rank or host at a time, f = 1):

* ``sigkill-worker``, ``sigstop-worker``: a worker process (found by its id in ``mover status``'s
  membership) killed, or stopped so that it hangs until its heartbeats' timeout;
* ``sigkill-standby``, ``sigstop-standby``: an idle standby, which the pool replaces
  ``--refill-delay-s`` after its exit (a stopped one is killed by its agent once silent);
* ``sigkill-agent``, ``sigstop-agent``: the ``mover-launch`` of host 1 or 2 — the agent of that
  host; its workers and standbys die with a killed one, and a stopped one leaves them running
  cut off from the job's stores. The controller finds the host silent for ``--agent-timeout-s``
  and recovers its ranks on other hosts' standbys. Once training runs again the soak kills what
  is left of the host (a hung machine power-cycled) and starts its ``mover-launch`` again, which
  rejoins the job as a spare host. Host 0 carries the controller and is not faulted: losing it
  ends the job (mover_plugin has no standby controller);
* ``migration``: planned maintenance of host 1 or 2 — ``mover migrate --host H``
  (:class:`JobClient`) moves its ranks to another host's standbys while the job trains; then
  the host is serviced (its ``mover-launch`` killed, found lost, started again) and rejoins as a
  spare host. (``mover migrate --rank R`` is not in the mix: it frees a slot the pool does not
  refill, by design, so a long soak would run out of standbys.)
* ``two-close``: a worker SIGKILLed and, 0.05–0.5 s later, a worker that is not its
  data-parallel twin SIGKILLed or SIGSTOPped.

A fault counts as survived when the job trains again without a restart; a fallback to a restart
(with its reason from the event log) is counted, not hidden. Printed: each fault as it happens,
faults survived, recoveries by kind, the downtime distribution, every fallback with its reason,
and as the last line::

    CHAOS faults F survived S fallbacks B digest equal|differs

Usage::

    python bench/chaos.py --faults 50 [--seed 1] [--train-iters N]
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

sys.path.insert(0, str(Path(__file__).parent))
from jobs import (GPT_EXAMPLE, gpt_model_flags, mover_launch_command,  # noqa: E402
                  params_digest, read_events, read_summary, run_job)

from mover_plugin.contract import STANDBY_ID_ENV  # noqa: E402
from mover_plugin.errors import MoverError  # noqa: E402
from mover_plugin.launch.job_secret import JOB_SECRET_ENV  # noqa: E402
from mover_plugin.launch.jobctl import JobClient  # noqa: E402
from mover_plugin.testing import processes_with_env  # noqa: E402

TAG_ENV = "MOVER_CHAOS_TAG"
STEPS_PER_FAULT = 350
"""Steps of the job per fault: more than a fault's cycle (the fault, the recovery, the pool's
refill or a host's return) takes."""
READY_TIMEOUT_S = 240.0
"""How long the soak waits for the job to train again with its pool full."""
HOSTS = ("127.0.0.1 slots=2", "127.0.0.2 slots=2", "127.0.0.3 slots=2 spare")
FAULTED_NODES = (1, 2)
TWINS = {0: 2, 2: 0, 1: 3, 3: 1}
"""TP2·PP1·DP2: each rank's data-parallel twin, the peer that holds a copy of its state."""
FAULTS = ("sigkill-worker", "sigstop-worker", "sigkill-standby", "sigstop-standby",
          "sigkill-agent", "sigstop-agent", "migration", "two-close")


def main() -> None:
    args = _parser().parse_args()
    rng = random.Random(args.seed)
    folder = Path(args.folder or tempfile.mkdtemp(prefix="mover-chaos-"))
    train_iters = args.train_iters or STEPS_PER_FAULT * args.faults + 200
    model = [GPT_EXAMPLE, *gpt_model_flags(1, 2, train_iters), "--global-batch-size", "4",
             "--tensor-model-parallel-size", "2", "--resilient"]
    print(f"chaos soak: {args.faults} faults, {train_iters} steps, seed {args.seed}, "
          f"folder {folder}", flush=True)
    expected = args.expected_digest or _failure_free_digest(folder, model, args.end_timeout_s)
    run = folder / "chaos"
    run.mkdir(parents=True, exist_ok=True)
    checkpoints = ["--save", str(run / "ckpt"), "--load", str(run / "ckpt"),
                   "--save-interval", str(args.save_interval)]
    hosts = Hosts(run, [*model, *checkpoints], args.faults)
    faults: list[tuple[str, bool]] = []
    try:
        hosts.start()
        soak = Soak(JobClient("127.0.0.1", hosts.port), hosts, rng, args.kinds)
        while len(faults) < args.faults and soak.wait_until_ready():
            fault = soak.inject(len(faults) + 1)
            if fault is not None:
                faults.append(fault)
        hosts.wait(args.end_timeout_s)
    finally:
        hosts.stop()
    _report(run, faults, hosts.returncode, expected)


def _failure_free_digest(folder: Path, model: list[str], timeout_s: float) -> str:
    (folder / "reference").mkdir(parents=True, exist_ok=True)
    reference = run_job(mover_launch_command(folder / "reference", 4, "--policy", "resilient",
                                             event_log=False) + model,
                        "the failure-free run failed", timeout_s=timeout_s)
    expected = params_digest(reference.output)
    print(f"failure-free run: PARAMS_DIGEST {expected}", flush=True)
    return expected


class Hosts:
    """The job's three ``mover-launch`` processes, one per host, each with its own log."""

    def __init__(self, run: Path, script: list[str], faults: int) -> None:
        self.run = run
        self.tag = f"chaos-{os.getpid()}"
        hostfile = run / "hosts"
        hostfile.write_text("\n".join(HOSTS) + "\n")
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        common = [sys.executable, "-m", "mover_plugin.launch.cli", "--hostfile", str(hostfile),
                  "--master-addr", "127.0.0.1", "--master-port", str(self.port),
                  "--policy", "resilient", "--standbys", "1", "--refill-delay-s", "1",
                  "--stop-grace-s", "2", "--max-restarts", str(faults)]
        own = ["--summary", str(run / "summary.json"), "--event-log", str(run / "events.jsonl")]
        self.commands = {node: [*common, "--node-rank", str(node), *(own if node == 0 else []),
                                *script] for node in range(len(HOSTS))}
        self.env = {**os.environ, TAG_ENV: self.tag,
                    JOB_SECRET_ENV: secrets.token_hex(16)}
        os.environ[JOB_SECRET_ENV] = self.env[JOB_SECRET_ENV]  # the operator's (JobClient)
        self.processes: dict[int, subprocess.Popen] = {}

    def start(self, nodes: tuple[int, ...] = (1, 2, 0)) -> None:
        for node in nodes:
            with (self.run / f"host{node}.log").open("a") as log:
                self.processes[node] = subprocess.Popen(
                    self.commands[node], stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True, env=self.env)
        deadline = time.monotonic() + 120
        while not (self.run / "events.jsonl").exists():
            if self.processes[0].poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the chaos job did not start; see {self.run / 'host0.log'}")
            time.sleep(0.2)

    def restart(self, node: int) -> None:
        """Kills what is left of ``node``'s mover-launch and its processes, and starts it
        again (it rejoins the running job as a spare host)."""
        process = self.processes[node]
        _send(process.pid, signal.SIGKILL)
        process.wait()
        for pid, env in _tagged(self.tag).items():
            if env.get("GROUP_RANK") == str(node):
                _send(pid, signal.SIGKILL)
        self.start((node,))

    @property
    def returncode(self) -> Optional[int]:
        return self.processes[0].returncode

    def ended(self) -> bool:
        return self.processes[0].poll() is not None

    def wait(self, timeout_s: float) -> None:
        self.processes[0].wait(timeout=timeout_s)
        for process in self.processes.values():
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        for pid in _tagged(self.tag):
            _send(pid, signal.SIGKILL)


class Soak:
    """The running job and the faults put into it."""

    def __init__(self, client: JobClient, hosts: Hosts, rng: random.Random,
                 kinds: tuple[str, ...] = FAULTS) -> None:
        self.client, self.hosts, self.rng, self.kinds = client, hosts, rng, kinds
        self.run = hosts.run
        self.status: dict = {}

    def wait_until_ready(self) -> bool:
        """Waits until the job trains, undisturbed, with every host back and its standby pool
        full; False once the job has ended."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.hosts.ended():
                return False
            try:
                status = self.client.status(timeout_s=10)
            except MoverError:
                return False
            self.status = status
            if (status["training"] and not status["migrations"] and not status["lost_hosts"]
                    and len(status["standbys"]) >= status["standby_target"]
                    and not status["refilling"]):
                time.sleep(self.rng.uniform(0.0, 2.0))
                return not self.hosts.ended()
            time.sleep(0.2)
        raise SystemExit("the job did not train again with its standby pool full within "
                         f"{READY_TIMEOUT_S:.0f} s; see {self.run}")

    def inject(self, number: int) -> Optional[tuple[str, bool]]:
        """Puts one fault into the job and waits for its outcome: (its kind, whether the job
        fell back to a restart); None when nothing happened (no fault the job can survive now,
        or a migration the job refused)."""
        kinds = [k for k in self.kinds if not k.endswith("-agent") or self._agent_nodes()]
        kinds = [k for k in kinds if k != "migration" or self._drainable_nodes()]
        kinds = [k for k in kinds if k != "two-close" or len(self.status["standbys"]) >= 2]
        if not kinds:  # none the job can survive now (too few standbys on one host)
            time.sleep(1.0)
            return None
        kind = self.rng.choice(kinds)
        before = len(_events(self.run))
        what, wanted = getattr(self, "_" + kind.replace("-", "_"))()
        print(f"{time.strftime('%H:%M:%S')} fault {number:3d} {kind:16s} {what}", flush=True)
        if not wanted:
            return None
        self._wait_for(wanted, before)
        if kind.endswith("-agent"):
            self.hosts.restart(int(what.split()[1]))
        elif kind == "migration" and wanted:
            self._service(int(what.split()[1]))
        restarted = any(e["event"] == "restart" for e in _events(self.run)[before:])
        return kind, restarted

    # -- the faults: each returns what it did and the events that end it -----------------

    def _sigkill_worker(self) -> tuple[str, set[str]]:
        return self._signal_rank(self.rng.randrange(4), signal.SIGKILL), _RECOVERED

    def _sigstop_worker(self) -> tuple[str, set[str]]:
        return self._signal_rank(self.rng.randrange(4), signal.SIGSTOP), _RECOVERED

    def _sigkill_standby(self) -> tuple[str, set[str]]:
        return self._signal_standby(signal.SIGKILL), {"standby_lost"}

    def _sigstop_standby(self) -> tuple[str, set[str]]:
        return self._signal_standby(signal.SIGSTOP), {"standby_lost"}

    def _sigkill_agent(self) -> tuple[str, set[str]]:
        return self._signal_agent(signal.SIGKILL)

    def _sigstop_agent(self) -> tuple[str, set[str]]:
        return self._signal_agent(signal.SIGSTOP)

    def _migration(self) -> tuple[str, set[str]]:
        node = self.rng.choice(self._drainable_nodes())
        host = HOSTS[node].split()[0]
        wanted = {"migration_done", "migration_failed", *_RECOVERED}
        try:
            accepted = self.client.migrate(host=host, wait=False)
        except MoverError as error:
            return f"node {node} ({host}): refused ({error})", set()
        return (f"node {node} ({host}, ranks {accepted['ranks']} -> "
                f"{', '.join(accepted['standbys'])})", wanted)

    def _service(self, node: int) -> None:
        """Host ``node``, drained, goes down for maintenance and comes back."""
        before = len(_events(self.run))
        _send(self.hosts.processes[node].pid, signal.SIGKILL)
        self._wait_for({"host_lost"}, before)
        self.hosts.restart(node)

    def _two_close(self) -> tuple[str, set[str]]:
        first = self.rng.randrange(4)
        second = self.rng.choice([r for r in range(4) if r not in (first, TWINS[first])])
        done = self._signal_rank(first, signal.SIGKILL)
        time.sleep(self.rng.uniform(0.05, 0.5))
        sig = self.rng.choice((signal.SIGKILL, signal.SIGSTOP))
        then = f"{sig.name} {self._signal_rank(second, sig)}"
        return f"{done}; then {then}", _RECOVERED

    def _signal_rank(self, rank: int, sig: signal.Signals) -> str:
        process = self.status["membership"][str(rank)]["process"]
        pid = self._pid(lambda env: _process_id(env) == process)
        _send(pid, sig)
        return f"rank {rank} ({process}, pid {pid})"

    def _signal_standby(self, sig: signal.Signals) -> str:
        standby = self.rng.choice(sorted(self.status["standbys"]))
        pid = self._pid(lambda env: env.get(STANDBY_ID_ENV) == standby)
        _send(pid, sig)
        return f"standby {standby} (pid {pid})"

    def _signal_agent(self, sig: signal.Signals) -> tuple[str, set[str]]:
        node = self.rng.choice(self._agent_nodes())
        ranks = self._ranks_on(node)
        _send(self.hosts.processes[node].pid, sig)
        what = f"node {node} (ranks {ranks or 'none'}, pid {self.hosts.processes[node].pid})"
        return what, ({"host_lost"} | (_RECOVERED if ranks else set()))

    def _agent_nodes(self) -> list[int]:
        """The faulted hosts whose loss the job can survive: no rank with its twin on the same
        host, and as many ready standbys on other hosts as the host has ranks."""
        nodes = []
        for node in FAULTED_NODES:
            ranks = self._ranks_on(node)
            elsewhere = [s for s, n in self.status["standbys"].items() if n != node]
            if not any(TWINS[r] in ranks for r in ranks) and len(elsewhere) >= len(ranks):
                nodes.append(node)
        return nodes

    def _drainable_nodes(self) -> list[int]:
        """The faulted hosts with ranks whose ranks another host has enough ready standbys
        for."""
        nodes = []
        for node in FAULTED_NODES:
            ranks = self._ranks_on(node)
            others = collections.Counter(n for n in self.status["standbys"].values() if n != node)
            if ranks and max(others.values(), default=0) >= len(ranks):
                nodes.append(node)
        return nodes

    def _ranks_on(self, node: int) -> list[int]:
        return [int(rank) for rank, member in self.status["membership"].items()
                if member["node"] == node]

    def _pid(self, matches: Callable[[dict[str, str]], bool]) -> Optional[int]:
        for pid, env in _tagged(self.hosts.tag).items():
            if matches(env):
                return pid
        return None

    def _wait_for(self, wanted: set[str], before: int) -> None:
        """Waits until the event log has each of ``wanted``'s groups (a host loss, then the
        recovery) after ``before``, or the job ends."""
        groups = [wanted & {"host_lost"}, wanted - {"host_lost"}]
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline and not self.hosts.ended():
            seen = {e["event"] for e in _events(self.run)[before:]}
            if all(not group or group & seen for group in groups):
                return
            time.sleep(0.1)


_RECOVERED = {"resumed", "restart"}


def _process_id(env: dict[str, str]) -> str:
    """The id ``mover status`` gives a process: its standby id, else ``a{attempt}.r{rank}``."""
    standby = env.get(STANDBY_ID_ENV)
    if standby:
        return standby
    return f"a{env.get('TORCHELASTIC_RESTART_COUNT')}.r{env.get('RANK')}"


def _send(pid: Optional[int], sig: signal.Signals) -> None:
    if pid is None:
        return
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _tagged(tag: str) -> dict[int, dict[str, str]]:
    """The live workers and standbys of this soak's job, with their environment."""
    return {pid: env for pid, env in processes_with_env(TAG_ENV, tag).items()
            if "RANK" in env or STANDBY_ID_ENV in env}


def _events(run: Path) -> list[dict]:
    return read_events(run) if (run / "events.jsonl").exists() else []


def _digests(run: Path) -> list[str]:
    """The ``PARAMS_DIGEST`` lines of every host's log: the rank that prints it may end the
    run on any host, its first one having been replaced."""
    return [line.split()[1] for log in sorted(run.glob("host*.log"))
            for line in log.read_text(errors="replace").splitlines()
            if line.startswith("PARAMS_DIGEST")]


def _report(run: Path, faults: list[tuple[str, bool]], returncode: Optional[int],
            expected: str) -> None:
    summary = read_summary(run)
    events = _events(run)
    digest = _digests(run)
    equal = returncode == 0 and len(digest) == 1 and digest[0].startswith(expected)
    fallbacks = [e for e in events if e["event"] == "fallback"]
    print(f"\njob exit code {returncode}, {summary['steps_completed']} steps, "
          f"{summary['restarts']} restart(s), {len(summary['interruptions'])} interruptions")
    kinds = collections.Counter(kind for kind, _ in faults)
    print("faults by kind: " + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())))
    recoveries = collections.Counter(f"{i['kind']}/{i.get('recovery')}"
                                     for i in summary["interruptions"])
    print("recoveries by kind: " + ", ".join(f"{k} {n}" for k, n in sorted(recoveries.items())))
    for kind in sorted({i["kind"] for i in summary["interruptions"]}):
        downtimes = sorted(i["downtime_s"] for i in summary["interruptions"]
                           if i["kind"] == kind and i.get("downtime_s") is not None)
        if downtimes:
            print(f"downtime s, {kind}: min {downtimes[0]:.3f}, median "
                  f"{statistics.median(downtimes):.3f}, p90 "
                  f"{downtimes[int(0.9 * (len(downtimes) - 1))]:.3f}, max {downtimes[-1]:.3f} "
                  f"({len(downtimes)})")
    for event in fallbacks:
        print(f"fallback at generation {event['generation']}, rank {event.get('rank')}: "
              f"{event.get('reason')}")
    count = collections.Counter(e["event"] for e in events)
    print(f"standbys lost and replaced: {count['standby_lost']}; refills: "
          f"{len(summary['refills'])}; hosts lost {count['host_lost']}, rejoined "
          f"{count['host_joined']}")
    survived = sum(not restarted for _, restarted in faults)
    print(f"CHAOS faults {len(faults)} survived {survived} fallbacks {len(fallbacks)} "
          f"digest {'equal' if equal else 'differs'}")


def _kinds(value: str) -> tuple[str, ...]:
    kinds = tuple(kind.strip() for kind in value.split(",") if kind.strip())
    unknown = [kind for kind in kinds if kind not in FAULTS]
    if unknown or not kinds:
        raise argparse.ArgumentTypeError(f"{value!r} names no fault kinds or unknown ones "
                                         f"({', '.join(unknown)}); valid: {', '.join(FAULTS)}")
    return kinds


def _digest_prefix(value: str) -> str:
    if len(value) < 16 or any(c not in "0123456789abcdef" for c in value):
        raise argparse.ArgumentTypeError(f"{value!r} is not a PARAMS_DIGEST or a prefix of 16 "
                                         "or more lower-case hex digits")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", type=int, default=50)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--train-iters", type=int, default=None,
                        help=f"steps of the job (default {STEPS_PER_FAULT} per fault + 200)")
    parser.add_argument("--kinds", type=_kinds, default=FAULTS,
                        help="the fault kinds to draw from, comma-separated (default all: "
                        f"{','.join(FAULTS)})")
    parser.add_argument("--save-interval", type=int, default=100)
    parser.add_argument("--end-timeout-s", type=float, default=7200.0)
    parser.add_argument("--folder", default=None)
    parser.add_argument("--expected-digest", type=_digest_prefix, default=None,
                        help="the failure-free run's PARAMS_DIGEST for the same steps (or its "
                        "first 16 or more hex digits), from an earlier soak: skips that run")
    return parser


if __name__ == "__main__":
    main()
