#!/usr/bin/env python
"""Benchmark: the cost of replacing one rank's process in the groups of a running job, with
delta communicators vs rebuilding every group, at world sizes 4, 8 and 16.

Each world is Megatron-Core's ``parallel_state`` for TP1 x PP2 x DP(N/2) on the ``mover``
backend (gloo), one process per rank. Once every group has carried a collective, the process
of the last rank exits and a pre-started process takes its global rank (as a promoted standby
would). Then, from one common start signal:

* full — every rank destroys all its groups and builds the next generation from scratch
  (``init_process_group`` and ``initialize_model_parallel``), as the runtime did before the
  delta;
* delta — as the runtime does: the default group is covered by the model-parallel and
  data-parallel groups (:mod:`mover_plugin.comm.world`), the new process builds its groups
  (its default group without connections of its own), and every other rank rebuilds only its
  groups that contain the replaced rank (:mod:`mover_plugin.comm.delta`), keeping the rest.

Printed first: how many groups a staying process rebuilds, and how many peer connections the
busiest one opens for them (each gloo group connects every member to every other). Then two
costs as series over the world size, each full vs delta, with how it grows from 4 to 16 ranks
(goal: the delta's growth <= 1.2x while the full rebuild grows):

* the CPU seconds the busiest staying process spends on the switch itself — what one rank
  pays when every rank has its own cores, as on a cluster (the goal is judged on this
  series); and, apart, the new process's (it builds all its groups either way);
* the wall seconds from the start signal until every rank has switched *and* run a first
  all-reduce on the default group and on its data-parallel and pipeline groups (connections
  made on first use counted; the sums check that the new process took part). Here all ranks
  share this machine's cores, so this series grows with the number of processes whatever
  each of them does.

Every number comes from this one run, the two ways interleaved.

Usage::

    python bench/group_rebuild.py --repeats 2
"""

from __future__ import annotations

import argparse
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

from mover_plugin.comm import register_backend
from mover_plugin.comm.delta import install_delta, member_groups, prepare_delta
from mover_plugin.comm.world import WorldOptions, cover_world
from mover_plugin.processes import parent_death_signal
from mover_plugin.runtime.rewire import rewire_module_globals

WORLD_SIZES = (4, 8, 16)
PIPELINE = 2
TIMEOUT = timedelta(seconds=120)
WAYS = ("full", "delta")

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

    covered = way == "delta"
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
    store = _connect(port)
    try:
        if not joiner:
            _init_generation(store, 0, rank, world, way)
            _first_collectives(1.0)
            store.set(f"warm/{rank}", "1")
            if rank == world - 1:
                store.wait(["go"], TIMEOUT)  # the replaced process leaves
                os._exit(0)
        store.wait(["go"], TIMEOUT)
        go = float(store.get("go"))
        cpu = time.process_time()
        if joiner:
            _init_generation(store, 1, rank, world, way)
            rebuilt = _sizes(member_groups())
        elif way == "full":
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
            _init_generation(store, 1, rank, world, way)
            rebuilt = _sizes(member_groups())
        else:
            from megatron.core import parallel_state

            delta = prepare_delta(dist.PrefixStore("gen1/", store), {world - 1},
                                  timeout=TIMEOUT)
            rewire_module_globals(parallel_state, install_delta(delta))
            rebuilt = [new.size() for _, new in delta.replacements.values()]
        cpu = time.process_time() - cpu
        sums = _first_collectives(2.0 if joiner else 1.0)
        results.put((-1 if joiner else rank, (time.time() - go, cpu, rebuilt), sums))
    except BaseException as error:  # reported to the parent, which fails the run
        results.put((rank, None, repr(error)))


def _sizes(groups: dict[str, Any]) -> list[int]:
    return [len(info.global_ranks) for _, info in groups.values()]


def measure(world: int, way: str) -> tuple[float, float, float, float, int]:
    """Seconds from the start signal until every rank has switched and run its first
    collectives in the new generation; the most CPU seconds a staying process spent on the
    switch itself; the CPU seconds the new process spent building its groups; the mean
    number of groups a staying process rebuilt; the most peer connections a staying process
    opened (a gloo group connects each member to every other: size - 1 each)."""
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
        time.sleep(0.5)  # the warm-up's last connections settle
        master.set("go", repr(time.time()))
        elapsed, stayers, joiner, rebuilt, connections = [], [], 0.0, [], []
        for _ in range(world):
            rank, seconds, sums = results.get(timeout=TIMEOUT.total_seconds())
            if seconds is None:
                raise SystemExit(f"world {world}, {way}: rank {rank} failed: {sums}")
            _check_sums(world, world - 1 if rank < 0 else rank, sums)
            elapsed.append(seconds[0])
            if rank < 0:
                joiner = seconds[1]
            else:
                stayers.append(seconds[1])
                rebuilt.append(len(seconds[2]))
                connections.append(sum(size - 1 for size in seconds[2]))
        return (max(elapsed), max(stayers), joiner, statistics.mean(rebuilt),
                max(connections))
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=list(WORLD_SIZES))
    args = parser.parse_args()
    if args.repeats < 1 or any(w < 2 * PIPELINE or w % PIPELINE for w in args.world_sizes):
        parser.error(f"--repeats must be >= 1 and world sizes even and >= {2 * PIPELINE}")
    walls: dict[tuple[int, str], list[float]] = {}
    stayers: dict[tuple[int, str], list[float]] = {}
    joiners: dict[tuple[int, str], list[float]] = {}
    groups: dict[tuple[int, str], list[float]] = {}
    connections: dict[tuple[int, str], list[float]] = {}
    for _ in range(args.repeats):
        for world in args.world_sizes:
            for way in WAYS:  # interleaved
                wall, stayer, joiner, rebuilt, opened = measure(world, way)
                groups.setdefault((world, way), []).append(rebuilt)
                connections.setdefault((world, way), []).append(opened)
                walls.setdefault((world, way), []).append(wall)
                stayers.setdefault((world, way), []).append(stayer)
                joiners.setdefault((world, way), []).append(joiner)
    print(f"replacing one rank, TP1 x PP{PIPELINE} x DP(N/2), median of {args.repeats} "
          f"(this machine: {os.cpu_count()} cores shared by all ranks)")
    _print_series("groups a staying process rebuilds (mean over the staying ranks)", groups,
                  args.world_sizes, goal=False)
    _print_series("peer connections the busiest staying process opens (what grows with the "
                  "world: the groups holding the replaced rank whose size grows with it)",
                  connections, args.world_sizes, goal=False)
    _print_series("CPU seconds of the switch in the busiest staying process (what a rank pays "
                  "with cores of its own, as on a cluster)", stayers, args.world_sizes,
                  goal=True)
    _print_series("CPU seconds of the new process building its groups (the same code both "
                  "ways: init_process_group + initialize_model_parallel)", joiners,
                  args.world_sizes, goal=False)
    _print_series("wall seconds until every rank ran its first collectives in the new "
                  "generation (all ranks contending for this machine's cores)", walls,
                  args.world_sizes, goal=False)


def _print_series(title: str, samples: dict[tuple[int, str], list[float]],
                  world_sizes: list[int], *, goal: bool) -> None:
    medians = {key: statistics.median(values) for key, values in samples.items()}
    print(f"\n{title}")
    print(f"{'world':>6} {'full rebuild':>13} {'delta':>8} {'full/delta':>11}")
    for world in world_sizes:
        full, delta = medians[(world, "full")], medians[(world, "delta")]
        print(f"{world:>6} {full:>13.3f} {delta:>8.3f} {full / delta:>10.1f}x")
    first, last = world_sizes[0], world_sizes[-1]
    for way in WAYS:
        growth = medians[(last, way)] / medians[(first, way)]
        verdict = f" (goal <= 1.2x: {'met' if growth <= 1.2 else 'MISSED'})"
        print(f"{way}: {first} -> {last} ranks grows {growth:.2f}x"
              + (verdict if goal and way == "delta" else ""))


if __name__ == "__main__":
    main()
