"""``python -m mover_plugin.gpu_check``: what anyone with a GPU runs first.

It runs every check this machine allows and prints one line per check, then a summary::

    GPU_CHECK <name> PASS|FAIL|SKIP <figures or reason>
    GPU_CHECK summary passed P failed F skipped S

The exit status is 0 unless a check failed. A check that needs more GPUs than the machine has is
skipped with the reason; on a machine without CUDA only the checks that need none run. Each
check runs in processes of its own with a time limit (a hang is a failure, not a hung command),
so the whole run stays within minutes.

The checks (GPUs needed):

- ``cuda`` (1): torch's CUDA and NCCL versions, the GPUs.
- ``nccl_env`` (0): ``register_backend()`` sets the NCCL environment a survivor needs
  (:mod:`mover_plugin.comm.nccl_env`).
- ``device_binding`` (1): a process started with ``LOCAL_RANK=i`` through the worker command
  (``python -m mover_plugin.launch.run``) has ``cuda:i`` current when its script runs, for each
  GPU (:mod:`mover_plugin.devices`).
- ``nccl_group`` (1): a one-rank ``mover`` group, made with ``device_id``, all-gathers a CUDA
  tensor through NCCL (its CUDA backend is NCCL's, an operation's future is on the device),
  aborts and shuts down; the times of each.
- ``rng_redo`` (1): Megatron's RNG snapshot (:func:`mover_plugin.megatron.checkpoint
  .capture_rng_state`) restores CUDA dropout: a redone forward equals the first.
- ``handover`` (1): a rank's state handed from one process to another (:mod:`mover_plugin
  .runtime.handover`): a GPU tensor, a host tensor and an object holding a GPU tensor, which
  lands on the joiner's own device (with two GPUs or more, another index than the source's).
- ``peer_loss`` (2): one rank of a two-rank ``mover`` group is SIGKILLed while the other waits
  in an all-reduce on CUDA tensors; the alarm comes 2 s later. The survivor must live, leave
  the collective, and synchronise its device; the times, ``pending_operations()`` and
  ``idle`` are printed.
- ``hung_groups`` (2): the peer of two groups stays alive but joins nothing more, so two
  all-reduces hang in their kernels; the alarm comes 2 s later. Both communicators must be
  aborted (concurrently) and the device synchronise; the times are printed.
- ``batch_p2p`` (2): a 64 MB exchange both ways with ``batch_isend_irecv`` on a ``mover``
  group (Megatron's pipeline with ``batch_p2p_comm``), checked and timed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

CHILD_TIMEOUT_S = 90.0
"""The limit of one check's processes."""
RESULT = "GPU_CHECK_RESULT "
"""The line a check's process prints its result on (JSON)."""
ALARM_AFTER_S = 2.0


@dataclass(frozen=True)
class Outcome:
    status: str
    """``PASS``, ``FAIL`` or ``SKIP``."""
    detail: str


@dataclass(frozen=True)
class Check:
    name: str
    gpus: int
    run: Callable[[int], Outcome]
    """Called with the machine's GPU count."""


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return _child(argv[1], int(argv[2]), int(argv[3]), int(argv[4]))
    gpus = _gpu_count()
    counts = {"PASS": 0, "FAIL": 0, "SKIP": 0}
    for check in CHECKS:
        if gpus < check.gpus:
            outcome = Outcome("SKIP", _too_few(check.gpus, gpus))
        else:
            try:
                outcome = check.run(gpus)
            except Exception as error:  # noqa: BLE001 - a check's own error is its failure
                outcome = Outcome("FAIL", f"{type(error).__name__}: {error}")
        counts[outcome.status] += 1
        print(f"GPU_CHECK {check.name} {outcome.status} {outcome.detail}", flush=True)
    print(f"GPU_CHECK summary passed {counts['PASS']} failed {counts['FAIL']} "
          f"skipped {counts['SKIP']}", flush=True)
    return 1 if counts["FAIL"] else 0


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _too_few(needed: int, gpus: int) -> str:
    if gpus == 0:
        return "needs CUDA; torch sees no GPU here"
    return f"needs {needed} GPUs; this machine has {gpus}"


# -- checks run from the parent -------------------------------------------------------------


def check_cuda(gpus: int) -> Outcome:
    import torch

    names = sorted({torch.cuda.get_device_name(i) for i in range(gpus)})
    version = torch.cuda.nccl.version()
    nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    return Outcome("PASS", f"torch {torch.__version__} CUDA {torch.version.cuda} NCCL {nccl} "
                   f"gpus {gpus} ({', '.join(names)})")


def check_nccl_env(gpus: int) -> Outcome:
    from mover_plugin.comm.nccl_env import RESILIENT_NCCL_ENV

    env = {k: v for k, v in os.environ.items() if k not in RESILIENT_NCCL_ENV}
    program = ("import json, os\nfrom mover_plugin.comm import register_backend\n"
               "register_backend()\n"
               f"print({RESULT!r} + json.dumps({{k: os.environ.get(k) for k in "
               f"{sorted(RESILIENT_NCCL_ENV)!r}}}))\n")
    seen = _results([_start([sys.executable, "-c", program], env)])[0]
    if "status" in seen:
        return _from_child(seen)
    return Outcome("PASS" if seen == RESILIENT_NCCL_ENV else "FAIL",
                   " ".join(f"{k}={v}" for k, v in sorted(seen.items())))


BINDING_SCRIPT = ("import json, os, torch\n"
                  f"print({RESULT!r} + json.dumps({{'local_rank': int(os.environ['LOCAL_RANK']), "
                  "'current': torch.cuda.current_device()}))\n")


def check_device_binding(gpus: int) -> Outcome:
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "current_device.py"
        script.write_text(BINDING_SCRIPT)
        processes = [_start([sys.executable, "-m", "mover_plugin.launch.run", str(script)],
                            {**os.environ, "LOCAL_RANK": str(i)}) for i in range(gpus)]
        results = _results(processes)
    wrong = [r for r in results if r["current"] != r["local_rank"]]
    found = " ".join(f"{r['local_rank']}->cuda:{r['current']}" for r in results)
    return Outcome("FAIL" if wrong else "PASS", f"LOCAL_RANK->current device: {found}")


def _run_ranks(name: str, world: int) -> list[dict[str, Any]]:
    """Runs check ``name``'s child on ``world`` processes, rank ``i`` on GPU ``i``, joined by a
    TCPStore this process hosts."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    command = [sys.executable, "-m", "mover_plugin.gpu_check", "--child", name]
    return _results([_start([*command, str(rank), str(world), str(store.port)],
                            {**os.environ, "LOCAL_RANK": str(rank)}) for rank in range(world)])


def check_nccl_group(gpus: int) -> Outcome:
    (result,) = _run_ranks("nccl_group", 1)
    return _from_child(result)


def check_rng_redo(gpus: int) -> Outcome:
    if importlib.util.find_spec("megatron") is None:
        return Outcome("SKIP", "needs megatron-core (pip install mover_plugin[megatron])")
    (result,) = _run_ranks("rng_redo", 1)
    return _from_child(result)


def check_handover(gpus: int) -> Outcome:
    joiner = _run_ranks("handover", 2)[1]
    return _from_child(joiner)


def check_peer_copy_memory(gpus: int) -> Outcome:
    (result,) = _run_ranks("peer_copy_memory", 1)
    return _from_child(result)


def check_peer_loss(gpus: int) -> Outcome:
    survivor = _run_ranks("peer_loss", 2)[0]
    return _from_child(survivor)


def check_hung_groups(gpus: int) -> Outcome:
    survivor = _run_ranks("hung_groups", 2)[0]
    return _from_child(survivor)


def check_batch_p2p(gpus: int) -> Outcome:
    results = _run_ranks("batch_p2p", 2)
    failed = [r for r in results if r["status"] != "PASS"]
    return _from_child(failed[0] if failed else results[0])


def _from_child(result: dict[str, Any]) -> Outcome:
    return Outcome(result["status"], result["detail"])


CHECKS = (
    Check("cuda", 1, check_cuda),
    Check("nccl_env", 0, check_nccl_env),
    Check("device_binding", 1, check_device_binding),
    Check("nccl_group", 1, check_nccl_group),
    Check("rng_redo", 1, check_rng_redo),
    Check("handover", 1, check_handover),
    Check("peer_copy_memory", 1, check_peer_copy_memory),
    Check("peer_loss", 2, check_peer_loss),
    Check("hung_groups", 2, check_hung_groups),
    Check("batch_p2p", 2, check_batch_p2p),
)


# -- processes --------------------------------------------------------------------------------


def _start(command: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def _results(processes: list[subprocess.Popen]) -> list[dict[str, Any]]:
    """Each process's result (the JSON of its result line), in order; a process that printed
    none (it failed, was killed as a check's lost peer, or ran past :data:`CHILD_TIMEOUT_S`
    and was killed) gives a FAIL naming why."""
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    results = []
    for process in processes:
        try:
            out, err = process.communicate(timeout=max(0.1, deadline - time.monotonic()))
            how = f"exit code {process.returncode}"
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            out, err = process.communicate()
            how = f"no result within {CHILD_TIMEOUT_S:.0f} s"
        lines = [line for line in out.splitlines() if line.startswith(RESULT)]
        if lines:
            results.append(json.loads(lines[-1][len(RESULT):]))
        else:
            tail = " | ".join(err.strip().splitlines()[-3:])
            results.append({"status": "FAIL", "detail": f"{how}: {tail}"})
    return results


# -- the checks' own processes ----------------------------------------------------------------


def _child(name: str, rank: int, world: int, port: int) -> int:
    import torch

    torch.cuda.set_device(rank % torch.cuda.device_count())
    try:
        status, detail = CHILDREN[name](rank, world, port)
    except Exception as error:  # noqa: BLE001 - reported as the check's failure
        status, detail = "FAIL", f"{type(error).__name__}: {error}"
    print(RESULT + json.dumps({"status": status, "detail": detail}), flush=True)
    sys.stdout.flush()
    os._exit(0)  # a survivor's teardown would wait for the aborted communicator's threads


def _world(rank: int, world: int, port: int, device_id: Any = None) -> Any:
    from datetime import timedelta

    import torch.distributed as dist

    from mover_plugin.comm import register_backend

    register_backend()
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("mover", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=60), device_id=device_id)
    return dist.group.WORLD


def _child_nccl_group(rank: int, world: int, port: int) -> tuple[str, str]:
    import torch
    import torch.distributed as dist

    started = time.monotonic()
    # device_id: c10d connects the group's NCCL backend at once (it looks it up by device)
    group = _world(rank, world, port, device_id=torch.device("cuda", torch.cuda.current_device()))
    backend = type(group._get_backend(torch.device("cuda"))).__name__
    tensor = torch.full((1024,), 2.0, device="cuda")
    gathered = torch.empty_like(tensor)
    dist.all_gather_into_tensor(gathered, tensor)  # NCCL's (an all-reduce of one needs none)
    torch.cuda.synchronize()
    made = time.monotonic() - started
    again = torch.empty_like(tensor)
    future = dist.all_gather_into_tensor(again, tensor * 2, async_op=True).get_future()
    doubled = future.then(lambda done: done.value()[0] * 1).wait()  # ordered on this stream
    future_ok = bool(torch.all(doubled == 4.0)) and doubled.is_cuda
    began = time.monotonic()
    group.abort("gpu_check")
    aborted = time.monotonic() - began
    began = time.monotonic()
    dist.destroy_process_group()
    shut = time.monotonic() - began
    ok = bool(torch.all(gathered == 2.0)) and future_ok and backend == "ProcessGroupNCCL"
    return ("PASS" if ok else "FAIL",
            f"init+all_gather {made:.2f} s abort {aborted * 1e3:.1f} ms "
            f"shutdown {shut * 1e3:.1f} ms result {'right' if ok else 'wrong'} "
            f"(cuda backend {backend}; future {'right' if future_ok else 'wrong'})")


def _child_rng_redo(rank: int, world: int, port: int) -> tuple[str, str]:
    import torch

    from mover_plugin.megatron.checkpoint import capture_rng_state, restore_rng_state

    torch.manual_seed(1234)
    dropout = torch.nn.Dropout(0.5)
    x = torch.ones(1 << 16, device="cuda")
    snapshot = capture_rng_state()
    first = dropout(x)
    restore_rng_state(snapshot)
    redone = dropout(x)
    other = dropout(x)
    same, moved = torch.equal(first, redone), not torch.equal(first, other)
    return ("PASS" if same and moved else "FAIL",
            f"redone forward equal {same}; next forward differs {moved}; "
            f"snapshot holds cuda {'cuda' in snapshot}")


def _child_handover(rank: int, world: int, port: int) -> tuple[str, str]:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from mover_plugin.runtime.handover import open_handover, receive_state, send_state

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    group = open_handover(store, 0, 0, source=rank == 0, timeout=timedelta(seconds=60))
    shard = torch.full((1 << 20,), float(1 - rank), device="cuda")
    copy = torch.full((1 << 10,), float(1 - rank))  # a peer's copy, on the host
    began = time.monotonic()
    if rank == 0:
        send_state(group, [shard, copy], {"exp_avg": torch.full((8,), 3.0, device="cuda")})
        group.shutdown()
        return "PASS", "sent"
    state = receive_state(group, [shard, copy])
    took = time.monotonic() - began
    group.shutdown()
    exp_avg = state["exp_avg"]
    ok = (bool(torch.all(shard == 1.0)) and bool(torch.all(copy == 1.0))
          and exp_avg.device == torch.device("cuda", torch.cuda.current_device())
          and bool(torch.all(exp_avg == 3.0)))
    return ("PASS" if ok else "FAIL",
            f"4 MB on the GPU and 4 KB on the host in {took * 1e3:.1f} ms; the state's tensor "
            f"on {exp_avg.device} (joiner's current cuda:{torch.cuda.current_device()}); "
            f"values {'right' if ok else 'wrong'}")


def _child_peer_copy_memory(rank: int, world: int, port: int) -> tuple[str, str]:
    import torch

    from mover_plugin.host_memory import PageLockedBuffer

    numel, gib = (5 << 29) // 4, 2.5  # a 2.5 GiB fp32 shard
    shard = torch.full((numel,), 1.5, device="cuda")
    before = _pinned_bytes()
    cached = torch.empty(numel, pin_memory=True)
    by_torch = _pinned_bytes() - before  # rounded up to a power of two
    del cached  # back to torch's cache, still page-locked
    began = time.monotonic()
    buffer = PageLockedBuffer(numel, torch.float32)
    registered_s = time.monotonic() - began
    unseen = _pinned_bytes() - before == by_torch
    began = time.monotonic()
    buffer.tensor.copy_(shard, non_blocking=True)
    torch.cuda.synchronize()
    copied_s = time.monotonic() - began
    right = bool(torch.all(buffer.tensor[::1 << 16] == 1.5))
    pinned = buffer.tensor.is_pinned()
    locked = buffer.nbytes / 2**30
    buffer.release()
    ok = pinned and unseen and right and locked == gib
    return ("PASS" if ok else "FAIL",
            f"a {gib} GiB shard: torch's pinned memory takes {by_torch / 2**30:.2f} GiB, the "
            f"peer copy's buffer {locked:.2f} GiB (page-locked {pinned}, in {registered_s:.2f} "
            f"s, outside torch's allocator {unseen}); GPU to it {gib / copied_s:.1f} GiB/s; "
            f"values {'right' if right else 'wrong'}")


def _pinned_bytes() -> int:
    """Page-locked bytes torch's caching host allocator holds."""
    import torch

    return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))


def _child_peer_loss(rank: int, world: int, port: int) -> tuple[str, str]:
    import torch
    import torch.distributed as dist

    from mover_plugin.comm import CollectiveAborted, raise_alarm

    group = _world(rank, world, port)
    tensor = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(tensor)
    torch.cuda.synchronize()
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    timer = threading.Timer(ALARM_AFTER_S, raise_alarm, args=("gpu_check: peer lost",))
    timer.start()
    began = time.monotonic()
    try:
        dist.all_reduce(tensor)
        tensor.sum().item()
        return "FAIL", "the all-reduce with a lost peer completed"
    except CollectiveAborted:
        how = "aborted by the alarm"
    except RuntimeError as error:  # the backend saw the peer's loss first
        how = f"the backend's error ({type(error).__name__})"
    left = time.monotonic() - began
    pending, idle = group.pending_operations(), group.idle
    began = time.monotonic()
    torch.cuda.synchronize()
    synced = time.monotonic() - began
    ok = left < ALARM_AFTER_S + 3.0 and not idle
    return ("PASS" if ok else "FAIL",
            f"left the collective after {left:.2f} s, {how} (alarm at {ALARM_AFTER_S:.0f} s); "
            f"synchronize {synced:.2f} s; pending_operations {pending}; idle {idle}")


def _child_hung_groups(rank: int, world: int, port: int) -> tuple[str, str]:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from mover_plugin.comm import CollectiveAborted, raise_alarm

    _world(rank, world, port)
    groups = [dist.new_group([0, 1]) for _ in range(2)]
    tensor = torch.ones(1 << 20, device="cuda")
    for group in groups:  # each communicator made and used once
        dist.all_reduce(tensor, group=group)
    torch.cuda.synchronize()
    dist.barrier()
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    if rank == 1:  # alive, but joins nothing more until rank 0 is done
        store.wait(["hung_groups/done"], timedelta(seconds=CHILD_TIMEOUT_S))
        return "PASS", "stayed away"
    works = [dist.all_reduce(tensor, group=group, async_op=True) for group in groups]
    threading.Timer(ALARM_AFTER_S, raise_alarm, args=("gpu_check: peer hung",)).start()
    began = time.monotonic()
    left = 0
    for work in works:
        try:
            work.wait()
        except CollectiveAborted:
            left += 1
    waited = time.monotonic() - began
    began = time.monotonic()
    torch.cuda.synchronize()
    synced = time.monotonic() - began
    store.set("hung_groups/done", "1")
    ok = left == 2 and waited < ALARM_AFTER_S + 3.0
    return ("PASS" if ok else "FAIL",
            f"two groups with hung all-reduces left {left}/2 after {waited:.2f} s "
            f"(alarm at {ALARM_AFTER_S:.0f} s); synchronize {synced:.2f} s")


def _child_batch_p2p(rank: int, world: int, port: int) -> tuple[str, str]:
    import torch
    import torch.distributed as dist

    _world(rank, world, port)
    peer = 1 - rank
    send = torch.full((16 << 20,), float(rank + 1), device="cuda")  # 64 MB of float32
    receive = torch.empty_like(send)
    began = time.monotonic()
    ops = [dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, receive, peer)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    torch.cuda.synchronize()
    took = time.monotonic() - began
    ok = bool(torch.all(receive == float(peer + 1)))
    return ("PASS" if ok else "FAIL",
            f"64 MB each way in {took * 1e3:.1f} ms; data {'right' if ok else 'wrong'}")


CHILDREN: dict[str, Callable[[int, int, int], tuple[str, str]]] = {
    "nccl_group": _child_nccl_group,
    "rng_redo": _child_rng_redo,
    "handover": _child_handover,
    "peer_copy_memory": _child_peer_copy_memory,
    "peer_loss": _child_peer_loss,
    "hung_groups": _child_hung_groups,
    "batch_p2p": _child_batch_p2p,
}


if __name__ == "__main__":
    sys.exit(main())
