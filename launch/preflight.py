"""Checking a training script's own flags before any worker starts.

A script that parses its flags with mover_plugin (``mover_plugin.megatron.arguments``,
``mover_plugin.deepspeed.arguments``; :mod:`mover_plugin.runtime.preflight`), or with
Megatron-LM's ``megatron.training`` (checked by Megatron-LM's own ``validate_args`` and then
mover_plugin's, through the hooks the worker command installs), checks them when
``MOVER_PREFLIGHT=1`` is set, before any process group exists, and exits: with a line
``MOVER_PREFLIGHT_OK resilient=0|1`` on stdout, or with :data:`PREFLIGHT_ERROR` and the message
on stderr. The launcher runs it that way once, with the job's ``WORLD_SIZE``, so that bad input
gives one clear error before any worker starts; with ``--policy resilient`` it also refuses a
script that was not given its resilience flag (the standbys would have nothing to join).
Scripts that import neither are not run in this mode.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from mover_plugin.errors import ConfigError
from mover_plugin.launch.config import LaunchConfig
from mover_plugin.contract import PREFLIGHT_ENV, PREFLIGHT_ERROR, PREFLIGHT_OK

_MARKERS = ("mover_plugin.megatron", "mover_plugin.deepspeed", "megatron.training")
"""A script that imports one of these parses its flags with mover_plugin or Megatron-LM."""
_TIMEOUT_S = 120.0


def supports_preflight(script: str) -> bool:
    """True when the script parses its flags with mover_plugin or Megatron-LM."""
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
    result = subprocess.run(list(config.worker_command), env=env, capture_output=True,
                            text=True, timeout=_TIMEOUT_S, stdin=subprocess.DEVNULL)
    verdict = _ok_line(result.stdout)
    if result.returncode == 0 and verdict is not None:
        _check_policy(config, resilient=verdict.endswith("resilient=1"))
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


def _ok_line(stdout: str) -> str | None:
    return next((line.strip() for line in stdout.splitlines()
                 if line.startswith(PREFLIGHT_OK)), None)


def _check_policy(config: LaunchConfig, *, resilient: bool) -> None:
    if config.policy == "resilient" and not resilient:
        raise ConfigError(
            f"--policy resilient: {Path(config.script_path or '').name} does not run resilient; "
            "add --resilient to the script's flags (DeepSpeed: an enabled \"resilience\" block "
            "in its config), or use --policy restart"
        )
