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
  (:class:`~mover_plugin.comm.process_group.MoverProcessGroup`).

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
from typing import Any

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
WAYS = ("full", "delta-mesh", "delta")

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
    try:
        if not joiner:
            _init_generation(store, 0, rank, world, way)
            _first_collectives(1.0)
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
        if joiner:
            _init_generation(store, 1, rank, world, way)
            rebuilt = len(member_groups())
        elif way == "full":
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
            _init_generation(store, 1, rank, world, way)
            rebuilt = len(member_groups())
        else:
            from megatron.core import parallel_state

            delta = prepare_delta(dist.PrefixStore("gen1/", store), {world - 1},
                                  timeout=TIMEOUT)
            rewire_module_globals(parallel_state, install_delta(delta))
            rebuilt = len(delta.replacements)
        sums = _first_collectives(2.0 if joiner else 1.0)
        cpu, main_cpu = time.process_time() - cpu, time.thread_time() - main_cpu
        above_idle = cpu - idle_rate * (time.perf_counter() - started)
        opened = len(established_connections() - before)
        costs = (time.time() - go, cpu, above_idle, main_cpu, rebuilt, opened)
        results.put((-1 if joiner else rank, costs, sums))
    except BaseException as error:  # reported to the parent, which fails the run
        results.put((rank, None, repr(error)))


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
    processes = [_CONTEXT.Process(target=_rank_main, args=(rank, world, master.port, way,
                                                           False, results), daemon=True)
                 for rank in range(world)]
    processes.append(_CONTEXT.Process(target=_rank_main, args=(world - 1, world, master.port,
                                                               way, True, results),
                                      daemon=True))
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
    args = parser.parse_args()
    if args.repeats < 1 or any(w < 2 * PIPELINE or w % PIPELINE for w in args.world_sizes):
        parser.error(f"--repeats must be >= 1 and world sizes even and >= {2 * PIPELINE}")
    samples: dict[str, dict[tuple[int, str], list[float]]] = {name: {} for name in SERIES}
    for _ in range(args.repeats):
        for world in args.world_sizes:
            for way in WAYS:  # interleaved
                for name, value in measure(world, way).items():
                    samples[name].setdefault((world, way), []).append(value)
    print(f"replacing one rank, TP1 x PP{PIPELINE} x DP(N/2), median of {args.repeats} "
          f"(this machine: {os.cpu_count()} cores shared by all ranks)")
    for name, title in SERIES.items():
        _print_series(title, samples[name], args.world_sizes, goal=name == GOAL_SERIES)


def _print_series(title: str, samples: dict[tuple[int, str], list[float]],
                  world_sizes: list[int], *, goal: bool) -> None:
    medians = {key: statistics.median(values) for key, values in samples.items()}
    print(f"\n{title}")
    print(f"{'world':>6}" + "".join(f"{way:>12}" for way in WAYS) + f"{'full/delta':>12}")
    for world in world_sizes:
        row = [medians[(world, way)] for way in WAYS]
        print(f"{world:>6}" + "".join(f"{value:>12.3f}" for value in row)
              + f"{row[0] / row[-1]:>11.1f}x")
    first, last = world_sizes[0], world_sizes[-1]
    for way in WAYS:
        growth = medians[(last, way)] / medians[(first, way)]
        verdict = f" (goal <= 1.2x: {'met' if growth <= 1.2 else 'MISSED'})"
        print(f"{way}: {first} -> {last} ranks grows {growth:.2f}x"
              + (verdict if goal and way == "delta" else ""))


if __name__ == "__main__":
    main()
