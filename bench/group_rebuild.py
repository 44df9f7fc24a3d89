#!/usr/bin/env python
"""Benchmark: the cost of replacing one rank's process in the groups of a running job, with
delta communicators vs rebuilding every group, at world sizes 4, 8 and 16.

Each world is Megatron-Core's ``parallel_state`` for TP1 x PP2 x DP(N/2) on the ``mover``
backend (gloo), one process per rank. Once every group has carried a collective, the process
of the last rank exits and a pre-started process takes its global rank (as a promoted standby
would). Then, from one common start signal:

* full — every rank destroys all its groups and builds the next generation from scratch
  (``init_process_group`` and ``initialize_model_parallel``) with c10d's gloo connections
  (every member of a group connected to every other at creation), as the runtime did before
  the delta;
* delta-mesh — the delta below, but with c10d's gloo backends (one full mesh per group);
* delta — as the runtime does: the default group is covered by the model-parallel and
  data-parallel groups (:mod:`mover_plugin.comm.world`), the new process builds its groups
  (its default group without connections of its own), every other rank rebuilds only its
  groups that contain the replaced rank (:mod:`mover_plugin.comm.delta`), keeping the rest,
  a group's members connect to their ring neighbours at creation and to other peers on first
  use, and groups with the same members share one gloo backend
  (:class:`~mover_plugin.comm.process_group.MoverProcessGroup`);
* reconfigure — torch 2.14's experimental fault-tolerance API on gloo, in place of new groups:
  each distinct set of members (the world, a stage's data-parallel ranks, a pipeline pair) is
  one ``ProcessGroupGloo`` created with ``enable_reconfigure=True``, configured by exchanging
  its members' reconfigure handles through the store; in the switch the members of the sets
  holding the replaced rank and the new process reconfigure those backends in place with the
  new process's handle (no group object replaced, nothing to rewire), and every other backend is
  kept. c10d's ``new_group`` cannot create groups in that regime (only ``init_process_group``
  can), so this way drives the backends directly rather than through Megatron-Core. Skipped
  on a torch without the API.

Each staying process then runs a first all-reduce on the default group and on its
data-parallel and pipeline groups (the sums check that the new process took part). Printed:
how many groups a staying process rebuilds, and how many peer connections the busiest one
opened during the switch and those first collectives (TCP connections counted in
``/proc``). Then costs as series over the world size, with how each way grows from 4 to 16
ranks (goal: the delta's growth <= 1.2x while the full rebuild grows):

* the CPU seconds the busiest staying process spends on the switch and its first collectives
  — what one rank pays when every rank has its own cores, as on a cluster (the goal is judged
  on this series); and, apart, the new process's (it builds all its groups either way);
* the wall seconds from the start signal until every rank has switched and run its first
  collectives. Here all ranks share this machine's cores, so this series grows with the
  number of processes whatever each of them does.

Every number comes from this one run, the two ways interleaved.

Usage::

    python bench/group_rebuild.py --repeats 2
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import statistics
import time
import warnings
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from common import benchmark_parser
from mover_plugin.comm import register_backend
from mover_plugin.comm.delta import install_delta, member_groups, prepare_delta
from mover_plugin.comm.process_group import MoverProcessGroup
from mover_plugin.comm.world import WorldOptions, cover_world
from mover_plugin.processes import established_connections, parent_death_signal
from mover_plugin.runtime.rewire import rewire_module_globals

WORLD_SIZES = (4, 8, 16)
PIPELINE = 2
TIMEOUT = timedelta(seconds=120)
WAYS = ("full", "delta-mesh", "reconfigure", "delta")

_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "megatron.core.parallel_state"])


def _connect(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)


def _init_generation(store: dist.Store, generation: int, rank: int, world: int,
                     way: str) -> None:
    """The groups of one generation; with the delta the default group is covered by the
    model-parallel and data-parallel groups (as the runtime does), so a newcomer's needs no
    connections of its own."""
    from megatron.core import parallel_state

    covered = way != "full"
    dist.init_process_group("mover", store=dist.PrefixStore(f"gen{generation}/", store),
                            rank=rank, world_size=world, timeout=TIMEOUT,
                            pg_options=WorldOptions(connect=generation == 0 or not covered))
    parallel_state.initialize_model_parallel(1, PIPELINE, create_gloo_process_groups=False)
    if covered:
        cover_world([parallel_state.get_model_parallel_group(),
                     parallel_state.get_data_parallel_group()])


def _first_collectives(value: float) -> list[float]:
    """An all-reduce on the default, data-parallel and pipeline groups; returns the sums."""
    from megatron.core import parallel_state

    sums = []
    for group in (None, parallel_state.get_data_parallel_group(),
                  parallel_state.get_pipeline_model_parallel_group()):
        tensor = torch.tensor([value])
        dist.all_reduce(tensor, group=group)
        sums.append(tensor.item())
    return sums


def _rank_main(rank: int, world: int, port: int, way: str, joiner: bool, results: Any) -> None:
    parent_death_signal(signal.SIGKILL)()
    warnings.filterwarnings("ignore")  # Megatron-Core's deprecation notices, once per rank
    torch.set_num_threads(1)
    register_backend()
    MoverProcessGroup.c10d_gloo = way != "delta"
    store = _connect(port)

    def switch() -> int:
        from megatron.core import parallel_state

        if joiner or way == "full":
            if not joiner:
                parallel_state.destroy_model_parallel()
                dist.destroy_process_group()
            _init_generation(store, 1, rank, world, way)
            return len(member_groups())
        delta = prepare_delta(dist.PrefixStore("gen1/", store), {world - 1}, timeout=TIMEOUT)
        rewire_module_globals(parallel_state, install_delta(delta))
        return len(delta.replacements)

    _measure(store, rank, world, joiner, results,
             warm_up=lambda: _init_generation(store, 0, rank, world, way), switch=switch,
             first_collectives=_first_collectives)


def _measure(store: dist.Store, rank: int, world: int, joiner: bool, results: Any, *,
             warm_up: Callable[[], None], switch: Callable[[], int],
             first_collectives: Callable[[float], list[float]]) -> None:
    """One process's part of a measurement, whichever way: the first generation is built
    (``warm_up``) and used; at the start signal the replaced process exits, the others and the
    new one ``switch`` (returning how many groups they rebuilt) and run their
    ``first_collectives``; the costs and sums go to ``results``."""
    try:
        if not joiner:
            warm_up()
            first_collectives(1.0)
            store.set(f"warm/{rank}", "1")
            if rank == world - 1:
                store.wait(["go"], TIMEOUT)  # the replaced process leaves
                os._exit(0)
        idle_rate = _idle_cpu_rate()
        store.wait(["go"], TIMEOUT)
        go = float(store.get("go"))
        before = established_connections()
        started = time.perf_counter()
        cpu, main_cpu = time.process_time(), time.thread_time()
        rebuilt = switch()
        sums = first_collectives(2.0 if joiner else 1.0)
        cpu, main_cpu = time.process_time() - cpu, time.thread_time() - main_cpu
        above_idle = cpu - idle_rate * (time.perf_counter() - started)
        opened = len(established_connections() - before)
        costs = (time.time() - go, cpu, above_idle, main_cpu, rebuilt, opened)
        results.put((-1 if joiner else rank, costs, sums))
    except BaseException as error:  # reported to the parent, which fails the run
        results.put((rank, None, repr(error)))


def _member_sets(world: int) -> dict[str, tuple[int, ...]]:
    """The distinct sets of members of TP1 x PP2 x DP(N/2), named: the world, each stage's
    data-parallel ranks, each pipeline pair."""
    dp = world // PIPELINE
    sets = {"world": tuple(range(world))}
    sets.update({f"dp{stage}": tuple(range(stage * dp, (stage + 1) * dp))
                 for stage in range(PIPELINE)})
    sets.update({f"pp{index}": tuple(range(index, world, dp)) for index in range(dp)})
    return sets


def _reconfigure(store: dist.Store, name: str, uuid: int, members: tuple[int, ...], rank: int,
                 backend: Any) -> None:
    """Configures ``backend`` (set ``name``) over ``members``: every member posts its handle,
    then all reconfigure with the handles in member order."""
    from torch._C._distributed_c10d import ReconfigureOptions

    store.set(f"rc/{name}/{uuid}/{rank}", backend.get_reconfigure_handle())
    keys = [f"rc/{name}/{uuid}/{member}" for member in members]
    store.wait(keys, TIMEOUT)
    options = ReconfigureOptions()
    options.uuid = uuid
    options.handles = [store.get(key).decode() for key in keys]
    options.timeout = TIMEOUT
    backend.reconfigure(options).wait()


def _reconfigurable_backends(store: dist.Store, rank: int, world: int,
                             uuid: int) -> dict[str, Any]:
    """This rank's backends, one per set holding it, each configured over its members."""
    backends = {}
    for index, (name, members) in enumerate(_member_sets(world).items()):
        if rank in members:
            backend = dist.ProcessGroupGloo(dist.PrefixStore(f"{name}/", store),
                                            members.index(rank), len(members), TIMEOUT,
                                            enable_reconfigure=True)
            _reconfigure(store, name, uuid + index, members, rank, backend)
            backends[name] = backend
    return backends


def _first_collectives_on(backends: dict[str, Any], rank: int, world: int,
                          value: float) -> list[float]:
    """The sums of an all-reduce on the world, data-parallel and pipeline backends."""
    dp = world // PIPELINE
    sums = []
    for name in ("world", f"dp{rank // dp}", f"pp{rank % dp}"):
        tensor = torch.tensor([value])
        backends[name].allreduce([tensor]).wait()
        sums.append(tensor.item())
    return sums


def _reconfigure_rank_main(rank: int, world: int, port: int, joiner: bool,
                           results: Any) -> None:
    """The reconfigure way's process (see the module docstring)."""
    parent_death_signal(signal.SIGKILL)()
    torch.set_num_threads(1)
    store = _connect(port)
    sets = _member_sets(world)
    backends: dict[str, Any] = {}

    def warm_up() -> None:
        backends.update(_reconfigurable_backends(store, rank, world, uuid=0))

    def switch() -> int:
        if joiner:
            backends.update(_reconfigurable_backends(store, rank, world, uuid=100))
            return len(backends)
        mine = [name for name, members in sets.items() if world - 1 in members and rank in members]
        for name in mine:
            _reconfigure(store, name, 100 + list(sets).index(name), sets[name], rank,
                         backends[name])
        return len(mine)

    _measure(store, rank, world, joiner, results, warm_up=warm_up, switch=switch,
             first_collectives=lambda value: _first_collectives_on(backends, rank, world, value))


def _idle_cpu_rate(seconds: float = 0.3) -> float:
    """CPU seconds per second this process spends while its main thread sleeps: mostly gloo's
    network loops (one per group), which wake up periodically whether or not data moves."""
    cpu, wall = time.process_time(), time.perf_counter()
    time.sleep(seconds)
    return (time.process_time() - cpu) / (time.perf_counter() - wall)


def measure(world: int, way: str) -> dict[str, float]:
    """One replacement: the series printed by :func:`main`, keyed as in ``SERIES``."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=TIMEOUT)
    results = _CONTEXT.Queue()

    def process(rank: int, joiner: bool) -> Any:
        if way == "reconfigure":
            target, args = _reconfigure_rank_main, (rank, world, master.port, joiner, results)
        else:
            target, args = _rank_main, (rank, world, master.port, way, joiner, results)
        return _CONTEXT.Process(target=target, args=args, daemon=True)

    processes = [process(rank, False) for rank in range(world)] + [process(world - 1, True)]
    try:
        for process in processes:
            process.start()
        master.wait([f"warm/{rank}" for rank in range(world)], TIMEOUT)
        time.sleep(0.6)  # the warm-up's last connections settle; each rank gauges its idle CPU
        master.set("go", repr(time.time()))
        stayers: list[tuple[float, ...]] = []
        for _ in range(world):
            rank, costs, sums = results.get(timeout=TIMEOUT.total_seconds())
            if costs is None:
                raise SystemExit(f"world {world}, {way}: rank {rank} failed: {sums}")
            _check_sums(world, world - 1 if rank < 0 else rank, sums)
            if rank < 0:
                wall, joiner_cpu = costs[0], costs[1]
            else:
                stayers.append(costs)
        columns = list(zip(*stayers))
        return {"groups": statistics.mean(columns[4]), "connections": max(columns[5]),
                "cpu": max(columns[1]), "cpu_above_idle": max(columns[2]),
                "main_thread_cpu": max(columns[3]), "joiner_cpu": joiner_cpu,
                "wall": max(max(columns[0]), wall)}
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join(timeout=10)


def _check_sums(world: int, rank: int, sums: list[float]) -> None:
    """The new process contributes 2, every other rank 1: each group holding the replaced rank
    sums to its size + 1."""
    dp = world // PIPELINE
    last_stage = rank >= world - dp
    expected = [world + 1.0, dp + (1.0 if last_stage else 0.0),
                PIPELINE + (1.0 if rank % dp == dp - 1 else 0.0)]
    if sums != expected:
        raise SystemExit(f"world {world}: rank {rank} summed {sums}, expected {expected}")


SERIES = {
    "groups": "groups a staying process rebuilds (mean over the staying ranks; with the delta, "
              "groups with the same members share one backend)",
    "connections": "peer connections the busiest staying process opens in the switch and its "
                   "first collectives",
    "cpu": "CPU seconds of the switch and first collectives in the busiest staying process, "
           "all its threads",
    "cpu_above_idle": "the same less the process's idle CPU over the same wall time (what the "
                      "switch costs a rank with cores of its own, as on a cluster: here the "
                      "switch lasts longer as the processes multiply, and gloo's idle network "
                      "loops, one per group, use CPU all the while)",
    "main_thread_cpu": "the same, the main thread's CPU alone (group builds, the ring "
                       "connections, rewiring, issuing and waiting)",
    "joiner_cpu": "CPU seconds of the new process building its groups and running its first "
                  "collectives",
    "wall": "wall seconds until every rank ran its first collectives in the new generation "
            "(all ranks contending for this machine's cores)",
}
GOAL_SERIES = "cpu_above_idle"


def main() -> None:
    parser = benchmark_parser(__doc__, repeats=2)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=list(WORLD_SIZES))
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS),
                        help="the ways to measure (the delta is measured in any case)")
    args = parser.parse_args()
    if args.repeats < 1 or any(w < 2 * PIPELINE or w % PIPELINE for w in args.world_sizes):
        parser.error(f"--repeats must be >= 1 and world sizes even and >= {2 * PIPELINE}")
    ways = [way for way in WAYS if way in args.ways or way == "delta"]
    if "reconfigure" in ways and not hasattr(dist.ProcessGroupGloo, "reconfigure"):
        print(f"reconfigure skipped: torch {torch.__version__} has no reconfigure API (2.14+)")
        ways.remove("reconfigure")
    samples: dict[str, dict[tuple[int, str], list[float]]] = {name: {} for name in SERIES}
    for _ in range(args.repeats):
        for world in args.world_sizes:
            for way in ways:  # interleaved
                for name, value in measure(world, way).items():
                    samples[name].setdefault((world, way), []).append(value)
    print(f"replacing one rank, TP1 x PP{PIPELINE} x DP(N/2), median of {args.repeats} "
          f"(this machine: {os.cpu_count()} cores shared by all ranks; torch {torch.__version__})")
    for name, title in SERIES.items():
        _print_series(title, samples[name], args.world_sizes, ways, goal=name == GOAL_SERIES)


def _print_series(title: str, samples: dict[tuple[int, str], list[float]],
                  world_sizes: list[int], ways: list[str], *, goal: bool) -> None:
    medians = {key: statistics.median(values) for key, values in samples.items()}
    print(f"\n{title}")
    print(f"{'world':>6}" + "".join(f"{way:>12}" for way in ways)
          + "".join(f"{way + '/delta':>18}" for way in ways[:-1]))
    for world in world_sizes:
        row = [medians[(world, way)] for way in ways]
        print(f"{world:>6}" + "".join(f"{value:>12.3f}" for value in row)
              + "".join(f"{value / row[-1]:>17.2f}x" if row[-1] else f"{'-':>18}"
                        for value in row[:-1]))
    first, last = world_sizes[0], world_sizes[-1]
    for way in ways:
        growth = medians[(last, way)] / medians[(first, way)]
        verdict = f" (goal <= 1.2x: {'met' if growth <= 1.2 else 'MISSED'})"
        print(f"{way}: {first} -> {last} ranks grows {growth:.2f}x"
              + (verdict if goal and way == "delta" else ""))


if __name__ == "__main__":
    main()
