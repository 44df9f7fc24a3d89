"""mover-launch end to end with a small torch.distributed job (real processes and signals).

The job (tests/support/scripts/toy_train.py) all-reduces each step, checkpoints every step and
prints ``PARAMS_DIGEST``; it starts in about a second, so these tests exercise the launcher, not
Megatron.
"""

import json
import subprocess
import sys

import pytest

from mover_plugin.testing import run_command
from support.paths import SCRIPTS

TOY = str(SCRIPTS / "toy_train.py")
LAUNCH = [sys.executable, "-m", "mover_plugin.launch.cli"]
TIMEOUT_S = 180


def launch(*flags, script_args=(), timeout_s=TIMEOUT_S):
    return run_command([*LAUNCH, *flags, TOY, *script_args], timeout_s=timeout_s)


def digest(result):
    lines = result.lines_starting("PARAMS_DIGEST")
    assert len(lines) == 1, result.output[-3000:]
    return lines[0].split()[1]


@pytest.fixture(scope="module")
def reference_digest():
    result = launch("--standalone", "--nproc-per-node", "3", script_args=["--steps", "6"])
    assert result.returncode == 0, result.output[-3000:]
    return digest(result)


def test_restart_policy_survives_sigkill_with_exact_result(tmp_path, reference_digest):
    summary_path = tmp_path / "summary.json"
    result = launch(
        "--standalone", "--nproc-per-node", "3", "--inject-failure", "2:4",
        "--summary", str(summary_path), "--stop-grace-s", "2",
        script_args=["--steps", "6", "--save", str(tmp_path / "ckpt")],
    )
    assert result.returncode == 0, result.output[-3000:]
    assert digest(result) == reference_digest
    summary = json.loads(summary_path.read_text())
    assert summary["exit_code"] == 0
    assert summary["steps_completed"] == 6
    assert summary["restarts"] == 1
    (interruption,) = summary["interruptions"]
    assert interruption["rank"] == 2 and interruption["step"] == 4
    assert interruption["how"] == "signal SIGKILL" and interruption["injected"]
    phases = interruption["phases_s"]
    assert list(phases) == ["failed", "detected", "stopped", "started", "recovered",
                            "first_step_completed"]
    assert all(b >= a for a, b in zip(phases.values(), list(phases.values())[1:]))
    assert 0 < interruption["downtime_s"] < phases["first_step_completed"]


def test_two_local_hosts_from_a_hostfile(tmp_path, reference_digest):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n127.0.0.1 slots=1\n")
    result = launch("--hostfile", str(hostfile), "--standalone", script_args=["--steps", "6"])
    assert result.returncode == 0, result.output[-3000:]
    assert result.output.count("joined") == 2
    assert digest(result) == reference_digest


def test_failures_beyond_max_restarts_stop_the_job(tmp_path):
    summary_path = tmp_path / "summary.json"
    result = launch(
        "--standalone", "--nproc-per-node", "2", "--max-restarts", "0",
        "--summary", str(summary_path), "--stop-grace-s", "2",
        script_args=["--steps", "4", "--exit-code-at", "1:2:3"],
    )
    assert result.returncode == 1
    summary = json.loads(summary_path.read_text())
    assert summary["exit_code"] == 1
    assert summary["interruptions"][0]["how"] == "exit code 3"
    assert not summary["interruptions"][0]["injected"]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--policy", "hope"], "'hope' is not a valid --policy"),
        (["--nproc-per-node", "2", "--inject-failure", "5:1"], "rank 5 does not exist"),
    ],
)
def test_bad_flags_fail_before_any_worker_starts(flags, message):
    result = launch("--standalone", *flags, timeout_s=60)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("mover-launch: error: ") and message in line
    assert "starting" not in result.output


def test_missing_script_is_reported(tmp_path):
    result = run_command([*LAUNCH, "--standalone", str(tmp_path / "nope.py")], timeout_s=60)
    assert result.returncode == 2
    assert "does not exist" in result.stderr


BUSY_CHILD = """
import sys, time
sys.stdin.readline()
end = time.process_time() + 0.3
while time.process_time() < end:
    pass
print("busy", flush=True)
sys.stdin.readline()
"""


def test_a_workers_cpu_per_step_is_the_cpu_it_used_between_step_ends():
    from mover_plugin.launch.agent import Worker

    process = subprocess.Popen([sys.executable, "-c", BUSY_CHILD], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE)
    try:
        worker = Worker(rank=0, attempt=0, process=process, pipe=-1)
        assert worker.cpu_per_step_s() is None
        worker.mark_cpu(1)
        process.stdin.write(b"go\n")
        process.stdin.flush()
        assert process.stdout.readline() == b"busy\n"
        worker.mark_cpu(4)  # 0.3 s of CPU over three steps
        assert 0.09 <= worker.cpu_per_step_s() <= 0.15
    finally:
        process.kill()
        process.wait()
