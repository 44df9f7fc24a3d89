"""Checking a training script's own flags before any worker starts.

A script that parses its flags with mover_plugin (``mover_plugin.megatron.arguments``,
``mover_plugin.deepspeed.arguments``; :mod:`mover_plugin.runtime.preflight`) checks
them when ``MOVER_PREFLIGHT=1`` is set, before importing its framework, and exits: with a line
starting :data:`PREFLIGHT_OK` on stdout, or with :data:`PREFLIGHT_ERROR` and the message on
stderr. The launcher runs it that way once, with the job's ``WORLD_SIZE``, so that bad input
gives one clear error before any worker starts. Scripts that do not parse their flags with
mover_plugin are not run in this mode.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from mover_plugin.errors import ConfigError
from mover_plugin.launch.config import LaunchConfig
from mover_plugin.contract import PREFLIGHT_ENV, PREFLIGHT_ERROR, PREFLIGHT_OK

_MARKERS = ("mover_plugin.megatron", "mover_plugin.deepspeed")
"""A script that imports one of these parses its flags with mover_plugin."""
_TIMEOUT_S = 120.0


def supports_preflight(script: str) -> bool:
    """True when the script parses its flags with mover_plugin."""
    try:
        text = Path(script).read_text(errors="replace")
    except OSError:
        return False
    return any(marker in text for marker in _MARKERS)


def run_preflight(config: LaunchConfig) -> None:
    """Runs the script's flag checks; raises :class:`ConfigError` with its message on failure."""
    script = config.script_path
    if script is None:
        return
    if not Path(script).is_file():
        raise ConfigError(f"training script {script!r} does not exist")
    if not config.preflight or not supports_preflight(script):
        return
    env = dict(os.environ)
    env.update(
        {PREFLIGHT_ENV: "1", "RANK": "0", "LOCAL_RANK": "0",
         "WORLD_SIZE": str(config.world_size),
         "LOCAL_WORLD_SIZE": str(config.nodes[0].local_world_size)}
    )
    result = subprocess.run(list(config.command), env=env, capture_output=True, text=True,
                            timeout=_TIMEOUT_S, stdin=subprocess.DEVNULL)
    if result.returncode == 0 and PREFLIGHT_OK in result.stdout:
        return
    errors = [line for line in result.stderr.splitlines() if line.startswith(PREFLIGHT_ERROR)]
    if errors:
        message = errors[-1].removeprefix(PREFLIGHT_ERROR).lstrip(": ")
        raise ConfigError(f"{Path(script).name}: {message}")
    tail = "\n".join(result.stderr.strip().splitlines()[-5:])
    raise ConfigError(
        f"{Path(script).name} failed while checking its flags (exit code {result.returncode}):\n"
        f"{tail}\n(pass --no-preflight to skip this check)"
    )
