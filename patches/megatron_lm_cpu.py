"""Megatron-LM shims for machines without CUDA: the ``megatron-lm-cpu`` patch group.

Megatron-LM's training entry point (``megatron.training``, shipped in the megatron-core wheel
since 0.17) assumes CUDA in a few more places than Megatron-Core itself (those are the
``megatron-cpu`` group, :mod:`mover_plugin.patches.megatron_cpu`, which this path needs too).
Each patch below removes one assumption with the smallest change and names the call site that
needs it (each checked on 0.19.2 with ``pretrain_gpt.py``, TP1 x PP2 x DP2 on gloo):

- ``nocuda-assert`` — ``pretrain`` calls ``initialize_megatron()`` without ``allow_no_cuda``,
  which asserts "Megatron requires CUDA."
- ``devcount`` — ``_initialize_distributed`` creates the model-parallel groups and
  ``_set_random_seed`` seeds the tensor-parallel RNG tracker only when
  ``torch.cuda.device_count() > 0``: the count reads 1 (and ``torch.cuda.is_available()``
  stays False, which it would not with ``PYTORCH_NVML_BASED_CUDA_CHECK=1``).
- ``setdev`` — with that count, ``torch.cuda.set_device(local_rank)`` would fail: a no-op.
- ``helpers`` — rank 0 runs ``make`` in ``megatron/core/datasets`` (``compile_helpers``) to
  build the dataset index helpers; the wheel ships them prebuilt and has no Makefile. The
  build is replaced by an import of the prebuilt extension (a clear error if it is missing).
- ``nowarmup`` — ``set_jit_fusion_options`` torch.compile-s the bias-GeLU and
  bias-dropout-add fusions on every rank as a warm-up (about 30 s on CPU), although the CPU
  flags (``--no-bias-gelu-fusion``, ``--no-bias-dropout-fusion``) never use them; it also
  draws from the RNG, so runs with and without it differ. Skipped.
- ``devarch`` — with tensor or context parallelism, ``validate_args`` asks for the GPU
  architecture of ``cuda:0``: it answers 0, so the checks of a pre-Blackwell GPU apply
  (``CUDA_DEVICE_MAX_CONNECTIONS=1``, as Megatron-LM's launch scripts set it).

Every patch applies only while ``torch.cuda.is_available()`` is False, and only to
megatron-core ``>=0.19.0,<0.20``. Importing this module applies nothing and imports no Megatron
module; applying the group imports ``megatron.training`` (without triton installed, apply the
``megatron-cpu`` group's ``notriton`` first: it is registered first, so applying both groups
together does that)::

    from mover_plugin.patches import apply_patches

    with apply_patches(["megatron-cpu", "megatron-lm-cpu"]):
        ...  # run Megatron-LM's pretrain() on CPU
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch

from mover_plugin.errors import PatchError
from mover_plugin.patches.megatron_cpu import DISTRIBUTION, TESTED_VERSIONS, cuda_unavailable
from mover_plugin.patches.registry import AttributeSwap, Patch, Undo, register_patch

GROUP = "megatron-lm-cpu"
"""Name of the group holding every patch of this module."""

HELPERS_MODULE = "megatron.core.datasets.helpers_cpp"


def _set(target: Any, attribute: str, value: Any) -> Undo:
    """Sets one attribute of ``target`` (a module, or a module's name); returns the undo."""
    module = importlib.import_module(target) if isinstance(target, str) else target
    swap = AttributeSwap()
    swap.set_attr(module, attribute, value)
    return swap.restore


def _patch(name: str, description: str) -> Callable[[Callable[[], Undo]], Callable[[], Undo]]:
    def decorate(apply: Callable[[], Undo]) -> Callable[[], Undo]:
        register_patch(Patch(name=name, distribution=DISTRIBUTION,
                             tested_versions=TESTED_VERSIONS, description=description,
                             apply=apply, condition=cuda_unavailable, groups=(GROUP,)))
        return apply

    return decorate


# --- nocuda-assert -------------------------------------------------------------------------------


def _allowing_no_cuda(initialize: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(initialize)
    def initialize_megatron(*args: Any, **kwargs: Any) -> Any:
        kwargs["allow_no_cuda"] = True
        return initialize(*args, **kwargs)

    return initialize_megatron


@_patch("nocuda-assert", "pretrain() calls initialize_megatron(allow_no_cuda=True)")
def apply_nocuda_assert() -> Undo:
    """Needed by ``training.pretrain`` → ``initialize_megatron``'s CUDA assertion."""
    training = importlib.import_module("megatron.training.training")
    return _set(training, "initialize_megatron", _allowing_no_cuda(training.initialize_megatron))


# --- devcount, setdev ----------------------------------------------------------------------------


def _one_device() -> int:
    """Stands in for ``torch.cuda.device_count()``: the CPU is the one device."""
    return 1


def _stay_on_cpu(device: Any) -> None:
    """Stands in for ``torch.cuda.set_device``."""


def _no_cuda() -> bool:
    """Stands in for ``torch.cuda.is_available()`` while ``device_count`` answers 1."""
    return False


@_patch("devcount", "torch.cuda.device_count() returns 1; torch.cuda.is_available() stays False")
def apply_devcount() -> Undo:
    """Needed by ``initialize._initialize_distributed`` (model-parallel groups) and
    ``_set_random_seed`` (the tensor-parallel RNG tracker), both behind ``device_count > 0``.

    ``torch.cuda.is_available()`` is pinned to its true answer, False: with
    ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` in the environment (DeepSpeed's import sets it, and
    children inherit it) it asks ``device_count()``, would answer True, and Megatron-LM's data
    loaders would then pin memory ("Found no NVIDIA driver")."""
    undo_count = _set(torch.cuda, "device_count", _one_device)
    undo_available = _set(torch.cuda, "is_available", _no_cuda)

    def undo() -> None:
        undo_available()
        undo_count()

    return undo


@_patch("setdev", "torch.cuda.set_device() is a no-op")
def apply_setdev() -> Undo:
    """Needed by ``initialize._initialize_distributed`` once ``devcount`` reports a device."""
    return _set(torch.cuda, "set_device", _stay_on_cpu)


# --- helpers -------------------------------------------------------------------------------------


def use_prebuilt_helpers() -> None:
    """Stands in for ``compile_helpers``: the wheel's prebuilt extension is used as it is."""
    try:
        importlib.import_module(HELPERS_MODULE)
    except ImportError as error:
        raise PatchError(f"the dataset helpers ({HELPERS_MODULE}) are not built: {error}; "
                         "install the megatron-core wheel, which ships them") from error


@_patch("helpers", "the dataset index helpers are the wheel's prebuilt ones; nothing is compiled")
def apply_helpers() -> Undo:
    """Needed by ``initialize._compile_dependencies`` (``make`` on rank 0)."""
    return _set("megatron.core.datasets.utils", "compile_helpers", use_prebuilt_helpers)


# --- nowarmup ------------------------------------------------------------------------------------


def _no_warmup(*args: Any, **kwargs: Any) -> None:
    """Stands in for ``initialize._warmup_jit_function``."""


@_patch("nowarmup", "no torch.compile warm-up of the bias fusions at start-up")
def apply_nowarmup() -> Undo:
    """Needed by ``training.pretrain`` → ``set_jit_fusion_options`` (cost, and RNG draws)."""
    return _set("megatron.training.initialize", "_warmup_jit_function", _no_warmup)


# --- devarch -------------------------------------------------------------------------------------


def _no_device_architecture() -> int:
    """Stands in for ``get_device_arch_version()`` (8 Ampere, 9 Hopper, 10 Blackwell): 0."""
    return 0


@_patch("devarch", "Megatron-LM's GPU architecture query answers 0 (older than any GPU)")
def apply_devarch() -> Undo:
    """Needed by ``arguments.validate_args`` with tensor or context parallelism, which reads
    the architecture of ``cuda:0`` (0.19). Answering 0 keeps the checks of a pre-Blackwell GPU:
    as there, ``CUDA_DEVICE_MAX_CONNECTIONS=1`` must be set, as Megatron-LM's own launch
    scripts do."""
    return _set("megatron.training.arguments", "get_device_arch_version", _no_device_architecture)
