"""Hook points in DeepSpeed's public API: the ``deepspeed-hooks`` patch group.

mover_plugin runs an unmodified DeepSpeed training script, one that calls only
``deepspeed.init_distributed`` and ``deepspeed.initialize`` and then the engine's own methods.
It enters through the module attributes DeepSpeed's callers look up at call time; this module
replaces each of them with a wrapper that hands the original to the installed
:class:`DeepSpeedHooks` object, whose base class passes every call straight through. The policy
lives with the caller (:mod:`mover_plugin.deepspeed.drop_in`); this module only swaps
attributes, reversibly. The engine's methods are not module attributes: the policy wraps them
on the engine that ``deepspeed.initialize`` returns.

Hook points (checked on DeepSpeed 0.19.8):

- ``init_distributed`` in ``deepspeed`` (a script's call) and in ``deepspeed.comm`` (the call
  ``deepspeed.initialize`` makes when the script made none):
  :meth:`DeepSpeedHooks.around_init_distributed`.
- ``initialize`` in ``deepspeed``: :meth:`DeepSpeedHooks.around_initialize`.
- ``init_process_group`` in ``torch.distributed`` (checked on torch 2.13 and 2.14): a script
  that makes the default group itself before DeepSpeed's call (Accelerate does on CPU):
  :meth:`DeepSpeedHooks.around_init_process_group`.
- the collectives of :data:`SCRIPT_COLLECTIVES` in ``torch.distributed``, which a script (the
  Transformers Trainer through Accelerate) makes between the engine's calls:
  :meth:`DeepSpeedHooks.around_collective`. They are in place from the drop-in's start, under
  every later patch of the same names (which restores them), so DeepSpeed's backend, created
  later, takes these wrappers too.
- ``__init__`` of ``torch.utils.data.dataloader._BaseDataLoaderIter`` (checked on torch 2.13 and
  2.14), which makes every iterator of a ``DataLoader``:
  :meth:`DeepSpeedHooks.around_loader_iterator`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mover_plugin.patches.deepspeed_cpu import TESTED_VERSIONS
from mover_plugin.patches.hook_points import HookPoints
from mover_plugin.patches.registry import (
    AppliedPatches,
    AttributeSwap,
    Patch,
    Undo,
    register_patch,
)

GROUP = "deepspeed-hooks"
SCRIPT_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor",
                      "all_gather_object", "broadcast_object_list", "barrier")
"""The collectives of ``torch.distributed`` whose calls reach
:meth:`DeepSpeedHooks.around_collective`."""


class DeepSpeedHooks:
    """What runs at each hook point; every method passes the call through unchanged."""

    def around_init_distributed(self, init: Callable[..., Any], *args: Any,
                                **kwargs: Any) -> Any:
        """Runs ``init_distributed(dist_backend=None, ...)``: DeepSpeed's communication
        backend, and ``init_process_group`` unless the default group exists."""
        return init(*args, **kwargs)

    def around_initialize(self, initialize: Callable[..., Any], *args: Any,
                          **kwargs: Any) -> Any:
        """Runs ``initialize(args=None, model=None, optimizer=None, ..., config=None, ...)``;
        returns (engine, optimizer, training data loader, learning-rate scheduler)."""
        return initialize(*args, **kwargs)

    def around_init_process_group(self, init: Callable[..., Any], *args: Any,
                                  **kwargs: Any) -> Any:
        """Runs ``torch.distributed.init_process_group(backend=None, ...)``."""
        return init(*args, **kwargs)

    def around_collective(self, name: str, collective: Callable[..., Any], *args: Any,
                          **kwargs: Any) -> Any:
        """Runs ``torch.distributed.<name>(...)``, one of :data:`SCRIPT_COLLECTIVES`."""
        return collective(*args, **kwargs)

    def around_loader_iterator(self, init: Callable[[Any, Any], None], iterator: Any,
                               loader: Any) -> None:
        """Runs ``init(iterator, loader)``: a new iterator of ``loader`` (``iter(loader)``;
        it draws its worker processes' base seed)."""
        init(iterator, loader)


_HOOKS: HookPoints[DeepSpeedHooks] = HookPoints(GROUP, "DeepSpeed hooks")


def install_hooks(hooks: DeepSpeedHooks) -> AppliedPatches:
    """Points every hook point at ``hooks``; ``revert()`` of the result takes them out."""
    return _HOOKS.install(hooks)


def _apply() -> Undo:
    swap = AttributeSwap()
    _HOOKS.swap_to_hook(swap, "deepspeed", "init_distributed", "around_init_distributed")
    _HOOKS.swap_to_hook(swap, "deepspeed.comm", "init_distributed", "around_init_distributed")
    _HOOKS.swap_to_hook(swap, "deepspeed", "initialize", "around_initialize")
    return _HOOKS.undo_with(swap)


def _apply_torch() -> Undo:
    import torch.distributed as dist

    swap = AttributeSwap()
    _HOOKS.swap_to_hook(swap, "torch.distributed", "init_process_group",
                        "around_init_process_group")
    for name in SCRIPT_COLLECTIVES:
        swap.set_attr(dist, name, _collective_hook(name, getattr(dist, name)))
    return _HOOKS.undo_with(swap)


def _apply_loader_iterators() -> Undo:
    from torch.utils.data import dataloader

    swap = AttributeSwap()
    init = dataloader._BaseDataLoaderIter.__init__

    def with_hooks(iterator: Any, loader: Any) -> None:
        _HOOKS.installed().around_loader_iterator(init, iterator, loader)

    with_hooks.__wrapped__ = init  # type: ignore[attr-defined]
    swap.set_attr(dataloader._BaseDataLoaderIter, "__init__", with_hooks)
    return _HOOKS.undo_with(swap)


def _collective_hook(name: str, collective: Callable[..., Any]) -> Callable[..., Any]:
    def with_hooks(*args: Any, **kwargs: Any) -> Any:
        return _HOOKS.installed().around_collective(name, collective, *args, **kwargs)

    with_hooks.__wrapped__ = collective  # type: ignore[attr-defined]
    return with_hooks


register_patch(Patch(name="ds-entry-points", distribution="deepspeed",
                     tested_versions=TESTED_VERSIONS,
                     description="deepspeed.init_distributed and deepspeed.initialize run "
                                 "inside the installed hooks",
                     apply=_apply, groups=(GROUP,)))
register_patch(Patch(name="torch-default-group", distribution="torch",
                     tested_versions=">=2.13,<2.15",
                     description="torch.distributed.init_process_group and the script's "
                                 "collectives run inside the installed hooks",
                     apply=_apply_torch, groups=(GROUP,)))
register_patch(Patch(name="torch-loader-iterators", distribution="torch",
                     tested_versions=">=2.13,<2.15",
                     description="every new iterator of a torch DataLoader is made inside the "
                                 "installed hooks",
                     apply=_apply_loader_iterators, groups=(GROUP,)))
