"""``megatron-lm-backend``: Megatron-LM's helpers that ask the default group's backend name
accept the ``mover`` backend.

- ``signal-handler-device``: ``--exit-signal-handler`` all-gathers, every iteration, whether a
  rank received the signal; ``megatron.training.dist_signal_handler.get_device`` picks the
  tensor's device from the backend's name and raises ``RuntimeError`` for any name but
  ``nccl`` and ``gloo``. A ``mover`` group carries CUDA tensors over NCCL and CPU tensors over
  gloo, so the patched function answers for ``mover`` as c10d's own backends would on this
  machine: ``cuda`` (``cuda:{local_rank}`` when given) where CUDA is available, else ``cpu``.
  Any other backend name goes to Megatron-LM's own function.

The worker command applies this group right after ``megatron.training`` is imported
(:mod:`mover_plugin.megatron.training_loop`).
"""

from __future__ import annotations

from typing import Any, Optional

from mover_plugin.patches.megatron_cpu import DISTRIBUTION, TESTED_VERSIONS
from mover_plugin.patches.registry import AttributeSwap, Patch, Undo, register_patch

GROUP = "megatron-lm-backend"
MOVER_BACKEND = "mover"
"""The name ``torch.distributed.get_backend()`` gives a ``mover`` group (``comm.BACKEND_NAME``;
the patches import no part of the plugin's layers)."""


def _apply_signal_handler_device() -> Undo:
    import torch
    from megatron.training import dist_signal_handler

    original = dist_signal_handler.get_device

    def get_device(local_rank: Optional[int] = None) -> Any:
        if torch.distributed.get_backend() != MOVER_BACKEND:
            return original(local_rank)
        if not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda" if local_rank is None else f"cuda:{local_rank}")

    get_device.__wrapped__ = original  # type: ignore[attr-defined]
    swap = AttributeSwap()
    swap.set_attr(dist_signal_handler, "get_device", get_device)
    return swap.restore


register_patch(Patch(
    name="signal-handler-device", distribution=DISTRIBUTION, tested_versions=TESTED_VERSIONS,
    description="--exit-signal-handler's all-gather picks its device for the mover backend",
    apply=_apply_signal_handler_device, groups=(GROUP,)))
