"""A host that joins a running job: ``mover-launch --join ADDR:PORT``.

The host need not be in the job's hostfile. Its ``mover-launch`` connects to the controller's
store at ADDR:PORT, asks to join (a ``join_request`` event naming the host, its slots and a
token of its own) and waits for the controller's answer, a command that carries the token:

* ``admit``: the host is node ``node`` of the job, a spare host (a lost host of the same name
  and slot count gets its node back; any other host gets the next free node rank). The
  command carries what an agent needs that only the job knows: its world size, the workers'
  command line, the standbys the host starts when a restart places ranks on it (``--standbys``,
  or on a spare host one per slot no worker uses), the stop grace and whether busy times are
  reported. The agent then joins like
  a lost host's agent started again (:mod:`mover_plugin.launch.host_loss`): it starts one
  standby per slot, which join the pool and are taken first.
* ``join_refused``: the job takes no host (a restart policy job has no standbys to place
  there); ``mover-launch`` says why and exits 1.

Stopped with SIGTERM, the joined host tells the controller that it leaves
(:mod:`mover_plugin.launch.departure`).

The job's script and settings thus stay the first host's: a joining host names only its slots
(``--nproc-per-node``), its name (``--host``), its GPUs (``--gpus-per-node``, by default
counted here) and how long to wait (``--join-timeout-s``). It needs the job's secret
(:mod:`mover_plugin.launch.job_secret`): ``MOVER_JOB_SECRET``, or on the
job's first host the job's secret file.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from typing import Any

from mover_plugin.contract import COMMANDS_MAILBOX, EVENTS_MAILBOX, command_problem
from mover_plugin.errors import LaunchError
from mover_plugin.launch.agent import Agent
from mover_plugin.launch.agent_config import AgentConfig
from mover_plugin.launch.config import JoinConfig
from mover_plugin.launch.departure import leave_on_sigterm
from mover_plugin.launch.hosts import NodeSpec
from mover_plugin.launch.job_secret import operator_secret
from mover_plugin.launch.jobs import secret_file
from mover_plugin.launch.store_gate import CONTROL_TARGET, StoreRelay
from mover_plugin.mailbox import Mailbox

logger = logging.getLogger(__name__)

ANSWER_POLL_S = 0.05


def run_joining_host(config: JoinConfig) -> int:
    """Joins the job at ``config``'s address and serves it as a spare host's agent until the
    job ends; returns the agent's exit code."""
    address = f"{config.master_addr}:{config.master_port}"
    secret = operator_secret(secret_file(config.master_addr, config.master_port), address)
    relay = StoreRelay(secret, config.master_addr, config.master_port,
                       connect_timeout_s=config.join_timeout_s)
    try:
        store = relay.client(CONTROL_TARGET, config.join_timeout_s)
    except (RuntimeError, OSError) as error:
        raise LaunchError(f"--join {address}: no controller there ({error})") from None
    answer = _ask_to_join(store, config)
    if answer["op"] == "join_refused":
        raise LaunchError(f"--join {address}: the job refused this host: {answer['reason']}")
    node = NodeSpec(**answer["node"])
    logger.info("host %s joins the job at %s as node %d (%d standby slot(s))", config.host,
                address, node.node_rank, node.spare_slots)
    agent = AgentConfig(node=node, world_size=answer["world_size"],
                        master_addr=config.master_addr, master_port=config.master_port,
                        command=tuple(answer["command"]), stop_grace_s=answer["stop_grace_s"],
                        exit_timeout_s=answer["exit_timeout_s"], standbys=answer["standbys"],
                        report_busy=answer["report_busy"], gpus=config.gpus)
    joined = Agent(agent, store, relay)
    leave_on_sigterm(store, node)
    return joined.run()


def _ask_to_join(store: Any, config: JoinConfig) -> dict[str, Any]:
    """Posts the ``join_request`` and returns the controller's answer to it."""
    commands = Mailbox(store, COMMANDS_MAILBOX)
    commands.skip_to_end()
    token = secrets.token_hex(8)
    Mailbox(store, EVENTS_MAILBOX).post({
        "kind": "join_request", "attempt": -1, "time": time.time(), "host": config.host,
        "slots": config.slots, "pid": os.getpid(), "token": token})
    deadline = time.monotonic() + config.join_timeout_s
    while time.monotonic() < deadline:
        for command in commands.poll():
            if (command_problem(command) is None and command["op"] in ("admit", "join_refused")
                    and command["token"] == token):
                return command
        time.sleep(ANSWER_POLL_S)
    raise LaunchError(f"--join {config.master_addr}:{config.master_port}: the controller did "
                      f"not answer within --join-timeout-s {config.join_timeout_s:g}")
