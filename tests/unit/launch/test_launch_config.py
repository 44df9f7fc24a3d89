"""Pure tests of mover-launch's flags, hostfiles, injections, mailbox and summary."""

import json
import signal
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from mover_plugin.errors import ConfigError
from mover_plugin.launch.config import JoinConfig, parse_launch_args
from mover_plugin.launch.faults import MigrationInjection, parse_injection
from mover_plugin.launch.hostfile import parse_hostfile
from mover_plugin import mailbox
from mover_plugin.mailbox import Mailbox
from mover_plugin.launch.summary import Interruption, RunSummary


def parse(*argv):
    return parse_launch_args(list(argv), sys.executable)


def test_torchrun_flags_and_spellings():
    config = parse("--nproc_per_node", "4", "--master-port", "1234", "train.py", "--lr", "1")
    assert config.world_size == 4
    assert config.master_port == 1234
    assert config.command[-3:] == ("train.py", "--lr", "1")
    assert config.runs_controller and config.local_node_ranks == (0,)


def test_second_node_runs_only_its_agent():
    config = parse("--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "2", "t.py")
    assert config.world_size == 4
    assert not config.runs_controller
    assert list(config.nodes[1].ranks) == [2, 3]


def test_hostfile_hosts_naming_this_machine_get_local_agents(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# two hosts\nlocalhost slots=2\n127.0.0.1 slots=3  # second\n")
    config = parse("--hostfile", str(hostfile), "--standalone", "t.py")
    assert [n.nproc for n in config.nodes] == [2, 3]
    assert config.local_node_ranks == (0, 1)
    assert config.master_port == 0


def test_a_hostfile_with_node_rank_0_starts_only_the_first_hosts_agent(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("127.0.0.1 slots=2\n127.0.0.2 slots=2\n")
    every = parse("--hostfile", str(hostfile), "t.py")
    first = parse("--hostfile", str(hostfile), "--node-rank", "0", "--master-port", "1234",
                  "t.py")
    assert every.local_node_ranks == (0, 1)
    assert first.local_node_ranks == (0,) and first.runs_controller


def test_the_agent_timeout_is_2_s_or_half_the_workers_failure_timeout_if_less():
    assert parse("t.py").agent_timeout_s == 2.0
    assert parse("t.py", "--resilient-failure-timeout-s", "3").agent_timeout_s == 1.5
    assert parse("t.py", "--resilient-failure-timeout-s", "9").agent_timeout_s == 2.0
    assert parse("--agent-timeout-s", "4", "t.py",
                 "--resilient-failure-timeout-s", "6").agent_timeout_s == 4.0


def test_spare_hosts_run_standbys_and_hold_no_rank(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node-a slots=2\nnode-s slots=3 spare\nnode-b slots=2\n")
    config = parse("--hostfile", str(hostfile), "--policy", "resilient", "--standbys", "1",
                   "t.py")
    assert [(n.host, list(n.ranks), n.spare_slots) for n in config.nodes] == [
        ("node-a", [0, 1], 0), ("node-s", [], 3), ("node-b", [2, 3], 0)]
    assert config.world_size == 4
    assert [config.standbys_of(n) for n in config.nodes] == [1, 3, 1]
    assert config.standby_target == 5
    marked = parse("--nnodes", "3", "--nproc-per-node", "2", "--spare-hosts", "1",
                   "--policy", "resilient", "--standbys", "0", "t.py")
    assert [n.spare_slots for n in marked.nodes] == [0, 0, 2] and marked.world_size == 4
    assert marked.standby_target == 2


@pytest.mark.parametrize("argv, message", [
    (["--nnodes", "2", "--spare-hosts", "2", "--policy", "resilient", "t.py"],
     "--spare-hosts 2: the job has 2 host\\(s\\); at least one must run workers"),
    (["--nnodes", "2", "--spare-hosts", "1", "t.py"],
     "spare host '127.0.0.1' needs --policy resilient"),
])
def test_bad_spare_hosts_are_refused(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse(*argv)


def test_a_hostfile_of_spares_only_is_refused(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node-s slots=2 spare\n")
    with pytest.raises(ConfigError, match="every host of the job is a spare host"):
        parse("--hostfile", str(hostfile), "--policy", "resilient", "t.py")


@pytest.mark.parametrize(
    "text, message",
    [
        ("host1\n", "is not of the form 'host slots=N'"),
        ("host1 slots=0\n", "slots='0' must be a positive integer"),
        ("\n# nothing\n", "lists no host"),
    ],
)
def test_bad_hostfile_names_file_and_line(tmp_path, text, message):
    hostfile = tmp_path / "hosts"
    hostfile.write_text(text)
    with pytest.raises(ConfigError, match=message):
        parse_hostfile(hostfile)


def test_a_joining_host_names_the_controller_its_slots_and_its_name():
    config = parse("--join", "10.0.0.1:29500", "--nproc-per-node", "4", "--host", "h4",
                   "--join-timeout-s", "20")
    assert config == JoinConfig(master_addr="10.0.0.1", master_port=29500, host="h4", slots=4,
                                join_timeout_s=20.0)
    assert parse("--join", "10.0.0.1:29500").slots == 1


def test_injected_migrations_reach_the_agent_of_their_rank():
    config = parse("--nproc-per-node", "4", "--policy", "resilient", "--inject-migration", "1:3",
                   "--inject-migration", "3:8", "t.py")
    assert config.migrations == (MigrationInjection(1, 3), MigrationInjection(3, 8))
    # commit=S and update=S may name the moving rank itself (its leaver is killed then).
    config = parse("--nproc-per-node", "4", "--policy", "resilient", "--inject-migration",
                   "1:3:commit=1", "--inject-migration", "3:8:update=0", "t.py")
    assert [(m.fault, m.fault_rank) for m in config.migrations] == [("commit=1", 1),
                                                                    ("update=0", 0)]


def test_the_slow_rank_policy_is_off_by_default_and_reaches_the_agents():
    assert parse("--policy", "resilient", "t.py").slow_rank_factor is None
    config = parse("--nproc-per-node", "4", "--policy", "resilient", "--slow-rank-factor", "2.5",
                   "t.py")
    assert (config.slow_rank_factor, config.slow_rank_steps) == (2.5, 5)
    from mover_plugin.launch.cli import _agent_config

    assert _agent_config(config, 0, 1234).report_busy is True
    assert _agent_config(parse("t.py"), 0, 1234).report_busy is False


def test_injection_forms():
    assert parse_injection("3:6") == parse_injection("3:6:SIGKILL")
    assert parse_injection("1:2:stop").signal == signal.SIGSTOP
    assert parse_injection("1:2:15").signal == signal.SIGTERM


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--policy", "pray", "t.py"], "'pray' is not a valid --policy; valid: restart"),
        (["--nproc-per-node", "4", "--inject-failure", "4:1", "t.py"],
         "rank 4 does not exist; the job has ranks 0..3"),
        (["--inject-failure", "1:0", "t.py"], "STEP must be 1 or more"),
        (["--inject-failure", "1:2:SIGNOPE", "t.py"], "unknown signal 'SIGNOPE'"),
        (["--nproc-per-node", "-2", "t.py"], "'-2' is not a positive integer"),
        (["--refill-delay-s", "-1", "t.py"], "'-1' is not a number of seconds of at least 0"),
        (["--nnodes", "2", "--node-rank", "2", "t.py"], "--node-rank 2 does not exist"),
        (["--nnodes", "2", "--master-port", "0", "t.py"], "--master-port 0 (any free port)"),
        (["--nproc-per-node", "4", "--policy", "resilient", "--inject-migration", "5:2", "t.py"],
         "--inject-migration 5:2: rank 5 does not exist; the job has ranks 0..3"),
        (["--nproc-per-node", "4", "--inject-migration", "1:2", "t.py"],
         "--inject-migration 1:2 needs --policy resilient"),
        (["--policy", "resilient", "--inject-migration", "1", "t.py"],
         "'1' is not RANK:STEP[:FAULT] with STEP >= 1"),
        (["--policy", "resilient", "--inject-migration", "1:2:sideways", "t.py"],
         "fault 'sideways' in '1:2:sideways' is not one of joiner, leaver, stayer=S"),
        (["--policy", "resilient", "--inject-migration", "1:2:stayer=1", "t.py"],
         "(S: a rank; for stayer=S a staying one, not 1)"),
        (["--policy", "resilient", "--inject-migration", "1:2:commit=x", "t.py"],
         "stayer=S, commit=S, update=S"),
        (["--nproc-per-node", "4", "--policy", "resilient", "--inject-migration",
          "1:2:stayer=7", "t.py"], "--inject-migration 1:2:stayer=7: rank 7 does not exist"),
        (["--nproc-per-node", "4", "--policy", "resilient", "--inject-migration",
          "1:2:update=4", "t.py"], "--inject-migration 1:2:update=4: rank 4 does not exist"),
        (["--policy", "resilient", "--slow-rank-factor", "0.5", "t.py"],
         "'0.5' is not a number above 1 (a multiple of the median busy time)"),
        (["--policy", "resilient", "--slow-rank-steps", "3", "t.py"],
         "--slow-rank-steps 3 needs --slow-rank-factor"),
        (["--slow-rank-factor", "2", "t.py"], "--slow-rank-factor 2 needs --policy resilient"),
        (["--agent-timeout-s", "0.2", "t.py"],
         "--agent-timeout-s 0.2 must be at least 0.5 (agents beat every 0.25 s)"),
        (["--agent-timeout-s", "5", "t.py"], "--agent-timeout-s 5.0 must be below the workers' "
         "failure timeout (--resilient-failure-timeout-s, by default, 5.0)"),
        (["--agent-timeout-s", "3", "t.py", "--resilient-failure-timeout-s=2.5"],
         "failure timeout (--resilient-failure-timeout-s 2.5)"),
        (["--policy", "resilient", "--slow-rank-factor", "2", "--slow-rank-steps", "0", "t.py"],
         "'0' is not a positive integer"),
        (["--nproc-per-node", "2"], "no training script given"),
        (["--join", "10.0.0.1"], "'10.0.0.1' is not ADDR:PORT (e.g. 10.0.0.1:29500)"),
        (["--join", "10.0.0.1:29500", "t.py"], "--join 10.0.0.1:29500 takes the job's script "
         "and settings from its controller: drop 't.py'"),
        (["--join", "10.0.0.1:29500", "--standbys", "2"], "drop --standbys (a joining host "
         "takes only --nproc-per-node, --host, --gpus-per-node and --join-timeout-s)"),
        (["--host", "h4", "t.py"], "--host h4 names a host that joins a running job"),
    ],
)
def test_bad_launcher_flags(argv, message):
    with pytest.raises(ConfigError) as error:
        parse(*argv)
    assert message in str(error.value)


def test_a_mailbox_steps_over_a_message_its_writer_never_wrote(monkeypatch):
    """A writer killed between taking a number and writing its message leaves a hole: the
    reader waits for it a while (a live writer fills it), then reads on."""
    monkeypatch.setattr(mailbox, "HOLE_TIMEOUT_S", 0.3)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=10))
    writer, reader = Mailbox(store, "box"), Mailbox(store, "box")
    writer.post({"n": 1})
    store.add("box/count", 1)  # number 2 taken by a writer that dies before writing
    writer.post({"n": 3})
    assert [m["n"] for m in reader.poll()] == [1]
    assert reader.poll() == []  # message 2 may still come
    time.sleep(0.35)
    assert [m["n"] for m in reader.poll()] == [3]  # number 2 stepped over
    store.add("box/count", 1)  # number 4 taken by a live writer that writes it a moment later
    assert reader.poll() == []
    store.set("box/4", json.dumps({"n": 4}))
    assert [m["n"] for m in reader.poll()] == [4]
    assert reader.poll() == []  # nothing taken after 4: nothing to wait for


def test_mailbox_delivers_in_order_to_every_reader():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=10))
    writer, reader_a, reader_b = (Mailbox(store, "box") for _ in range(3))
    for n in range(3):
        writer.post({"n": n})
    assert [m["n"] for m in reader_a.poll()] == [0, 1, 2]
    writer.post({"n": 3})
    assert [m["n"] for m in reader_a.poll()] == [3]
    assert [m["n"] for m in reader_b.poll()] == [0, 1, 2, 3]
    assert reader_b.poll() == []


def test_downtime_is_the_gap_between_steps_less_one_step(tmp_path):
    item = Interruption("failure", rank=3, step=6, how="signal SIGKILL", injected=True,
                        attempt=0, last_step_before=100.0, step_time_before=0.5)
    item.mark("failed", 100.2)
    item.mark("detected", 100.25)
    item.mark("first_step_completed", 110.5)
    assert item.downtime_s == pytest.approx(10.0)
    assert item.to_dict()["phases_s"]["detected"] == pytest.approx(0.05)
    summary = RunSummary("restart", 4, ["x"], started_at=0.0, finished_at=20.0,
                         interruptions=[item])
    summary.write(tmp_path / "summary.json")
    assert '"downtime_s": 10.0' in (tmp_path / "summary.json").read_text()


def test_a_slow_last_step_before_the_interruption_is_not_taken_for_a_normal_step():
    """The step after a migration's switch took 1.2 s; steps take 0.3 s: the downtime of a
    failure right after it subtracts 0.3 s, not 1.2 s (which made it negative)."""
    item = Interruption("failure", rank=0, step=4, how="signal SIGKILL", injected=True,
                        attempt=0, last_step_before=100.0, step_time_before=1.2)
    item.mark("first_step_completed", 100.8)
    assert item.downtime_s == pytest.approx(-0.4)  # the last step alone
    item.typical_step_s = 0.3
    assert item.downtime_s == pytest.approx(0.5)
    item.typical_step_s = 2.0  # a typical step slower than the last: the last one counts
    assert item.downtime_s == pytest.approx(-0.4)
