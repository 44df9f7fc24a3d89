"""Crash recovery without a restart: examples/pretrain_gpt.py --resilient under
mover-launch --policy resilient, with real SIGKILL/SIGSTOP delivered to real worker processes.

Each run must complete every step with the failure-free PARAMS_DIGEST; the event log must
show detect -> switch -> resume, every survivor leaving the failed step, and a standby (the
only new process) taking the lost rank's place.
"""

import json
import os
import signal
import sys

import pytest

from support.gpt_jobs import (EXAMPLE, HELD_EXAMPLE, LAUNCH, MODEL, background_job, digest,
                              pretrain, read_events, wait_for_events, worker_pid)
from mover_plugin.testing import run_command
from support.paths import SCRIPTS

pytest.importorskip("megatron.core")

PP2 = ["--pipeline-model-parallel-size", "2", "--train-iters", "10", "--resilient"]


def resilient_run(tmp_path, *injections, standbys=1, script_flags=PP2, extra=()):
    summary, events = tmp_path / "summary.json", tmp_path / "events.jsonl"
    launcher = ["--policy", "resilient", "--standbys", str(standbys), "--summary", str(summary),
                "--event-log", str(events), "--stop-grace-s", "2", *extra]
    for injection in injections:
        launcher += ["--inject-failure", injection]
    result = pretrain(*script_flags, launcher_flags=launcher)
    assert result.returncode == 0, result.output[-5000:]
    return result, json.loads(summary.read_text()), read_events(events)


def check_standby_recovery(interruption, events, rank, world_size=4, interruptions=1):
    """``interruption`` (one of ``interruptions`` in the run) was ``rank``'s, recovered by a
    standby with every other rank kept."""
    assert interruption["recovery"] == "standby"
    assert interruption["rank"] == rank
    survivors = sorted(set(range(world_size)) - {rank})
    assert sorted(int(r) for r in interruption["left_s"]) == survivors
    order = [e["event"] for e in events if e["event"] in ("worker_failed", "promote", "resumed")]
    assert order == ["worker_failed", "promote", "resumed"] * interruptions
    generation = interruption["generation"]
    switched = {e["rank"]: e["role"] for e in events
                if e["event"] == "switched" and e["generation"] == generation}
    assert switched == {r: ("joiner" if r == rank else "survivor") for r in range(world_size)}
    assert not [e for e in events if e["event"] == "attempt_start" and e["attempt"] > 0]


@pytest.mark.parametrize(
    "kills",
    [((0, 3), (3, 7)), ((2, 4), (1, 8))],
    ids=["first-stage-dp0-early-then-last-stage-dp1-late",
         "last-stage-dp0-early-then-first-stage-dp1-late"],
)
def test_sigkill_of_any_rank_is_survived_exactly(tmp_path, reference_pp2, kills):
    """Each rank of TP1 x PP2 x DP2 SIGKILLed once, early or late in the run, two ranks a run
    (two standbys): each is replaced in place by a standby that adopts the model it kept."""
    result, summary, events = resilient_run(tmp_path, *(f"{rank}:{step}" for rank, step in kills),
                                            standbys=2)
    assert digest(result) == digest(reference_pp2)
    assert summary["steps_completed"] == 10 and summary["restarts"] == 0
    assert len(summary["interruptions"]) == len(kills)
    for interruption, (rank, step) in zip(summary["interruptions"], kills):
        assert interruption["step"] >= step and interruption["how"] == "signal SIGKILL"
        check_standby_recovery(interruption, events, rank, interruptions=len(kills))
        assert {"detected", "alarm", "left", "switched", "first_step_completed"} <= set(
            interruption["phases_s"])
    # Each standby warmed up as both stages and kept both: it adopts the failed rank's.
    warmed = [e for e in events if e["event"] == "standby_warmed"]
    assert len(warmed) == len(kills)
    for each in warmed:
        assert each["roles"] == each["kept"] == ["first", "last"]
        assert each["shadow_iterations"] == 2 and each["sandbox_operations"] > 0
    joiners = [e for e in events if e["event"] == "switched" and e["role"] == "joiner"]
    assert [(e["rank"], e["adopted"]) for e in joiners] == [(rank, True) for rank, _ in kills]


PP3 = ["--pipeline-model-parallel-size", "3", "--num-layers", "3", "--train-iters", "8"]
SIX = ["--nproc-per-node", "6"]


def test_a_first_stage_rank_of_a_three_stage_pipeline_is_survived_exactly(tmp_path):
    """TP1 x PP3 x DP2, rank 0 SIGKILLed: the standby adopts the first stage it kept (of the
    three it played). The last stage's rank 4 was waiting for stage 1's activations in the
    aborted generation, a receive its peer never completes there: its process still ends with
    exit status 0 (the interpreter's teardown, which that wait would abort, is skipped)."""
    reference = pretrain(*PP3, launcher_flags=SIX)
    assert reference.returncode == 0, reference.output[-4000:]
    result, summary, events = resilient_run(tmp_path, "0:5", script_flags=[*PP3, "--resilient"],
                                            extra=SIX)
    assert digest(result) == digest(reference)
    assert "terminate called" not in result.output
    (interruption,) = summary["interruptions"]
    check_standby_recovery(interruption, events, 0, world_size=6)
    assert summary["restarts"] == 0 and summary["steps_completed"] == 8
    (warmed,) = [e for e in events if e["event"] == "standby_warmed"]
    assert warmed["kept"] == ["first", "last", "middle"]
    # No GPU and no --resilient-standby-memory-mb: no budget, every role kept; what each holds
    assert warmed["released"] == [] and warmed["budget_mb"] is None
    assert sorted(warmed["held_mb"]) == ["first", "last", "middle"]
    assert all(held > 0 for held in warmed["held_mb"].values())
    (joiner,) = [e for e in events if e["event"] == "switched" and e["role"] == "joiner"]
    assert joiner["adopted"] is True


def test_a_kill_and_a_hang_with_two_standbys_are_both_survived(tmp_path, reference_pp2):
    """Two failures in one run: rank 1 killed (SIGKILL), later rank 2 hung (SIGSTOP: found by
    its missing heartbeats, killed and replaced)."""
    flags = [*PP2, "--resilient-failure-timeout-s", "3"]
    result, summary, events = resilient_run(tmp_path, "1:4", "2:7:SIGSTOP", standbys=2,
                                            script_flags=flags)
    assert digest(result) == digest(reference_pp2)
    assert [i["rank"] for i in summary["interruptions"]] == [1, 2]
    assert [i["kind"] for i in summary["interruptions"]] == ["failure", "hang"]
    assert [i["recovery"] for i in summary["interruptions"]] == ["standby", "standby"]
    assert [e["rank"] for e in events if e["event"] == "hung"] == [2]
    # mover report on the run's folder: every step's time once, both interruptions, a picture.
    steps = [item for e in events if e["event"] == "steps" for item in e["steps"]]
    assert [step for step, _, _ in steps] == list(range(1, 11))
    report = run_command([sys.executable, "-m", "mover_plugin.launch.jobctl", "report",
                          str(tmp_path)], timeout_s=120)
    assert report.returncode == 0, report.output
    rows = report.stdout.splitlines()[2:-2]  # between the header and the totals
    assert [row.split()[1:3] for row in rows] == [["failure", "1"], ["hang", "2"]]
    assert report.stdout.splitlines()[-1] == f"report: picture in {tmp_path / 'report.png'}"
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


DISTRIBUTED = ["--pipeline-model-parallel-size", "2", "--train-iters", "10",
               "--use-distributed-optimizer"]


def test_a_second_rank_lost_during_the_switch_is_survived_exactly(tmp_path, reference_pp2_40):
    """Rank 3 is SIGKILLed as it begins step 10; as soon as the controller promotes its
    standby (before the switch completes), rank 0 is SIGKILLed too. The survivors and the
    joiner give up the generation they were building; the next one replaces rank 0 and keeps
    rank 3's joiner, every group is rebuilt, and training goes on in place with the
    failure-free parameters. (The first kill comes from the launcher at a step, not from the
    test once it sees a step: this tiny job trains its 40 steps in a few seconds, and a kill
    that lands after the others ended their script is a different case, a restart.)"""
    events_path, summary_path = tmp_path / "events.jsonl", tmp_path / "summary.json"
    command = [*LAUNCH, "--standalone", "--nproc-per-node", "4", "--policy", "resilient",
               "--standbys", "2", "--refill-delay-s", "3600", "--event-log", str(events_path),
               "--summary", str(summary_path), "--inject-failure", "3:10", EXAMPLE, *MODEL,
               "--pipeline-model-parallel-size", "2", "--train-iters", "40", "--resilient"]
    with background_job(command, tag=str(tmp_path)) as process:
        wait_for_events(events_path, lambda es: sum(e["event"] == "worker_ready"
                                                    for e in es) == 4, process)
        second = worker_pid(0, str(tmp_path))
        wait_for_events(events_path, lambda es: any(e["event"] == "promote" for e in es),
                        process, poll_s=0.005)  # the switch takes a few hundred ms
        os.kill(second, signal.SIGKILL)
        output, _ = process.communicate(timeout=240)
    assert process.returncode == 0, output[-4000:]
    assert f"PARAMS_DIGEST {digest(reference_pp2_40)}" in output
    events = read_events(events_path)
    assert not [e for e in events if e["event"] in ("fallback", "restart")]
    assert [(e["rank"], e["generation"]) for e in events if e["event"] == "worker_failed"] == [
        (3, 0), (0, 1)]
    (carried,) = [e for e in events if e["event"] == "carried"]
    (promoted_first, promoted_second) = [e for e in events if e["event"] == "promote"]
    assert (carried["rank"], carried["generation"]) == (3, 2)
    assert carried["standby"] == promoted_first["standby"] and carried["twin"] == 2
    assert (promoted_second["rank"], promoted_second["twin"]) == (0, 1)
    switched = {e["rank"]: e["role"] for e in events
                if e["event"] == "switched" and e["generation"] == 2}
    assert switched == {0: "joiner", 1: "survivor", 2: "survivor", 3: "joiner"}
    assert [e["generation"] for e in events if e["event"] == "resumed"] == [2]
    summary = json.loads(summary_path.read_text())
    assert summary["restarts"] == 0 and summary["steps_completed"] == 40


def test_the_distributed_optimizer_continues_in_place_from_the_peer_copy(tmp_path,
                                                                         reference_distopt):
    """With --use-distributed-optimizer a SIGKILLed rank's optimizer shard comes from the copy
    its data-parallel peer keeps; no rank rolls back."""
    result, summary, events = resilient_run(tmp_path, "2:4",
                                            script_flags=[*DISTRIBUTED, "--resilient"])
    assert digest(result) == digest(reference_distopt)
    (interruption,) = summary["interruptions"]
    check_standby_recovery(interruption, events, 2)
    assert interruption["rolled_back_to"] is None
    assert not [e for e in events if e["event"] == "rolled_back"]
    assert {e["rank"] for e in events if e["event"] == "peer_copy"} == {0, 1, 2, 3}
    (joiner,) = [e for e in events if e["event"] == "switched" and e["role"] == "joiner"]
    assert joiner["adopted"] is True  # rank 2: last stage, data-parallel index 0


def test_without_the_peer_copy_every_rank_rolls_back_to_the_examples_checkpoint(
        tmp_path, reference_distopt):
    """--resilient-no-peer-copy: the lost rank's shard exists nowhere, so every rank rolls back
    in place to the example's last checkpoint, whose optimizer shards every rank saved."""
    ckpt = str(tmp_path / "ckpt")
    result, summary, events = resilient_run(
        tmp_path, "1:8",
        script_flags=[*DISTRIBUTED, "--resilient", "--resilient-no-peer-copy", "--save", ckpt,
                      "--load", ckpt, "--save-interval", "3"])
    assert digest(result) == digest(reference_distopt)
    (interruption,) = summary["interruptions"]
    assert interruption["rolled_back_to"] == 6 and summary["restarts"] == 0
    assert interruption["inexact"] is None  # Megatron's checkpoints hold the RNG states
    assert sorted(e["rank"] for e in events if e["event"] == "rolled_back") == [0, 1, 2, 3]
    # Rank 1's optimizer shard is data-parallel index 1's: the standby's kept first stage
    # (sharded for index 0) does not fit, so it builds.
    (joiner,) = [e for e in events if e["event"] == "switched" and e["role"] == "joiner"]
    assert joiner["adopted"] is False


@pytest.fixture(scope="module")
def reference_distopt():
    """TP1 x PP2 x DP2 with the distributed optimizer, 10 steps, no interruption."""
    result = pretrain(*DISTRIBUTED)
    assert result.returncode == 0, result.output[-4000:]
    return result


def test_no_twin_falls_back_to_the_restart_baseline(tmp_path, reference_tp2_pp2):
    ckpt = str(tmp_path / "ckpt")
    flags = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
             "--train-iters", "6", "--resilient", "--save", ckpt, "--load", ckpt,
             "--save-interval", "1"]
    result, summary, events = resilient_run(tmp_path, "1:4", script_flags=flags)
    assert digest(result) == digest(reference_tp2_pp2)
    (interruption,) = summary["interruptions"]
    assert interruption["recovery"] == "restart" and summary["restarts"] == 1
    (fallback,) = [e for e in events if e["event"] == "fallback"]
    assert "data-parallel size is 1" in fallback["reason"]


def test_a_standby_dying_while_idle_is_replaced_and_training_goes_on(tmp_path, reference_pp2):
    events_path = tmp_path / "events.jsonl"
    command = [*LAUNCH, "--standalone", "--nproc-per-node", "4", "--policy", "resilient",
               "--standbys", "1", "--refill-delay-s", "0", "--event-log", str(events_path),
               EXAMPLE, *MODEL, *PP2]
    with background_job(command, tag=str(tmp_path)) as process:
        wait_for_events(events_path, lambda es: any(e["event"] == "standby_ready" for e in es),
                  process)
        os.kill(worker_pid(0, str(tmp_path), standby="a0.n0.s0"), signal.SIGKILL)
        output, _ = process.communicate(timeout=240)
    assert process.returncode == 0, output[-4000:]
    assert f"PARAMS_DIGEST {digest(reference_pp2)}" in output
    events = read_events(events_path)
    (lost,) = [e for e in events if e["event"] == "standby_lost"]
    assert lost["pool"] == 0 and lost["how"] == "signal SIGKILL"
    (refill,) = [e for e in events if e["event"] == "standby_refill"]
    assert refill["standby"] == "a0.n0.r0" and refill["node"] == 0 and refill["pool"] == 0
    assert not [e for e in events if e["event"] in ("worker_failed", "fallback", "restart")]


@pytest.mark.parametrize(
    "launcher_flags, script_flags, message",
    [
        (["--standbys", "-1"], [], "'-1' is not a non-negative integer"),
        (["--policy", "restart", "--standbys", "1"], [], "--standbys 1 needs --policy resilient"),
        ([], ["--resilient-heartbeat-interval-s", "5", "--resilient-failure-timeout-s", "2"],
         "--resilient-heartbeat-interval-s 5.0 must be below --resilient-failure-timeout-s 2.0"),
        ([], ["--resilient-standby-shadow-iterations", "-1"],
         "--resilient-standby-shadow-iterations -1 must be a whole number of at least 0"),
        ([], ["--resilient-failure-timeout-s", "90"],
         "--resilient-failure-timeout-s 90.0 must be below --resilient-collective-timeout-s"),
    ],
)
def test_bad_resilience_input_fails_before_anything_starts(launcher_flags, script_flags,
                                                           message):
    flags = launcher_flags if "--policy" in launcher_flags else ["--policy", "resilient",
                                                                 *launcher_flags]
    result = pretrain("--resilient", *script_flags, launcher_flags=flags, timeout_s=60)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("mover-launch: error: ") and message in line
    assert "starting" not in result.output


def test_a_spare_hosts_standby_takes_the_lost_rank(tmp_path, reference_pp2):
    """A spare host (its own agent, one standby, no worker) replaces a rank of the worker host;
    the worker host runs no standby."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("127.0.0.1 slots=4\n127.0.0.2 slots=1 spare\n")
    summary, events = tmp_path / "summary.json", tmp_path / "events.jsonl"
    result = run_command(
        [*LAUNCH, "--hostfile", str(hostfile), "--standalone", "--policy", "resilient",
         "--standbys", "0", "--summary", str(summary), "--event-log", str(events),
         "--stop-grace-s", "2", "--inject-failure", "3:4", EXAMPLE, *MODEL, *PP2],
        timeout_s=300)
    assert result.returncode == 0, result.output[-5000:]
    assert digest(result) == digest(reference_pp2)
    summary, events = json.loads(summary.read_text()), read_events(events)
    assert summary["steps_completed"] == 10 and summary["restarts"] == 0
    (interruption,) = summary["interruptions"]
    check_standby_recovery(interruption, events, rank=3)
    (promote,) = [e for e in events if e["event"] == "promote"]
    assert promote["standby"] == "a0.n1.s0"
    assert [e["standby"] for e in events if e["event"] == "standby_ready"] == ["a0.n1.s0"]


BUGGY = str(SCRIPTS / "pretrain_gpt_with_a_bug.py")


def test_an_error_of_the_training_code_ends_the_job_with_its_traceback(tmp_path):
    """Rank 1's training code raises mid-step an error whose text reads like gloo's for a lost
    peer; no peer is lost, so no alarm comes: the rank reports the error as its own, its
    traceback is shown, and the job follows its policy (no restart left: it ends) instead of
    putting the standby in the rank's place."""
    summary_path, events_path = tmp_path / "summary.json", tmp_path / "events.jsonl"
    result = run_command(
        [*LAUNCH, "--standalone", "--nproc-per-node", "4", "--policy", "resilient",
         "--standbys", "1", "--max-restarts", "0", "--summary", str(summary_path),
         "--event-log", str(events_path), "--stop-grace-s", "2", BUGGY, *MODEL, *PP2,
         "--resilient-failure-timeout-s", "2"],
        env={"BUG_AT": "1:3"}, timeout_s=300)
    assert result.returncode == 1, result.output[-5000:]
    assert "Traceback (most recent call last)" in result.stderr
    assert "RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer (a bug" \
        in result.stderr
    events = read_events(events_path)
    (reported,) = [e for e in events if e["event"] == "worker_error"]
    assert reported["rank"] == 1 and reported["error"].startswith("RuntimeError: [gloo")
    (fallback,) = [e for e in events if e["event"] == "fallback"]
    assert fallback["rank"] == 1 and "an error of its own" in fallback["reason"]
    assert not [e for e in events if e["event"] in ("promote", "left_step", "switched")]
    summary = json.loads(summary_path.read_text())
    assert summary["exit_code"] == 1 and summary["restarts"] == 0
    (interruption,) = summary["interruptions"]
    assert interruption["rank"] == 1 and interruption["recovery"] == "restart"


def _holder_pid(events, rank, tag):
    """The pid of the process that holds ``rank`` now in the tagged job: the standby last
    promoted to it, or the worker started with it."""
    promoted = [e["standby"] for e in events if e["event"] == "promote" and e["rank"] == rank]
    pid = worker_pid(rank, tag, standby=promoted[-1] if promoted else None)
    assert pid is not None, f"no process holds rank {rank}"
    return pid


def test_one_standby_per_host_survives_three_failures_in_a_row_on_a_refilling_pool(
        tmp_path, reference_pp2_40):
    """--standbys 1: after each recovery the host whose worker was lost starts a new standby;
    each next SIGKILL (sent by the test once the refill is ready) is recovered in place too.
    Rank 0 is held between steps while a refill warms up (pretrain_gpt_held.py), so the job
    cannot end first however slow the machine."""
    summary_path, events_path = tmp_path / "summary.json", tmp_path / "events.jsonl"
    hold = tmp_path / "hold"
    hold.write_text("0")
    command = [*LAUNCH, "--standalone", "--nproc-per-node", "4", "--policy", "resilient",
               "--standbys", "1", "--refill-delay-s", "0", "--summary", str(summary_path),
               "--event-log", str(events_path), "--stop-grace-s", "2", HELD_EXAMPLE, *MODEL,
               "--pipeline-model-parallel-size", "2", "--train-iters", "40", "--resilient"]
    with background_job(command, tag=str(tmp_path), env={"HOLD_FILE": str(hold)}) as process:
        # training (held after its first step), with its standby ready
        events = wait_for_events(events_path, lambda es: any(e["event"] == "steps" for e in es)
                           and any(e["event"] == "standby_ready" for e in es), process)
        for number, rank in enumerate((3, 1, 3)):
            hold.write_text(str(number + 1))  # released; held again once recovered
            os.kill(_holder_pid(events, rank, str(tmp_path)), signal.SIGKILL)
            # recovered in place, and (but after the last) the refill it started is ready
            refills_ready = min(number + 1, 2)
            events = wait_for_events(events_path, lambda es: sum(
                e["event"] == "resumed" for e in es) == number + 1 and sum(
                e["event"] == "standby_ready" and ".r" in e["standby"] for e in es)
                >= refills_ready, process)
        hold.write_text("")
        output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output[-4000:]
    assert f"PARAMS_DIGEST {digest(reference_pp2_40)}" in output
    summary = json.loads(summary_path.read_text())
    assert [i["rank"] for i in summary["interruptions"]] == [3, 1, 3]
    assert [i["recovery"] for i in summary["interruptions"]] == ["standby"] * 3
    assert summary["restarts"] == 0
    events = read_events(events_path)
    assert not [e for e in events if e["event"] in ("fallback", "restart")]
    assert [e["standby"] for e in events if e["event"] == "promote"] == [
        "a0.n0.s0", "a0.n0.r0", "a0.n0.r1"]
    refills = summary["refills"]
    assert [r["standby"] for r in refills] == ["a0.n0.r0", "a0.n0.r1", "a0.n0.r2"]
    assert all(r["ready_at"] > r["requested_at"] for r in refills[:2])
