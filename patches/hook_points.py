"""The one installed hooks object behind a group of hook points.

A hook-point patch group (``megatron-lm-hooks``, ``deepspeed-hooks``) replaces framework
functions with wrappers that hand the original to a method of whatever hooks object is
installed. :class:`HookPoints` holds that object for one group: :meth:`HookPoints.install`
applies the group with it, :meth:`HookPoints.swap_to_hook` makes one wrapper, and
:meth:`HookPoints.undo_with` gives the group's undo, which also forgets the object.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Generic, Optional, TypeVar

from mover_plugin.errors import PatchError
from mover_plugin.patches.registry import AppliedPatches, AttributeSwap, Undo, apply_patches

Hooks = TypeVar("Hooks")


class HookPoints(Generic[Hooks]):
    """The hooks object of patch group ``group`` (``what`` names the hooks in errors)."""

    def __init__(self, group: str, what: str) -> None:
        self.group = group
        self.what = what
        self._installed: Optional[Hooks] = None

    def installed(self) -> Hooks:
        """The hooks object the patched hook points call."""
        if self._installed is None:
            raise PatchError(f"no {self.what} are installed (install_hooks)")
        return self._installed

    def install(self, hooks: Hooks) -> AppliedPatches:
        """Points every hook point of the group at ``hooks``; ``revert()`` of the result takes
        them out."""
        if self._installed is not None:
            raise PatchError(f"{self.what} are installed already; revert them first")
        self._installed = hooks
        try:
            return apply_patches(self.group)
        except BaseException:
            self._installed = None
            raise

    def undo_with(self, swap: AttributeSwap) -> Undo:
        """The undo of a patch of the group: restores ``swap`` and forgets the hooks."""
        def undo() -> None:
            swap.restore()
            self._installed = None

        return undo

    def swap_to_hook(self, swap: AttributeSwap, module_name: str, name: str, hook: str) -> None:
        """Points ``module_name.name`` at a wrapper that hands the original to the installed
        hooks' method ``hook``; the wrapper's ``__wrapped__`` is the original."""
        module = importlib.import_module(module_name)
        original = getattr(module, name)

        def with_hooks(*args: Any, **kwargs: Any) -> Any:
            return getattr(self.installed(), hook)(original, *args, **kwargs)

        with_hooks.__wrapped__ = original  # type: ignore[attr-defined]
        swap.set_attr(module, name, with_hooks)


def unhooked(function: Callable[..., Any]) -> Callable[..., Any]:
    """The framework's own function behind a hook point's wrapper (``function`` itself if it
    is not one)."""
    return getattr(function, "__wrapped__", function)
