"""Sending one rank's training state to the process that takes the rank over.

The *source* (the leaving rank in a migration, or a live data-parallel twin after a crash)
and the *joiner* meet in a two-process group of their own, outside the job's process groups
and not aborted by the alarm (a failure elsewhere must not cut a hand-over short; the death of
the other end still ends it with an error):
it rendezvouses under ``gen{g}/handover/{rank}/`` of the control store, so the hand-over needs
neither the old generation's groups (the leaver is not in the new one) nor any other rank.
Tensors travel in place, flattened per dtype into one broadcast each, into the joiner's own
tensors of the same shapes (its model was built the same way); everything else (optimizer and
scheduler state, RNG states, the iteration) travels as one pickled object.
"""

from __future__ import annotations

import pickle
from datetime import timedelta
from typing import Any, Sequence

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed import PrefixStore, Store

from mover_plugin.comm.process_group import MoverProcessGroup
from mover_plugin.contract import handover_prefix

_SOURCE, _JOINER = 0, 1


def open_handover(store: Store, generation: int, rank: int, *, source: bool,
                  timeout: timedelta) -> MoverProcessGroup:
    """The two-process group for handing ``rank`` over in generation ``generation``; blocks
    until the other side opens it too."""
    return MoverProcessGroup(PrefixStore(handover_prefix(generation, rank), store),
                             _SOURCE if source else _JOINER, 2, timeout,
                             group_name=f"handover-g{generation}-r{rank}", use_cuda=False,
                             abortable=False)


def send_state(group: MoverProcessGroup, tensors: Sequence[torch.Tensor], state: Any) -> None:
    """The source's side: ``tensors`` (in the order the joiner lists its own) and ``state``."""
    for bucket in _buckets(tensors):
        _broadcast(group, _flatten_dense_tensors([t.detach() for t in bucket]))
    payload = torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)
    _broadcast(group, torch.tensor([payload.numel()], dtype=torch.int64))
    _broadcast(group, payload)


def receive_state(group: MoverProcessGroup, tensors: Sequence[torch.Tensor]) -> Any:
    """The joiner's side: fills ``tensors`` in place and returns the source's ``state``."""
    with torch.no_grad():
        for bucket in _buckets(tensors):
            flat = _flatten_dense_tensors([t.detach() for t in bucket])
            _broadcast(group, flat)
            for tensor, value in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                tensor.copy_(value)
    size = torch.zeros(1, dtype=torch.int64)
    _broadcast(group, size)
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    _broadcast(group, payload)
    return pickle.loads(payload.numpy().tobytes())


def module_state_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors of ``module``'s state dict (parameters and buffers) in the order of their
    names: the same list at a source and at a joiner whose module was built the same way."""
    return [tensor.data for _, tensor in sorted(module.state_dict(keep_vars=True).items())
            if isinstance(tensor, torch.Tensor)]


def _buckets(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    return [by_dtype[dtype] for dtype in sorted(by_dtype, key=str)]


def _broadcast(group: MoverProcessGroup, tensor: torch.Tensor) -> None:
    group.broadcast([tensor], _SOURCE).wait()
