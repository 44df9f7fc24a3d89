"""The data-parallel communication Megatron-Core's ``DistributedDataParallel`` keeps in flight
inside an iteration, dropped when the iteration is; and a joiner's first iteration gathering
parameters as the running ranks' iterations do.

With ``--overlap-grad-reduce`` each bucket group holds the handle of its asynchronous
gradient reduction from the moment its last gradient is ready until ``finish_grad_sync`` waits
for it, and counts which gradients are ready. With ``--overlap-param-gather`` (the distributed
optimizer) an update leaves each rank's parameters current in its own shard only: the next
iteration's forward pass gathers every bucket's parameters (dispatched by the first
micro-batch or a module's forward pre-hook, each bucket once, marked dispatched until the
gradients of that iteration are reduced).

An iteration that a lost peer interrupts leaves handles of the old generation's communicators
(failed or never completing), partial counts and dispatch marks behind: the redone iteration
would wait on an old handle (its error again), assert that no reduction is outstanding, record a
partial count as the bucket's complete one, or skip a bucket's gather that a joiner makes.
A bucket group's own ``reset`` (run by ``zero_grad_buffer`` at each iteration's start) keeps
all of them, so :func:`drop_syncs_in_flight` drops them before the redo. The handles'
communicators are gone with the old generation (aborted, on a GPU); nothing waits on them again.

Megatron-LM's ``train()`` turns the forward pre-hooks and the first micro-batch's gather off for
the first iteration a process runs (so that a bad load does not spread) and on after it. A
joiner that takes its rank in the running loop runs its first iteration while the others gather:
:class:`JoinerGathers` turns them on for that iteration, so that every rank makes the same
collectives, and hands them back to ``train()`` as it left them.
"""

from __future__ import annotations

import argparse
from typing import Any, Iterable


def drop_syncs_in_flight(model_chunks: Iterable[Any]) -> int:
    """Forgets the gradient reductions and parameter gathers in flight, the ready-gradient
    counts and the gathers' dispatch marks of every bucket group of ``model_chunks`` (those
    that are Megatron-Core DDP modules); returns how many handles were dropped."""
    dropped = 0
    for chunk in model_chunks:
        for group in _bucket_groups(chunk):
            dropped += sum(getattr(group, name, None) is not None
                           for name in ("grad_reduce_handle", "param_gather_handle"))
            group.grad_reduce_handle = None
            group.grad_reduce_finished = False
            group.per_param_grad_ready_counts = {}
            group.param_gather_handle = None
            group.param_gather_dispatched = False
    return dropped


def _bucket_groups(chunk: Any) -> list[Any]:
    return [*getattr(chunk, "bucket_groups", ()),
            *getattr(chunk, "expert_parallel_bucket_groups", ())]


class JoinerGathers:
    """A joiner's first iteration in Megatron-LM's running loop, with the parameter gathers of
    the job's other iterations (module docstring); without ``--overlap-param-gather``
    nothing changes."""

    def __init__(self, args: argparse.Namespace, model_chunks: list[Any]) -> None:
        from megatron.training.training import should_disable_forward_pre_hook

        self._chunks = model_chunks
        self._active = should_disable_forward_pre_hook(args)
        self._align = bool(getattr(args, "align_param_gather", False))
        self._config: Any = None
        self._left: Any = None

    def begin(self) -> None:
        """Before the joiner's first ``train_step``: its forward pre-hooks and the first
        micro-batch's gather on, as at the other ranks, every bucket to be gathered."""
        if not self._active:
            return
        from megatron.core.utils import get_model_config
        from megatron.training.training import enable_forward_pre_hook

        self._config = get_model_config(self._chunks[0])
        self._left = self._config.param_sync_func
        drop_syncs_in_flight(self._chunks)
        enable_forward_pre_hook(self._chunks)
        if self._align:
            gathers = [chunk.start_param_sync for chunk in self._chunks]
            self._config.param_sync_func = gathers[0] if len(gathers) == 1 else gathers

    def end(self, *, train_enters_again: bool) -> None:
        """After it: handed back to ``train()`` as it left them, which turns them on after
        its first iteration; left on when every rank rolled back and ``train()`` is entered
        again (it turns them off at its start, as at the other ranks)."""
        if not self._active or train_enters_again:
            return
        from megatron.training.training import disable_forward_pre_hook

        disable_forward_pre_hook(self._chunks, param_sync=False)
        self._config.param_sync_func = self._left
