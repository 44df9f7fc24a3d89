"""What a warmed standby keeps of the roles it played (mover_plugin/megatron/standby_memory.py):
the budget's choice with a budget given, with one measured on a (recorded) GPU, and the bytes a
role's objects hold (pure)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mover_plugin.megatron.standby_memory import MB, MemoryBudget, held_bytes
from mover_plugin.runtime.settings import ResilienceSettings


def test_roles_are_kept_in_order_while_they_fit_the_budget_given():
    budget = MemoryBudget(7 * MB)
    assert [budget.keeps(role, 3 * MB) for role in ("first", "last", "middle")] == \
        [True, True, False]
    assert budget.report() == {"released": ["middle"],
                               "held_mb": {"first": 3.0, "last": 3.0, "middle": 3.0},
                               "budget_mb": 7.0}
    assert MemoryBudget(2 * MB).keeps("first", 3 * MB) is False  # a cold standby, warm code


def test_without_a_gpu_or_a_budget_every_role_is_kept(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    budget = MemoryBudget()
    for role in ("first", "last", "middle"):
        with budget.measuring(role):
            pass
        assert budget.keeps(role, 1 << 40)
    assert budget.report()["released"] == [] and budget.report()["budget_mb"] is None


def test_on_a_gpu_the_budget_is_what_a_worker_of_the_largest_role_peaked_at(monkeypatch):
    """The peaks are those a worker of each role needs (activations included), measured over
    the role's build and shadow iterations beyond what the standby already held."""
    gpu = SimpleNamespace(allocated=0, peak=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: gpu.allocated)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: gpu.peak)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: None)
    budget = MemoryBudget()
    kept = []
    for role, held, activations in (("first", 6, 4), ("last", 7, 5)):
        with budget.measuring(role):
            gpu.peak = gpu.allocated + (held + activations) * MB
        kept.append(budget.keeps(role, held * MB))
        gpu.allocated += held * MB if kept[-1] else 0
    assert kept == [True, False]  # 6 + 7 MB held > the last stage's worker peak of 12 MB
    assert budget.report() == {"released": ["last"], "held_mb": {"first": 6.0, "last": 7.0},
                               "budget_mb": 12.0}


def test_a_role_holds_its_parameters_gradients_and_optimizer_state():
    model = torch.nn.Linear(8, 4)  # 36 float32 values
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 8)).sum().backward()
    assert held_bytes((model, optimizer, None)) == 2 * 36 * 4  # parameters and gradients
    optimizer.step()
    steps = sum(state["step"].untyped_storage().nbytes() for state in optimizer.state.values())
    assert held_bytes(([model], optimizer, None)) == 4 * 36 * 4 + steps  # + exp_avg, exp_avg_sq


def test_the_budget_is_a_setting_of_its_own():
    assert ResilienceSettings().standby_memory_mb == 0
    with pytest.raises(Exception, match="--resilient-standby-memory-mb -1 must be a whole"):
        ResilienceSettings(standby_memory_mb=-1).validate()
