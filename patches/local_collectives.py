"""``local-collectives``: collectives that touch no peer, for a joiner building its model.

A standby that takes a lost rank's place builds the model, DDP and optimizer exactly as a
rank does at start-up. That construction runs a few collectives the running ranks will not
match: Megatron-Core's ``GPTModel`` all-reduces the tied embedding over the embedding group
(first and last pipeline stage) and ``get_megatron_optimizer`` all-gathers over WORLD;
DeepSpeed's pipeline engine primes its point-to-point links with a send and a receive between
neighbouring stages. Their results are overwritten by the state the joiner then receives from
its twin, so during the build this patch makes them local: ``all_reduce``, ``broadcast``,
``barrier``, ``send`` and ``recv`` leave their inputs as they are, ``all_gather_object`` fills
every slot with this rank's object and ``all_gather``/``all_gather_into_tensor`` with this
rank's tensor. Megatron-Core's timers bind their all-gather when ``megatron.core.timers`` is
imported; while that module is loaded, its binding is made local too. Use it only around the
joiner's build, as a ``with`` block (Megatron-LM's loop: from the joiner's distributed set-up to
its first iteration).
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from mover_plugin.patches.registry import AttributeSwap, Patch, Undo, register_patch

GROUP = "local-collectives"


class _Completed:
    """The handle of a collective that completed locally (for a caller that asked for an
    asynchronous one, as ZeRO stage 3's parameter all-gathers do)."""

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def completed(async_op: bool) -> Optional[_Completed]:
    """What a collective that completed locally returns: a handle if asked for one."""
    return _Completed() if async_op else None


def no_op(*args: Any, async_op: bool = False, **kwargs: Any) -> Optional[_Completed]:
    return completed(async_op)


def _gather_object_locally(object_list: list[Any], obj: Any, group: Any = None) -> None:
    for index in range(len(object_list)):
        object_list[index] = obj


def _gather_locally(tensor_list: list[torch.Tensor], tensor: torch.Tensor, *args: Any,
                    async_op: bool = False, **kwargs: Any) -> Optional[_Completed]:
    for item in tensor_list:
        item.copy_(tensor)
    return completed(async_op)


def _gather_into_tensor_locally(output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                                *args: Any, async_op: bool = False,
                                **kwargs: Any) -> Optional[_Completed]:
    """``all_gather_into_tensor`` (torch's argument names, which DeepSpeed passes by keyword)
    with every slot this rank's tensor."""
    repeats = output_tensor.numel() // max(input_tensor.numel(), 1)
    output_tensor.copy_(input_tensor.repeat(repeats).view_as(output_tensor))
    return completed(async_op)


LOCAL_COLLECTIVES: dict[str, Callable[..., Any]] = {
    **{name: no_op for name in ("all_reduce", "broadcast", "barrier", "send", "recv")},
    "all_gather_object": _gather_object_locally,
    "all_gather": _gather_locally,
    "all_gather_into_tensor": _gather_into_tensor_locally,
}
"""Each collective of torch.distributed this module makes local, by name, as it acts."""


def _apply() -> Undo:
    swap = AttributeSwap()
    for name, local in LOCAL_COLLECTIVES.items():
        swap.set_attr(dist, name, local)
    return swap.restore


TIMERS_MODULE = "megatron.core.timers"


def _timers_loaded() -> bool:
    return TIMERS_MODULE in sys.modules


def _apply_timers() -> Undo:
    swap = AttributeSwap()
    swap.set_attr(sys.modules[TIMERS_MODULE], "dist_all_gather_func", _gather_into_tensor_locally)
    return swap.restore


register_patch(
    Patch(
        name="local-collectives-build",
        distribution="torch",
        tested_versions=">=2.4,<2.15",
        description="collectives of torch.distributed act locally (a joiner's model build)",
        apply=_apply,
        groups=(GROUP,),
    )
)

register_patch(
    Patch(
        name="local-collectives-timers",
        distribution="megatron-core",
        tested_versions=">=0.19.0,<0.20",
        description="Megatron-Core's timers gather their times locally (a joiner's start-up)",
        apply=_apply_timers,
        condition=_timers_loaded,
        groups=(GROUP,),
    )
)
