"""A whole host lost with its agent: three hosts of a hostfile, each with its own mover-launch.

Hosts 0 and 1 run TP2 x PP1 x DP2 (a tensor-parallel group on each) and no standby, as on a GPU
cluster; host 2 is a spare host with two standbys. Host 1 is lost mid-run, either SIGKILLed
(its mover-launch, which runs its agent, and its two workers at once, as a crashed machine takes
them; the hosts are 127.0.0.1-3) or cut off by its network (the hosts in network namespaces of
their own, host 1's link taken down: its processes live on and hear nothing). Either way the
controller finds the host silent for the agents' heartbeat timeout and hands both its ranks to
the spare host's standbys in one generation; host 0's workers train on in their processes (the
alarm reached them within their failure timeout), and the result is the failure-free run's, bit
for bit. A host not in the hostfile joins the running job (mover-launch --join) as a spare host,
as does the SIGKILLed host's mover-launch started again; their standbys take the next ranks lost.
While hosts join, rank 0 is held between steps (``pretrain_gpt_held.py``), so that the job
cannot end before they are ready, however slow the machine.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Callable, Iterator

import pytest

from support.gpt_jobs import (HELD_EXAMPLE, LAUNCH, MODEL, background_job, digest, pretrain,
                              read_events, tagged_processes, wait_for_events, worker_pid)
from support.netns import can_make_namespaces, namespace_hosts

from mover_plugin.launch.job_secret import JOB_SECRET_ENV

pytest.importorskip("megatron.core")

TP2 = ["--num-layers", "2", "--tensor-model-parallel-size", "2", "--train-iters", "350"]
"""Two layers, and steps enough for a new host to join and host 1 to come back, each used in
turn, before training ends."""
JOB_ENV = {JOB_SECRET_ENV: "three-hosts-job-secret"}
"""Each host starts its own mover-launch: they share the job's secret, as with srun."""


@pytest.fixture(scope="module")
def reference_tp2():
    """TP2 x PP1 x DP2, 350 steps, no interruption."""
    result = pretrain(*TP2)
    assert result.returncode == 0, result.output[-4000:]
    return result


class ThreeHosts:
    """The job's three mover-launch processes, its event log and summary."""

    def __init__(self, tmp_path: Path, processes: list[subprocess.Popen],
                 commands: dict[int, list[str]], port: int) -> None:
        self.tag = str(tmp_path)
        self.port = port
        """The controller's store port on host 0."""
        self.events_path = tmp_path / "events.jsonl"
        self.summary_path = tmp_path / "summary.json"
        self.hold = tmp_path / "hold"
        """Rank 0 waits between steps while this file names its generation
        (``pretrain_gpt_held.py``): the job cannot end before the test has acted."""
        self.env = {**JOB_ENV, "HOLD_FILE": str(self.hold)}
        """The environment of every host's mover-launch, a joining host's too."""
        self.processes = processes
        self.commands = commands
        """The command that started each host's mover-launch."""

    def wait_for(self, done: Callable[[list[dict]], bool]) -> list[dict]:
        return wait_for_events(self.events_path, done, self.processes[0])

    def ranks_0_and_1(self) -> dict[int, int]:
        return {rank: worker_pid(rank, self.tag) for rank in (0, 1)}

    def run_on_after_losing_host_1(self, survivors: dict[int, int], resumed: int = 1) -> str:
        """Once training resumed (the ``resumed``-th time), checks that ranks 0 and 1 kept
        their processes; returns host 0's output at the end of the job."""
        self.wait_for(lambda es: sum(e["event"] == "resumed" for e in es) >= resumed)
        assert self.ranks_0_and_1() == survivors
        output, _ = self.processes[0].communicate(timeout=240)
        return output

    def workers_of(self, node: int) -> list[int]:
        """The pids of the tagged job's workers and standbys started on ``node``."""
        return [pid for pid, env in tagged_processes(self.tag).items()
                if env.get("GROUP_RANK") == str(node)]


@contextmanager
def three_hosts(tmp_path: Path, addresses: list[str],
                on_host: Callable[[int, list[str]], list[str]]) -> Iterator[ThreeHosts]:
    """Starts the job on three hosts (``on_host(node, argv)`` is the command that runs argv
    there) and, once rank 0 reported its fifth step, yields it."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"{addresses[0]} slots=2\n{addresses[1]} slots=2\n"
                        f"{addresses[2]} slots=2 spare\n")
    with socket.socket() as probe:
        probe.bind((addresses[0], 0))
        port = probe.getsockname()[1]
    common = [*LAUNCH, "--hostfile", str(hostfile), "--master-addr", addresses[0],
              "--master-port", str(port), "--policy", "resilient", "--standbys", "0",
              "--stop-grace-s", "2", "--refill-delay-s", "600"]  # no refill competes for CPU
    # A hold (below) keeps the others waiting in their collectives: well within this bound.
    script = [HELD_EXAMPLE, *MODEL, *TP2, "--resilient", "--resilient-collective-timeout-s",
              "180"]
    (tmp_path / "hold").write_text("")
    own = {0: ["--summary", str(tmp_path / "summary.json"),
               "--event-log", str(tmp_path / "events.jsonl")]}
    commands = {node: on_host(node, [*common, "--node-rank", str(node), *own.get(node, []),
                                     *script]) for node in (1, 2, 0)}
    with ExitStack() as stack:
        env = {**JOB_ENV, "HOLD_FILE": str(tmp_path / "hold")}
        processes = {node: stack.enter_context(background_job(command, str(tmp_path), env))
                     for node, command in commands.items()}
        job = ThreeHosts(tmp_path, [processes[0], processes[1], processes[2]], commands,
                         port)
        job.wait_for(lambda es: any(e["event"] == "steps" and e["steps"][-1][0] >= 5
                                    for e in es))
        yield job


def _check_recovered_by_the_spare_host(job: ThreeHosts, output: str, reference, *,
                                       then: tuple[tuple[int, str], ...] = ()) -> None:
    """Host 1's ranks went to the spare host in generation 1 (``then``: the promotions that
    followed, as (rank, the start of the standby's id)), bit-exact, with no restart."""
    assert job.processes[0].returncode == 0, output[-5000:]
    assert f"PARAMS_DIGEST {digest(reference)}" in output
    events = read_events(job.events_path)
    (lost,) = [e for e in events if e["event"] == "host_lost"]
    assert lost["node"] == 1 and lost["ranks"] == [2, 3]
    assert lost["how"].startswith("no heartbeat from its agent for ")
    promotes = [e for e in events if e["event"] == "promote"]
    assert [(e["rank"], e["standby"], e["generation"]) for e in promotes[:2]] == [
        (2, "a0.n2.s0", 1), (3, "a0.n2.s1", 1)]
    assert [(e["rank"], e["standby"][:len(prefix)])
            for e, (_, prefix) in zip(promotes[2:], then)] == list(then)
    assert len(promotes) == 2 + len(then)
    assert not [e for e in events if e["event"] in ("fallback", "restart", "worker_error")]
    summary = json.loads(job.summary_path.read_text())
    assert summary["restarts"] == 0 and summary["steps_completed"] == 350
    item = summary["interruptions"][0]
    assert len(summary["interruptions"]) == 1 + len(then)
    assert item["kind"] == "host_loss" and item["ranks"] == [2, 3]
    assert item["recovery"] == "standby" and item["generation"] == 1
    assert list(item["phases_s"]) == ["failed", "detected", "alarm", "left", "switched",
                                      "first_step_completed"]
    assert item["downtime_s"] is not None and item["downtime_s"] > 0


def _joined_standbys_ready(count: int) -> Callable[[list[dict]], bool]:
    return lambda es: sum(e["event"] == "standby_ready" and ".j" in e["standby"]
                          for e in es) == count


def test_a_host_sigkilled_with_its_agent_is_replaced_by_the_spare_host_and_comes_back(
        tmp_path, reference_tp2):
    """... then a host not in the hostfile joins (mover-launch --join, one slot), and its
    standby takes rank 2 when that process is SIGKILLed; host 1's mover-launch started again
    joins as a spare host too, and one of its standbys takes rank 3 when that one is."""
    with three_hosts(tmp_path, ["127.0.0.1", "127.0.0.2", "127.0.0.3"],
                     lambda node, argv: argv) as job:
        survivors = job.ranks_0_and_1()
        doomed = job.workers_of(1)
        assert len(doomed) == 2
        job.hold.write_text("1")  # held in generation 1 until the new host's standby is ready
        for pid in [job.processes[1].pid, *doomed]:
            os.kill(pid, signal.SIGKILL)
        job.wait_for(lambda es: any(e["event"] == "resumed" for e in es))
        assert job.ranks_0_and_1() == survivors
        joining = [*LAUNCH, "--join", f"127.0.0.1:{job.port}", "--nproc-per-node", "1",
                   "--host", "127.0.0.4"]
        with ExitStack() as hosts:
            new = hosts.enter_context(background_job(joining, job.tag, job.env))
            job.wait_for(_joined_standbys_ready(1))
            # the new host's standby is the only one ready: it takes rank 2
            job.hold.write_text("2")  # released; held in generation 2 until host 1 is back
            os.kill(worker_pid(2, job.tag, standby="a0.n2.s0"), signal.SIGKILL)
            back = hosts.enter_context(background_job(job.commands[1], job.tag, job.env))
            job.wait_for(lambda es: sum(e["event"] == "resumed" for e in es) >= 2)
            job.wait_for(_joined_standbys_ready(3))
            job.hold.write_text("")
            os.kill(worker_pid(3, job.tag, standby="a0.n2.s1"), signal.SIGKILL)
            output = job.run_on_after_losing_host_1(survivors, resumed=3)
            new_output, _ = new.communicate(timeout=60)
            back_output, _ = back.communicate(timeout=60)
        spare_output, _ = job.processes[2].communicate(timeout=60)
        job.processes[1].wait(timeout=60)
    _check_recovered_by_the_spare_host(job, output, reference_tp2,
                                       then=((2, "a0.n3.j0"), (3, "a0.n1.j")))
    assert new.returncode == 0, new_output[-3000:]
    assert back.returncode == 0, back_output[-3000:]
    assert job.processes[2].returncode == 0, spare_output[-3000:]
    assert job.processes[1].returncode == -signal.SIGKILL
    events = read_events(job.events_path)
    (admitted,) = [e for e in events if e["event"] == "host_admitted"]
    assert admitted["node"] == 3 and admitted["host"] == "127.0.0.4" and admitted["slots"] == 1
    joined = {e["node"]: e["standbys"] for e in events if e["event"] == "host_joined"}
    assert joined == {3: ["a0.n3.j0"], 1: ["a0.n1.j1", "a0.n1.j2"]}
    assert not tagged_processes(job.tag)


@pytest.mark.skipif(not can_make_namespaces(), reason="needs root and iproute2 (ip netns)")
def test_a_host_cut_off_by_its_network_is_replaced_and_its_agent_stops_its_workers(
        tmp_path, reference_tp2):
    with namespace_hosts(3, subnet=231) as hosts, \
            three_hosts(tmp_path, [h.address for h in hosts],
                        lambda node, argv: hosts[node].command(argv)) as job:
        survivors = job.ranks_0_and_1()
        hosts[1].cut()
        output = job.run_on_after_losing_host_1(survivors)
        # Cut off, host 1's agent hears nothing: it stops its workers once the controller has
        # been silent for its timeout, and its mover-launch says why.
        cut_output, _ = job.processes[1].communicate(timeout=120)
        job.processes[2].communicate(timeout=60)
    _check_recovered_by_the_spare_host(job, output, reference_tp2)
    assert job.processes[1].returncode == 1
    assert "node 1 lost the controller" in cut_output and "stopping its workers" in cut_output
    assert not job.workers_of(1)
