"""The operator's side of a running job: its status and planned migrations (API and CLI).

:class:`JobClient` talks to the controller of a job started by ``mover-launch``: it posts a
request to the controller's ``requests`` mailbox and reads the reply the controller writes
under the request's own key. The ``mover`` console script is a thin layer over it::

    mover status                      # generation, membership, standbys, recent events
    mover migrate --rank 3            # move global rank 3 to a standby, wait until it runs
    mover migrate --host node-b       # move every rank of host node-b
    mover migrate --rank 3 --no-wait  # return once the controller accepted the request
    mover report RUN [-o FILE.png]    # a finished (or running) run's interruptions and timeline
    mover templates --hosts 1024 --pipeline-size 16 --num-layers 96 --global-batch-size 4096
    mover simulate --costs summary.json # GPU-hours wasted per week, 1K to 128K GPUs

``status`` and ``migrate`` find the job from ``--master-addr``/``--master-port`` like
``mover-launch``, and with neither given, the one job running on this host
(:mod:`mover_plugin.launch.jobs`). They need the job's secret: ``MOVER_JOB_SECRET``, or on the
job's first host the job's secret file (:mod:`mover_plugin.launch.job_secret`); the job refuses
and logs a wrong one. A request the controller cannot carry out (a rank that does not
exist, no free standby, a rank already being moved, a job that is not resilient) is rejected with
one line that says why, and the job is left untouched.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional, Sequence

import torch.distributed as dist

from mover_plugin.errors import ConfigError, MoverError
from mover_plugin.launch.flag_types import port_number
from mover_plugin.launch import plans, simulation
from mover_plugin.launch.job_secret import operator_secret
from mover_plugin.launch.jobs import find_job, secret_file
from mover_plugin.launch.store_gate import CONTROL_TARGET, GateRefused, StoreRelay
from mover_plugin.mailbox import Mailbox
from mover_plugin.contract import REQUESTS_MAILBOX, request_done_key, request_reply_key


class RequestRejected(MoverError):
    """The controller refused a request (the message says why); the job is untouched."""


class JobClient:
    """A connection to one running job's controller."""

    def __init__(self, master_addr: Optional[str] = None, master_port: Optional[int] = None,
                 *, connect_timeout_s: float = 10.0) -> None:
        self.master_addr, self.master_port = find_job(master_addr, master_port)
        address = f"{self.master_addr}:{self.master_port}"
        secret = operator_secret(secret_file(self.master_addr, self.master_port), address)
        self._relay = StoreRelay(secret, self.master_addr, self.master_port,
                                 connect_timeout_s=connect_timeout_s)
        try:
            self._store = self._relay.client(CONTROL_TARGET, connect_timeout_s)
        except (RuntimeError, OSError) as error:
            raise ConfigError(f"no mover-launch job answers at {self.master_addr}:"
                              f"{self.master_port} ({error})") from None
        self._requests = Mailbox(self._store, REQUESTS_MAILBOX)

    def status(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """The job's generation, membership, standby pool, migrations and recent events."""
        return self._request({"op": "status"}, timeout_s)

    def migrate(self, ranks: Sequence[int] = (), host: Optional[str] = None, *,
                wait: bool = True, timeout_s: float = 600.0) -> dict[str, Any]:
        """Moves ``ranks`` (or every rank of ``host``) to standbys.

        Returns the controller's acceptance (the ranks, standbys and generation), and with
        ``wait`` also the outcome once training runs on the new processes (``downtime_s``).
        Raises :class:`RequestRejected` when the controller refuses.
        """
        if not ranks and host is None:
            raise ConfigError("name the ranks to move (--rank R) or a host (--host H)")
        if ranks and host is not None:
            raise ConfigError("give either ranks (--rank) or a host (--host), not both")
        request = {"op": "migrate", "ranks": [int(r) for r in ranks], "host": host}
        accepted = self._request(request, timeout_s=30.0)
        if not wait:
            return accepted
        done = json.loads(self._wait(request_done_key(accepted["id"]), timeout_s))
        if not done.get("ok"):
            raise RequestRejected(f"migration of ranks {accepted['ranks']} failed: "
                                  f"{done.get('error')}")
        return {**accepted, **done}

    def _request(self, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        request_id = uuid.uuid4().hex
        self._requests.post({**request, "id": request_id})
        reply = json.loads(self._wait(request_reply_key(request_id), timeout_s))
        if not reply.get("ok"):
            raise RequestRejected(reply.get("error", "rejected"))
        return {**reply, "id": request_id}

    def _wait(self, key: str, timeout_s: float) -> bytes:
        try:
            self._store.wait([key], timedelta(seconds=timeout_s))
        except (RuntimeError, dist.DistError) as error:
            if "timeout" in str(error).lower():
                raise RequestRejected(f"the controller did not answer within {timeout_s:g} s "
                                      "(is the job still running?)") from None
            raise RequestRejected(f"lost the job's controller ({error})") from None
        return self._store.get(key)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The ``mover`` console script."""
    args = _parser().parse_args(argv)
    if args.command == "report":
        return _report(args.run, args.output)
    if args.command == "templates":
        return _templates(args)
    if args.command == "simulate":
        return _simulate(args)
    try:
        client = JobClient(args.master_addr, args.master_port)
        if args.command == "status":
            _print_status(client.status(), as_json=args.json)
            return 0
        result = client.migrate(args.rank or (), args.host, wait=not args.no_wait,
                                timeout_s=args.timeout)
    except ConfigError as error:
        print(f"mover: error: {error}", file=sys.stderr)
        return 2
    except (RequestRejected, GateRefused) as error:
        print(f"mover: {error}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result))
        return 0
    moves = ", ".join(f"rank {r} -> standby {s}" for r, s in zip(result["ranks"],
                                                                result["standbys"]))
    print(f"migration accepted: {moves} (generation {result['generation']})")
    if "downtime_s" in result:
        print(f"migration done: training runs on the new processes; downtime "
              f"{result['downtime_s']:.3f} s")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mover", description=__doc__.split("\n\n")[0])
    parser.add_argument("--master-addr", "--master_addr", dest="master_addr",
                        help="the job's --master-addr (default: the job running on this host)")
    parser.add_argument("--master-port", "--master_port", dest="master_port", type=port_number,
                        help="the job's control port (default: the job running on this host)")
    parser.add_argument("--json", action="store_true", help="print the reply as JSON")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("status", help="generation, membership, standbys, recent events")
    migrate = commands.add_parser("migrate", help="move ranks to standbys (planned migration)")
    target = migrate.add_mutually_exclusive_group(required=True)
    target.add_argument("--rank", type=_rank, action="append",
                        help="a global rank to move (repeat for several)")
    target.add_argument("--host", help="move every rank of this host (as in the hostfile)")
    migrate.add_argument("--no-wait", action="store_true",
                         help="return once the controller accepted the migration")
    migrate.add_argument("--timeout", type=float, default=600.0,
                         help="seconds to wait for the migration to finish (default 600)")
    report = commands.add_parser(
        "report", help="a run's interruptions as a table and its timeline as a picture")
    report.add_argument("run", nargs="+", metavar="RUN",
                        help="a folder holding summary.json and events.jsonl, or the run's "
                        "--summary and --event-log files")
    report.add_argument("-o", "--output", type=_png_path, metavar="FILE.png",
                        help="where the picture goes (default: report.png beside the summary)")
    templates = commands.add_parser(
        "templates", help="the pipeline templates and the plan for a number of hosts")
    plans.add_arguments(templates)
    templates.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                           help="print the templates and plans as JSON")
    simulate = commands.add_parser(
        "simulate", help="GPU-hours wasted per week by interruptions, 1K to 128K GPUs")
    simulation.add_arguments(simulate)
    simulate.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                          help="print the rows (system, gpus, wasted_gpu_hours_per_week, ...) "
                          "as JSON")
    return parser


def _simulate(args: argparse.Namespace) -> int:
    try:
        output = _png_path(args.output) if args.output else None
        result = simulation.run(args)
        if output:
            simulation.draw(result, Path(output))
    except (ConfigError, argparse.ArgumentTypeError) as error:
        print(f"mover simulate: error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(result) if args.json else simulation.describe(result))
    if output and not args.json:
        print(f"simulate: chart in {output}")
    return 0


def _templates(args: argparse.Namespace) -> int:
    try:
        result = plans.run(args)
    except ConfigError as error:
        print(f"mover templates: error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(result) if args.json else plans.describe(result))
    return 0


def _report(run: Sequence[str], output: Optional[str]) -> int:
    from mover_plugin.launch.report import report

    try:
        table, picture = report(run, output)
    except ConfigError as error:
        print(f"mover report: error: {error}", file=sys.stderr)
        return 2
    print(table)
    print(f"report: picture in {picture}")
    return 0


def _png_path(text: str) -> str:
    if not text.lower().endswith(".png") or os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a .png file name")
    return text


def _print_status(status: dict[str, Any], *, as_json: bool) -> None:
    if as_json:
        print(json.dumps(status))
        return
    print(f"job: policy {status['policy']}, generation {status['generation']}, "
          f"attempt {status['attempt']}, world size {status['world_size']}")
    for rank, member in sorted(status["membership"].items(), key=lambda kv: int(kv[0])):
        print(f"  rank {rank}: {member['process']} on node {member['node']}")
    standbys = ", ".join(f"{s} (node {n})" for s, n in status["standbys"].items()) or "none"
    print(f"standbys ready: {standbys} (target {status['standby_target']})")
    if status["refilling"]:
        print("standbys starting to refill the pool: " + ", ".join(
            f"{s} (node {n})" for s, n in status["refilling"].items()))
    for key, what in (("lost_hosts", "hosts lost"), ("left_hosts", "hosts left")):
        if status.get(key):
            print(f"{what}: " + ", ".join(
                f"node {n} ({host})" for n, host in status[key].items()))
    for item in status["migrations"]:
        print(f"migration in progress: ranks {item['ranks']} ({item['state']})")
    for event in status["recent_events"]:
        rank = "" if event.get("rank") is None else f" rank {event['rank']}"
        print(f"  {time.strftime('%H:%M:%S', time.localtime(event['time']))} "
              f"gen {event['generation']} {event['event']}{rank}")


def _rank(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a global rank (0, 1, ...)")
    return int(text)


if __name__ == "__main__":
    sys.exit(main())
