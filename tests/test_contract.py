"""The launcher↔worker contract: the closed set of events and their schemas (pure)."""

from __future__ import annotations

import json

import pytest

from mover_plugin.contract import EVENTS, NOTICE_KINDS, encode_notice, event_problem


def agent_event(kind: str, **fields):
    return {"kind": kind, "attempt": 0, "time": 1.5, "generation": 0, "node": 1, **fields}


def worker_event(kind: str, **fields):
    return {"kind": kind, "attempt": 0, "time": 2, "generation": 3, **fields}


@pytest.mark.parametrize("event", [
    agent_event("worker_exit", rank=2, standby=None, returncode=-9, how="signal SIGKILL",
                step_begun=4, step_completed=3),
    agent_event("hung", rank=None, standby="a0.n0.s0", silent_s=5.2),
    agent_event("node_done", steps_completed=None, workers=[]),
    worker_event("groups_prepared", rank=1, build_s=0.02, rebuilt=2, kept=3),
    worker_event("standby_warmed", standby="a0.n1.s0", roles=["first", "last"]),
])
def test_events_as_agents_and_workers_post_them_are_valid(event):
    assert event_problem(json.loads(json.dumps(event))) is None


@pytest.mark.parametrize("event, problem", [
    (agent_event("failure", rank=1), "unknown event kind 'failure'"),
    (agent_event("request", op="migrate"), "unknown event kind 'request'"),
    ({"attempt": 0, "time": 1.0}, "unknown event kind None"),
    ([1, 2], "an event must be a JSON object, got list"),
    (agent_event("ready", step=3), "ready event without its field 'rank'"),
    ({**agent_event("ready", rank=0, step=1), "node": "1"},
     "ready event: field 'node' is str, expected int"),
    (agent_event("worker_exit", rank=2, returncode=True, how="x", step_begun=0),
     "worker_exit event: field 'returncode' is bool, expected int"),
    (worker_event("boundary", rank=0, iteration=4, step_s=None, migration=2),
     "boundary event: field 'step_s' is NoneType, expected int or float"),
    ({"kind": "left_step", "attempt": 0, "time": 1.0, "rank": 1},
     "left_step event without its field 'generation'"),
])
def test_an_unknown_or_malformed_event_is_named_with_what_is_wrong(event, problem):
    assert event_problem(event) == problem


def test_every_event_kind_names_its_fields():
    assert "joined" in EVENTS and "switched" in EVENTS
    assert all(isinstance(name, str) for schema in EVENTS.values() for name in schema.required)


def test_a_notice_is_one_json_line():
    line = encode_notice({"generation": 2, "kind": NOTICE_KINDS[0], "reason": "rank 3 lost"})
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert json.loads(line) == {"generation": 2, "kind": "alarm", "reason": "rank 3 lost"}
