"""The ``mover-launch`` console script.

``mover-launch [flags] script.py [script flags]`` checks its flags and the script's, then on the
first host runs the controller and starts an agent per local host; on other hosts
(``--node-rank N``) it runs that host's agent; with ``--join ADDR:PORT`` it adds this host to a
running job (:mod:`mover_plugin.launch.join`). See ``mover-launch --help``.

SIGTERM ends it with status 143: on the first host the job ends (its agents abort); on another
host that runs its agent itself, the controller is told first that the host leaves
(:mod:`mover_plugin.launch.departure`).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import signal
import socket
import subprocess
import sys
from typing import Optional, Sequence

from mover_plugin.errors import ConfigError, LaunchError
from mover_plugin.launch.agent import AGENT_CONFIG_ENV, Agent
from mover_plugin.launch.agent_config import AgentConfig
from mover_plugin.launch.config import JoinConfig, LaunchConfig, parse_launch_args
from mover_plugin.launch.controller import Controller
from mover_plugin.launch.departure import EXIT_STATUS, leave_on_sigterm
from mover_plugin.launch.job_secret import JOB_SECRET_ENV, launch_secret
from mover_plugin.launch.jobs import registered_job
from mover_plugin.launch.liveness import beat_period
from mover_plugin.launch.join import run_joining_host
from mover_plugin.launch.preflight import run_preflight
from mover_plugin.launch.store_gate import (
    CONTROL_TARGET,
    StoreGate,
    StoreRelay,
    host_loopback_store,
    raise_open_file_limit,
)
from mover_plugin.launch.summary import RunSummary
from mover_plugin.processes import start_process, stop_processes

logger = logging.getLogger("mover_plugin.launch")


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="[mover-launch] %(message)s", stream=sys.stderr)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(EXIT_STATUS))
    raise_open_file_limit()  # the stores' and relays' connections: thousands at scale
    try:
        config = parse_launch_args(sys.argv[1:] if argv is None else argv, sys.executable)
        if isinstance(config, JoinConfig):
            return run_joining_host(config)
        secret = launch_secret(starts_every_host=config.runs_controller
                               and len(config.local_node_ranks) == len(config.nodes))
        if config.runs_controller:
            run_preflight(config)
            return _run_first_host(config, secret)
        return _run_agent_only(config, secret)
    except ConfigError as error:
        print(f"mover-launch: error: {error}", file=sys.stderr)
        return 2
    except LaunchError as error:
        print(f"mover-launch: {error}", file=sys.stderr)
        return 1


def _run_first_host(config: LaunchConfig, secret: bytes) -> int:
    store = host_loopback_store()
    gate = _open_gate(config, secret, {CONTROL_TARGET: store.port})
    port = gate.port
    agents = {node_rank: _spawn_agent(config, node_rank, port, secret)
              for node_rank in config.local_node_ranks}
    controller = Controller(config, store, agents, gate=gate)
    try:
        with registered_job(config.master_addr, port, config.command, secret):
            return controller.run()
    finally:
        # The controller told the agents to finish (or abort): each stops what it still runs
        # within --stop-grace-s and exits. Only then are they stopped.
        stop_processes(list(agents.values()), grace_s=config.stop_grace_s + 5.0,
                       exiting_s=config.stop_grace_s + 5.0)
        gate.close()
        _report(controller.summary, config)


def _open_gate(config: LaunchConfig, secret: bytes, routes: dict[int, int]) -> StoreGate:
    """The job's one open port, on the job's address only, leading to ``routes`` from its
    first connection on."""
    try:
        return StoreGate(secret, _listen_address(config), config.master_port, routes)
    except OSError as error:
        raise ConfigError(
            f"cannot open the job's port {config.master_addr}:{config.master_port} ({error}); "
            "choose a free --master-port (or --standalone)"
        ) from None


def _listen_address(config: LaunchConfig) -> str:
    """The address the gate listens on: the one the launch names (every interface of a
    Kubernetes pod), else the job's address. A host name that resolves to a loopback address
    (``127.0.1.1`` in many ``/etc/hosts``) while other hosts must reach it cannot be the
    listening address; the gate then listens on every interface."""
    if config.listen_addr is not None:
        return config.listen_addr
    try:
        address = socket.gethostbyname(config.master_addr)
    except OSError as error:
        raise ConfigError(f"--master-addr {config.master_addr} does not resolve ({error})") \
            from None
    literal = _is_ip(config.master_addr)
    remote_hosts = [n.host for n in config.nodes
                    if not (_is_ip(n.host) and ipaddress.ip_address(n.host).is_loopback)]
    if ipaddress.ip_address(address).is_loopback and not literal and remote_hosts:
        logger.warning("%s resolves to %s, which other hosts cannot reach: the job's port "
                       "listens on every interface (only holders of the job's secret get "
                       "through)", config.master_addr, address)
        return "0.0.0.0"
    return address


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _spawn_agent(config: LaunchConfig, node_rank: int, port: int,
                 secret: bytes) -> subprocess.Popen:
    env = dict(os.environ)
    env[AGENT_CONFIG_ENV] = _agent_config(config, node_rank, port).to_json()
    env[JOB_SECRET_ENV] = secret.decode()
    return start_process([sys.executable, "-m", "mover_plugin.launch.agent"], env,
                         death_signal=signal.SIGTERM)


def _agent_config(config: LaunchConfig, node_rank: int, port: int) -> AgentConfig:
    node = config.nodes[node_rank]
    return AgentConfig(
        node=node,
        world_size=config.world_size,
        master_addr=config.master_addr,
        master_port=port,
        command=config.worker_command,
        injections=tuple(i for i in config.injections if i.rank in node.ranks),
        migrations=tuple(i for i in config.migrations if i.rank in node.ranks),
        stop_grace_s=config.stop_grace_s,
        standbys=config.standbys_of(node),
        exit_timeout_s=config.exit_timeout_s,
        report_busy=config.report_busy,
        gpus=config.gpus_of(node),
        beat_period_s=beat_period(config.agent_timeout_s),
    )


def _run_agent_only(config: LaunchConfig, secret: bytes) -> int:
    (node_rank,) = config.local_node_ranks
    relay = StoreRelay(secret, config.master_addr, config.master_port,
                       connect_timeout_s=config.join_timeout_s)
    try:
        store = relay.client(CONTROL_TARGET, config.join_timeout_s)
    except (RuntimeError, OSError) as error:
        raise LaunchError(
            f"no controller at {config.master_addr}:{config.master_port} ({error})"
        ) from None
    agent = Agent(_agent_config(config, node_rank, config.master_port), store, relay)
    leave_on_sigterm(store, config.nodes[node_rank])
    return agent.run()


def _report(summary: RunSummary, config: LaunchConfig) -> None:
    if config.summary_path:
        summary.write(config.summary_path)
    steps = "unknown" if summary.steps_completed is None else summary.steps_completed
    logger.info("job ended with exit code %s after %.2f s: %s steps, %d restart(s)",
                summary.exit_code, summary.wall_time_s or 0.0, steps, summary.restarts)
    for item in summary.interruptions:
        data = item.to_dict()
        phases = ", ".join(f"{p} +{s:.3f}s" for p, s in data["phases_s"].items())
        downtime = data["downtime_s"]
        rollback = ("" if item.rolled_back_to is None
                    else f"; rolled back to the checkpoint of step {item.rolled_back_to}")
        if item.inexact is not None:
            rollback += f"; inexact ({item.inexact})"
        logger.info("interruption: %s of rank %d at step %d (%s): %s; downtime %s%s",
                    item.kind, item.rank, item.step, item.how, phases,
                    "n/a" if downtime is None else f"{downtime:.3f} s", rollback)
    for refill in summary.refills:
        outcome = (f"ready after {refill.ready_at - refill.requested_at:.1f} s"
                   if refill.ready_at is not None else
                   "lost before it was ready" if refill.lost_at is not None else
                   "stopped at the end of the job" if refill.stopped_at is not None else
                   "not ready")
        logger.info("refill: standby %s on node %d, %s", refill.standby, refill.node, outcome)


if __name__ == "__main__":
    sys.exit(main())
