"""``python -m mover_plugin.launch.run SCRIPT [ARGS...]`` (or ``-m MODULE [ARGS...]``): run a
training script the way ``mover-launch``'s workers run it.

Every worker of ``mover-launch`` runs its script through this module. It runs the script as
``python SCRIPT ARGS`` would (``__main__``, ``sys.argv``, the script's folder first on
``sys.path``), after arranging that, when the script first imports a framework that
mover_plugin drives, mover_plugin's part is put in place around that import. Today that is
torch: right after it, the process's GPU becomes its current device
(:mod:`mover_plugin.devices`). Megatron: before ``megatron.core``, the stand-ins for triton
when it is not installed; after Megatron-LM's ``megatron.training``, its CPU stand-ins and hooks
(:mod:`mover_plugin.megatron.training_loop`). DeepSpeed: after ``deepspeed``, its CPU patches
on a machine without CUDA and, for a script whose DeepSpeed config enables a ``"resilience"``
block, the drop-in's hooks (:mod:`mover_plugin.deepspeed.drop_in`). A script that
imports no such framework runs unchanged, and nothing is imported before it needs it.

A DeepSpeed standby with ``"standby_shadow_iterations"`` runs its script twice: first in the
sandbox, to warm up, until the drop-in unwinds it; then, once promoted, for real
(:mod:`mover_plugin.deepspeed.shadow_run`).

When the script ends, the worker tells its agent, with the script's exit status: the agent
gives the process's teardown ``--exit-timeout-s`` from the last script of its host to end
(:mod:`mover_plugin.launch.agent`). When the script ends while a thread is still blocked in
the wait of an operation abandoned with its group, the process skips the interpreter's
teardown, which that thread would abort (:func:`mover_plugin.runtime.exits.end_of_script`).

Under ``torchrun`` the same module gives the same behaviour::

    torchrun --nproc-per-node 4 -m mover_plugin.launch.run pretrain_gpt.py <Megatron-LM flags>
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import runpy
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, Optional

USAGE = ("usage: python -m mover_plugin.launch.run [--local-rank-arg] SCRIPT [ARGS...] | "
         "-m MODULE [ARGS...]")
LOCAL_RANK_ARG_FLAG = "--local-rank-arg"
"""Gives the script ``--local_rank=$LOCAL_RANK`` before its own arguments, as the deepspeed
launcher does (``mover-launch`` with the deepspeed launcher's flags)."""


class _HookedLoader(importlib.abc.Loader):
    """Runs ``before`` and ``after`` around the module code of one module."""

    def __init__(self, loader: importlib.abc.Loader, before: Callable[[], None],
                 after: Callable[[], None]) -> None:
        self._loader = loader
        self._before = before
        self._after = after

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._before()
        self._loader.exec_module(module)
        self._after()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class FirstImportHook(importlib.abc.MetaPathFinder):
    """Calls ``before()`` and ``after()`` around the first import of module ``name``; a
    module imported already is left alone. Until the module's code runs, every spec found for
    it carries the hooks: a spec asked for without importing (``importlib.util.find_spec``,
    as Transformers asks whether DeepSpeed is installed) is not the import."""

    def __init__(self, name: str, before: Callable[[], None], after: Callable[[], None]) -> None:
        self.name = name
        self._before = before
        self._after = after

    def install(self) -> None:
        if self.name not in sys.modules:
            sys.meta_path.insert(0, self)

    def find_spec(self, fullname: str, path: Optional[Sequence[str]],
                  target: Optional[ModuleType] = None) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname != self.name:
            return None
        spec = _find_with_others(self, fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _HookedLoader(spec.loader, self._importing, self._after)
        return spec

    def _importing(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        self._before()


def _find_with_others(hook: FirstImportHook, fullname: str, path: Optional[Sequence[str]],
                      target: Optional[ModuleType]) -> Optional[importlib.machinery.ModuleSpec]:
    for finder in list(sys.meta_path):
        find_spec = getattr(finder, "find_spec", None)
        if finder is hook or find_spec is None:
            continue
        spec = find_spec(fullname, path, target)
        if spec is not None:
            return spec
    return None


def _nothing() -> None:
    pass


def _before_megatron() -> None:
    from mover_plugin.megatron.training_loop import before_megatron_import

    before_megatron_import()


def _after_megatron_training() -> None:
    from mover_plugin.megatron.training_loop import after_megatron_training_import

    after_megatron_training_import()


def _after_deepspeed() -> None:
    from mover_plugin.deepspeed.drop_in import after_deepspeed_import

    after_deepspeed_import()


def _after_torch() -> None:
    from mover_plugin.devices import bind_device

    bind_device()
    from mover_plugin.deepspeed.config import block_under_launch

    if block_under_launch(sys.argv[1:]) is not None:
        # The drop-in must be in place before the script makes its default group, which a
        # script (or Accelerate) may do before it imports deepspeed.
        importlib.import_module("deepspeed")


def install_framework_hooks() -> None:
    """Arranges mover_plugin's part around the frameworks this module knows: the process's
    GPU (its ``LOCAL_RANK``) made current as soon as torch is imported, before the script
    builds anything on a device (:mod:`mover_plugin.devices`); Megatron (``megatron.core``,
    then Megatron-LM's ``megatron.training``) and DeepSpeed."""
    FirstImportHook("megatron.core", _before_megatron, _nothing).install()
    FirstImportHook("megatron.training", _nothing, _after_megatron_training).install()
    FirstImportHook("deepspeed", _nothing, _after_deepspeed).install()
    if "torch" in sys.modules:
        _after_torch()
    else:
        FirstImportHook("torch", _nothing, _after_torch).install()


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == [LOCAL_RANK_ARG_FLAG]:
        argv = with_local_rank_arg(argv[1:], os.environ.get("LOCAL_RANK", "0"))
    if not argv or argv[0] in ("-h", "--help") or argv[:1] == ["-m"] and len(argv) < 2:
        print(USAGE, file=sys.stderr)
        sys.exit(2)
    install_framework_hooks()
    try:
        _run_to_the_end(argv)
    except BaseException as end:  # SystemExit included: the script's exit status
        _end_of_script(end)
        raise
    _end_of_script(None)


def with_local_rank_arg(argv: list[str], local_rank: str) -> list[str]:
    """``SCRIPT ARGS`` (or ``-m MODULE ARGS``) with ``--local_rank=N`` after the script."""
    split = 2 if argv[:1] == ["-m"] else 1
    return argv[:split] + ([f"--local_rank={local_rank}"] if len(argv) >= split else []) \
        + argv[split:]


def _run_to_the_end(argv: list[str]) -> None:
    """Runs the script; again, from the same ``sys.path`` and working directory, after a
    DeepSpeed standby's shadow run of it ended."""
    path, cwd = list(sys.path), os.getcwd()
    while True:
        try:
            _run(list(argv))
        except BaseException as end:  # noqa: BLE001 - re-raised unless a shadow run ended
            if not _shadow_run_ended(end):
                raise
        else:
            if not _shadow_run_ended(None):
                return
        sys.path[:] = path
        os.chdir(cwd)
        _after_shadow_run()  # its traceback is gone: what it built can be collected


def _shadow_run_ended(end: Optional[BaseException]) -> bool:
    """Whether the script that ended was a DeepSpeed standby's shadow run
    (:mod:`mover_plugin.deepspeed.shadow_run`)."""
    if "mover_plugin.deepspeed.drop_in" not in sys.modules:
        return False
    from mover_plugin.deepspeed.drop_in import end_shadow_run

    return end_shadow_run(end)


def _after_shadow_run() -> None:
    from mover_plugin.deepspeed.drop_in import after_shadow_run

    after_shadow_run()


def _run(argv: list[str]) -> None:
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    script = argv[0]
    sys.argv = argv
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


def _end_of_script(end: Optional[BaseException]) -> None:
    """Ends the DeepSpeed drop-in's runtime if it ran; tells the agent (under ``mover-launch``)
    that the script ended and with which status: what follows is the process's teardown, which
    the agent bounds. Then skips the interpreter's teardown when an abandoned operation still
    blocks a thread (:func:`mover_plugin.runtime.exits.end_of_script`; nothing to check
    without mover's groups); otherwise returns."""
    if "mover_plugin.deepspeed.drop_in" in sys.modules:
        from mover_plugin.deepspeed.drop_in import finish

        finish()
    from mover_plugin.processes import exit_status
    from mover_plugin.progress import ProgressReporter

    ProgressReporter.from_env().script_end(exit_status(end))
    if "mover_plugin.comm.context" in sys.modules:
        from mover_plugin.runtime.exits import end_of_script

        end_of_script(end)


if __name__ == "__main__":
    main()
