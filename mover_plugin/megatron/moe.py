"""What mixture-of-experts layers keep outside the model and optimizer between iterations.

Megatron-Core's MoE routers add their auxiliary losses (the load-balancing loss, the z-loss) of
every micro-batch to a process-wide metrics tracker during the forward pass, and Megatron-LM's
``training_log`` reduces, logs and clears them once per iteration. An iteration that is
interrupted and redone would otherwise add its losses twice, and one interrupted inside
``training_log`` (while reducing them) would carry them into the next iteration, so that the
logged ``load_balancing_loss`` would differ from the failure-free run's. The tracker's values
are part of a rank's snapshot at the start of every iteration
(:func:`capture_moe_metrics`, :func:`restore_moe_metrics`) and are cleared when a peer is lost
during ``training_log`` (:func:`clear_moe_metrics`). The expert parameters themselves are part
of the model, and their optimizer state part of the optimizer.

Nothing here imports Megatron-Core's MoE modules: a model without experts never loaded them,
and then there is nothing to keep.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

import torch

_LOGGING_MODULE = "megatron.core.transformer.moe.moe_logging"


def _tracker() -> Optional[Any]:
    module = sys.modules.get(_LOGGING_MODULE)
    return None if module is None else module.get_moe_metrics_tracker()


def capture_moe_metrics() -> dict[str, torch.Tensor]:
    """A copy of every tracked metric's per-layer values (empty without MoE layers)."""
    tracker = _tracker()
    if tracker is None:
        return {}
    return {name: entry.values.detach().clone() for name, entry in tracker.metrics.items()}


def restore_moe_metrics(saved: dict[str, torch.Tensor]) -> None:
    """Puts the tracked values back as :func:`capture_moe_metrics` saw them; a metric first
    tracked since then starts again from zero."""
    tracker = _tracker()
    if tracker is None:
        return
    for name, entry in tracker.metrics.items():
        if name in saved:
            entry.values.copy_(saved[name].to(entry.values.device))
        else:
            entry.values.zero_()


def clear_moe_metrics() -> None:
    """What ``training_log`` does after logging them (its log line was dropped)."""
    tracker = _tracker()
    if tracker is not None:
        tracker.clear()
