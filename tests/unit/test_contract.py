"""The launcher↔worker contract: the closed set of events and their schemas (pure)."""

from __future__ import annotations

import ast
import json
import re
from typing import Optional

import pytest

from mover_plugin.contract import (
    COMMANDS,
    EVENTS,
    NOTICE_KINDS,
    GenerationPlan,
    PlanKind,
    command_problem,
    encode_notice,
    event_problem,
    make_command,
)
from mover_plugin.generations import Replacement


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


from support.paths import ROOT
POSTERS = ("post", "_post")
"""The names the code posts events through: an agent's ``_post(kind, **fields)``, a worker's
``control.post(kind, **fields)``, the step-time batcher's ``_post``, peer copy's ``post``."""
FILLED_BY_POSTER = {"time", "generation"}
"""Fields a poster adds when the call leaves them out."""


def posting_sites() -> list[tuple[str, str, Optional[set[str]]]]:
    """(where, kind, fields) for every event the package's code posts with a literal kind:
    calls of :data:`POSTERS` and dict literals with a ``"kind"`` key; ``fields`` is None where
    a ``**`` argument makes them unknown until run time."""
    sites = []
    sources = [*ROOT.joinpath("mover_plugin").rglob("*.py"), *ROOT.joinpath("launch").glob("*.py")]
    for source in sources:
        tree = ast.parse(source.read_text(), filename=str(source))
        for node in ast.walk(tree):
            where = f"{source.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Call) and _called_name(node) in POSTERS and node.args \
                    and isinstance(node.args[0], ast.Constant) \
                    and isinstance(node.args[0].value, str):
                names = [k.arg for k in node.keywords]
                sites.append((where, node.args[0].value,
                              None if None in names else set(names)))
            elif isinstance(node, ast.Dict):
                entries = dict(zip(node.keys, node.values))
                kinds = [v.value for k, v in entries.items()
                         if isinstance(k, ast.Constant) and k.value == "kind"
                         and isinstance(v, ast.Constant) and isinstance(v.value, str)]
                if kinds:
                    names = {k.value for k in node.keys if isinstance(k, ast.Constant)}
                    sites.append((where, kinds[0], None if None in node.keys else names))
    return sites


def _called_name(call: ast.Call) -> Optional[str]:
    if isinstance(call.func, ast.Attribute):
        return call.func.attr
    return call.func.id if isinstance(call.func, ast.Name) else None


def test_every_event_the_code_posts_is_in_the_contract_with_its_fields():
    sites = posting_sites()
    unknown = [(where, kind) for where, kind, _ in sites if kind not in EVENTS]
    assert not unknown, f"posted but not in mover_plugin.contract.EVENTS: {unknown}"
    missing = [(where, kind, sorted(set(EVENTS[kind].required) - fields - FILLED_BY_POSTER))
               for where, kind, fields in sites if fields is not None
               and set(EVENTS[kind].required) - fields - FILLED_BY_POSTER]
    assert not missing, f"posted without fields the contract requires: {missing}"
    never_posted = set(EVENTS) - {kind for _, kind, _ in sites}
    assert not never_posted, f"in the contract but posted nowhere: {sorted(never_posted)}"
    assert len(sites) >= len(EVENTS)


def test_a_notice_is_one_json_line():
    line = encode_notice({"generation": 2, "kind": NOTICE_KINDS[0], "reason": "rank 3 lost"})
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert json.loads(line) == {"generation": 2, "kind": "alarm", "reason": "rank 3 lost"}


@pytest.mark.parametrize("command", [
    make_command("start", attempt=0, generation=0, ranks={"0": [0, 1]}),
    make_command("promote", standby="a0.n0.s0", rank=3, migration=False),
    make_command("notice", generation=2, kind="alarm", reason="rank 3 lost"),
    make_command("drop", ranks=(1, 2)),
    make_command("finish"),
])
def test_commands_as_the_controller_makes_them_survive_json(command):
    assert command_problem(json.loads(json.dumps(command))) is None


@pytest.mark.parametrize("command, problem", [
    ({"op": "launch"}, "unknown command 'launch'"),
    ({"attempt": 1}, "unknown command None"),
    ("stop", "a command must be a JSON object, got str"),
    ({"op": "stop"}, "stop command without its field 'attempt'"),
    ({"op": "promote", "standby": "s", "rank": "3", "migration": False},
     "promote command: field 'rank' is str, expected int"),
    ({"op": "fence", "node": 1, "reason": "x"}, "fence command: unknown field(s) 'reason'"),
])
def test_an_unknown_or_malformed_command_is_named_with_what_is_wrong(command, problem):
    assert command_problem(command) == problem
    if isinstance(command, dict) and isinstance(command.get("op"), str):
        with pytest.raises(ValueError, match=re.escape(problem)):
            make_command(**command)


def command_sites() -> list[tuple[str, str, Optional[set[str]]]]:
    """(where, op, fields) for every ``.command("op", ...)`` call of the launcher with a literal
    op; an ``op`` chosen by an expression counts each literal it may take (``a if c else b``)."""
    sites = []
    for source in ROOT.joinpath("launch").glob("*.py"):
        tree = ast.parse(source.read_text(), filename=str(source))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and _called_name(node) == "command"
                    and node.args):
                continue
            where = f"{source.relative_to(ROOT)}:{node.lineno}"
            names = [k.arg for k in node.keywords]
            fields = None if None in names else set(names)
            first = node.args[0]
            choices = [first.body, first.orelse] if isinstance(first, ast.IfExp) else [first]
            for choice in choices:
                assert isinstance(choice, ast.Constant), f"{where}: op is not a literal"
                sites.append((where, choice.value, fields))
    return sites


def test_every_command_the_controller_sends_is_in_the_contract_with_its_fields():
    sites = command_sites()
    unknown = [(where, op) for where, op, _ in sites if op not in COMMANDS]
    assert not unknown, f"sent but not in mover_plugin.contract.COMMANDS: {unknown}"
    wrong = [(where, op, sorted(fields ^ set(COMMANDS[op].required)))
             for where, op, fields in sites if fields is not None
             and fields != set(COMMANDS[op].required)]
    assert not wrong, f"sent with other fields than the contract's: {wrong}"
    never_sent = set(COMMANDS) - {op for _, op, _ in sites}
    assert not never_sent, f"in the contract but sent nowhere: {sorted(never_sent)}"


# --- a generation's plan ------------------------------------------------------------------------

_PLANS = [
    GenerationPlan(PlanKind.CRASH, 4, replacements=(Replacement(1, "a0.n1.s0", 0, 1),),
                   rebuild_all=True, generation=3),
    GenerationPlan(PlanKind.MIGRATION, 4, replacements=(Replacement(2, "a0.n0.s0", 2, 0),),
                   fault="prepare:crash", generation=1),
    GenerationPlan(PlanKind.SHRINK, 3, survivors=(0, 2, 3), lost=(1,),
                   placement={"pipelines": [[0, 1]]}, moves=(("layer 2", 1, 0),),
                   describe="[0 1] layers 0-3 x 2", generation=2),
]


@pytest.mark.parametrize("plan", _PLANS, ids=lambda plan: plan.kind.value)
def test_a_generation_plan_survives_json(plan: GenerationPlan) -> None:
    assert GenerationPlan.from_record(json.loads(json.dumps(plan.to_record()))) == plan


def test_a_plan_names_its_replacements_by_rank() -> None:
    plan = GenerationPlan(PlanKind.CRASH, 4, replacements=(
        Replacement(1, "a0.n1.s0", 0, 1), Replacement(3, "a0.n1.s1", 2, 1)))
    assert plan.replaced_ranks == {1, 3}
    assert plan.replacement_of(3) == Replacement(3, "a0.n1.s1", 2, 1)
    assert plan.replacement_of(0) is None


@pytest.mark.parametrize("change, problem", [
    ({"kind": "resize"}, "a generation plan of unknown kind 'resize'; kinds: crash, migration, "
                         "shrink, grow"),
    ({"world_size": "4"}, "a generation plan: field 'world_size' is str, expected int"),
    ({"replacements": None}, "a generation plan: field 'replacements' is NoneType, expected "
                             "list or tuple"),
])
def test_a_malformed_plan_is_named_with_what_is_wrong(change: dict, problem: str) -> None:
    record = {**_PLANS[0].to_record(), **change}
    with pytest.raises(ValueError) as raised:
        GenerationPlan.from_record(record)
    assert str(raised.value) == problem
    without = _PLANS[0].to_record()
    del without["generation"]
    with pytest.raises(ValueError, match="a generation plan without its field 'generation'"):
        GenerationPlan.from_record(without)
