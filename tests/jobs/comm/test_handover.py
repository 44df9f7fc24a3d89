"""A rank's state handed to the process that takes it over (mover_plugin/runtime/handover.py):
over a real two-process group, and the object's tensors put on the joiner's own device."""

from __future__ import annotations

import random
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist

from mover_plugin.runtime.handover import (
    deserialize,
    onto_device,
    open_handover,
    receive_state,
    send_state,
    serialize,
)
from mover_plugin.testing import run_ranks


def hand_over(rank: int, world_size: int) -> dict:
    """Rank 0 is the source, rank 1 the joiner; they meet over the default group's store."""
    store = dist.distributed_c10d._get_default_store()
    group = open_handover(store, 3, 5, source=rank == 0, timeout=timedelta(seconds=20))
    mine = [torch.full((2, 3), float(rank)), torch.arange(4, dtype=torch.int64) * (rank + 1),
            torch.full((5,), -1.0 * rank, dtype=torch.float64)]
    if rank == 0:
        send_state(group, mine, {"optimizer": {"exp_avg": torch.ones(3) * 7}, "iteration": 9,
                                 "rng": random.Random(4).getstate()})
        group.shutdown()
        return {}
    state = receive_state(group, mine)
    group.shutdown()
    exp_avg = state["optimizer"].pop("exp_avg")  # plain values back: the rank exits at once
    return {"tensors": [t.tolist() for t in mine], "state": state,
            "exp_avg": (exp_avg.tolist(), exp_avg.device.type)}


def test_the_joiner_gets_the_source_s_tensors_in_place_and_its_state():
    _, joined = run_ranks(hand_over, 2, timeout_s=60)
    assert joined["tensors"] == [[[0.0] * 3] * 2, [0, 1, 2, 3], [0.0] * 5]
    state = joined["state"]
    assert state["iteration"] == 9 and state["rng"] == random.Random(4).getstate()
    assert joined["exp_avg"] == ([7.0] * 3, "cpu") and state["optimizer"] == {}


def test_a_tensor_saved_on_any_gpu_is_read_onto_the_joiner_s_own_gpu():
    """``torch.load``'s map for the object: what the source held on its ``cuda:i`` goes to the
    joiner's device (another index, perhaps); a CPU tensor (an RNG state) stays on the CPU."""
    moved = []
    storage = SimpleNamespace(cuda=lambda index: moved.append(index) or "on the joiner's GPU")
    assert onto_device(storage, "cuda:3", device=1) == "on the joiner's GPU" and moved == [1]
    assert onto_device(storage, "cpu", device=1) is storage
    assert onto_device(storage, "cuda:0", device=None) is storage  # no GPU here: left as is
    assert moved == [1]
    state = {"rng": torch.get_rng_state(), "step": 3}
    back = deserialize(serialize(state), device=None)
    assert torch.equal(back["rng"], state["rng"]) and back["step"] == 3
