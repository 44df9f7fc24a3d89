"""The per-job secret that opens the job's store (:mod:`mover_plugin.launch.store_gate`).

A job started entirely by one ``mover-launch`` (one host, or a hostfile whose hosts this launch
starts) gets a fresh random secret; its agents receive it in their environment
(:data:`JOB_SECRET_ENV`), its workers never see it (they reach the store through their host's
relay), and operators on the first host find it in a file only the user can read, next to the
job's record (:mod:`mover_plugin.launch.jobs`). A job whose hosts start their own
``mover-launch`` (``--node-rank``, Slurm) takes the secret from ``MOVER_JOB_SECRET``, which
must then hold the same value on every host; it also overrides the file for ``mover status``,
``mover migrate`` and ``mover-launch --join`` from anywhere else.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Mapping, Optional

from mover_plugin.errors import ConfigError

JOB_SECRET_ENV = "MOVER_JOB_SECRET"
MIN_SECRET_CHARS = 16
SECRET_SUFFIX = ".secret"


def launch_secret(starts_every_host: bool, environ: Mapping[str, str] = os.environ) -> bytes:
    """The secret of a job being launched: ``MOVER_JOB_SECRET``, else a fresh one when this
    launch starts every host of the job (raises :class:`ConfigError` otherwise)."""
    given = _from_environment(environ)
    if given is not None:
        return given
    if starts_every_host:
        return secrets.token_hex(32).encode()
    raise ConfigError(
        f"this job's hosts start their own mover-launch: set {JOB_SECRET_ENV} to the same "
        f"secret (at least {MIN_SECRET_CHARS} characters) on every host, e.g. "
        f"'export {JOB_SECRET_ENV}=$(openssl rand -hex 32)' before srun or ssh")


def operator_secret(secret_file: Optional[Path], address: str,
                    environ: Mapping[str, str] = os.environ) -> bytes:
    """The secret an operator's command uses for the job at ``address``: ``MOVER_JOB_SECRET``,
    else the job's secret file on this host (raises :class:`ConfigError` without either)."""
    given = _from_environment(environ)
    if given is not None:
        return given
    if secret_file is not None:
        try:
            return secret_file.read_bytes().strip()
        except OSError as error:
            raise ConfigError(f"cannot read the secret of the job at {address} from "
                              f"{secret_file} ({error.strerror}); set {JOB_SECRET_ENV}") from None
    raise ConfigError(f"the job at {address} is not registered on this host, so its secret is "
                      f"unknown here: set {JOB_SECRET_ENV} to the job's secret")


def write_secret_file(path: Path, secret: bytes) -> None:
    """Writes ``secret`` to ``path``, readable and writable by this user only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, secret)
    finally:
        os.close(fd)


def _from_environment(environ: Mapping[str, str]) -> Optional[bytes]:
    value = environ.get(JOB_SECRET_ENV)
    if value is None:
        return None
    value = value.strip()
    if len(value) < MIN_SECRET_CHARS:
        raise ConfigError(f"{JOB_SECRET_ENV} holds {len(value)} characters; a job secret has at "
                          f"least {MIN_SECRET_CHARS} (e.g. 'openssl rand -hex 32')")
    return value.encode()
