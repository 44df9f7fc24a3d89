"""Finding the job running on this host: mover_plugin.launch.jobs, and the ``mover`` command's
errors when there is none (real files, real processes)."""

import os
import subprocess
import sys

import pytest

from mover_plugin.errors import ConfigError
from mover_plugin.launch.job_secret import JOB_SECRET_ENV, launch_secret, operator_secret
from mover_plugin.launch.jobs import find_job, registered_job, running_jobs, secret_file

SECRET = b"0123456789abcdef0123"


@pytest.fixture
def jobs_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MOVER_JOBS_DIR", str(tmp_path / "jobs"))
    return tmp_path / "jobs"


def test_a_registered_job_is_found_and_forgotten_when_it_ends(jobs_dir):
    with pytest.raises(ConfigError, match="no mover-launch job is running on this host"):
        find_job(None, None)
    with registered_job("127.0.0.1", 4242, ("python", "train.py"), SECRET) as record:
        assert record.pid == os.getpid()
        assert find_job(None, None) == ("127.0.0.1", 4242)
        assert [job.master_port for job in running_jobs()] == [4242]
        path = secret_file("127.0.0.1", 4242)
        assert path is not None and path.stat().st_mode & 0o777 == 0o600
        assert operator_secret(path, "127.0.0.1:4242", environ={}) == SECRET
        assert secret_file("127.0.0.1", 4243) is None
    assert running_jobs() == [] and not list(jobs_dir.iterdir())


def test_the_job_secret_comes_from_the_environment_or_is_made_for_a_job_on_one_launch():
    made = launch_secret(starts_every_host=True, environ={})
    assert len(made) == 64 and made != launch_secret(starts_every_host=True, environ={})
    given = {JOB_SECRET_ENV: "s" * 16}
    assert launch_secret(starts_every_host=False, environ=given) == b"s" * 16
    assert operator_secret(None, "h:1", environ=given) == b"s" * 16
    with pytest.raises(ConfigError, match=f"set {JOB_SECRET_ENV} to the same secret"):
        launch_secret(starts_every_host=False, environ={})
    with pytest.raises(ConfigError, match=f"{JOB_SECRET_ENV} holds 5 characters; .* at least 16"):
        launch_secret(starts_every_host=True, environ={JOB_SECRET_ENV: "short"})
    with pytest.raises(ConfigError, match="not registered on this host.*set MOVER_JOB_SECRET"):
        operator_secret(None, "h:1", environ={})


def test_an_address_given_is_used_as_is(jobs_dir):
    assert find_job("10.0.0.7", 29500) == ("10.0.0.7", 29500)
    assert find_job(None, 29501) == ("127.0.0.1", 29501)


def _listed_job(port: int) -> subprocess.Popen:
    """A process that lists a job on this host, as mover-launch does, until it is killed."""
    code = ("import time\nfrom mover_plugin.launch.jobs import registered_job\n"
            f"with registered_job('127.0.0.1', {port}, ('train.py',), b'x' * 16):\n"
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
        assert not (jobs_dir / f"{second.pid}.secret").exists()
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
