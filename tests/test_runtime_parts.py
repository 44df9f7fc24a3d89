"""Parts of the worker runtime tested without a job: the step ledger, injected faults and a
migration's group preparation in its thread."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

import pytest

from mover_plugin.runtime.faults import FaultInjector
from mover_plugin.runtime.ledger import StepLedger
from mover_plugin.runtime.migration import GroupPreparation


def test_the_ledger_counts_an_iteration_only_while_one_runs():
    ledger = StepLedger(applied=4)
    ledger.count_running_iteration()
    assert ledger.applied == 4
    step = ledger.begin(4)
    step.reached_commit = True
    ledger.count_running_iteration()
    assert (ledger.applied, ledger.step.reached_commit) == (5, True)
    ledger.end()
    assert ledger.step is None


def test_a_fault_point_other_than_the_armed_one_does_nothing():
    faults = FaultInjector()
    faults.at("joiner", rank=0)  # nothing armed
    faults.arm("leaver")
    faults.at("joiner", rank=0)
    faults.before_vote(0, switch_requested=lambda: True, timeout_s=0.1)  # not commit=0
    assert faults.fault == "leaver"


@pytest.mark.parametrize("code", [
    "faults.arm('stayer=2'); faults.at('stayer=2', rank=2)",
    "faults.arm('commit=1'); faults.before_vote(1, lambda: True, timeout_s=5.0)",
])
def test_the_armed_fault_kills_its_process_with_sigkill(code):
    program = ("from mover_plugin.runtime.faults import FaultInjector\n"
               f"faults = FaultInjector()\n{code}\n")
    result = subprocess.run([sys.executable, "-c", program], timeout=60, capture_output=True)
    assert result.returncode == -signal.SIGKILL


def test_commit_fault_without_the_switch_notice_gives_up_at_the_timeout():
    faults = FaultInjector()
    faults.arm("commit=1")
    faults.before_vote(1, switch_requested=lambda: False, timeout_s=0.05)  # returns: no notice


class FakeDelta:
    """Stands in for a prepared delta: only its release is observed."""


def test_a_preparation_abandoned_while_building_releases_its_groups_when_done(monkeypatch):
    released = []
    monkeypatch.setattr("mover_plugin.runtime.migration.discard_delta", released.append)
    may_finish = threading.Event()
    delta = FakeDelta()

    def build():
        may_finish.wait(timeout=10)
        return delta

    preparation = GroupPreparation(7, build)
    preparation.abandon()
    may_finish.set()
    assert preparation.result() is None
    assert released == [delta] and preparation.generation == 7


def test_a_preparation_hands_over_its_groups_or_its_error():
    delta = FakeDelta()
    assert GroupPreparation(3, lambda: delta).result() is delta

    def fail():
        raise RuntimeError("joiner lost")

    with pytest.raises(RuntimeError, match="joiner lost"):
        GroupPreparation(3, fail).result()
