"""The launcher's settings: one dataclass, its command-line flags and their checks.

Every check runs before any process starts and raises :class:`ConfigError` with a message that
names the bad value and what would be valid. The flag names are torchrun's
(``--nproc-per-node``, ``--nnodes``, ``--node-rank``, ``--master-addr``, ``--master-port``,
``--max-restarts``, ``--standalone``; the underscore spellings work too) so that replacing
``torchrun`` by ``mover-launch`` in a command line just works; the ``deepspeed`` launcher's own
flags keep its meanings (:mod:`mover_plugin.launch.deepspeed_line`). Without host flags, the
hosts come from a scheduler's environment: Slurm's variables under ``srun``
(:mod:`mover_plugin.launch.slurm`), a JobSet pod's in Kubernetes
(:mod:`mover_plugin.launch.kubernetes`).
"""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence, Union

from mover_plugin.devices import check_host_fits, driver_gpu_count, gpus_on_host
from mover_plugin.errors import ConfigError
from mover_plugin.runtime.settings import ResilienceSettings
from mover_plugin.launch.deepspeed_line import (
    add_deepspeed_flags,
    refuse_unsupported,
    uses_deepspeed_launcher,
)
from mover_plugin.launch.faults import (
    FailureInjection,
    MigrationInjection,
    injection_argument,
    migration_argument,
)
from mover_plugin.launch.flag_types import (
    ErrorRaisingParser,
    choice,
    factor_above_one,
    non_negative_float,
    non_negative_int,
    port_number,
    positive_float,
    positive_int,
)
from mover_plugin.launch.hosts import (
    DEFAULT_MASTER_ADDR,
    DEFAULT_MASTER_PORT,
    NodeSpec,
    environment_allocation,
    local_gpus,
    local_nodes,
    nodes_of,
    nodes_of_allocation,
    store_port,
)
from mover_plugin.launch.liveness import BEAT_PERIOD_S
from mover_plugin.launch.run import LOCAL_RANK_ARG_FLAG

POLICIES = ("restart", "resilient")
DEFAULT_AGENT_TIMEOUT_S = 2.0
RUN_MODULE = "mover_plugin.launch.run"
"""The module every worker runs its script through (see ``LaunchConfig.worker_command``)."""


@dataclass(frozen=True)
class LaunchConfig:
    """Everything ``mover-launch`` needs; built by :func:`parse_launch_args`."""

    nodes: tuple[NodeSpec, ...]
    """All hosts of the job, in node-rank order."""
    local_node_ranks: tuple[int, ...]
    """The nodes whose agents this ``mover-launch`` process starts."""
    runs_controller: bool
    """True on the first host: this process hosts the controller and the control-plane store."""
    master_addr: str
    master_port: int
    """Port of the control-plane store; 0 lets the OS choose (single-machine jobs only)."""
    command: tuple[str, ...]
    """The user's command: the interpreter, ``-u``, the script (or ``-m module``) and its args."""
    listen_addr: Optional[str] = None
    """Where the first host's port listens: None for the job's address (``master_addr``), or
    every interface in a Kubernetes pod (:mod:`mover_plugin.launch.kubernetes`)."""
    policy: str = "restart"
    max_restarts: int = 3
    injections: tuple[FailureInjection, ...] = ()
    migrations: tuple[MigrationInjection, ...] = ()
    """Planned migrations the launcher itself requests (``--inject-migration``)."""
    summary_path: Optional[str] = None
    event_log_path: Optional[str] = None
    """JSON-lines event log of the controller."""
    standbys: int = 0
    """Standby processes per worker host (resilient policy); a spare host runs one per slot."""
    gpus: int = 0
    """GPUs of this host the job may use, one per process (0: none, any number of processes;
    :mod:`mover_plugin.devices`)."""
    slow_rank_factor: Optional[float] = None
    """Migrate a rank whose busy time stays above this multiple of the median (None: off)."""
    slow_rank_steps: int = 5
    """... for this many steps in a row."""
    stop_grace_s: float = 5.0
    """Seconds between SIGTERM and SIGKILL when the launcher stops workers."""
    exit_timeout_s: float = 60.0
    """Seconds a rank's process may take to exit once every script on its host ended."""
    refill_delay_s: float = 30.0
    """Seconds after training resumed from a crash before a standby is started to refill the
    pool (resilient policy)."""
    join_timeout_s: float = 300.0
    """Seconds the controller waits for every host's agent to join."""
    agent_timeout_s: float = 2.0
    """Seconds without an agent's heartbeat before its host is declared lost (by default
    :data:`DEFAULT_AGENT_TIMEOUT_S`, or half the workers' failure timeout if that is less)."""
    preflight: bool = True
    """Run the script once with ``MOVER_PREFLIGHT=1`` to check its flags before any worker."""
    script_path: Optional[str] = None
    """The training script (None with ``-m``)."""
    script_args: tuple[str, ...] = field(default=())
    local_rank_arg: bool = False
    """Give each process's script ``--local_rank=N`` first, as the deepspeed launcher does
    (a line with its flags; :mod:`mover_plugin.launch.deepspeed_line`)."""

    @property
    def world_size(self) -> int:
        return sum(node.nproc for node in self.nodes)

    @property
    def worker_command(self) -> tuple[str, ...]:
        """What the agents run: the user's command through ``python -m mover_plugin.launch.run``
        (:mod:`mover_plugin.launch.run`), which installs the framework hooks first."""
        interpreter, unbuffered, *target = self.command
        flag = (LOCAL_RANK_ARG_FLAG,) if self.local_rank_arg else ()
        return (interpreter, unbuffered, "-m", RUN_MODULE, *flag, *target)

    @property
    def report_busy(self) -> bool:
        """Whether agents send each step's busy times (the slow-rank policy is on)."""
        return self.slow_rank_factor is not None

    def gpus_of(self, node: NodeSpec) -> int:
        """The GPUs of ``node`` its processes may use: those named for it, or all of
        :attr:`gpus` (0 on a host without GPUs)."""
        return len(node.devices) if node.devices and self.gpus else self.gpus

    def standbys_of(self, node: NodeSpec) -> int:
        """Standbys the agent of ``node`` starts: a spare host one per slot, a worker host
        ``--standbys``."""
        return node.spare_slots if node.spare else self.standbys

    @property
    def standby_target(self) -> int:
        """Standbys of the whole job when every agent has started its own."""
        return sum(self.standbys_of(node) for node in self.nodes)


@dataclass(frozen=True)
class JoinConfig:
    """``mover-launch --join ADDR:PORT``: a host that joins a running job as a spare host
    (:mod:`mover_plugin.launch.join`); everything else comes from the job's controller."""

    master_addr: str
    master_port: int
    host: str
    slots: int
    join_timeout_s: float
    gpus: int = 0
    """This host's GPUs (:attr:`LaunchConfig.gpus`)."""


JOIN_FLAGS = ("join", "host", "nproc_per_node", "gpus_per_node", "join_timeout_s")
"""The flags a joining host takes; every other one is the job's, set on its first host."""


def _join_config(args: argparse.Namespace, parser: argparse.ArgumentParser,
                 environ: Mapping[str, str]) -> JoinConfig:
    given = [action for action in parser._actions  # noqa: SLF001 - argparse has no public list
             if action.dest not in (*JOIN_FLAGS, "help")
             and getattr(args, action.dest) != action.default
             and not (action.dest == "script_args" and not args.script_args)]
    if given:
        action = given[0]
        name = action.option_strings[0] if action.option_strings else repr(args.script)
        raise ConfigError(
            f"--join {args.join[0]}:{args.join[1]} takes the job's script and settings from its "
            f"controller: drop {name} (a joining host takes only --nproc-per-node, --host, "
            "--gpus-per-node and --join-timeout-s)")
    addr, port = args.join
    host, slots = args.host or socket.gethostname(), args.nproc_per_node or 1
    gpus = gpus_on_host(args.gpus_per_node, environ, driver_gpu_count)
    check_host_fits(host, 0, slots, gpus)
    return JoinConfig(master_addr=addr, master_port=port, host=host, slots=slots,
                      join_timeout_s=args.join_timeout_s, gpus=gpus.count)


def _address_argument(text: str) -> tuple[str, int]:
    addr, _, port = text.rpartition(":")
    if not addr or not port.isdigit() or not 0 < int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not ADDR:PORT (e.g. 10.0.0.1:29500), "
                                         "the running job's --master-addr and --master-port")
    return addr, int(port)


def build_parser() -> argparse.ArgumentParser:
    parser = ErrorRaisingParser(
        prog="mover-launch",
        description="Run a distributed training script on local workers with torchrun's "
        "environment, a controller that outlives the ranks and a policy for failures.",
    )
    add = parser.add_argument
    add("--nproc-per-node", "--nproc_per_node", dest="nproc_per_node", type=positive_int,
        default=None, help="Workers per host (default 1; with --hostfile, its slots).")
    add("--nnodes", type=positive_int, default=None, help="Number of hosts (default 1).")
    add("--node-rank", "--node_rank", dest="node_rank", type=non_negative_int, default=None,
        help="This host's index among the hosts (default 0).")
    add("--master-addr", "--master_addr", dest="master_addr", default=None,
        help="Address of the first host, where the controller runs (default 127.0.0.1; under "
        "srun, the first host of the Slurm job step; in a JobSet pod, MOVER_MASTER_ADDR).")
    add("--master-port", "--master_port", dest="master_port", type=port_number, default=None,
        help=f"Port of the controller's store (default {DEFAULT_MASTER_PORT}; under srun, one "
        "derived from the Slurm job id; in a JobSet pod, MOVER_MASTER_PORT; 0: any free port, "
        "single-machine jobs only).")
    add("--standalone", action="store_true",
        help="Single-machine job on a free port (like torchrun --standalone).")
    add("--hostfile", default=None,
        help="File with one 'host slots=N' line per host. Without --node-rank, hosts naming "
        "this machine get an agent each from this command; other hosts run 'mover-launch "
        "--node-rank N' themselves (with --node-rank 0, every other host does).")
    add("--no_ssh", "--no-ssh", dest="no_ssh", action="store_true",
        help="Accepted for the deepspeed launcher's sake: mover-launch never uses ssh (each "
        "host runs its own mover-launch --node-rank N).")
    add("--policy", default=None, type=choice("--policy", POLICIES),
        help="What to do when a worker dies. restart: stop all workers, start all again; the "
        "script resumes from its latest checkpoint. resilient: a standby takes the lost rank's "
        "place in the running job (the script must run with --resilient, or a DeepSpeed "
        "config with a \"resilience\" block); without a standby or a data-parallel twin it "
        "falls back to restart. Default: resilient when the script's --deepspeed_config has "
        "an enabled \"resilience\" block, else restart.")
    add("--standbys", type=non_negative_int, default=None,
        help="Standby processes per worker host (resilient policy; default 1, or the DeepSpeed "
        "config's \"resilience.standbys\").")
    add("--gpus-per-node", dest="gpus_per_node", type=non_negative_int, default=None,
        metavar="N", help="GPUs of each host the job may use: every worker and every standby "
        "owns one (default: the entries of CUDA_VISIBLE_DEVICES, else the driver's count; "
        "without GPUs, any number of processes).")
    add("--spare-hosts", dest="spare_hosts", type=non_negative_int, default=0, metavar="K",
        help="The last K hosts of the job are spare hosts: each runs one standby per slot and "
        "no worker, and recovery and migration take their standbys first (resilient policy; "
        "a hostfile line ending with 'spare' marks one too; in a JobSet pod, MOVER_SPARES).")
    add("--event-log", dest="event_log", default=None, metavar="PATH",
        help="Append the controller's events to PATH as JSON lines.")
    add("--max-restarts", "--max_restarts", dest="max_restarts", type=non_negative_int,
        default=3, help="How many times the restart policy may restart the workers (default 3).")
    add("--inject-failure", dest="inject_failure", action="append", default=[],
        type=injection_argument, metavar="RANK:STEP[:SIGNAL]",
        help="Deliver SIGNAL (default SIGKILL) to global RANK when it begins STEP (1-based). "
        "Repeatable; each fires once. With standbys it fires only once every standby is "
        "ready: at STEP or, if they are not ready by then, at the first step after.")
    add("--inject-migration", dest="inject_migration", action="append", default=[],
        type=migration_argument, metavar="RANK:STEP[:FAULT]",
        help="Migrate global RANK to a standby when it begins STEP, as 'mover migrate --rank "
        "RANK' would (resilient policy). Repeatable; armed like --inject-failure. FAULT kills "
        "a process of the migration with SIGKILL: 'joiner' (in phase 1, once its model is "
        "built), 'leaver' (in phase 2, before its state is sent), 'stayer=S' (rank S, in "
        "phase 2, right after it switched), 'commit=S' (rank S, at its commit all-reduce once "
        "it has the switch notice, before voting) or 'update=S' (rank S, in the switch iteration, "
        "right after that all-reduce).")
    add("--slow-rank-factor", dest="slow_rank_factor", type=factor_above_one, default=None,
        metavar="F", help="Migrate a rank to a standby when its busy time per step (the step "
        "minus its waits for peers) stays above F times the median of all ranks (resilient "
        "policy; off by default).")
    add("--slow-rank-steps", dest="slow_rank_steps", type=positive_int, default=None,
        metavar="N", help="... for N steps in a row (default 5).")
    add("--summary", default=None, metavar="PATH", help="Write a JSON run summary to PATH.")
    add("--stop-grace-s", type=positive_float, default=5.0,
        help="Seconds between SIGTERM and SIGKILL when stopping workers (default 5).")
    add("--exit-timeout-s", type=positive_float, default=60.0,
        help="Seconds a rank's process may take to exit once every script on its host ended; "
             "then it is stopped, its rank done (default 60).")
    add("--refill-delay-s", type=non_negative_float, default=30.0,
        help="Seconds after training resumed from a crash before the lost rank's host starts "
        "a standby to refill the pool, and after a ready standby exited before its host "
        "starts one in its place (default 30; resilient policy).")
    add("--agent-timeout-s", type=positive_float, default=None,
        help="Seconds without a heartbeat from a host's agent before the controller declares "
        "the host lost and recovers all its ranks (default 2, or half the workers' "
        "--resilient-failure-timeout-s if that is less; at least 0.5, and below it).")
    add("--join-timeout-s", type=positive_float, default=300.0,
        help="Seconds to wait for every host's agent to join (default 300); with --join, for "
        "the controller to answer.")
    add("--join", default=None, type=_address_argument, metavar="ADDR:PORT",
        help="Join the running job whose controller's store is at ADDR:PORT (its --master-addr "
        "and --master-port) as a spare host with --nproc-per-node slots (default 1): a host "
        "not in its hostfile, or one that was lost. The job's script and settings come from "
        "its controller: give no script and no other job flag (resilient policy only).")
    add("--host", default=None, metavar="NAME",
        help="With --join: this host's name in the job (default its hostname); a lost host of "
        "that name and slot count is taken back as itself.")
    add("--no-preflight", dest="preflight", action="store_false",
        help="Do not check the script's flags before starting workers.")
    add("-m", "--module", action="store_true",
        help="Treat the script as a Python module name, as 'python -m'.")
    add_deepspeed_flags(add)
    add("script", nargs="?", default=None, help="The training script (or module with -m).")
    add("script_args", nargs=argparse.REMAINDER, help="Arguments of the training script.")
    return parser


def parse_launch_args(argv: Sequence[str], python: str,
                      environ: Optional[Mapping[str, str]] = None
                      ) -> Union[LaunchConfig, JoinConfig]:
    """Parses and checks ``mover-launch`` flags; raises :class:`ConfigError` on bad input.
    With ``--join``, the settings of a host that joins a running job (:class:`JoinConfig`).
    Without host flags, the hosts come from ``environ`` (by default this process's environment)
    when it runs in a Slurm job step (:mod:`mover_plugin.launch.slurm`) or a Kubernetes JobSet
    pod (:mod:`mover_plugin.launch.kubernetes`)."""
    parser = build_parser()
    args = parser.parse_args(list(argv))
    refuse_unsupported(args)
    environ = environ if environ is not None else os.environ
    if args.join is not None:
        return _join_config(args, parser, environ)
    if args.host is not None:
        raise ConfigError(f"--host {args.host} names a host that joins a running job: it goes "
                          "with --join ADDR:PORT (the job's hosts come from --hostfile)")
    if args.script is None:
        raise ConfigError("no training script given: mover-launch [flags] script.py "
                          "[script flags] (or --join ADDR:PORT to add this host to a running "
                          "job)")
    _apply_deepspeed_block(args)
    where = _job_hosts(args, environ)
    nodes, local = where.nodes, where.local
    world_size = sum(node.nproc for node in nodes)
    standbys = _standbys(args)
    gpus = local_gpus(args, environ, [nodes[n] for n in local], standbys)
    for flag, injections in (("--inject-failure", args.inject_failure),
                             ("--inject-migration", args.inject_migration)):
        for injection in injections:
            if injection.rank >= world_size:
                raise ConfigError(
                    f"{flag} {injection.spec()}: rank {injection.rank} does not exist; "
                    f"the job has ranks 0..{world_size - 1}"
                )
    for injection in args.inject_migration:
        killed = injection.fault_rank
        if killed is not None and killed >= world_size:
            raise ConfigError(f"--inject-migration {injection.spec()}: rank {killed} does not "
                              f"exist; the job has ranks 0..{world_size - 1}")
    if args.inject_migration and args.policy != "resilient":
        raise ConfigError(f"--inject-migration {args.inject_migration[0].spec()} needs "
                          "--policy resilient (migration moves a rank to a standby)")
    _check_slow_rank_policy(args)
    agent_timeout_s = _agent_timeout(args)
    target = ["-m", args.script] if args.module else [args.script]
    return LaunchConfig(
        nodes=nodes,
        local_node_ranks=local,
        runs_controller=where.runs_controller,
        master_addr=where.master_addr,
        master_port=where.master_port,
        listen_addr=where.listen_addr,
        command=(python, "-u", *target, *args.script_args),
        policy=args.policy,
        max_restarts=args.max_restarts,
        injections=tuple(args.inject_failure),
        migrations=tuple(args.inject_migration),
        summary_path=args.summary,
        event_log_path=args.event_log,
        standbys=standbys,
        gpus=gpus.count,
        slow_rank_factor=args.slow_rank_factor,
        slow_rank_steps=args.slow_rank_steps or 5,
        stop_grace_s=args.stop_grace_s,
        exit_timeout_s=args.exit_timeout_s,
        refill_delay_s=args.refill_delay_s,
        join_timeout_s=args.join_timeout_s,
        agent_timeout_s=agent_timeout_s,
        preflight=args.preflight,
        script_path=None if args.module else args.script,
        script_args=tuple(args.script_args),
        local_rank_arg=(uses_deepspeed_launcher(argv, args.script_args)
                        and not args.no_local_rank),
    )


@dataclass(frozen=True)
class _JobHosts:
    """Where the job's hosts are, as :func:`_job_hosts` found them."""

    nodes: tuple[NodeSpec, ...]
    local: tuple[int, ...]
    runs_controller: bool
    master_addr: str
    master_port: int
    listen_addr: Optional[str] = None


def _job_hosts(args: argparse.Namespace, environ: Mapping[str, str]) -> _JobHosts:
    """The hosts from the flags, or without host flags from a scheduler's environment (Slurm,
    a Kubernetes JobSet pod; :func:`mover_plugin.launch.hosts.environment_allocation`)."""
    allocation = environment_allocation(args, environ)
    if allocation is None:
        nodes = nodes_of(args, lambda: gpus_on_host(args.gpus_per_node, environ,
                                                    driver_gpu_count).count)
        local, runs_controller = local_nodes(args, nodes)
        return _JobHosts(nodes, local, runs_controller, args.master_addr or DEFAULT_MASTER_ADDR,
                         store_port(args, nodes, local))
    port = (args.master_port if args.master_port is not None else
            allocation.port if allocation.port is not None else DEFAULT_MASTER_PORT)
    return _JobHosts(nodes_of_allocation(args, allocation), (allocation.node_rank,),
                     allocation.node_rank == 0, allocation.master_addr, port,
                     allocation.listen_addr)


def _check_slow_rank_policy(args: argparse.Namespace) -> None:
    if args.slow_rank_steps is not None and args.slow_rank_factor is None:
        raise ConfigError(f"--slow-rank-steps {args.slow_rank_steps} needs --slow-rank-factor "
                          "(the slow-rank policy is off without it)")
    if args.slow_rank_factor is not None and args.policy != "resilient":
        raise ConfigError(f"--slow-rank-factor {args.slow_rank_factor:g} needs --policy "
                          "resilient (a slow rank is migrated to a standby)")


def _agent_timeout(args: argparse.Namespace) -> float:
    """The agents' heartbeat timeout: it must span two beats, and end before a survivor of a
    lost host stops waiting for the alarm (the workers' failure timeout, from the script's
    flags or the DeepSpeed config's block, else the default). Not given, it is
    :data:`DEFAULT_AGENT_TIMEOUT_S` or half the failure timeout, whichever is less."""
    failure, where = _script_failure_timeout(args)
    timeout = args.agent_timeout_s
    if timeout is None:
        timeout = max(min(DEFAULT_AGENT_TIMEOUT_S, failure / 2), 2 * BEAT_PERIOD_S)
        if timeout < failure:
            return timeout
    if timeout < 2 * BEAT_PERIOD_S:
        raise ConfigError(f"--agent-timeout-s {timeout} must be at least {2 * BEAT_PERIOD_S} "
                          f"(agents beat every {BEAT_PERIOD_S} s)")
    if timeout >= failure:
        raise ConfigError(f"--agent-timeout-s {timeout} must be below the workers' failure "
                          f"timeout ({where} {failure}): survivors of a lost host wait that "
                          "long for the alarm, then give up")
    return timeout


def _script_failure_timeout(args: argparse.Namespace) -> tuple[float, str]:
    """The workers' failure timeout and where it is set."""
    from mover_plugin.deepspeed.config import config_path_in, load_ds_config

    flag = "--resilient-failure-timeout-s"
    script_args = list(args.script_args)
    for index, arg in enumerate(script_args):
        text = (arg.split("=", 1)[1] if arg.startswith(flag + "=") else
                script_args[index + 1] if arg == flag and index + 1 < len(script_args) else None)
        if text is not None:
            try:
                return float(text), flag
            except ValueError:
                break  # the script's own check names the bad value
    path = config_path_in(script_args)
    block = load_ds_config(path)[1] if path is not None else None
    if block is not None:
        return block.settings.failure_timeout_s, f"{path}: resilience.failure_timeout_s"
    return ResilienceSettings.failure_timeout_s, f"{flag}, by default,"


def _apply_deepspeed_block(args: argparse.Namespace) -> None:
    """Takes the policy and standbys from the ``"resilience"`` block of the script's DeepSpeed
    config (checked here, before anything starts) where the flags do not set them."""
    from mover_plugin.deepspeed.config import config_path_in, load_ds_config

    path = config_path_in(args.script_args)
    block = load_ds_config(path)[1] if path is not None else None
    enabled = block is not None and block.settings.enabled
    if args.policy is None:
        args.policy = "resilient" if enabled else "restart"
    elif enabled and args.policy != "resilient":
        raise ConfigError(f"--policy {args.policy}: the DeepSpeed config {path} enables "
                          "\"resilience\"; drop --policy or set \"resilience.enabled\" to false")
    elif path is not None and not enabled and args.policy == "resilient":
        raise ConfigError(f"--policy resilient needs a \"resilience\" block in the DeepSpeed "
                          f"config {path} (the workers run the resilience runtime only then)")
    if enabled and args.standbys is None:
        args.standbys = block.standbys


def _standbys(args: argparse.Namespace) -> int:
    if args.policy != "resilient":
        if args.standbys:
            raise ConfigError(
                f"--standbys {args.standbys} needs --policy resilient (the restart policy "
                "uses no standby)"
            )
        return 0
    return 1 if args.standbys is None else args.standbys
