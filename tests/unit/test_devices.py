"""Which GPU each process owns (mover_plugin/devices.py): a host's GPU count, the check that
its workers and standbys fit, the slot of each process, a promoted standby's environment and
the binding a process makes (pure; the binding with torch.cuda's calls recorded)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mover_plugin.devices import (
    DeviceError,
    HostGpus,
    bind_device,
    check_host_fits,
    free_slot,
    gpus_on_host,
)
from mover_plugin.errors import ConfigError
from mover_plugin.launch.agent import Agent
from mover_plugin.launch.agent_config import AgentConfig
from mover_plugin.launch.config import JoinConfig, parse_launch_args
from mover_plugin.launch.hosts import NodeSpec


def no_driver() -> int:
    raise AssertionError("the driver is asked only without the flag and CUDA_VISIBLE_DEVICES")


@pytest.mark.parametrize("flag, env, expected", [
    (4, {"CUDA_VISIBLE_DEVICES": "0,1"}, HostGpus(4, "--gpus-per-node")),
    (None, {"CUDA_VISIBLE_DEVICES": "2,3,5"}, HostGpus(3, "CUDA_VISIBLE_DEVICES=2,3,5")),
    (None, {"CUDA_VISIBLE_DEVICES": ""}, HostGpus(0, "CUDA_VISIBLE_DEVICES=")),
])
def test_the_gpu_count_comes_from_the_flag_then_the_visible_devices(flag, env, expected):
    assert gpus_on_host(flag, env, no_driver) == expected


def test_without_flag_or_visible_devices_the_driver_counts():
    assert gpus_on_host(None, {}, lambda: 8) == HostGpus(8, "the CUDA driver")


def test_a_host_whose_processes_need_more_gpus_than_it_has_is_refused():
    check_host_fits("h1", 4, 4, HostGpus(8, "--gpus-per-node"))
    check_host_fits("h1", 64, 3, HostGpus(0, "the CUDA driver"))  # no GPU: CPU processes
    with pytest.raises(ConfigError, match=r"host h1 would run 8 worker\(s\) and 1 standby\(s\), "
                       r"one GPU each, but has 8 GPU\(s\) \(CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,"
                       r"7\); lower --nproc-per-node or --standbys \(standbys can run on spare "
                       r"hosts: --spare-hosts\), or set --gpus-per-node"):
        check_host_fits("h1", 8, 1, HostGpus(8, "CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7"))


def test_a_standby_takes_the_lowest_slot_no_live_process_holds():
    assert free_slot([0, 1, 2, 3], 8) == 4
    assert free_slot([0, 2, 3, 4], 8) == 1  # a lost worker's GPU
    assert free_slot(range(8), 8) is None
    assert free_slot(range(40), 0) == 40  # no GPU: slots are numbers only


def test_the_launcher_checks_every_local_host_before_anything_starts():
    argv = ["--standalone", "--nproc-per-node", "2", "--policy", "resilient", "--standbys",
            "2", "train.py"]
    with pytest.raises(ConfigError, match=r"host 127.0.0.1 would run 2 worker\(s\) and 2 "
                       r"standby\(s\), one GPU each, but has 3 GPU\(s\) "
                       r"\(CUDA_VISIBLE_DEVICES=0,1,2\)"):
        parse_launch_args(argv, "python", environ={"CUDA_VISIBLE_DEVICES": "0,1,2"})
    config = parse_launch_args(["--gpus-per-node", "4", *argv], "python",
                               environ={"CUDA_VISIBLE_DEVICES": "0,1,2"})
    assert config.gpus == 4


def test_a_joining_host_checks_its_slots_against_its_gpus():
    join = ["--join", "10.0.0.1:29500", "--nproc-per-node", "3"]
    with pytest.raises(ConfigError, match=r"would run 0 worker\(s\) and 3 standby\(s\)"):
        parse_launch_args([*join, "--gpus-per-node", "2"], "python", environ={})
    config = parse_launch_args(join, "python", environ={"CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    assert isinstance(config, JoinConfig) and config.gpus == 4


def process_env(rank, slot):
    """The environment the agent of node 1 (4 workers) gives a process of ``rank`` (None: a
    standby) on ``slot``."""
    node = NodeSpec(node_rank=1, host="127.0.0.2", nproc=4, first_rank=4)
    agent = Agent(AgentConfig(node, 8, "127.0.0.1", 0, ("true",), standbys=2, gpus=8),
                  store=SimpleNamespace(), relay=SimpleNamespace(port_for=lambda _: 29511))
    return agent._worker_env(rank, slot, attempt=0, progress_fd=9)


WORKER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                    "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES",
                    "TORCHELASTIC_RESTART_COUNT")


def test_a_promoted_standby_presents_the_environment_of_a_worker_of_its_slot(monkeypatch):
    """A standby starts with its slot as LOCAL_RANK and no RANK; its promotion sets RANK
    (mover_plugin.runtime.resilience): then every variable a script reads to find its rank
    and its device is a worker's of that slot."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    monkeypatch.setenv("RANK", "3")  # the launcher's own environment is not passed on
    standby = process_env(None, 5)
    assert "RANK" not in standby and standby["LOCAL_RANK"] == "5"
    promoted = {**standby, "RANK": "6"}
    worker = process_env(6, 5)
    assert {v: promoted.get(v) for v in WORKER_VARIABLES} == \
        {v: worker.get(v) for v in WORKER_VARIABLES}
    assert worker["LOCAL_WORLD_SIZE"] == "4" and worker["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"


@pytest.fixture
def cuda_calls(monkeypatch):
    """torch.cuda with ``count`` GPUs, its ``set_device`` calls recorded."""
    calls = SimpleNamespace(count=4, set=[])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: calls.count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: calls.count)
    monkeypatch.setattr(torch.cuda, "set_device", calls.set.append)
    return calls


def test_a_process_binds_the_gpu_of_its_slot(cuda_calls):
    assert bind_device({"LOCAL_RANK": "2"}) == 2 and cuda_calls.set == [2]
    cuda_calls.count = 1  # CUDA_VISIBLE_DEVICES shows it its own GPU only
    assert bind_device({"LOCAL_RANK": "3"}) == 0 and cuda_calls.set == [2, 0]


def test_a_slot_beyond_the_visible_gpus_is_an_error_and_no_slot_binds_nothing(cuda_calls):
    with pytest.raises(DeviceError, match=r"LOCAL_RANK 5 names no GPU this process sees: it "
                       r"sees 4 \(CUDA_VISIBLE_DEVICES=0,1,2,3\)"):
        bind_device({"LOCAL_RANK": "5", "CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    assert bind_device({}) is None
    cuda_calls.count = 0
    assert bind_device({"LOCAL_RANK": "0"}) is None
    assert cuda_calls.set == []



def test_a_cuda_error_at_the_device_wait_ends_the_rank_as_a_lost_one(monkeypatch, cuda_calls):
    """Before a commit vote, a redo or a rollback a rank waits for its GPU work; a CUDA error
    there is sticky, so the process exits with status 1 (the launcher replaces a lost rank)
    instead of reporting an error of the training code."""
    from mover_plugin.devices import DeviceFault, synchronize_device
    from mover_plugin.runtime import exits

    synced = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: synced.append(True))
    synchronize_device()
    exits.device_ready_or_exit(3, "the commit vote")
    assert synced == [True, True]

    def failing() -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "synchronize", failing)
    with pytest.raises(DeviceFault, match="illegal memory access"):
        synchronize_device()
    ended = []
    monkeypatch.setattr(exits, "exit_now", lambda status: ended.append(status))
    exits.device_ready_or_exit(3, "the commit vote")
    assert ended == [1]
    cuda_calls.count = 0  # no CUDA: nothing to wait for
    synchronize_device()
