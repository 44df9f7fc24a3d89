"""Replacing every reference to old process groups inside framework objects.

Frameworks cache process groups in many places: Megatron-Core keeps them in
``parallel_state`` but also in DDP and its buckets, the optimizer and every transformer layer
(``tp_group``, ``pg_collection``). After a generation switch, :func:`rewire` walks an object
graph (attributes, dicts, lists, tuples, sets; each object once) and replaces each old group by
its counterpart of the new generation. Tensors, modules' parameters and buffers, and other
leaf values are not entered.
"""

from __future__ import annotations

import types
from typing import Any, Callable, Iterable

import torch

# Values never entered: scalars, tensors, and code (modules, functions, methods, classes), whose
# namespaces reach the whole program rather than the objects being rewired.
_LEAF_TYPES = (str, bytes, int, float, bool, complex, type(None), torch.Tensor, torch.dtype,
               torch.device, type, types.ModuleType, types.FunctionType,
               types.BuiltinFunctionType, types.MethodType)


def rewire_module_globals(module: types.ModuleType, replacements: dict[int, Any]) -> int:
    """Like :func:`rewire` for a module's global variables (e.g. Megatron-Core's
    ``parallel_state``, which holds its groups in module globals and lists)."""
    namespace = vars(module)
    values = {name: value for name, value in namespace.items()
              if not name.startswith("__") and not isinstance(value, _LEAF_TYPES)}
    count = rewire([values], replacements)
    namespace.update(values)
    return count


def rewire(roots: Iterable[Any], replacements: dict[int, Any]) -> int:
    """Replaces, in place, every reference to ``old`` by ``replacements[id(old)]``.

    Returns the number of references replaced.
    """
    walker = _Walker(lambda value: replacements.get(id(value)))
    for root in roots:
        walker.visit(root)
    return walker.replaced


def count_references(roots: Iterable[Any], matches: Callable[[Any], bool]) -> int:
    """How many references reachable from ``roots`` (as :func:`rewire` walks them) point to
    a value for which ``matches`` is true; nothing is changed."""
    found = 0

    def count(value: Any) -> None:
        nonlocal found
        if matches(value):
            found += 1

    walker = _Walker(count)
    for root in roots:
        walker.visit(root)
    return found


class _Walker:
    """Visits an object graph; ``replacement(value)`` returns what replaces a value, or None
    to keep it (and walk into it)."""

    def __init__(self, replacement: Callable[[Any], Any]) -> None:
        self._replacement = replacement
        self._seen: set[int] = set()
        self.replaced = 0

    def _swap(self, value: Any) -> tuple[bool, Any]:
        new = self._replacement(value)
        if new is None:
            return False, value
        self.replaced += 1
        return True, new

    def visit(self, obj: Any) -> None:
        if isinstance(obj, _LEAF_TYPES) or id(obj) in self._seen:
            return
        self._seen.add(id(obj))
        if isinstance(obj, dict):
            self._visit_dict(obj)
        elif isinstance(obj, list):
            for index, item in enumerate(obj):
                changed, new = self._swap(item)
                if changed:
                    obj[index] = new
                else:
                    self.visit(item)
        elif isinstance(obj, (set, frozenset, tuple)):
            for item in obj:
                self.visit(item)
        else:
            state = getattr(obj, "__dict__", None)
            if isinstance(state, dict):
                self._visit_dict(state)
            for name in getattr(type(obj), "__slots__", ()):
                if hasattr(obj, name):
                    self._visit_attribute(obj, name)

    def _visit_dict(self, mapping: dict) -> None:
        for key, value in list(mapping.items()):
            if isinstance(value, tuple):
                value = self._rebuilt_tuple(value)
                mapping[key] = value
            changed, new = self._swap(value)
            if changed:
                mapping[key] = new
            else:
                self.visit(value)

    def _visit_attribute(self, obj: Any, name: str) -> None:
        value = getattr(obj, name)
        changed, new = self._swap(value)
        if changed:
            setattr(obj, name, new)
        else:
            self.visit(value)

    def _rebuilt_tuple(self, value: tuple) -> tuple:
        """Tuples are immutable: a tuple holding an old group is replaced by a new tuple."""
        items = [self._swap(item) for item in value]
        if not any(changed for changed, _ in items):
            return value
        rebuilt = tuple(new for _, new in items)
        return type(value)(*rebuilt) if hasattr(value, "_fields") else rebuilt
