"""The ``"resilience"`` block of a DeepSpeed config: what it may hold, and its checks.

A DeepSpeed user switches resilience on by adding the block to the config file the script
already passes to ``deepspeed.initialize``::

    "resilience": {"standbys": 1, "peer_copy": true, "failure_timeout_s": 5}

Every key is optional. ``enabled`` (default true), the timeouts ``heartbeat_interval_s``,
``failure_timeout_s`` and ``collective_timeout_s`` are the settings of
:class:`~mover_plugin.runtime.settings.ResilienceSettings`, with the same defaults and checks as
the Megatron flags; ``standbys`` (default 1) is the number of standby processes per host that
``mover-launch`` starts; ``peer_copy`` (default false) keeps a copy of each rank's ZeRO optimizer
shard on a data-parallel peer, so a lost shard is taken from there instead of rolling every
rank back to the last checkpoint. ``standby_shadow_iterations`` (default 0 here, unlike the Megatron
flag's 2) makes each standby run its script that many iterations in the sandbox before it
reports ready (:mod:`mover_plugin.deepspeed.shadow_run`).

``mover-launch`` reads the block from the script's ``--deepspeed_config`` (or Hugging Face's
``--deepspeed PATH.json``) before anything starts, and the training script reads it again with
:func:`load_ds_config`, which also returns the config without the block for
``deepspeed.initialize``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from mover_plugin.contract import CONTROL_ADDR_ENV
from mover_plugin.errors import ConfigError
from mover_plugin.runtime.settings import ResilienceSettings

BLOCK = "resilience"
CONFIG_FLAGS = ("--deepspeed_config", "--deepspeed-config")
"""The script flags that name the DeepSpeed config (``deepspeed.add_config_arguments``)."""
HF_CONFIG_FLAG = "--deepspeed"
"""Hugging Face ``TrainingArguments``' flag for the DeepSpeed config's path."""
_LAUNCH_KEYS = ("standbys", "peer_copy")
DEFAULT_SHADOW_ITERATIONS = 0
"""A DeepSpeed standby's shadow run is opt-in: the script's own side effects (files it writes)
would happen in it too (:mod:`mover_plugin.deepspeed.shadow_run`)."""
_NOT_FOR_DEEPSPEED = {
    "fault_tolerance": "a DeepSpeed job does not shrink onto pipeline templates (without a "
                       "ready standby it falls back to a restart)",
    "standby_memory_mb": "a DeepSpeed standby keeps no pipeline roles warmed up in advance",
}


@dataclass(frozen=True)
class DeepSpeedResilience:
    """The checked ``"resilience"`` block."""

    settings: ResilienceSettings = field(default_factory=ResilienceSettings)
    standbys: int = 1
    peer_copy: bool = False

    @property
    def enabled(self) -> bool:
        """Whether the script runs under the resilience runtime."""
        return self.settings.enabled


def parse_block(block: Any, where: str) -> DeepSpeedResilience:
    """Checks a ``"resilience"`` block (``where`` names the config file in errors)."""
    try:
        return _parse_block(block)
    except ConfigError as error:
        raise ConfigError(f"{where}: {error}") from None


def _parse_block(block: Any) -> DeepSpeedResilience:
    def name(key: str) -> str:
        return f'"{BLOCK}.{key}"'

    if not isinstance(block, Mapping):
        raise ConfigError(f'"{BLOCK}" must be an object of settings, not {block!r}')
    for key, why in _NOT_FOR_DEEPSPEED.items():
        if key in block:
            raise ConfigError(f"{name(key)} is not a DeepSpeed setting: {why}")
    valid = sorted({*ResilienceSettings.__dataclass_fields__, *_LAUNCH_KEYS}
                   - set(_NOT_FOR_DEEPSPEED))
    unknown = sorted(set(block) - set(valid))
    if unknown:
        raise ConfigError(f"{name(unknown[0])} is not a setting; valid keys: {valid}")
    standbys = block.get("standbys", 1)
    if isinstance(standbys, bool) or not isinstance(standbys, int) or standbys < 0:
        raise ConfigError(f"{name('standbys')} {standbys!r} must be a whole number of at "
                          "least 0")
    peer_copy = block.get("peer_copy", False)
    if not isinstance(peer_copy, bool):
        raise ConfigError(f"{name('peer_copy')} {peer_copy!r} must be true or false")
    values = {"enabled": True, "standby_shadow_iterations": DEFAULT_SHADOW_ITERATIONS,
              **{k: v for k, v in block.items() if k not in _LAUNCH_KEYS}}
    settings = ResilienceSettings(**values).validate(name)
    return DeepSpeedResilience(settings, standbys, peer_copy)


def read_config(path: str) -> dict[str, Any]:
    """A DeepSpeed config file as a dict (JSON); errors name the file."""
    try:
        with open(path, encoding="utf-8") as handle:
            config = json.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"DeepSpeed config {path!r} does not exist") from None
    except (OSError, ValueError) as error:
        raise ConfigError(f"DeepSpeed config {path!r} is not readable JSON: {error}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"DeepSpeed config {path!r} must hold a JSON object")
    return config


def load_ds_config(path: str) -> tuple[dict[str, Any], Optional[DeepSpeedResilience]]:
    """The config for ``deepspeed.initialize`` (without the block) and the checked block
    (None when absent)."""
    config = read_config(path)
    block = config.pop(BLOCK, None)
    if block is None:
        return config, None
    checked = parse_block(block, os.path.basename(path))
    if checked.enabled:
        _check_zero_stage(config, os.path.basename(path))
    return config, checked


SUPPORTED_ZERO_STAGES = (0, 1, 2, 3)
_OFFLOADS = ("offload_optimizer", "offload_param")
_UNSUPPORTED_SWITCHES = ("cpu_offload", "cpu_offload_param", "zero_quantized_weights",
                         "zero_quantized_nontrainable_weights")
"""ZeRO settings that keep state the runtime does not copy or reset (CPU offload by DeepSpeed's
older keys, ZeRO++'s quantized weights): refused when true."""


def _check_zero_stage(config: Mapping[str, Any], where: str) -> None:
    """The ZeRO settings the runtime recovers: stages 0 to 3, with the optimizer and the
    parameters on the accelerator (an offload to CPU memory or NVMe keeps state the runtime
    does not copy), without ZeRO++'s quantized weights or hierarchical partitions."""
    zero = config.get("zero_optimization") or {}
    if not isinstance(zero, Mapping):
        return
    stage = zero.get("stage", 0)
    if stage not in SUPPORTED_ZERO_STAGES:
        raise ConfigError(f'{where}: "zero_optimization.stage" {stage!r} cannot run with an '
                          f'enabled "{BLOCK}" block; supported stages: '
                          f"{list(SUPPORTED_ZERO_STAGES)}")
    for name in _OFFLOADS:
        offload = zero.get(name) or {}
        device = offload.get("device", "none") if isinstance(offload, Mapping) else offload
        if device not in (None, "none"):
            raise ConfigError(f'{where}: "zero_optimization.{name}.device" {device!r} cannot '
                              f'run with an enabled "{BLOCK}" block; supported: "none"')
    for name in _UNSUPPORTED_SWITCHES:
        if zero.get(name):
            raise ConfigError(f'{where}: "zero_optimization.{name}" {zero[name]!r} cannot run '
                              f'with an enabled "{BLOCK}" block; supported: false')
    hpz = zero.get("zero_hpz_partition_size", 1)
    if hpz not in (0, 1):
        raise ConfigError(f'{where}: "zero_optimization.zero_hpz_partition_size" {hpz!r} '
                          f'cannot run with an enabled "{BLOCK}" block; supported: 1')


def config_path_in(script_args: Sequence[str]) -> Optional[str]:
    """The DeepSpeed config a script's arguments name, if any: ``--deepspeed_config PATH``
    (``deepspeed.add_config_arguments``), else ``--deepspeed PATH.json`` (Hugging Face's
    ``TrainingArguments``; DeepSpeed's own ``--deepspeed`` is a switch, so only a value ending
    in ``.json`` counts)."""
    named = _flag_value(script_args, CONFIG_FLAGS)
    if named is not None:
        return named
    value = _flag_value(script_args, (HF_CONFIG_FLAG,))
    return value if value is not None and value.endswith(".json") else None


def block_under_launch(script_args: Sequence[str]) -> Optional[DeepSpeedResilience]:
    """The enabled block of the config a script's arguments name, when the process runs
    under ``mover-launch`` (its drop-in then drives the script); None otherwise."""
    path = config_path_in(script_args)
    block = None if path is None else load_ds_config(path)[1]
    if block is None or not block.enabled or not os.environ.get(CONTROL_ADDR_ENV):
        return None
    return block


def unseen_block_error(config: Any) -> Optional[str]:
    """Why a config given to ``deepspeed.initialize`` (a dict or a path) cannot run as its
    ``"resilience"`` block asks, when ``mover-launch`` did not find that config among the
    script's arguments (a script that names it in code): None if it enables no block."""
    values = read_config(config) if isinstance(config, str) else config
    block = values.get(BLOCK) if isinstance(values, Mapping) else None
    if block is None or not parse_block(block, "deepspeed.initialize's config").enabled:
        return None
    return (f'the DeepSpeed config given to deepspeed.initialize enables a "{BLOCK}" block, '
            "but mover-launch found no config among the script's arguments, so the job would "
            "run unprotected: name the config on the script's command line "
            f"({' or '.join(CONFIG_FLAGS)} PATH, or Transformers' {HF_CONFIG_FLAG} PATH.json)")


def _flag_value(script_args: Sequence[str], flags: Sequence[str]) -> Optional[str]:
    for index, arg in enumerate(script_args):
        for flag in flags:
            if arg == flag and index + 1 < len(script_args):
                return script_args[index + 1]
            if arg.startswith(flag + "="):
                return arg.partition("=")[2]
    return None
