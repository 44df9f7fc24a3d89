"""Parts of the worker runtime tested without a job: the step ledger, injected faults, a
migration's group preparation in its thread, and how an error is told to be a lost peer."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest

from mover_plugin.comm import CollectiveAborted, clear_alarm, raise_alarm
from mover_plugin.runtime.exits import describe_error, is_lost_peer
from mover_plugin.runtime.faults import FaultInjector
from mover_plugin.runtime.ledger import StepLedger
from mover_plugin.runtime.migration import GroupPreparation
from mover_plugin.runtime.peer_copy import shard_record


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


def test_the_commit_rule_counts_an_iteration_passed_but_not_applied():
    ledger = StepLedger(applied=4)
    assert (ledger.update_pending, ledger.completed_by_commit()) == (False, 4)
    step = ledger.begin(4)
    step.reached_commit = True  # waiting in the commit: nothing changed yet
    assert (ledger.update_pending, ledger.completed_by_commit()) == (False, 4)
    assert ledger.may_finish_update(5) and not ledger.may_finish_update(4)
    step.passed_commit = True  # every rank reached it: the iteration is done for the job
    assert (ledger.update_pending, ledger.completed_by_commit()) == (True, 5)
    ledger.count_running_iteration()
    assert (ledger.update_pending, ledger.completed_by_commit()) == (False, 5)
    assert not ledger.may_finish_update(5)  # applied already
    record = shard_record(ledger, None)
    assert record == {"applied": 5, "updating": False, "held_of": -1, "held_version": -1}


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
    """No switch notice within the timeout: the rank votes (the call returns, the process
    lives), after asking for the notice until the timeout."""
    faults = FaultInjector()
    faults.arm("commit=1")
    asked = []
    started = time.monotonic()
    faults.before_vote(1, switch_requested=lambda: asked.append(time.monotonic()) or False,
                       timeout_s=0.2)
    assert asked[-1] - started >= 0.2 and len(asked) > 2
    assert faults.fault == "commit=1"  # still armed for a later switch


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


@pytest.fixture
def clear_alarm_after():
    clear_alarm()
    yield
    clear_alarm()


GLOO_LIKE = RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer")
"""The text of a lost peer's error, raised here by the training code itself."""


def test_an_error_without_an_alarm_is_the_training_codes_own(clear_alarm_after):
    started = time.monotonic()
    assert not is_lost_peer(GLOO_LIKE, grace_s=0.2)
    assert time.monotonic() - started >= 0.2  # it waited the grace period for the alarm


def test_an_error_followed_by_the_alarm_within_the_grace_is_a_lost_peer(clear_alarm_after):
    timer = threading.Timer(0.05, raise_alarm, args=("rank 3 lost",))
    timer.start()
    started = time.monotonic()
    try:
        assert is_lost_peer(ValueError("any text"), grace_s=30.0)
    finally:
        timer.join()
    assert time.monotonic() - started < 10.0  # woken by the alarm, not at the end of the grace


def test_a_collective_the_plugin_abandoned_is_a_lost_peer_at_once(clear_alarm_after):
    assert is_lost_peer(CollectiveAborted("all_reduce: aborted by the alarm"), grace_s=0.0)


def test_an_error_of_its_own_is_described_with_its_traceback():
    try:
        raise ValueError("bad batch")
    except ValueError as error:
        described = describe_error(error)
    assert described["error"] == "ValueError: bad batch"
    assert described["traceback"].startswith("Traceback") and "raise ValueError" in \
        described["traceback"]


def test_flushing_open_files_at_exit_passes_over_a_dead_weak_proxy(tmp_path):
    """A process ending through exit_now() flushes every open file it finds among the live
    objects; a weak proxy whose referent is gone is among them (Megatron-Core's MoE layers
    leave such proxies) and must not end the exit with a ReferenceError."""
    code = (
        "import weakref, sys\n"
        "from mover_plugin.runtime.exits import _flush_open_files\n"
        "class Referent: pass\n"
        "referent = Referent()\n"
        "proxy = weakref.proxy(referent)\n"
        "del referent\n"
        f"out = open({str(tmp_path / 'written.txt')!r}, 'w')\n"
        "out.write('kept')\n"
        "_flush_open_files()\n"
        "sys.stdout.write(open(out.name).read())\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "kept"
