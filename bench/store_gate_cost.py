#!/usr/bin/env python
"""Benchmark: what the job's port costs the store's users — one store operation, and the
rendezvous of a gloo group — through the gate and a host's relay vs straight at the store.

Every process of a job reaches the controller's stores through its host's relay and the gate
(mover_plugin/launch/store_gate.py): two hops written in Python, each a selector thread that
passes the bytes on (the gate's in a process of its own). A recovery's store traffic is mostly
the rendezvous of the groups it rebuilds, so both are measured, from this process (the store,
the relay and the clients) the two ways interleaved:

* a store ``get`` of a small value, the median over ``--ops`` operations;
* a gloo group of ``--group-size`` ranks (threads of this process, each with its own store
  client) created over a fresh prefix and its first all-reduce, the median over repeats.

Printed: each figure both ways and their ratio, then ``STORE_OP_US`` and ``GLOO_GROUP_MS``
lines. Usage::

    python bench/store_gate_cost.py [--repeats 5] [--ops 2000] [--group-size 4]
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from common import benchmark_parser  # noqa: E402

from mover_plugin.launch.store_gate import (  # noqa: E402
    CONTROL_TARGET,
    LOOPBACK,
    StoreGate,
    StoreRelay,
    host_loopback_store,
)

SECRET = b"bench-job-secret-0123456789"
TIMEOUT = timedelta(seconds=60)


def main() -> None:
    parser = benchmark_parser(__doc__, repeats=5)
    parser.add_argument("--ops", type=int, default=2000)
    parser.add_argument("--group-size", type=int, default=4)
    args = parser.parse_args()
    store = host_loopback_store()
    gate = StoreGate(SECRET, LOOPBACK, 0, {CONTROL_TARGET: store.port})
    relay = StoreRelay(SECRET, LOOPBACK, gate.port)
    relay.client(CONTROL_TARGET, timeout_s=10)  # the gate answers
    ports = {"direct": store.port, "gate": relay.port_for(CONTROL_TARGET)}
    op_us: dict[str, list[float]] = {way: [] for way in ports}
    group_ms: dict[str, list[float]] = {way: [] for way in ports}
    for repeat in range(args.repeats):
        for way, port in ports.items():
            op_us[way].append(_store_op_us(port, args.ops))
            group_ms[way].append(_gloo_group_ms(port, args.group_size, f"{way}/{repeat}"))
    gate.close()
    _report("store get (us)", "STORE_OP_US", op_us)
    _report(f"gloo group of {args.group_size} (ms)", "GLOO_GROUP_MS", group_ms)


def _client(port: int) -> dist.TCPStore:
    return dist.TCPStore(LOOPBACK, port, is_master=False, wait_for_workers=False,
                         timeout=TIMEOUT)


def _store_op_us(port: int, ops: int) -> float:
    client = _client(port)
    client.set("value", "x" * 64)
    times = []
    for _ in range(ops):
        started = time.perf_counter()
        client.get("value")
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def _gloo_group_ms(port: int, size: int, prefix: str) -> float:
    clients = [_client(port) for _ in range(size)]
    started = time.perf_counter()
    _run_threads([lambda rank=rank: _gloo_rank(clients[rank], prefix, rank, size)
                  for rank in range(size)])
    return (time.perf_counter() - started) * 1e3


def _gloo_rank(client: dist.TCPStore, prefix: str, rank: int, size: int) -> None:
    options = dist.ProcessGroupGloo._Options()
    options._timeout = TIMEOUT
    options._devices = [dist.ProcessGroupGloo.create_default_device()]
    group = dist.ProcessGroupGloo(dist.PrefixStore(prefix, client), rank, size, options)
    total = torch.ones(1)
    group.allreduce([total]).wait()
    assert total.item() == size


def _run_threads(targets: list[Callable[[], None]]) -> None:
    errors: list[BaseException] = []

    def guarded(target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as error:  # reported below, on the main thread
            errors.append(error)

    threads = [threading.Thread(target=guarded, args=(t,)) for t in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def _report(label: str, key: str, values: dict[str, list[float]]) -> None:
    direct, gated = (statistics.median(values[way]) for way in ("direct", "gate"))
    print(f"{label}: direct {direct:.1f}, through the gate {gated:.1f} "
          f"({gated / direct:.2f}x; runs: {', '.join(f'{v:.1f}' for v in values['gate'])})")
    print(f"{key} direct {direct:.1f} gate {gated:.1f} ratio {gated / direct:.2f}")


if __name__ == "__main__":
    main()
