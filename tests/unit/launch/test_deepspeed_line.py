"""The deepspeed launcher's command line (mover_plugin.launch.deepspeed_line): its host and slot
selection, the ``--local_rank`` argument, and the flags refused, checked before anything
starts."""

from __future__ import annotations

import re

import pytest

from mover_plugin.devices import visible_subset
from mover_plugin.errors import ConfigError
from mover_plugin.launch.config import parse_launch_args
from mover_plugin.launch.deepspeed_line import parse_node_specs
from mover_plugin.launch.run import LOCAL_RANK_ARG_FLAG, with_local_rank_arg

HOSTS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")
NO_GPUS = {"CUDA_VISIBLE_DEVICES": ""}
FOUR_GPUS = {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}


@pytest.fixture
def hostfile(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("".join(f"{host} slots=4\n" for host in HOSTS))
    return str(path)


def layout(argv, environ=NO_GPUS):
    config = parse_launch_args([*argv, "train.py", "--lr", "1"], "py", environ)
    return [(n.host, n.nproc, n.first_rank, n.devices) for n in config.nodes]


def test_a_host_list_names_hosts_and_their_slots():
    assert parse_node_specs("worker-0@worker-1:2,0@worker-1:2", "--include") == {
        "worker-0": [], "worker-1": [0, 2]}


@pytest.mark.parametrize("text, message", [
    ("w:", "'w:' is not NAME or NAME:SLOT"),
    ("w:0,x", "slot 'x' of w is not a whole number"),
    ("a@", "'' is not NAME or NAME:SLOT"),
])
def test_a_bad_host_list_is_named(text, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_node_specs(text, "--include")


def test_num_nodes_and_num_gpus_take_the_first_hosts_and_slots(hostfile):
    assert layout(["--hostfile", hostfile, "--num_nodes", "2"]) == [
        ("127.0.0.1", 4, 0, ()), ("127.0.0.2", 4, 4, ())]
    assert layout(["--hostfile", hostfile, "--num_gpus", "2", "--num_nodes", "3"]) == [
        ("127.0.0.1", 2, 0, ()), ("127.0.0.2", 2, 2, ()), ("127.0.0.3", 2, 4, ())]
    # Without a hostfile --num_gpus is --nproc-per-node (and goes with --nnodes).
    assert layout(["--num_gpus", "3", "--nnodes", "2"]) == [
        ("127.0.0.1", 3, 0, ()), ("127.0.0.1", 3, 3, ())]


def test_include_and_exclude_keep_the_named_hosts_and_slots_in_hostfile_order(hostfile):
    assert layout(["--hostfile", hostfile, "--include", "127.0.0.3@127.0.0.2:3,1"]) == [
        ("127.0.0.2", 2, 0, (1, 3)), ("127.0.0.3", 4, 2, (0, 1, 2, 3))]
    assert layout(["--hostfile", hostfile, "--exclude=127.0.0.1@127.0.0.3:0"]) == [
        ("127.0.0.2", 4, 0, (0, 1, 2, 3)), ("127.0.0.3", 3, 4, (1, 2, 3))]


def test_without_a_hostfile_the_host_is_localhost_and_its_slots_its_gpus():
    assert layout(["--include", "localhost:1,3"], FOUR_GPUS) == [("127.0.0.1", 2, 0, (1, 3))]
    assert layout(["--exclude", "localhost:0"], FOUR_GPUS) == [("127.0.0.1", 3, 0, (1, 2, 3))]
    # A host without GPUs: the named slots are numbers, one worker each.
    assert layout(["--include", "localhost:0,1,2"]) == [("127.0.0.1", 3, 0, (0, 1, 2))]
    config = parse_launch_args(["--include", "localhost:1,3", "t.py"], "py", FOUR_GPUS)
    assert config.gpus_of(config.nodes[0]) == 2
    assert visible_subset(config.nodes[0].devices, FOUR_GPUS) == "5,7"
    assert visible_subset((0, 2), {}) == "0,2"
    with pytest.raises(ConfigError, match=re.escape("slot 5 names no GPU; it has 4")):
        parse_launch_args(["--include", "localhost:5", "--gpus-per-node", "8", "t.py"], "py",
                          FOUR_GPUS)


@pytest.mark.parametrize("argv, message", [
    (["--num_gpus", "2", "--include", "127.0.0.1"],
     "--num_nodes and --num_gpus do not go with --include or --exclude"),
    (["--include", "127.0.0.1", "--exclude", "127.0.0.2"],
     "--include and --exclude do not go together"),
    (["--include", "gpu9:0"], "--include 'gpu9:0': host 'gpu9' is not one of the job's hosts "
                              "(127.0.0.1, 127.0.0.2, 127.0.0.3)"),
    (["--include", "127.0.0.2:4"], "host 127.0.0.2 has no slot 4 (its slots are 0..3)"),
    (["--exclude", "127.0.0.1@127.0.0.2@127.0.0.3"], "leaves no host to run on"),
    (["--num_nodes", "4"], "--num_nodes 4: the job has 3 host(s)"),
    (["--num_gpus", "5"], "--num_gpus 5: host 127.0.0.1 has 4 slot(s)"),
])
def test_a_selection_that_cannot_be_made_is_named(hostfile, argv, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        layout(["--hostfile", hostfile, *argv])


@pytest.mark.parametrize("argv, message", [
    (["--num_nodes", "2"], "--num_nodes 2: the job has 1 host(s) without a hostfile"),
    (["--include", "localhost:0", "--nproc-per-node", "2"], "--nproc-per-node does not go"),
    (["--num_gpus", "2", "--nproc-per-node", "2"], "say the same thing"),
    (["--include", "localhost:5"], "host localhost has no slot 5 (its slots are 0..3)"),
    (["--exclude", "localhost:0"], "host localhost has no GPUs to count slots by"),
    (["--no_python"], "--no_python: mover-launch runs each rank's script in its own Python"),
    (["--launcher", "pdsh"], "--launcher: mover-launch starts every host's processes itself"),
])
def test_a_line_mover_launch_cannot_run_as_asked_is_refused_with_the_reason(argv, message):
    environ = FOUR_GPUS if "localhost:5" in argv else NO_GPUS
    with pytest.raises(ConfigError, match=re.escape(message)):
        layout(argv, environ)


def test_a_deepspeed_style_line_gives_the_script_local_rank_as_that_launcher_does():
    def command(*argv):
        return parse_launch_args([*argv, "t.py", "--include", "x"], "py", NO_GPUS) \
            .worker_command

    assert LOCAL_RANK_ARG_FLAG in command("--num_gpus", "2")
    assert LOCAL_RANK_ARG_FLAG in command("--force_multi", "--nproc-per-node", "2")
    assert LOCAL_RANK_ARG_FLAG not in command("--nproc-per-node", "2")  # torchrun's line
    assert LOCAL_RANK_ARG_FLAG not in command("--num_gpus", "2", "--no_local_rank")
    assert with_local_rank_arg(["t.py", "--x"], "3") == ["t.py", "--local_rank=3", "--x"]
    assert with_local_rank_arg(["-m", "pkg.train"], "0") == ["-m", "pkg.train",
                                                             "--local_rank=0"]
