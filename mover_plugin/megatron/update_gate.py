"""The commit gate inside a Megatron-Core optimizer's step, and what an interrupted
iteration's update still owes after a crash.

Megatron-Core's ``optimizer.step()`` first prepares the gradients (with ``--fp16``: unscales
them, checks them for inf/NaN across the gradient-statistics group and updates the loss scaler),
clips them, and then applies the update (``step_with_ready_grads``). Every collective of the
step comes before the update, so the runtime's commit (a WORLD all-reduce,
:meth:`~mover_plugin.runtime.resilience.ResilienceRuntime.commit`) sits just before it: a rank
that passed it knows every rank has complete gradients.

Each iteration ends in one of two kinds of update (:class:`UpdateKind`):

- **applied**: the commit, then the update; the iteration counts as completed (the ledger's
  ``applied``) as soon as the update is in place;
- **skipped**: the optimizer found inf/NaN in fp16's scaled gradients (or a gradient norm past
  Megatron-Core's skip threshold) and returned without an update. That iteration is a completed
  one too (Megatron-LM counts it, its samples are consumed), with a null update: the commit
  follows the end of ``optimizer.step()`` and counts it.

After a crash a survivor is brought to the iteration the job continues from
(:meth:`UpdateGate.settle`): a rank that reached the commit but did not pass it applies the
update (nothing for a skipped one), and a rank that applied the update but was interrupted
before its scheduler stepped (Megatron-LM's ``train_step`` runs model-parallel collectives in
between) steps it. An iteration that is redone starts from the loss scaler's state at its start
(:meth:`UpdateGate.snapshot`): the aborted attempt may have updated it already.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from mover_plugin.errors import LaunchError
from mover_plugin.runtime.peer_copy import PeerCopy
from mover_plugin.runtime.resilience import ResilienceRuntime


class UpdateKind(enum.Enum):
    """How the running iteration's optimizer step ends, once the optimizer decided."""

    APPLIED = "applied"
    """The commit, then the update."""
    SKIPPED = "skipped"
    """No update (inf/NaN found, or the gradient norm past the skip threshold); the commit
    after ``optimizer.step()`` counts the iteration."""


@dataclass
class _Attempt:
    """The running attempt at an iteration, as far as its update goes."""

    scheduler_steps: int
    """The scheduler's ``num_steps`` when the attempt began."""
    kind: Optional[UpdateKind] = None
    """None until the optimizer entered the update or returned without one."""


class UpdateGate:
    """The commit gate on one Megatron-Core optimizer (plain, distributed or chained) and
    the scheduler stepped with it; ``increment()`` is the scheduler step of one iteration
    (the samples of its global batch)."""

    def __init__(self, optimizer: Any, scheduler: Any, runtime: ResilienceRuntime,
                 peer_copy: Optional[PeerCopy], increment: Callable[[], int]) -> None:
        self._optimizer, self._scheduler = optimizer, scheduler
        self._runtime, self._peer_copy, self._increment = runtime, peer_copy, increment
        self._attempt = _Attempt(_scheduler_steps(scheduler))
        self.apply_update: Callable[[], bool] = optimizer.step_with_ready_grads
        """The optimizer's own update, without the gate."""
        self._step: Callable[[], Any] = optimizer.step
        optimizer.step_with_ready_grads = self._gated_update
        optimizer.step = self._gated_step

    # -- inside the step ------------------------------------------------------------------

    def _gated_update(self) -> bool:
        self._attempt.kind = UpdateKind.APPLIED
        if self._peer_copy is not None:
            self._peer_copy.before_update()
        self._runtime.commit()
        applied = self.apply_update()
        self._runtime.ledger.count_running_iteration()
        return applied

    def _gated_step(self) -> Any:
        result = self._step()
        if self._attempt.kind is None:
            self._attempt.kind = UpdateKind.SKIPPED
            self._runtime.commit()
            self._runtime.ledger.count_running_iteration()
        return result

    # -- an attempt's start, and a redo ---------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """What a redone attempt starts from (the loss scalers' state); an attempt begins.
        Taken at an iteration boundary only: the runtime takes one as each iteration starts,
        and a rank sending its state takes one at the boundary its receiver starts from."""
        self.begin_attempt()
        return {"loss_scalers": loss_scaler_states(self._optimizer)}

    def restore(self, snapshot: dict[str, Any]) -> None:
        """The state of :meth:`snapshot` back; the redone attempt begins."""
        load_loss_scaler_states(self._optimizer, snapshot.get("loss_scalers", ()))
        self.begin_attempt()

    def begin_attempt(self) -> None:
        self._attempt = _Attempt(_scheduler_steps(self._scheduler))

    # -- after a crash --------------------------------------------------------------------

    def settle(self, target: int) -> None:
        """Brings this rank, interrupted in its running iteration, to ``target`` completed
        iterations, or raises :class:`~mover_plugin.errors.LaunchError` if it cannot."""
        ledger, attempt = self._runtime.ledger, self._attempt
        if ledger.may_finish_update(target):
            # Some rank passed the commit: every rank's gradients were complete.
            if attempt.kind is UpdateKind.APPLIED:
                self.apply_update()
            ledger.applied = target
        if ledger.applied != target:
            raise LaunchError(
                f"rank {self._runtime.rank} completed {ledger.applied} iterations but the job "
                f"is at {target}; it cannot catch up"
            )
        step = ledger.step
        if (step is not None and step.iteration == target - 1
                and attempt.kind is UpdateKind.APPLIED
                and _scheduler_steps(self._scheduler) == attempt.scheduler_steps):
            self._scheduler.step(increment=self._increment())



def loss_scaler_states(optimizer: Any) -> list[dict[str, Any]]:
    """A copy of the state of each loss scaler of a Megatron-Core optimizer (none without
    fp16)."""
    return [_scaler_state(scaler) for scaler in _scalers(optimizer)]


def load_loss_scaler_states(optimizer: Any, states: Any) -> None:
    """Puts :func:`loss_scaler_states` into the loss scalers of ``optimizer``."""
    for scaler, state in zip(_scalers(optimizer), states):
        vars(scaler).update(_scaler_state(state))


def _scalers(optimizer: Any) -> list[Any]:
    optimizers = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    scalers = [getattr(item, "grad_scaler", None) for item in optimizers]
    return [scaler for scaler in scalers if scaler is not None]


def _scaler_state(state: Any) -> dict[str, Any]:
    """A copy of a loss scaler's attributes (a scaler, or such a copy), tensors cloned."""
    items = state.items() if isinstance(state, dict) else vars(state).items()
    return {name: value.clone() if isinstance(value, torch.Tensor) else value
            for name, value in items}


def _scheduler_steps(scheduler: Any) -> int:
    return int(getattr(scheduler, "num_steps", 0))
