"""What a warmed standby may keep of the pipeline roles it played: a memory budget.

For each role it keeps (:mod:`mover_plugin.megatron.standby`), a standby holds that stage's
model, gradients and optimizer state. A worker of a real job fills most of its GPU with one
stage, so a standby cannot keep three. The budget is ``--resilient-standby-memory-mb``, or by
default what a worker of the standby's largest role needs: the peak of GPU memory while the
standby built the role and ran its shadow iterations (activations included), the largest over
the roles played so far. Without a GPU and without the flag there is no limit.

Roles are kept in the order they are played (first, last, then a middle stage) while the memory
they hold, added up, fits the budget; a role over it is released once played: its code paths
are warm, and a rank of that role builds its model on promotion.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any, Optional

import torch

MB = 1 << 20


class MemoryBudget:
    """Decides, role by role, whether the standby keeps what it built."""

    def __init__(self, limit_bytes: Optional[int] = None) -> None:
        """``limit_bytes``: the flag's budget; None: measured on a GPU, no limit without."""
        self._limit = limit_bytes
        self._measured = torch.cuda.is_available() and limit_bytes is None
        self._peaks: dict[str, int] = {}
        self._held: dict[str, int] = {}
        self._kept: list[str] = []

    @contextlib.contextmanager
    def measuring(self, role: str) -> Iterator[None]:
        """Around a role's build and shadow iterations: its peak of GPU memory, beyond what
        the standby held before (nothing is measured without a GPU)."""
        if not self._measured:
            yield
            return
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        yield
        self._peaks[role] = torch.cuda.max_memory_allocated() - before

    @property
    def limit_bytes(self) -> Optional[int]:
        """The budget now: the flag's, or the largest peak measured so far (None: no limit)."""
        if self._limit is not None or not self._peaks:
            return self._limit
        return max(self._peaks.values())

    def keeps(self, role: str, held: int) -> bool:
        """Whether the role whose objects hold ``held`` bytes is kept (and counted)."""
        self._held[role] = held
        limit = self.limit_bytes
        if limit is not None and sum(self._held[r] for r in self._kept) + held > limit:
            return False
        self._kept.append(role)
        return True

    def report(self) -> dict[str, Any]:
        """For the ``standby_warmed`` event: the roles released, what each held, the budget."""
        limit = self.limit_bytes
        return {"released": [role for role in self._held if role not in self._kept],
                "held_mb": {role: round(held / MB, 3) for role, held in self._held.items()},
                "budget_mb": None if limit is None else round(limit / MB, 3)}


def held_bytes(objects: tuple[Any, Any, Any]) -> int:
    """Bytes of the tensors a role's model and optimizer hold: parameters, their gradients
    (Megatron-Core's DDP keeps them in ``main_grad`` buffers) and the optimizer's state and
    main parameters, each storage counted once."""
    model, optimizer, _ = objects
    seen: set[tuple[int, str]] = set()
    total = 0
    for tensor in _tensors(model, optimizer):
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), str(tensor.device))
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def _tensors(model: Any, optimizer: Any) -> Iterator[torch.Tensor]:
    for module in model if isinstance(model, (list, tuple)) else [model]:
        for parameter in module.parameters():
            yield parameter
            for grad in (parameter.grad, getattr(parameter, "main_grad", None)):
                if isinstance(grad, torch.Tensor):
                    yield grad
    for inner in _torch_optimizers(optimizer):
        for group in inner.param_groups:
            yield from (p for p in group["params"] if isinstance(p, torch.Tensor))
        for state in inner.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def _torch_optimizers(optimizer: Any) -> Iterable[Any]:
    """The torch optimizers inside Megatron-Core's (chained, mixed-precision, distributed)."""
    for part in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(part, "optimizer", part)
        if hasattr(inner, "param_groups") and hasattr(inner, "state"):
            yield inner
