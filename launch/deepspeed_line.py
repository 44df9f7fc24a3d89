"""The ``deepspeed`` launcher's command line, as ``mover-launch`` takes it.

A user's ``deepspeed [flags] train.py [args]`` line works with only the command's name changed.
The flags keep the deepspeed launcher's meanings:

- ``--num_nodes N``: the first N hosts of the hostfile (without a hostfile, one host);
- ``--num_gpus N`` (``--num_accelerators``): slots 0..N-1 of each host;
- ``--include`` / ``--exclude NAME[:SLOT[,SLOT...]][@NAME...]``: those hosts and slots only, or
  all but those (not with ``--num_nodes``/``--num_gpus``). Without a hostfile the one host is
  ``localhost`` and its slots are its GPUs. A host's named slots are the GPUs its processes use
  (``CUDA_VISIBLE_DEVICES``), numbered as the host's GPUs are seen; on a host without GPUs they
  are numbers only, one process each;
- ``--no_local_rank``: the script is not given ``--local_rank``. A line that uses any flag only
  the deepspeed launcher has (:data:`DEEPSPEED_ONLY_FLAGS`) runs as that launcher runs it: each
  process's script gets ``--local_rank=N`` before its own arguments. A line without one runs as
  torchrun runs it: ``LOCAL_RANK`` in the environment only;
- ``--force_multi``, ``--no_ssh``, ``--no_ssh_check``: accepted; ``mover-launch`` starts each
  host's processes the same way for one host or many, and never through ssh;
- ``--no_python`` and the flags of :data:`REFUSED` are refused with the reason, before anything
  starts.

Every check raises :class:`~mover_plugin.errors.ConfigError` naming the bad value.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Optional

from mover_plugin.errors import ConfigError
from mover_plugin.launch.flag_types import positive_int

DEEPSPEED_ONLY_FLAGS = ("--num_gpus", "--num_accelerators", "--num_nodes", "--include",
                        "--exclude", "--no_local_rank", "--force_multi", "--no_ssh",
                        "--no_ssh_check")
"""Spellings only the deepspeed launcher has: a line that uses one gets its behaviour."""

LOCAL_HOST = "localhost"
"""The one host of a line without a hostfile, as ``--include``/``--exclude`` name it."""

REFUSED = {
    "--no_python": "mover-launch runs each rank's script in its own Python interpreter, where "
                   "it installs its hooks; give the Python script itself (drop --no_python)",
    "--launcher": "mover-launch starts every host's processes itself (each host runs "
                  "mover-launch --node_rank N); drop --launcher",
    "--launcher_args": "mover-launch uses no pdsh, MPI or Slurm launcher; drop --launcher_args",
    "--ssh_port": "mover-launch never uses ssh (each host runs mover-launch --node_rank N); "
                  "drop --ssh_port",
    "--elastic_training": "mover-launch's --policy resilient keeps the job running through "
                          "failures; drop --elastic_training",
    "--min_elastic_nodes": "see --elastic_training",
    "--max_elastic_nodes": "see --elastic_training",
    "--autotuning": "run DeepSpeed's autotuning with the deepspeed launcher; drop --autotuning",
}
"""The deepspeed launcher's flags that ``mover-launch`` cannot honour, and why."""
REFUSED_SWITCHES = ("--no_python", "--elastic_training")
"""Those of :data:`REFUSED` that take no value."""


def add_deepspeed_flags(add) -> None:
    """Adds the deepspeed launcher's own flags (``add``: the parser's ``add_argument``)."""
    add("--num_gpus", "--num_accelerators", dest="num_gpus", type=positive_int, default=None,
        metavar="N", help="The deepspeed launcher's: slots 0..N-1 of each host (without a "
        "hostfile, N workers).")
    add("--num_nodes", dest="num_nodes", type=positive_int, default=None, metavar="N",
        help="The deepspeed launcher's: the first N hosts of the hostfile.")
    add("--include", default=None, metavar="NAME[:SLOT,...][@...]",
        help="The deepspeed launcher's: only these hosts, and of each only these slots "
        "(GPUs). Without a hostfile the host is 'localhost'.")
    add("--exclude", default=None, metavar="NAME[:SLOT,...][@...]",
        help="The deepspeed launcher's: all hosts and slots but these.")
    add("--no_local_rank", action="store_true",
        help="Do not pass --local_rank=N to the script (a line with the deepspeed launcher's "
        "flags passes it, as that launcher does).")
    add("--force_multi", "--no_ssh_check", dest="force_multi", action="store_true",
        help="Accepted for the deepspeed launcher's sake: mover-launch starts one host or "
        "many the same way, never through ssh.")
    for flag in REFUSED:
        kind = ({"action": "store_const", "const": True} if flag in REFUSED_SWITCHES
                else {"metavar": "VALUE"})
        add(flag, dest=f"refused_{flag[2:]}", default=None, help=argparse.SUPPRESS, **kind)


def refuse_unsupported(args: argparse.Namespace) -> None:
    """Raises :class:`ConfigError` for the first flag of :data:`REFUSED` given."""
    for flag, why in REFUSED.items():
        if getattr(args, f"refused_{flag[2:]}") is not None:
            raise ConfigError(f"{flag}: {why}")


def uses_deepspeed_launcher(argv: Sequence[str], script_args: Sequence[str]) -> bool:
    """Whether the launcher's part of ``argv`` (before the script's arguments) spells a flag
    only the deepspeed launcher has."""
    own = list(argv)[:len(argv) - len(script_args)]
    return any(arg.split("=", 1)[0] in DEEPSPEED_ONLY_FLAGS for arg in own)


def parse_node_specs(text: str, flag: str) -> dict[str, list[int]]:
    """``NAME[:SLOT[,SLOT...]][@NAME...]`` as host -> sorted slots (empty: all of them)."""
    specs: dict[str, list[int]] = {}
    for part in text.split("@"):
        name, colon, slots = part.partition(":")
        if not name.strip() or (colon and not slots):
            raise ConfigError(f"{flag} {text!r}: {part!r} is not NAME or NAME:SLOT[,SLOT...] "
                              "(e.g. worker-0@worker-1:0,2)")
        numbers = []
        for slot in slots.split(",") if colon else []:
            if not slot.strip().isdigit():
                raise ConfigError(f"{flag} {text!r}: slot {slot!r} of {name} is not a whole "
                                  "number")
            numbers.append(int(slot))
        specs.setdefault(name.strip(), []).extend(numbers)
    return {name: sorted(set(slots)) for name, slots in specs.items()}


def select_slots(pool: dict[str, Optional[int]], args: argparse.Namespace
                 ) -> dict[str, list[int]]:
    """The hosts of ``pool`` (host -> its slot count, None: any number, a host without GPUs and
    no hostfile) the line's ``--num_nodes``/``--num_gpus``/``--include``/``--exclude`` keep,
    in pool order, each with the slots it keeps."""
    if (args.include or args.exclude) and (args.num_nodes or args.num_gpus):
        raise ConfigError("--num_nodes and --num_gpus do not go with --include or --exclude "
                          "(as with the deepspeed launcher): give the hosts and slots one way")
    if args.include and args.exclude:
        raise ConfigError("--include and --exclude do not go together: give one of them")
    if args.include or args.exclude:
        return _filtered(pool, args.include or args.exclude, bool(args.include))
    hosts = list(pool)
    if args.num_nodes is not None:
        if args.num_nodes > len(hosts):
            raise ConfigError(f"--num_nodes {args.num_nodes}: the job has {len(hosts)} host(s)"
                              + ("" if len(hosts) > 1 else " without a hostfile (--hostfile)"))
        hosts = hosts[:args.num_nodes]
    chosen = {}
    for host in hosts:
        count = pool[host]
        if args.num_gpus is not None and count is not None and args.num_gpus > count:
            raise ConfigError(f"--num_gpus {args.num_gpus}: host {host} has {count} slot(s)")
        chosen[host] = list(range(args.num_gpus if args.num_gpus is not None else count or 1))
    return chosen


def _filtered(pool: dict[str, Optional[int]], text: str, include: bool) -> dict[str, list[int]]:
    flag = "--include" if include else "--exclude"
    named = parse_node_specs(text, flag)
    for host, slots in named.items():
        if host not in pool:
            raise ConfigError(f"{flag} {text!r}: host {host!r} is not one of the job's hosts "
                              f"({', '.join(pool)})")
        count = pool[host]
        if count is None and not include:
            raise ConfigError(f"{flag} {text!r}: host {host} has no GPUs to count slots by; "
                              "give a hostfile (host slots=N) or use --include")
        missing = [s for s in slots if count is not None and s >= count]
        if missing:
            raise ConfigError(f"{flag} {text!r}: host {host} has no slot {missing[0]} (its "
                              f"slots are 0..{count - 1})")
        if include and count is None and not slots:
            raise ConfigError(f"{flag} {text!r}: host {host} has no GPUs to count slots by; "
                              f"name its slots ({host}:0,1,...)")
    kept = {}
    for host, count in pool.items():
        every = list(range(count)) if count is not None else []
        if include:
            slots = (named[host] or every) if host in named else []
        elif host not in named:
            slots = every
        else:  # a host named without slots is excluded whole
            slots = [s for s in every if named[host] and s not in named[host]]
        if slots:
            kept[host] = slots
    if not kept:
        raise ConfigError(f"{flag} {text!r} leaves no host to run on")
    return kept
