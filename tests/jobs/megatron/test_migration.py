"""Planned migration: examples/pretrain_gpt.py --resilient under mover-launch --policy
resilient, with ranks moved to standbys while the job trains — by the launcher
(``--inject-migration``) and by an operator with the ``mover`` command.

Every run must complete every step with the PARAMS_DIGEST of the run without migration, with
no restart: the only new processes are the standbys, each leaver exits with status 0 after
handing its state over, and the event log tells the story.
"""

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from support.gpt_jobs import EXAMPLE, LAUNCH, MODEL, TAG_ENV, digest, read_events, worker_pid
from mover_plugin.contract import COMMANDS_MAILBOX
from mover_plugin.errors import ConfigError
from mover_plugin.launch.job_secret import JOB_SECRET_ENV
from mover_plugin.launch.jobctl import JobClient, RequestRejected
from mover_plugin.mailbox import Mailbox
from mover_plugin.testing import run_command

pytest.importorskip("megatron.core")

MOVER = [sys.executable, "-m", "mover_plugin.launch.jobctl"]
PP2 = ["--pipeline-model-parallel-size", "2", "--resilient"]


def test_each_of_the_four_ranks_migrates_with_the_exact_result(tmp_path, reference_pp2_40):
    """One run, four migrations: each is requested when its rank begins the step named, and
    waits for the previous one to be done (two that fall due while one is in phase 1 may be
    carried out in either order)."""
    summary_path, events_path = tmp_path / "summary.json", tmp_path / "events.jsonl"
    launcher = ["--policy", "resilient", "--standbys", "4", "--summary", str(summary_path),
                "--event-log", str(events_path), "--stop-grace-s", "2"]
    for rank, step in ((0, 2), (1, 4), (2, 6), (3, 8)):
        launcher += ["--inject-migration", f"{rank}:{step}"]
    result = run_command([*LAUNCH, "--standalone", "--nproc-per-node", "4", *launcher, EXAMPLE,
                          *MODEL, *PP2, "--train-iters", "40"], timeout_s=400)
    assert result.returncode == 0, result.output[-5000:]
    assert digest(result) == digest(reference_pp2_40)
    summary, events = json.loads(summary_path.read_text()), read_events(events_path)
    assert summary["steps_completed"] == 40 and summary["restarts"] == 0
    migrations = summary["interruptions"]
    order = [m["rank"] for m in migrations]
    assert sorted(order) == [0, 1, 2, 3]
    assert {(m["kind"], m["recovery"]) for m in migrations} == {("migration", "standby")}
    for item in migrations:
        # Measured (the gap less one step time: a switch cheaper than the step-time noise
        # may come out slightly below zero).
        assert isinstance(item["downtime_s"], float)
        assert list(item["phases_s"]) == ["requested", "prepared", "boundary", "handed_over",
                                          "switched", "first_step_completed"]
    story = [(e["event"], e["rank"] if e["rank"] is not None else e.get("ranks"))
             for e in events if e["event"] in ("migration_requested", "joiner_prepared",
                                               "handed_over", "migration_done")]
    assert story == [step for rank in order for step in (
        ("migration_requested", rank), ("joiner_prepared", rank), ("handed_over", rank),
        ("migration_done", [rank]))]
    for rank, item in zip(order, migrations):
        switched = {e["rank"]: e["role"] for e in events
                    if e["event"] == "switched" and e["generation"] == item["generation"]}
        assert switched == {r: "joiner" if r == rank else "stayer" for r in range(4)}
        rebuilt = {e["rank"]: e["rebuilt"] for e in events if e["event"] == "switched"
                   and e["generation"] == item["generation"] and e["role"] == "stayer"}
        # The rank diagonal to the leaver shares with it only groups of every rank: the
        # default group, covered by the others and kept, and Megatron-Core's
        # distributed-optimizer instance group, rebuilt.
        assert rebuilt[3 - rank] == 1 and rebuilt[rank ^ 1] > 1, rebuilt
    leavers = [e for e in events if e["event"] == "leaver_exit"]
    assert sorted(e["rank"] for e in leavers) == [0, 1, 2, 3]
    assert {e["how"] for e in leavers} == {"exit code 0"}
    assert not [e for e in events if e["event"] in ("worker_failed", "fallback", "restart")]
    # The timeline has rank 0's every step once, from the leaver, then from its joiner, and
    # also those trained while each migration was in its phase 1; but the leaver hands the
    # rank over inside the step at whose end they switch, and reports no end of it.
    steps = [item[0] for e in events if e["event"] == "steps" for item in e["steps"]]
    (switch_step,) = [m["step"] for m in migrations if m["rank"] == 0]
    assert steps == [step for step in range(1, 41) if step != switch_step]


def test_failures_during_migrations_are_survived_with_the_exact_result(tmp_path,
                                                                      reference_pp2_40):
    """One run, three migrations, each with a process killed (SIGKILL) at a set point:

    * rank 1's joiner in phase 1, once its model is built: the migration is called off, rank 1
      stays where it is, nothing else is interrupted;
    * rank 2's leaver in phase 2, once the hand-over group is open, before its state is sent:
      the joiner is stopped, and rank 2 is recovered from its data-parallel twin (rank 3) by
      another standby;
    * rank 3, a staying rank, in phase 2 right after it switched (rank 0 moving): rank 0's
      hand-over completes, then rank 3 is recovered from its twin by another standby.
    """
    summary, events = _survive_faulty_migrations(
        tmp_path, reference_pp2_40, standbys=5,
        migrations=["1:3:joiner", "2:12:leaver", "0:22:stayer=3"])
    outcomes = [(e["event"], e.get("ranks")) for e in events
                if e["event"] in ("migration_done", "migration_failed")]
    assert outcomes == [("migration_failed", [1]), ("migration_failed", [2]),
                        ("migration_done", [0])]
    failed = [e for e in events if e["event"] == "migration_failed"]
    assert "joiner of rank 1 was lost in phase 1" in failed[0]["error"]
    # The leaver is killed once the hand-over group is open: before the switch was committed
    # (the migration is cancelled) or after (abandoned); its joiner, cut off, exits too, and
    # either loss may be seen first.
    assert "of rank 2 was lost" in failed[1]["error"], failed[1]
    assert [e["rank"] for e in events if e["event"] == "joiner_lost"] == [1]
    # Rank 3 dies right after it switched: if rank 0's hand-over had not completed yet, its
    # recovery waits for it (deferred); either way rank 3 is recovered from its twin.
    assert [e["rank"] for e in events if e["event"] == "failure_deferred"] in ([], [3])
    recoveries = [(e["rank"], e["twin"]) for e in events if e["event"] == "promote"]
    assert recoveries == [(2, 3), (3, 2)]
    crashes = [i for i in summary["interruptions"] if i["kind"] == "failure"]
    assert [(i["rank"], i["recovery"]) for i in crashes] == [(2, "standby"), (3, "standby")]
    assert all(i["downtime_s"] is not None for i in crashes)


def test_a_rank_lost_inside_the_switch_iteration_is_recovered_in_place(tmp_path,
                                                                       reference_pp2_40):
    """One run, three migrations, each with a process killed (SIGKILL) in the iteration at
    whose end the ranks were to switch, before every rank had ended it — before the point of
    no return, so each migration is cancelled, the processes go on in the old generation and
    the lost rank is recovered there from its data-parallel twin:

    * rank 3, a staying rank, at its commit all-reduce once it has the switch notice, before
      voting (rank 1 moving): no rank passes that commit, all leave the iteration and redo it;
    * rank 2, a staying rank, right after that all-reduce agreed on the switch (rank 0
      moving): ranks 0 and 1 (the first stage) end the iteration (rank 0 hands its state
      over), learn that the switch is cancelled and lose rank 2 in the next iteration; rank 3,
      which had passed the commit too, loses it in the data-parallel loss all-reduce after its
      update, so the ranks are on both sides of the iteration's end when they recover;
    * rank 3's own leaving process, right after the all-reduce (rank 3 moving).
    """
    summary, events = _survive_faulty_migrations(
        tmp_path, reference_pp2_40, standbys=6,
        migrations=["1:4:commit=3", "0:16:update=2", "3:28:update=3"])
    assert not [e for e in events if e["event"] == "switch_committed"]
    failed = [e for e in events if e["event"] in ("migration_done", "migration_failed")]
    assert [(e["event"], e["ranks"]) for e in failed] == [("migration_failed", [1]),
                                                          ("migration_failed", [0]),
                                                          ("migration_failed", [3])]
    window = "was lost in phase 2 before every rank had ended the switch iteration"
    assert f"cancelled: rank 3 {window}" in failed[0]["error"], failed[0]
    assert f"cancelled: rank 2 {window}" in failed[1]["error"], failed[1]
    assert f"cancelled: the leaver of rank 3 {window}" in failed[2]["error"], failed[2]
    # Who had ended the switch iteration and went on in the old generation when the switch
    # was cancelled: nobody when rank 3 died before the commit; after it, the first stage (the
    # last stage's survivor was cut off in the loss all-reduce that follows the update).
    migrations = [e["generation"] for e in events if e["event"] == "migration_requested"]
    stayed = [{e["rank"] for e in events if e["event"] == "switch_cancelled"
               and e["migration"] == generation} for generation in migrations]
    assert stayed == [set(), {0, 1}, {0, 1}], stayed
    recoveries = [(e["rank"], e["twin"]) for e in events if e["event"] == "promote"]
    assert recoveries == [(3, 2), (2, 3), (3, 2)]
    crashes = [i for i in summary["interruptions"] if i["kind"] == "failure"]
    assert [(i["rank"], i["recovery"]) for i in crashes] == [(3, "standby"), (2, "standby"),
                                                            (3, "standby")]
    assert all(i["downtime_s"] is not None for i in crashes)
    # The leaving processes of the cancelled migrations stayed (none exited after a
    # hand-over); the joiners were stopped.
    assert not [e for e in events if e["event"] == "leaver_exit"]


def _survive_faulty_migrations(tmp_path: Path, reference, *, standbys: int,
                               migrations: list[str]) -> tuple[dict, list[dict]]:
    """Runs the 40-step job with ``--inject-migration`` of each of ``migrations``; checks that
    it completed every step with the reference's digest, with neither a restart nor a
    fallback; returns its summary and event log."""
    summary_path, events_path = tmp_path / "summary.json", tmp_path / "events.jsonl"
    launcher = ["--policy", "resilient", "--standbys", str(standbys), "--summary",
                str(summary_path), "--event-log", str(events_path), "--stop-grace-s", "2"]
    for migration in migrations:
        launcher += ["--inject-migration", migration]
    result = run_command([*LAUNCH, "--standalone", "--nproc-per-node", "4", *launcher, EXAMPLE,
                          *MODEL, *PP2, "--train-iters", "40"], timeout_s=500)
    assert result.returncode == 0, result.output[-6000:]
    assert digest(result) == digest(reference)
    summary, events = json.loads(summary_path.read_text()), read_events(events_path)
    assert summary["steps_completed"] == 40 and summary["restarts"] == 0
    assert not [e for e in events if e["event"] in ("fallback", "restart")], result.output[-3000:]
    return summary, events


def _mover(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([*MOVER, *args], capture_output=True, text=True, timeout=120, env=env)


def _mover_started(*args: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen([*MOVER, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def _wait_until_trained_with_standbys(client: JobClient, count: int,
                                      job: subprocess.Popen) -> dict:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        assert job.poll() is None, "the job ended early"
        status = client.status()
        if status["training"] and len(status["standbys"]) == count:
            return status
        time.sleep(0.2)
    raise AssertionError("the job did not start training with its standbys in time")


def _wait_for_migration_done(events_path: Path, job: subprocess.Popen) -> dict:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert job.poll() is None, "the job ended before the migration was done"
        if events_path.exists():
            for event in read_events(events_path):
                assert event["event"] != "migration_failed", event
                if event["event"] == "migration_done":
                    return event
        time.sleep(0.2)
    raise AssertionError("the migration did not finish in time")


def test_operator_moves_a_host_and_bad_requests_leave_the_job_untouched(tmp_path, monkeypatch,
                                                                         reference_pp2_40):
    """Two "hosts" (two agents on this machine, as a hostfile of two machines gives), two
    standbys each. The operator moves every rank of the second host (``--host``); requests
    that cannot be carried out are refused with one line each and change nothing; the result
    equals a run without migration.

    Someone without the job's secret can neither migrate (``mover migrate`` with a wrong
    ``MOVER_JOB_SECRET``), nor stop the job (an ``abort`` posted to the agents' commands with
    torch's own store client, straight at the job's port), nor stall it (a connection held
    open that never answers the gate's challenge): each is refused and in the event log, and
    the job ends as if they never came."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n127.0.0.1 slots=2\n")
    monkeypatch.setenv("MOVER_JOBS_DIR", str(tmp_path / "jobs"))
    env = dict(os.environ)
    events_path = tmp_path / "events.jsonl"
    script = [EXAMPLE, *MODEL, "--pipeline-model-parallel-size", "2", "--train-iters", "40"]

    no_job = _mover("status", env=env)
    assert no_job.returncode == 2 and "no mover-launch job is running" in no_job.stderr
    log = tmp_path / "job.log"
    with open(log, "w") as sink:
        job = subprocess.Popen(
            [*LAUNCH, "--hostfile", str(hostfile), "--master-port", "0", "--policy",
             "resilient", "--standbys", "2", "--event-log", str(events_path), "--stop-grace-s",
             "2", *script, "--resilient"],
            stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    commands: list[subprocess.Popen] = []
    stalling = socket.socket()
    try:
        client = _connect(job)
        # The command line, started as soon as the job is listed: its workers take far longer
        # to start than the command, so the job is sure to be running when it answers.
        cli_status = _mover_started("status", env=env)
        cli_bad_rank = _mover_started("migrate", "--rank", "7", env=env)
        # Someone without the secret, while the job starts and trains.
        stalling.connect((client.master_addr, client.master_port))
        outsider = _mover_started("migrate", "--rank", "1",
                                  env={**env, JOB_SECRET_ENV: "not-the-secret-of-this-job"})
        commands += [cli_status, cli_bad_rank, outsider]
        with pytest.raises(dist.DistError):
            raw = dist.TCPStore(client.master_addr, client.master_port, is_master=False,
                                wait_for_workers=False, timeout=timedelta(seconds=2))
            Mailbox(raw, COMMANDS_MAILBOX).post({"op": "abort"})
        status = _wait_until_trained_with_standbys(client, 4, job)
        assert status["policy"] == "resilient" and status["world_size"] == 4
        assert _nodes(status) == {0: 0, 1: 0, 2: 1, 3: 1}

        with pytest.raises(RequestRejected, match=r"rank 7 does not exist; .*ranks 0\.\.3"):
            client.migrate([7])
        with pytest.raises(RequestRejected, match="host 'node-x' is not one host"):
            client.migrate(host="node-x")
        accepted = client.migrate(host="127.0.0.1", wait=False)
        assert accepted["ranks"] == [2, 3]
        with pytest.raises(RequestRejected, match=r"rank\(s\) \[3\] are already being moved"):
            client.migrate([3])

        done = _wait_for_migration_done(events_path, job)
        assert done["ranks"] == [2, 3]
        status = client.status()
        assert _nodes(status) == {0: 0, 1: 0, 2: 0, 3: 0}
        assert set(status["standbys"].values()) == {1}  # node 0's two were used
        with pytest.raises(RequestRejected, match="no free standby"):
            client.migrate(host="localhost")

        out, err = cli_status.communicate(timeout=120)
        assert cli_status.returncode == 0, err
        # Printed before or after the move, depending on how fast the command started.
        assert out.startswith("job: policy resilient, generation ")
        assert re.search(r"^  rank 3: \S+ on node [01]$", out, re.MULTILINE), out
        out, err = cli_bad_rank.communicate(timeout=120)
        assert cli_bad_rank.returncode == 1
        assert err.strip() == "mover: rank 7 does not exist; this job has ranks 0..3"
        out, err = outsider.communicate(timeout=120)
        assert outsider.returncode == 1 and "refused this host's secret" in err, err
    finally:
        _finish(job)
        stalling.close()
        for command in commands:
            command.kill()
            command.communicate()
    output = log.read_text()
    assert job.returncode == 0, output[-5000:]
    events = read_events(events_path)
    assert not [e for e in events if e["event"] in ("worker_failed", "fallback", "restart")]
    assert len([e for e in events if e["event"] == "migration_rejected"]) == 5
    refused = [e["reason"] for e in events if e["event"] == "connection_refused"]
    assert refused.count("wrong job secret") == 1 and len(refused) >= 2, refused
    assert sorted(e["rank"] for e in events if e["event"] == "leaver_exit") == [2, 3]

    finals = [line.split()[1] for line in output.splitlines()
              if line.startswith("PARAMS_DIGEST")]
    assert finals == [digest(reference_pp2_40)]


def _connect(job: subprocess.Popen) -> JobClient:
    """The job's client, found like ``mover`` finds it: the one job running on this host."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return JobClient()
        except ConfigError:
            assert job.poll() is None and time.monotonic() < deadline, "the job did not start"
            time.sleep(0.2)


def _nodes(status: dict) -> dict[int, int]:
    return {int(rank): member["node"] for rank, member in status["membership"].items()}


def _finish(job: subprocess.Popen) -> None:
    """Waits for the job to end; kills its whole process group if it does not."""
    try:
        job.wait(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, 9)
        job.wait()


def _throttle_once_training(events_path: Path, rank: int, tag: str, done: "threading.Event",
                            stopped_s: float = 0.08, running_s: float = 0.02) -> None:
    """Makes ``rank``'s process a straggler once every rank is ready: it runs a fifth of the
    time (SIGSTOP/SIGCONT), until it exits or the test ends."""
    while not done.is_set() and not (
            events_path.exists() and events_path.read_text().count('"worker_ready"') >= 4):
        time.sleep(0.05)
    pid = worker_pid(rank, tag)
    if pid is None:
        return
    try:
        while not done.is_set():
            os.kill(pid, signal.SIGSTOP)
            time.sleep(stopped_s)
            os.kill(pid, signal.SIGCONT)
            time.sleep(running_s)
    except ProcessLookupError:
        return  # it handed its rank over and exited
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


def test_a_straggler_is_found_by_its_busy_time_and_migrated_exactly(tmp_path, monkeypatch,
                                                                    reference_pp2_40):
    """Rank 1 is slowed down by the test (it runs a fifth of the time); every rank's
    wall-clock step time then grows alike, but its busy time (the step minus its waits
    for peers) stands out, and the slow-rank policy moves it to a standby."""
    tag = str(tmp_path)
    monkeypatch.setenv(TAG_ENV, tag)
    summary_path, events_path = tmp_path / "summary.json", tmp_path / "events.jsonl"
    launcher = ["--policy", "resilient", "--standbys", "1", "--summary", str(summary_path),
                "--event-log", str(events_path), "--stop-grace-s", "2",
                "--slow-rank-factor", "2", "--slow-rank-steps", "3"]
    done = threading.Event()
    throttler = threading.Thread(target=_throttle_once_training, daemon=True,
                                 args=(events_path, 1, tag, done))
    throttler.start()
    try:
        result = run_command([*LAUNCH, "--standalone", "--nproc-per-node", "4", *launcher,
                              EXAMPLE, *MODEL, *PP2, "--train-iters", "40"], timeout_s=300)
    finally:
        done.set()
        throttler.join(5)
    assert result.returncode == 0, result.output[-5000:]
    assert digest(result) == digest(reference_pp2_40)
    events = read_events(events_path)
    slow = [e for e in events if e["event"] == "slow_rank"]
    assert [e["rank"] for e in slow] == [1], slow
    assert slow[0]["busy_s"] > 2 * slow[0]["median_busy_s"]
    (migration,) = json.loads(summary_path.read_text())["interruptions"]
    assert (migration["kind"], migration["rank"]) == ("migration", 1)
    assert migration["downtime_s"] is not None
    assert not [e for e in events if e["event"] in ("worker_failed", "fallback", "restart")]
