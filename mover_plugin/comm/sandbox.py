"""The sandbox: a c10d backend that talks to no one, for a standby's warm-up.

A standby warms up by building the model and running *shadow iterations* as if it were a rank
of the job, before it knows which rank it will replace. Every collective and point-to-point
operation of those iterations must complete without reaching the job's ranks. After
:func:`register_sandbox_backend`, ``init_process_group("mover_sandbox", store=..., rank=r,
world_size=n)`` makes the default group a :class:`SandboxProcessGroup`, and every ``new_group``
(Megatron-Core's ``initialize_model_parallel``) inherits one: the process sees the job's world
size, its rank and its groups, but each operation completes at once, locally:

- all-reduce, reduce and broadcast leave their tensors as they are (as if every peer held the
  same values, or contributed nothing to a sum);
- all-gather fills every slot with this rank's input, reduce-scatter keeps this rank's chunk;
- a send goes nowhere, a receive (and an all-to-all) delivers zeros; barriers return;
  ``batch_isend_irecv`` does the same for each of its operations.

Outputs are written outside autograd, as a real backend writes them (a pipeline stage receives
into a tensor that requires grad).

The group never touches the store c10d hands it and opens no connection: it has no transport
at all. :func:`operations_served` counts what it answered, so a warm-up can show that it ran
the job's communication pattern; the counts are the ``sandbox`` counters of the process's
:class:`~mover_plugin.comm.context.CommContext`.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from mover_plugin.comm.backend import register_plugin
from mover_plugin.comm.context import SandboxCounters, default_context
from mover_plugin.comm.named import NamedProcessGroup
from mover_plugin.patches import apply_inactive_patches
from mover_plugin.patches.mover_comm import GROUP as MOVER_COMM

SANDBOX_BACKEND = "mover_sandbox"


def _counters() -> SandboxCounters:
    return default_context().sandbox


def operations_served() -> dict[str, int]:
    """How many operations of each kind the sandbox groups of this process answered."""
    counters = _counters()
    with counters.lock:
        return dict(counters.served)


class SandboxProcessGroup(NamedProcessGroup):
    """A group of ``size`` ranks in which this process is ``rank`` and no peer exists."""

    backend_name = SANDBOX_BACKEND

    def __init__(self, rank: int, size: int, group_name: str = "") -> None:
        super().__init__(rank, size, group_name)

    def __repr__(self) -> str:
        return (f"SandboxProcessGroup(name={self._group_name!r}, rank={self.rank()}, "
                f"size={self.size()})")

    def shutdown(self) -> None:
        """Nothing to release."""

    def abort(self, reason: str = "") -> None:  # type: ignore[override]
        """Nothing can be in flight."""

    def _done(self, op: str, result: Any = None) -> dist.Work:
        """A completed work whose result is ``result``."""
        counters = _counters()
        with counters.lock:
            counters.served[op] += 1
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(result if result is not None else [])
        return torch._C._distributed_c10d._create_work_from_future(future)

    # -- reductions and broadcasts: the values stay as they are -----------------------------

    def allreduce(self, tensors: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        return self._done("allreduce", _as_list(tensors))

    def allreduce_coalesced(self, tensors: list[torch.Tensor],  # type: ignore[override]
                            opts: Any = None) -> dist.Work:
        return self._done("allreduce_coalesced", tensors)

    def broadcast(self, tensors: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        return self._done("broadcast", _as_list(tensors))

    def reduce(self, tensors: list[torch.Tensor],  # type: ignore[override]
               opts: Any = None) -> dist.Work:
        return self._done("reduce", tensors)

    def barrier(self, opts: Any = None) -> dist.Work:  # type: ignore[override]
        return self._done("barrier")

    # -- gathers: every slot holds this rank's contribution ----------------------------------

    @torch.no_grad()
    def allgather(self, output_tensors: list[list[torch.Tensor]],  # type: ignore[override]
                  input_tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        for outputs, source in zip(output_tensors, input_tensors):
            for output in outputs:
                output.copy_(source)
        return self._done("allgather", output_tensors)

    @torch.no_grad()
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: Any = None) -> dist.Work:
        _fill_with_copies(output, input)
        return self._done("all_gather_into_tensor", [output])

    _allgather_base = all_gather_single

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]],  # type: ignore[override]
                            input_list: list[torch.Tensor], opts: Any = None) -> dist.Work:
        return self.allgather(output_lists, input_list, opts)

    @torch.no_grad()
    def all_gather_single_coalesced(self, outputs: list[torch.Tensor],
                                    inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:
        for output, source in zip(outputs, inputs):
            _fill_with_copies(output, source)
        return self._done("all_gather_into_tensor_coalesced", outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, output_tensors: list[list[torch.Tensor]],  # type: ignore[override]
               input_tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        if output_tensors:  # only the root has outputs
            return self.allgather(output_tensors, input_tensors, opts)
        return self._done("gather")

    # -- scatters: this rank's chunk ----------------------------------------------------------

    @torch.no_grad()
    def reduce_scatter(self, output_tensors: list[torch.Tensor],  # type: ignore[override]
                       input_lists: list[list[torch.Tensor]], opts: Any = None) -> dist.Work:
        for output, inputs in zip(output_tensors, input_lists):
            output.copy_(inputs[self.rank()])
        return self._done("reduce_scatter", output_tensors)

    @torch.no_grad()
    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: Any = None) -> dist.Work:
        self._take_chunk(output, input)
        return self._done("reduce_scatter_tensor", [output])

    _reduce_scatter_base = reduce_scatter_single

    @torch.no_grad()
    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor],
                                        opts: Any = None) -> dist.Work:
        for output, source in zip(outputs, inputs):
            self._take_chunk(output, source)
        return self._done("reduce_scatter_tensor_coalesced", outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    @torch.no_grad()
    def scatter(self, output_tensors: list[torch.Tensor],  # type: ignore[override]
                input_tensors: list[list[torch.Tensor]], opts: Any = None) -> dist.Work:
        for index, output in enumerate(output_tensors):
            if input_tensors:  # the root holds every chunk
                output.copy_(input_tensors[index][self.rank()])
            else:
                output.zero_()
        return self._done("scatter", output_tensors)

    def _take_chunk(self, output: torch.Tensor, input: torch.Tensor) -> None:
        output.copy_(input.reshape(self.size(), -1)[self.rank()].view_as(output))

    # -- exchanges with peers: nothing arrives -------------------------------------------------

    @torch.no_grad()
    def alltoall(self, output_tensors: list[torch.Tensor],  # type: ignore[override]
                 input_tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        for output in output_tensors:
            output.zero_()
        return self._done("alltoall", output_tensors)

    @torch.no_grad()
    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: list[int], input_split_sizes: list[int],
                          opts: Any = None) -> dist.Work:
        output.zero_()
        return self._done("all_to_all_single", [output])

    alltoall_base = all_to_all_single

    def send(self, tensors: list[torch.Tensor], dst_rank: int,  # type: ignore[override]
             tag: int = 0) -> dist.Work:
        return self._done("send")

    @torch.no_grad()
    def recv(self, tensors: list[torch.Tensor], src_rank: int,  # type: ignore[override]
             tag: int = 0) -> dist.Work:
        for tensor in tensors:
            tensor.zero_()
        return self._done("recv", tensors)

    def recv_anysource(self, tensors: list[torch.Tensor],  # type: ignore[override]
                       tag: int = 0) -> dist.Work:
        return self.recv(tensors, 0, tag)

    def batch_p2p(self, ops: Sequence[dist.P2POp]) -> list[dist.Work]:
        """``batch_isend_irecv`` (the ``mover-comm`` patch hands the group its batch): each
        operation as if issued alone, one work each, as torch issues them on gloo."""
        return [self.send([op.tensor], op.group_peer, op.tag)
                if op.op in (dist.isend, dist.send)
                else self.recv([op.tensor], op.group_peer, op.tag) for op in ops]


def _as_list(tensors: Any) -> list[torch.Tensor]:
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def _fill_with_copies(output: torch.Tensor, input: torch.Tensor) -> None:
    copies = output.numel() // max(1, input.numel())
    output.view(-1).copy_(input.reshape(-1).repeat(copies))


def register_sandbox_backend() -> str:
    """Registers the ``mover_sandbox`` backend with c10d (idempotent); returns its name.

    The process also gets the ``mover-comm`` patches: a sandbox group has no backend to
    present per device (it reaches no one), and torch's own ``batch_isend_irecv`` looks one up
    from torch 2.14 on; patched, it hands the group its batch."""
    apply_inactive_patches(MOVER_COMM)
    return register_plugin(SANDBOX_BACKEND, _create_group)


def _create_group(options: Any, backend_options: Any = None) -> SandboxProcessGroup:
    """c10d's creator hook; the store in ``options`` is deliberately left untouched."""
    return SandboxProcessGroup(options.group_rank, options.group_size,
                               group_name=str(options.group_id))
