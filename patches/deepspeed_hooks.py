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


register_patch(Patch(name="ds-entry-points", distribution="deepspeed",
                     tested_versions=TESTED_VERSIONS,
                     description="deepspeed.init_distributed and deepspeed.initialize run "
                                 "inside the installed hooks",
                     apply=_apply, groups=(GROUP,)))
