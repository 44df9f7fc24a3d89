"""A DeepSpeed standby's warm-up: its own script, run in the sandbox before its promotion.

The Megatron standby builds its model and optimizer in the sandbox and adopts them once
promoted, because mover_plugin builds them itself, per role. An unmodified DeepSpeed script
builds its own, between ``deepspeed.init_distributed`` and ``deepspeed.initialize``, from its
rank: its loader's sampler, ZeRO's partition, a pipeline engine's stage. Its loop holds them,
and that code cannot run again once the rank is known. So a DeepSpeed standby with
``"standby_shadow_iterations": K`` (K > 0) makes a *shadow run* instead:

1. It waits for the job's layout (published by the first rank once its engine is built), and
   plays the first pipeline stage of the last data-parallel replica (:func:`shadow_rank`): the
   first stage reads its data and receives no activations, so every call runs on real inputs,
   and a rank other than 0 (unless the job has one replica) skips what scripts do on rank 0
   alone.
2. Its script runs on in the sandbox world (:mod:`mover_plugin.comm.sandbox`: the job's world
   size, every collective answered locally, ZeRO-3's cross-rank trace checks passed locally),
   as that rank (``RANK``): ``deepspeed.initialize`` builds the engine, the script loads its
   checkpoint if it reads one, and trains K iterations from there. ``save_checkpoint`` does
   nothing, and what the script prints to standard output is counted, not shown (DeepSpeed's
   own log lines go to the stream its logger took at import, and are shown).
3. At the start of iteration K + 1 (a ``train_batch``, or a data-parallel engine's
   ``forward``), :class:`ShadowRunOver` unwinds the script. The engine is destroyed
   (:func:`~mover_plugin.deepspeed.engine_state.discard_engine`) so that it can be freed, the
   sandbox's default group is destroyed, and DeepSpeed's process-wide state is put back as it
   was before (:class:`ModuleGlobals` over :data:`STATE_MODULES`: the globals of its modules
   that keep it, the class attributes of their classes, their functions' default-argument
   counters). ``sys.path`` and the working directory are put back too
   (:mod:`mover_plugin.launch.run`). Not put back: the modules the script imported (they are
   not imported again), and handlers it registered (``atexit``, signals).
4. The script runs again at once, up to ``deepspeed.init_distributed``, where the standby
   reports its warm-up (whether the engine was freed, its peak RSS) and ready, and waits. Once
   promoted, it goes on from there for real.

What this warms: what does not depend on the rank, such as the code paths of
``deepspeed.initialize`` and of the first iterations, the accelerator's context and kernels,
the allocator, and the data files in the page cache. It does not save the engine's build.

The script's other side effects happen twice: files it writes itself (a log file per rank, the
monitors its DeepSpeed config enables) are written by the shadow run too, as the played rank.
That is why the shadow run is opt-in. A shadow run that fails (its script raised, say) is
logged and put back the same way, and the standby waits; what the failure left (memory, an
accelerator's error) stays with it.
"""

from __future__ import annotations

import copy
import enum
import gc
import importlib
import logging
import os
import resource
import sys
import time
import types
import weakref
from typing import Any, Callable, Optional

import torch.distributed as dist

from mover_plugin.comm.sandbox import SANDBOX_BACKEND, operations_served, register_sandbox_backend
from mover_plugin.deepspeed.engine_state import discard_engine, is_pipeline_engine
from mover_plugin.layout import ParallelLayout
from mover_plugin.patches import AppliedPatches, apply_patches

logger = logging.getLogger(__name__)

STATE_MODULES = (
    "deepspeed.comm.comm",
    "deepspeed.utils.groups",
    "deepspeed.runtime.pipe.p2p",
    "deepspeed.runtime.zero.partition_parameters",
    "deepspeed.runtime.zero.parameter_offload",
    "deepspeed.runtime.activation_checkpointing.checkpointing",
    "deepspeed.runtime.torch_autocast",
    "deepspeed.runtime.tensor_parallel.init_utils",
    "deepspeed.runtime.sequence_parallel.parallel_state_sp",
)
"""DeepSpeed's modules (0.19.8) whose globals an engine's set-up and training change: the
communication backend (``cdb``), the cached groups and ``mpu``, pipeline point-to-point's groups,
ZeRO-3's init context and forward module stack, activation checkpointing's settings, autocast's
settings, tensor-parallel model init's arguments, sequence parallelism's groups."""


_LOCAL_TRACE_CHECKS = "deepspeed-local-trace-checks"
"""ZeRO-3 checks that every rank recorded the same trace of its modules by comparing with
rank 0's over the group, which the sandbox cannot answer: the checks pass locally."""


class ShadowRunOver(BaseException):
    """Unwinds the standby's script at the start of the iteration after its last shadow one (a
    ``BaseException``, so that a script's ``except Exception`` does not take it)."""


def shadow_rank(layout: ParallelLayout) -> int:
    """The rank a shadow run plays: the first pipeline stage of the last data-parallel
    replica."""
    return layout.rank(tp=0, dp=layout.dp - 1, pp=0)


class ModuleGlobals:
    """The state some modules keep, as it was, to put back: their globals and the class
    attributes of the classes they define (ZeRO-3's ``Init.param_id`` counter, say), every
    value but modules, functions and classes; the contents of every dict, list or set among
    them, and among their functions' default arguments (ZeRO-3 counts its modules in a default
    ``count=[0]``), changed in place."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self._bound: list[tuple[Any, str, Any]] = []
        self._contents: list[tuple[Any, Any]] = []
        for name in names:
            module = sys.modules.get(name) or importlib.import_module(name)
            self._keep(module)
            for value in list(vars(module).values()):
                if (isinstance(value, type) and value.__module__ == name
                        and not issubclass(value, enum.Enum)):
                    self._keep(value)

    def _keep(self, owner: Any) -> None:
        for key, value in vars(owner).items():
            if _is_state(key, value):
                self._bound.append((owner, key, value))
                self._keep_contents(value)
            elif isinstance(value, types.FunctionType):
                for default in (*(value.__defaults__ or ()),
                                *(value.__kwdefaults__ or {}).values()):
                    self._keep_contents(default)

    def _keep_contents(self, value: Any) -> None:
        if isinstance(value, (dict, list, set)):
            self._contents.append((value, copy.copy(value)))

    def restore(self) -> int:
        """Puts every kept value back; returns how many had been rebound or changed."""
        changed = 0
        for owner, key, value in self._bound:
            if vars(owner).get(key) is not value:
                setattr(owner, key, value)
                changed += 1
        for container, contents in self._contents:
            changed += _differs(container, contents)
            _refill(container, contents)
        return changed


def _is_state(key: str, value: Any) -> bool:
    if key.startswith("__") or isinstance(value, (types.ModuleType, type, property,
                                                  classmethod, staticmethod)):
        return False
    return not callable(value)


def _differs(container: Any, contents: Any) -> bool:
    try:
        return bool(container != contents)
    except (RuntimeError, TypeError, ValueError):  # elements that do not compare (tensors)
        return True


def _refill(container: Any, contents: Any) -> None:
    if isinstance(container, list):
        container[:] = contents
    else:
        container.clear()
        container.update(contents)


class ShadowRun:
    """One shadow run of the standby's script (module docstring)."""

    def __init__(self, iterations: int, rank: int, world_size: int) -> None:
        self.iterations = iterations
        self.rank = rank
        self.world_size = world_size
        self.running = False
        self.report: dict[str, Any] = {}
        """What the run did (once it ended)."""
        self._engine: Optional[weakref.ref[Any]] = None
        """The engine ``deepspeed.initialize`` built in it, not kept alive."""
        self._trained: Callable[[], int] = lambda: 0
        """Shadow iterations completed so far (the engine's, once it trains)."""
        self._globals: Optional[ModuleGlobals] = None
        self._rank_env: Optional[str] = None
        self._stdout: Any = None
        self._muted: Optional[_MutedStream] = None
        self._local_checks: Optional[AppliedPatches] = None
        self._started = 0.0
        self._served = 0

    @property
    def engine_built(self) -> bool:
        """Whether ``deepspeed.initialize`` returned in the shadow run."""
        return self._engine is not None

    def begin(self) -> None:
        """The sandbox's default group as :attr:`rank`, before the script's
        ``deepspeed.init_distributed`` runs on it."""
        self._globals = ModuleGlobals(STATE_MODULES)
        self._started = time.perf_counter()
        self._served = sum(operations_served().values())
        self._rank_env = os.environ.get("RANK")
        os.environ["RANK"] = str(self.rank)
        register_sandbox_backend()
        dist.init_process_group(SANDBOX_BACKEND, store=dist.HashStore(), rank=self.rank,
                                world_size=self.world_size)
        self._local_checks = apply_patches(_LOCAL_TRACE_CHECKS)
        self._stdout = sys.stdout
        self._muted = sys.stdout = _MutedStream(self._stdout)
        self.running = True
        logger.info("standby: shadow run of %d iterations as rank %d of %d in the sandbox",
                    self.iterations, self.rank, self.world_size)

    def watch(self, engine: Any) -> None:
        """Counts the engine's iterations from its first (after a checkpoint the script
        loads), ends the run at the start of the one after the last, and makes its
        ``save_checkpoint`` do nothing."""
        self._engine = weakref.ref(engine)
        first: list[int] = []

        def before_iteration() -> None:
            if not first:
                first.append(engine.global_steps)
                self._trained = lambda: engine.global_steps - first[0]
            if self._trained() >= self.iterations:
                raise ShadowRunOver()

        name = "train_batch" if is_pipeline_engine(engine) else "forward"
        setattr(engine, name, _after(before_iteration, getattr(engine, name)))
        engine.save_checkpoint = lambda *args, **kwargs: True

    def end(self, end: Optional[BaseException]) -> None:
        """The script unwound (``end``: :class:`ShadowRunOver`, or what else ended it; None if
        it returned): standard output back, the engine discarded, the sandbox's group
        destroyed and DeepSpeed's state put back; :attr:`report` says what the run did."""
        assert self._globals is not None and self._muted is not None
        self.running = False
        self._muted.muted = False
        if sys.stdout is self._muted:
            sys.stdout = self._stdout
        trained, self._trained = self._trained(), lambda: 0  # the engine is not kept
        if self._local_checks is not None:
            self._local_checks.revert()
            self._local_checks = None
        self._discard_engine()
        if dist.is_initialized():
            dist.destroy_process_group()
        restored = self._globals.restore()
        if self._rank_env is None:
            os.environ.pop("RANK", None)
        else:
            os.environ["RANK"] = self._rank_env
        outcome = _outcome(end)
        self.report = {
            "shadow_rank": self.rank,
            "shadow_iterations": trained,
            "outcome": outcome,
            "warm_up_s": time.perf_counter() - self._started,
            "sandbox_operations": sum(operations_served().values()) - self._served,
            "state_restored": restored,
            "output_lines": self._muted.lines,
        }
        log = logger.info if isinstance(end, ShadowRunOver) or end is None else logger.warning
        log("standby: shadow run as rank %d %s after %d iterations in %.2f s",
            self.rank, outcome, trained, self.report["warm_up_s"])

    def _discard_engine(self) -> None:
        engine = self._engine() if self._engine is not None else None
        if engine is None:
            return
        try:
            discard_engine(engine)
        except Exception:  # noqa: BLE001 - the standby is still worth keeping
            logger.exception("standby: the shadow run's engine could not be destroyed; its "
                             "memory may stay in use")

    def release(self) -> dict[str, Any]:
        """Once the script's frames are gone (its traceback dropped): collects what the shadow
        run built; returns :attr:`report` with whether its engine was freed and the peak RSS."""
        gc.collect()
        engine = self._engine() if self._engine is not None else None
        return {**self.report, "engine_freed": None if self._engine is None else engine is None,
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


class _MutedStream:
    """Standard output while the shadow run runs: what is written is counted and dropped.
    After it, everything goes to the stream it stood in for, so that a reference the script
    kept (a logging handler, say) writes there again; other attributes are the stream's."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.muted = True
        self.lines = 0

    def write(self, text: str) -> int:
        if not self.muted:
            return self._stream.write(text)
        self.lines += text.count("\n")
        return len(text)

    def flush(self) -> None:
        if not self.muted:
            self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _after(check: Callable[[], None], method: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        check()
        return method(*args, **kwargs)

    return call


def _outcome(end: Optional[BaseException]) -> str:
    if isinstance(end, ShadowRunOver):
        return "unwound"
    if end is None or isinstance(end, SystemExit) and end.code in (None, 0):
        return "ended"  # the script finished within the shadow iterations
    return f"failed: {type(end).__name__}: {end}"
