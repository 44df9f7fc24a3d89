"""The jobs running on this host, so that ``mover status`` finds one without an address.

Each ``mover-launch`` that runs a controller writes a small JSON file naming its control
store's address and port into this user's job folder (``$XDG_RUNTIME_DIR/mover_plugin/jobs``,
or ``/tmp/mover_plugin-<uid>/jobs``), and the job's secret into a file beside it that only the
user can read (:mod:`mover_plugin.launch.job_secret`); both go when the job ends. A file
whose launcher process is gone (killed before it could clean up) is ignored and removed by
the next reader.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Optional

from mover_plugin.errors import ConfigError
from mover_plugin.launch.job_secret import SECRET_SUFFIX, write_secret_file

JOBS_DIR_ENV = "MOVER_JOBS_DIR"


@dataclass(frozen=True)
class JobRecord:
    """Where to reach one job's controller."""

    master_addr: str
    master_port: int
    pid: int
    """The ``mover-launch`` process that runs the controller."""
    started_at: float
    command: tuple[str, ...]


def jobs_dir() -> Path:
    """This user's job folder (``MOVER_JOBS_DIR`` overrides it)."""
    if os.environ.get(JOBS_DIR_ENV):
        return Path(os.environ[JOBS_DIR_ENV])
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "mover_plugin" / "jobs"
    return Path(tempfile.gettempdir()) / f"mover_plugin-{os.getuid()}" / "jobs"


@contextlib.contextmanager
def registered_job(master_addr: str, master_port: int, command: tuple[str, ...],
                   secret: bytes) -> Iterator[JobRecord]:
    """Lists this process's job, and keeps its secret for operators, while the block runs."""
    record = JobRecord(master_addr, master_port, os.getpid(), time.time(), tuple(command))
    folder = jobs_dir()
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = folder / f"{record.pid}.json"
    secret_path = path.with_suffix(SECRET_SUFFIX)
    write_secret_file(secret_path, secret)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(asdict(record)))
    temporary.replace(path)
    try:
        yield record
    finally:
        path.unlink(missing_ok=True)
        secret_path.unlink(missing_ok=True)


def running_jobs() -> list[JobRecord]:
    """The jobs whose launcher is still alive, oldest first."""
    folder = jobs_dir()
    if not folder.is_dir():
        return []
    jobs = []
    for path in sorted(folder.glob("*.json")):
        try:
            raw = json.loads(path.read_text())
            record = JobRecord(raw["master_addr"], int(raw["master_port"]), int(raw["pid"]),
                               float(raw["started_at"]), tuple(raw["command"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being written, or not ours
        if _alive(record.pid):
            jobs.append(record)
        else:
            path.unlink(missing_ok=True)
            path.with_suffix(SECRET_SUFFIX).unlink(missing_ok=True)
    return sorted(jobs, key=lambda r: r.started_at)


def find_job(master_addr: Optional[str], master_port: Optional[int]) -> tuple[str, int]:
    """The controller address to use: the one given, else the one job running on this host."""
    if master_port is not None:
        return master_addr or "127.0.0.1", master_port
    jobs = [j for j in running_jobs() if master_addr is None or j.master_addr == master_addr]
    if not jobs:
        raise ConfigError(
            "no mover-launch job is running on this host (looked in "
            f"{jobs_dir()}); give --master-addr and --master-port of the job"
        )
    if len(jobs) > 1:
        listed = "; ".join(f"{j.master_addr}:{j.master_port} (pid {j.pid})" for j in jobs)
        raise ConfigError(f"{len(jobs)} jobs are running on this host: {listed}; "
                          "choose one with --master-port")
    return jobs[0].master_addr, jobs[0].master_port


def secret_file(master_addr: str, master_port: int) -> Optional[Path]:
    """The secret file of the job registered on this host at ``master_addr:master_port``."""
    for job in running_jobs():
        if (job.master_addr, job.master_port) == (master_addr, master_port):
            return jobs_dir() / f"{job.pid}{SECRET_SUFFIX}"
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
