"""A DeepSpeed standby's shadow run, pure logic: the rank it plays, DeepSpeed's process-wide
state put back after it, and how its end is told apart (the run itself: the drop-in tests)."""

import enum
import sys
import types

import pytest

from mover_plugin.deepspeed.shadow_run import (
    ModuleGlobals,
    ShadowRunOver,
    _MutedStream,
    _outcome,
    shadow_rank,
)
from mover_plugin.layout import ParallelLayout


@pytest.mark.parametrize("pp, dp, rank", [(1, 4, 3), (2, 2, 1), (4, 1, 0), (2, 3, 2)])
def test_the_shadow_run_plays_the_first_stage_of_the_last_replica(pp, dp, rank):
    layout = ParallelLayout(tp=1, pp=pp, dp=dp)
    assert shadow_rank(layout) == rank
    assert layout.coordinates(rank).pp == 0 and layout.coordinates(rank).dp == dp - 1


class Colour(enum.Enum):
    RED = 1


@pytest.fixture
def stateful_module():
    """A module with state of the kinds DeepSpeed keeps: a global rebound by a ``global``
    statement, a dict changed in place, a class counter, a default-argument counter."""
    module = types.ModuleType("fake_deepspeed_state")

    class Init:
        param_id = 0

        def register(self, count=[0]):  # noqa: B006 - the pattern under test
            count[0] += 1
            return count[0]

    Init.__module__ = module.__name__
    Colour.__module__ = module.__name__
    module.cdb = None
    module.groups = {"world": None}
    module.Init = Init
    module.Colour = Colour
    sys.modules[module.__name__] = module
    yield module
    del sys.modules[module.__name__]


def test_the_state_is_put_back_as_it_was(stateful_module):
    module = stateful_module
    groups = module.groups
    kept = ModuleGlobals((module.__name__,))
    module.cdb = object()
    module.groups["world"] = "a sandbox group"
    module.Init.param_id = 15
    assert module.Init().register() == 1
    assert kept.restore() == 4
    assert module.cdb is None and module.groups is groups and groups == {"world": None}
    assert module.Init.param_id == 0 and module.Init().register() == 1
    assert module.Colour.RED.value == 1  # an enum's members are not reassigned
    assert kept.restore() == 1  # only the counter the check above advanced


@pytest.mark.parametrize("end, outcome", [
    (ShadowRunOver(), "unwound"),
    (None, "ended"),
    (SystemExit(0), "ended"),
    (SystemExit(3), "failed: SystemExit: 3"),
    (RuntimeError("no such field"), "failed: RuntimeError: no such field"),
])
def test_how_a_shadow_run_ended(end, outcome):
    assert _outcome(end) == outcome


def test_a_script_catching_exceptions_does_not_catch_the_unwinding():
    with pytest.raises(ShadowRunOver):
        try:
            raise ShadowRunOver()
        except Exception:  # noqa: BLE001 - what a script may do
            pytest.fail("caught as an Exception")


def test_what_the_script_prints_is_counted_not_shown_and_goes_through_after(capsys):
    muted = _MutedStream(sys.stdout)
    kept = muted  # a reference the script keeps (a logging handler's stream, say)
    print("step 1/8 | loss 4.2", file=muted)
    print("PARAMS_DIGEST 00", file=muted, flush=True)
    assert muted.lines == 2 and capsys.readouterr().out == ""
    muted.muted = False
    print("after the shadow run", file=kept)
    assert capsys.readouterr().out == "after the shadow run\n"
    assert muted.encoding == sys.stdout.encoding
