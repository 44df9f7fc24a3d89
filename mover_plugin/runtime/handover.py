"""Sending one rank's training state to the process that takes the rank over.

The *source* (the leaving rank in a migration, or a live data-parallel twin after a crash)
and the *joiner* meet in a two-process group of their own, outside the job's process groups
and not aborted by the alarm (a failure elsewhere must not cut a hand-over short; the death of
the other end still ends it with an error):
it rendezvouses under ``gen{g}/handover/{rank}/`` of the control store, so the hand-over needs
neither the old generation's groups (the leaver is not in the new one) nor any other rank.
Tensors travel in place, packed per dtype into one broadcast each, into the joiner's own
tensors of the same shapes (its model was built the same way); everything else (optimizer and
scheduler state, RNG states, the iteration) travels as one serialized object.

The group is gloo's, so tensors travel through host memory: each bucket is packed into one
host buffer (pinned when a GPU holds any of its tensors), sent, and copied into the joiner's
tensors on their own devices. A bucket may mix devices (a peer's copy of a shard on the host,
the parameters on the GPU): only dtypes form buckets, the same on both sides.
The object is written with ``torch.save`` and read with ``torch.load`` onto the joiner's
device: a tensor the source held on its ``cuda:i`` lands on the joiner's current device, which
may have another index (:mod:`mover_plugin.devices`), and a CPU tensor stays on the CPU.
"""

from __future__ import annotations

import functools
import io
from datetime import timedelta
from typing import Any, Optional, Sequence

import torch
from torch.distributed import PrefixStore, Store

from mover_plugin.comm.process_group import MoverProcessGroup
from mover_plugin.contract import handover_prefix
from mover_plugin.errors import StateTransferError

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
        flat = _pack(bucket)
        _broadcast(group, torch.tensor([flat.numel()], dtype=torch.int64))
        _broadcast(group, flat)
    payload = torch.frombuffer(bytearray(serialize(state)), dtype=torch.uint8)
    _broadcast(group, torch.tensor([payload.numel()], dtype=torch.int64))
    _broadcast(group, payload)


def receive_state(group: MoverProcessGroup, tensors: Sequence[torch.Tensor]) -> Any:
    """The joiner's side: fills ``tensors`` in place and returns the source's ``state``."""
    with torch.no_grad():
        for bucket in _buckets(tensors):
            flat = _host_buffer(bucket)
            _expect_numel(group, flat)
            _broadcast(group, flat)
            _unpack(flat, bucket)
    size = torch.zeros(1, dtype=torch.int64)
    _broadcast(group, size)
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    _broadcast(group, payload)
    return deserialize(payload.numpy().tobytes())


def serialize(state: Any) -> bytes:
    """``state`` as bytes, its tensors with the device they are on."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def deserialize(data: bytes, device: Optional[int] = None) -> Any:
    """What :func:`serialize` wrote, its GPU tensors on GPU ``device`` (by default this
    process's current one), its CPU tensors on the CPU."""
    if device is None and torch.cuda.is_available():
        device = torch.cuda.current_device()
    return torch.load(io.BytesIO(data), weights_only=False,
                      map_location=functools.partial(onto_device, device=device))


def onto_device(storage: Any, location: str, *, device: Optional[int]) -> Any:
    """``torch.load``'s ``map_location``: a storage saved on any GPU (``location``
    ``cuda:i``) goes to GPU ``device``; any other stays where ``torch.load`` put it (the
    CPU)."""
    if location.startswith("cuda") and device is not None:
        return storage.cuda(device)
    return storage


def _host_buffer(bucket: Sequence[torch.Tensor]) -> torch.Tensor:
    """A host tensor for a bucket's values, in one piece (pinned when a GPU holds any)."""
    pinned = any(t.device.type == "cuda" for t in bucket)
    return torch.empty(sum(t.numel() for t in bucket), dtype=bucket[0].dtype, pin_memory=pinned)


def _pack(bucket: Sequence[torch.Tensor]) -> torch.Tensor:
    """The bucket's values, one tensor after the other, in a host buffer gloo can send,
    wherever each tensor is (the source's own shard on its GPU, a peer's copy on the host)."""
    flat, offset = _host_buffer(bucket), 0
    for tensor in bucket:
        flat[offset:offset + tensor.numel()].copy_(tensor.detach().reshape(-1))
        offset += tensor.numel()
    return flat


def _unpack(flat: torch.Tensor, bucket: Sequence[torch.Tensor]) -> None:
    """Copies the received values into the bucket's tensors, on their own devices."""
    offset = 0
    for tensor in bucket:
        tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()


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


def _expect_numel(group: MoverProcessGroup, flat: torch.Tensor) -> None:
    """Receives the size of the source's next bucket; raises if it is not ``flat``'s (the
    two sides list different tensors of that dtype: the values would land in the wrong
    tensors)."""
    size = torch.zeros(1, dtype=torch.int64)
    _broadcast(group, size)
    if int(size.item()) != flat.numel():
        raise StateTransferError(
            f"the source sends {int(size.item())} {flat.dtype} elements where this joiner's "
            f"tensors of that dtype hold {flat.numel()}: they were not built alike")


def _broadcast(group: MoverProcessGroup, tensor: torch.Tensor) -> None:
    group.broadcast([tensor], _SOURCE).wait()
