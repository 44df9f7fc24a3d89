"""The commit gate in a Megatron-Core optimizer's step and what an interrupted iteration's
update owes (:mod:`mover_plugin.megatron.update_gate`): pure logic, no processes. The
optimizer, scheduler and runtime are stand-ins with the calls the gate makes; the ledger is
the runtime's own."""

from __future__ import annotations

import torch

from mover_plugin.megatron.distributed_optimizer import adam_state_before_first_step
from mover_plugin.megatron.update_gate import UpdateGate
from mover_plugin.runtime.ledger import StepLedger


class Scaler:
    def __init__(self) -> None:
        self._scale = torch.tensor([1024.0])
        self._growth_tracker = 0

    def update(self, found_inf: bool) -> None:
        self._scale = self._scale / 2 if found_inf else self._scale
        self._growth_tracker = 0 if found_inf else self._growth_tracker + 1


class Optimizer:
    """Megatron-Core's step in outline: prepare (the scaler's update), then the update unless
    the scaled gradients overflowed."""

    def __init__(self) -> None:
        self.grad_scaler = Scaler()
        self.overflow = False
        self.updates = 0

    def step(self):
        self.grad_scaler.update(self.overflow)
        if self.overflow:
            return False, None, None
        return self.step_with_ready_grads(), 1.0, None

    def step_with_ready_grads(self) -> bool:
        self.updates += 1
        return True


class Scheduler:
    def __init__(self) -> None:
        self.num_steps = 0

    def step(self, increment: int) -> None:
        self.num_steps += increment


class Runtime:
    rank = 0

    def __init__(self) -> None:
        self.ledger = StepLedger()
        self.commits = 0
        self.interrupt_commit = False

    def commit(self) -> None:
        self.ledger.step.reached_commit = True
        if self.interrupt_commit:
            raise RuntimeError("a peer was lost in the commit")
        self.commits += 1
        self.ledger.step.passed_commit = True


def gate() -> tuple[UpdateGate, Optimizer, Scheduler, Runtime]:
    optimizer, scheduler, runtime = Optimizer(), Scheduler(), Runtime()
    return UpdateGate(optimizer, scheduler, runtime, None, lambda: 8), optimizer, scheduler, \
        runtime


def step_lost_in_the_commit(optimizer: Optimizer, runtime: Runtime) -> None:
    """Iteration 0's step, interrupted in the commit's all-reduce (a peer was lost)."""
    runtime.ledger.begin(0)
    runtime.interrupt_commit = True
    try:
        optimizer.step()
    except RuntimeError:
        pass


def test_an_applied_update_is_committed_before_it_and_counted_after_it():
    _, optimizer, _, runtime = gate()
    runtime.ledger.begin(0)
    assert optimizer.step()[0] is True
    assert (runtime.commits, optimizer.updates, runtime.ledger.applied) == (1, 1, 1)


def test_a_skipped_update_is_committed_and_counted_as_a_completed_iteration():
    _, optimizer, _, runtime = gate()
    optimizer.overflow = True
    runtime.ledger.begin(0)
    assert optimizer.step()[0] is False
    assert (runtime.commits, optimizer.updates, runtime.ledger.applied) == (1, 0, 1)


def test_a_rank_left_in_the_commit_of_an_applied_update_applies_it_and_steps_the_schedule():
    update_gate, optimizer, scheduler, runtime = gate()
    step_lost_in_the_commit(optimizer, runtime)
    update_gate.settle(1)  # another rank passed the commit
    assert (optimizer.updates, scheduler.num_steps, runtime.ledger.applied) == (1, 8, 1)


def test_a_rank_left_in_the_commit_of_a_skipped_update_applies_nothing():
    update_gate, optimizer, scheduler, runtime = gate()
    optimizer.overflow = True
    step_lost_in_the_commit(optimizer, runtime)
    update_gate.settle(1)
    assert (optimizer.updates, scheduler.num_steps, runtime.ledger.applied) == (0, 0, 1)


def test_the_schedule_is_stepped_once_for_an_update_applied_before_the_interruption():
    update_gate, optimizer, scheduler, runtime = gate()
    runtime.ledger.begin(0)
    optimizer.step()  # applied; lost in a collective before the script stepped its schedule
    update_gate.settle(1)
    assert scheduler.num_steps == 8
    update_gate.begin_attempt()
    runtime.ledger.begin(1)
    optimizer.step()
    scheduler.step(8)  # the script stepped it, then was interrupted
    update_gate.settle(2)
    assert (optimizer.updates, scheduler.num_steps) == (2, 16)


def test_a_redone_iteration_starts_from_the_loss_scalers_state_at_its_start():
    update_gate, optimizer, _, runtime = gate()
    snapshot = update_gate.snapshot()
    optimizer.overflow = True
    step_lost_in_the_commit(optimizer, runtime)
    assert float(optimizer.grad_scaler._scale) == 512.0
    update_gate.restore(snapshot)  # no rank passed the commit: the iteration is redone
    assert float(optimizer.grad_scaler._scale) == 1024.0
    runtime.interrupt_commit = False
    runtime.ledger.begin(0)
    optimizer.step()  # the redo overflows too: halved once, as without the interruption
    assert float(optimizer.grad_scaler._scale) == 512.0
    assert (runtime.commits, runtime.ledger.applied) == (1, 1)


def test_adam_state_created_before_the_first_step_changes_no_update():
    torch.manual_seed(0)
    lazy, early = (torch.nn.Parameter(torch.randn(5)) for _ in range(2))
    early.data.copy_(lazy.data)
    optimizers = [torch.optim.AdamW([p], lr=0.1, weight_decay=0.1) for p in (lazy, early)]
    group = optimizers[1].param_groups[0]
    optimizers[1].state[early].update(adam_state_before_first_step(early, group))
    for _ in range(3):
        gradient = torch.randn(5)
        for parameter, optimizer in zip((lazy, early), optimizers):
            parameter.grad = gradient.clone()
            optimizer.step()
    assert torch.equal(lazy, early)
    assert optimizers[0].state[lazy]["step"] == optimizers[1].state[early]["step"] == 3
