"""Finding the job running on this host: mover_plugin.launch.jobs, and the ``mover`` command's
errors when there is none (real files, real processes)."""

import os
import subprocess
import sys

import pytest

from mover_plugin.errors import ConfigError
from mover_plugin.launch.jobs import find_job, registered_job, running_jobs


@pytest.fixture
def jobs_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MOVER_JOBS_DIR", str(tmp_path / "jobs"))
    return tmp_path / "jobs"


def test_a_registered_job_is_found_and_forgotten_when_it_ends(jobs_dir):
    with pytest.raises(ConfigError, match="no mover-launch job is running on this host"):
        find_job(None, None)
    with registered_job("127.0.0.1", 4242, ("python", "train.py")) as record:
        assert record.pid == os.getpid()
        assert find_job(None, None) == ("127.0.0.1", 4242)
        assert [job.master_port for job in running_jobs()] == [4242]
    assert running_jobs() == [] and not list(jobs_dir.iterdir())


def test_an_address_given_is_used_as_is(jobs_dir):
    assert find_job("10.0.0.7", 29500) == ("10.0.0.7", 29500)
    assert find_job(None, 29501) == ("127.0.0.1", 29501)


def _listed_job(port: int) -> subprocess.Popen:
    """A process that lists a job on this host, as mover-launch does, until it is killed."""
    code = ("import time\nfrom mover_plugin.launch.jobs import registered_job\n"
            f"with registered_job('127.0.0.1', {port}, ('train.py',)):\n"
            "    print('listed', flush=True)\n    time.sleep(120)\n")
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "listed"
    return process


def test_two_jobs_need_a_port_and_a_killed_launcher_s_entry_is_dropped(jobs_dir):
    first, second = _listed_job(4242), _listed_job(4243)
    try:
        with pytest.raises(ConfigError, match="2 jobs are running on this host.*4242.*4243"):
            find_job(None, None)
        second.kill()  # SIGKILL: no chance to remove its entry
        second.wait()
        assert (jobs_dir / f"{second.pid}.json").exists()
        assert find_job(None, None) == ("127.0.0.1", 4242)
        assert not (jobs_dir / f"{second.pid}.json").exists()
    finally:
        for process in (first, second):
            process.kill()
            process.wait()


def test_mover_without_a_job_says_so_and_exits_2(jobs_dir):
    result = subprocess.run([sys.executable, "-m", "mover_plugin.launch.jobctl", "status"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.startswith("mover: error: no mover-launch job is running on this host")
    result = subprocess.run([sys.executable, "-m", "mover_plugin.launch.jobctl", "migrate",
                             "--rank", "x"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "'x' is not a global rank" in result.stderr
