"""A job whose end meets a standby still starting: for the tests of how a job ends.

Workers (``RANK`` set) all-reduce one tensor per step, reporting their progress to the agent;
rank 0 begins its last step only once a marker file of each standby named by ``--await``
exists in ``--markers`` (a refill, or a joining host's standby, started at the last step).
The rank named by ``--hang-at-exit`` leaves a thread that never ends: Python's teardown waits
for it forever, as it would for a stuck communicator or an exchange that never completes.

A standby (``MOVER_STANDBY_ID`` set) writes its marker ``<id>.started``, holding its slot on
the host (its ``LOCAL_RANK``), then:

* the first standby of the first host (``a0.n0.s0``) reports ready and exits 1 — a ready
  standby lost, which the pool replaces with a refill;
* a refill (``.r`` in its id) or a joining host's standby (``.j``) never reports ready (it
  stands for one still importing or warming up) and ignores SIGTERM;
* any other standby reports ready and waits, ignoring SIGTERM.

Every standby that is stopped writes nothing more; one that outlives the job would be found by
its ``MOVER_TEST_TAG``.
"""

import argparse
import os
import signal
import threading
import time
from pathlib import Path

from mover_plugin.contract import STANDBY_ID_ENV
from mover_plugin.progress import ProgressReporter


def standby(standby_id: str, markers: Path) -> None:
    (markers / f"{standby_id}.started").write_text(os.environ["LOCAL_RANK"])
    progress = ProgressReporter.from_env()
    if standby_id == "a0.n0.s0":
        progress.standby_ready()
        time.sleep(0.5)
        raise SystemExit(1)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if ".r" not in standby_id and ".j" not in standby_id:
        progress.standby_ready()
    while True:
        time.sleep(1.0)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    progress = ProgressReporter.from_env()
    progress.ready(0)
    state = torch.zeros(1)
    for step in range(1, args.steps + 1):
        if step == args.steps and rank == 0:
            await_markers(args.markers, args.awaited)
        began = time.time()
        progress.step_begin(step)
        contribution = torch.ones(1) * (rank + step)
        dist.all_reduce(contribution)
        state += contribution
        time.sleep(0.05)
        progress.step_end(step, time.time() - began)
    if rank == 0:
        print(f"STATE {state.item()}", flush=True)
    dist.destroy_process_group()
    if rank == args.hang_at_exit:
        threading.Thread(target=time.sleep, args=(3600.0,), name="never-ends").start()


def await_markers(markers: Path, awaited: list[str], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    paths = [markers / f"{name}.started" for name in awaited]
    while not all(path.exists() for path in paths):
        if time.monotonic() > deadline:
            missing = [path.name for path in paths if not path.exists()]
            raise SystemExit(f"no marker {missing} within {timeout_s} s")
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--markers", type=Path, required=True)
    parser.add_argument("--await", dest="awaited", action="append", default=[],
                        help="a standby id whose start the last step waits for")
    parser.add_argument("--hang-at-exit", type=int, default=-1,
                        help="the rank whose process never ends after its script")
    args = parser.parse_args()
    standby_id = os.environ.get(STANDBY_ID_ENV)
    if standby_id is not None:
        standby(standby_id, args.markers)
    else:
        worker(args)


if __name__ == "__main__":
    main()
