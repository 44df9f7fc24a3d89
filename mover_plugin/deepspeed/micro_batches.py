"""A data-parallel engine's iteration, recorded so that its micro-batches can be redone.

A DeepSpeed data-parallel script runs an iteration as several calls of its own:
``engine(batch)``, its loss, ``engine.backward(loss)``, ``engine.step()``, once per
micro-batch. With ZeRO stage 2 every ``backward`` reduces gradients, so a lost peer can
interrupt the iteration in the middle of any micro-batch, after the script computed the
earlier micro-batches' losses from outputs the redo cannot ask it for again. What makes the
redo possible without the script:

- at each ``forward`` the micro-batch's inputs and the random-number streams are kept
  (:class:`MicroBatch`), so its forward can be run again identically;
- an identity function on the outputs ``engine(batch)`` returns (:func:`tap`) keeps the
  gradient that reaches them during the script's ``engine.backward(loss)``, whatever the
  script's loss was (already divided by the accumulation steps and multiplied by the loss
  scale: DeepSpeed scales the loss, and its hooks on the outputs pass the gradient on as it
  is when the backward is the engine's);
- a redone micro-batch runs the engine's ``forward`` on the kept inputs, then the engine's
  ``backward`` on a scalar whose backward hands the kept gradients to the outputs
  (:func:`replay_loss`), so DeepSpeed's hooks and reductions see exactly what they saw.

The gradients are the outputs' size per micro-batch, kept until the iteration ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch.utils import _pytree as pytree

from mover_plugin.errors import MoverError
from mover_plugin.runtime.random_streams import RandomStreams


class ReplayError(MoverError):
    """A micro-batch that cannot be redone (its output gradients were never seen)."""


@dataclass
class MicroBatch:
    """One micro-batch of the iteration: its inputs, the random-number state its forward
    began with, the gradients its outputs received, and how far the script got with it."""

    inputs: tuple[Any, ...]
    kwargs: dict[str, Any]
    streams: RandomStreams
    output_grads: Optional[list[Optional[torch.Tensor]]] = None
    done: list[str] = field(default_factory=list)
    """The calls made for it that completed, in order: ``forward``, ``backward``, ``step``."""
    boundaries: dict[str, Any] = field(default_factory=dict)
    """The engine's accumulation boundary as the script had set it when each call began
    (``backward``, ``step``; None where the engine counts micro-batches)."""


def _differentiable(leaf: Any) -> bool:
    return isinstance(leaf, torch.Tensor) and leaf.requires_grad


class _Tap(torch.autograd.Function):
    """Identity; its backward keeps the gradients that pass through it. Its outputs alias
    its inputs' storage without being views of them, so the script may modify them in place
    (the Transformers Trainer scales its loss so). Only the gradient the script's own code
    gives an output passes here: one output computed from another inside the model (a loss
    from the logits) reaches it through the model's graph, not through this function, and an
    output the script does not use gets None (nothing is allocated for it)."""

    @staticmethod
    def forward(ctx: Any, record: MicroBatch, *tensors: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.record = record
        ctx.set_materialize_grads(False)
        return tuple(tensor.detach() for tensor in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Optional[torch.Tensor]) -> Any:  # type: ignore[override]
        ctx.record.output_grads = list(grads)
        return (None, *grads)


class _Replay(torch.autograd.Function):
    """A zero scalar whose backward gives its inputs the kept gradients."""

    @staticmethod
    def forward(ctx: Any, grads: list[Optional[torch.Tensor]],  # type: ignore[override]
                *tensors: torch.Tensor) -> torch.Tensor:
        ctx.grads = grads
        return tensors[0].new_zeros(())

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> Any:  # type: ignore[override]
        return (None, *ctx.grads)


def tap(outputs: Any, record: MicroBatch) -> Any:
    """``outputs`` (a tensor, or a tuple, list, dict or other pytree of them) with every
    tensor that requires a gradient passed through :class:`_Tap`, which fills
    ``record.output_grads``."""
    leaves, spec = pytree.tree_flatten(outputs)
    positions = [i for i, leaf in enumerate(leaves) if _differentiable(leaf)]
    if not positions:
        return outputs
    tapped = _Tap.apply(record, *(leaves[i] for i in positions))
    for position, tensor in zip(positions, tapped):
        leaves[position] = tensor
    return pytree.tree_unflatten(leaves, spec)


def replay_loss(outputs: Any, record: MicroBatch) -> torch.Tensor:
    """A scalar whose backward hands ``outputs`` (a redone forward's) the gradients the
    micro-batch's outputs received in the script's backward."""
    grads = record.output_grads
    if grads is None:
        raise ReplayError("the micro-batch's outputs received no gradient before the peer was "
                          "lost, so its backward cannot be redone")
    tensors = [leaf for leaf in pytree.tree_leaves(outputs) if _differentiable(leaf)]
    if len(tensors) != len(grads):
        raise ReplayError(f"the redone forward returned {len(tensors)} differentiable "
                          f"tensors, the original {len(grads)}")
    return _Replay.apply(grads, *tensors)


def stand_in(outputs: Any) -> Any:
    """What a joiner's catch-up returns for a forward the job already trained, made from a
    forward's ``outputs`` once: their structure, detached, floating-point values NaN (so the
    script's loss is NaN). Give the script :func:`fresh_stand_in` of it."""
    def replace(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        leaf = leaf.detach()
        if not leaf.is_floating_point():
            return leaf.clone()
        return torch.full_like(leaf, float("nan")).requires_grad_()

    return pytree.tree_map(replace, outputs)


def fresh_stand_in(template: Any) -> Any:
    """A copy of a :func:`stand_in` for one forward: each floating-point tensor a new one
    that requires a gradient and is not a leaf, so that a script's backward call goes
    through and the script may scale its loss in place (the Transformers Trainer does)."""
    def copy(leaf: Any) -> Any:
        return leaf.clone() if isinstance(leaf, torch.Tensor) else leaf

    return pytree.tree_map(copy, template)
