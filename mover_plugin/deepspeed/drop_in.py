"""An unmodified DeepSpeed script under the resilience runtime: the ``"resilience"`` block alone.

``mover-launch`` runs every worker's script through :mod:`mover_plugin.launch.run`. When the
script imports ``deepspeed``, :func:`after_deepspeed_import` applies the ``deepspeed-cpu``
patches on a machine without CUDA (with CUDA, a resilient job's ``deepspeed-resilience``) and,
when the script's ``--deepspeed_config`` holds an enabled ``"resilience"`` block and the
process runs under ``mover-launch``, installs a :class:`DropIn`
at DeepSpeed's hook points (:mod:`mover_plugin.patches.deepspeed_hooks`). The drop-in drives
the same runtime as a script written against the API
(:class:`~mover_plugin.deepspeed.resilience.DeepSpeedResilience`) from DeepSpeed's own calls:

- ``deepspeed.init_distributed`` (the script's, or the one ``deepspeed.initialize`` makes): the
  runtime connects to ``mover-launch``, and a standby waits here for its promotion; then
  ``init_process_group`` with the abortable ``mover`` backend on the generation's store, under
  DeepSpeed's backend. A joiner's collectives stay local from here until its first iteration
  (``local-collectives``): its start-up's collectives have no partner in a running job, and
  what they produce is replaced by the state it receives.
- ``torch.distributed.init_process_group`` made by the script before any of DeepSpeed's
  (Accelerate does on CPU, for a Transformers ``Trainer`` script): as above, the runtime makes
  the default group instead. For such a script the worker command imports ``deepspeed`` right
  after torch, so that the hooks are in place before that call.
- ``deepspeed.initialize``: the engine's groups cover WORLD (a pipeline engine's grid, a
  data-parallel engine's data-parallel group), its optimizer update waits for the commit, and
  its training calls and ``save_checkpoint`` (and a pipeline engine's ``eval_batch``) are
  wrapped. DeepSpeed ignores the ``"resilience"`` key of its config.
- A pipeline engine's ``train_batch``: one iteration through the runtime's ``run_step``; the
  job's iteration is the engine's ``global_steps``. The micro-batches a call draws (from the
  iterator it is given, or the engine's own from ``training_data``) are recorded
  (:class:`~mover_plugin.runtime.replay.ReplayableIterator`), so a redone iteration is fed the
  same ones.
- A data-parallel engine's ``engine(batch)``, ``backward`` and ``step``: an iteration runs
  from its first ``forward`` to the ``step`` on the accumulation boundary, and a lost peer in
  any of its calls is recovered inside that call, the iteration's earlier calls redone from
  what was recorded at them (:mod:`mover_plugin.deepspeed.data_parallel`).
- The script's collectives between two iterations (the Trainer's gathers) are recorded, and a
  joiner's script is answered from the record once it has caught up
  (:mod:`mover_plugin.deepspeed.between_calls`).
- A planned switch happens at the start of an iteration (a ``train_batch``, or the first
  ``forward``), so that the leaver, not the joiner, takes part in whatever collectives the
  script runs between two iterations.
- **A joiner** receives its state from a live rank at its first iteration. Its script started
  its loop from what its own start-up loaded (``global_steps`` then, ``g0``), so it is
  ``T - g0`` iterations behind the job's iteration ``T``. Those iterations fast-forward: a
  ``train_batch`` draws and drops the micro-batches its stage would have read and returns a NaN
  loss; a ``forward`` returns NaN outputs, and ``backward`` and ``step`` train nothing;
  ``save_checkpoint`` and ``eval_batch`` do nothing meanwhile; its collectives stay local. So
  the script's loop and data are where the lost rank's were when the joiner trains.

Limits: ZeRO stage 0 to 3, without offload (refused before the job starts); a lost rank is
recovered in place when a live peer holds a copy of its optimizer shard (``"peer_copy":
true``); otherwise the job restarts and the script resumes from its own checkpoint, because an
unmodified script's loop cannot go back in place. The script must read its data in the same
order on every start (a replay of the same loader from the step its checkpoint holds), and,
with a data-parallel engine, call ``engine.backward(loss)`` (not ``loss.backward()``). A peer
lost inside a collective the script makes between two calls ends the script (the job
restarts).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any, Callable, Optional

import torch

from mover_plugin.contract import CONTROL_ADDR_ENV
from mover_plugin.deepspeed.between_calls import BetweenCalls, Mode
from mover_plugin.deepspeed.config import DeepSpeedResilience as ResilienceBlock
from mover_plugin.deepspeed.config import block_under_launch, unseen_block_error
from mover_plugin.deepspeed.data_parallel import DataParallelCalls
from mover_plugin.deepspeed.engine_state import is_pipeline_engine
from mover_plugin.deepspeed.resilience import DeepSpeedResilience
from mover_plugin.deepspeed.shadow_run import ShadowRun, shadow_rank
from mover_plugin.errors import ConfigError
from mover_plugin.patches import AppliedPatches, apply_inactive_patches, apply_patches
from mover_plugin.patches.deepspeed_hooks import DeepSpeedHooks, install_hooks
from mover_plugin.runtime.random_streams import LOADER_SEEDS, loader_draws_from_streams
from mover_plugin.runtime.replay import ReplayableIterator

logger = logging.getLogger(__name__)

_LOCAL_COLLECTIVES = ("local-collectives", "deepspeed-local-collectives")
"""A joiner's collectives while it builds its engine: torch.distributed's, and the references
DeepSpeed's backend took to two of them."""
_CATCH_UP_LOCAL = "local-collectives"
"""While its script catches up: the collectives a script makes between two calls go through
torch.distributed (the engine's own are not run)."""


def after_deepspeed_import() -> None:
    """What the worker command arranges once the script imported ``deepspeed``."""
    block = block_under_launch(sys.argv[1:])
    if not torch.cuda.is_available():
        apply_inactive_patches("deepspeed-cpu")
    elif block is not None:
        apply_inactive_patches("deepspeed-resilience")
    if block is not None:
        DropIn.installed = DropIn(block)
        install_hooks(DropIn.installed)
    elif os.environ.get(CONTROL_ADDR_ENV):
        install_hooks(UnseenBlockCheck())


class UnseenBlockCheck(DeepSpeedHooks):
    """Under ``mover-launch``, for a script whose arguments name no config with the block:
    ``deepspeed.initialize`` given one that enables it (a Transformers script that sets
    ``TrainingArguments(deepspeed=...)`` in code) fails with the reason, instead of training
    unprotected without a word."""

    def around_initialize(self, initialize: Callable[..., Any], *args: Any,
                          **kwargs: Any) -> Any:
        script_args = kwargs.get("args", args[0] if args else None)
        for config in (kwargs.get("config"), kwargs.get("config_params"),
                       getattr(script_args, "deepspeed_config", None)):
            why = None if config is None else unseen_block_error(config)
            if why is not None:
                raise ConfigError(why)
        return initialize(*args, **kwargs)


def finish() -> None:
    """The script ended: the runtime stops its heartbeats and notices (if the drop-in ran)."""
    drop_in = DropIn.installed
    if drop_in is not None and drop_in.resilience is not None:
        drop_in.resilience.finish()


def end_shadow_run(end: Optional[BaseException]) -> bool:
    """Whether the script that ended (``end``: how; None if it returned) was a standby's shadow
    run, which then ends (:meth:`DropIn.end_shadow_run`): the script runs again."""
    drop_in = DropIn.installed
    return drop_in is not None and drop_in.end_shadow_run(end)


def after_shadow_run() -> None:
    """Called once the shadow run's frames are gone, before the script runs again."""
    assert DropIn.installed is not None
    DropIn.installed.after_shadow_run()


class DropIn(DeepSpeedHooks):
    """The runtime entered from DeepSpeed's public API (module docstring)."""

    installed: Optional["DropIn"] = None

    def __init__(self, block: ResilienceBlock) -> None:
        self.block = block
        self.resilience: Optional[DeepSpeedResilience] = None
        self._local: Optional[AppliedPatches] = None
        self._engine: Any = None
        self.iteration: Optional[int] = None
        """The next iteration this rank trains; None before its first one."""
        self.behind = 0
        """Iterations a joiner's script still has to catch up on."""
        self._attempted = -1
        self._catch_up_began = (0, 0.0)
        """A joiner's catch-up: the calls it had to make, and when it began."""
        self._distributed = False
        """Whether the runtime's groups are up (after a standby's promotion)."""
        self._starting = False
        """Whether :meth:`_start_distributed` runs (its own default group passes through)."""
        self._shadow: Optional[ShadowRun] = None
        """A standby's shadow run, once it began."""
        self.between = BetweenCalls()
        """The script's collectives between iterations (recorded, or a joiner's replayed)."""
        self._inexact: Optional[str] = None
        """Why a joiner's catch-up may have left its data other than the replaced rank's."""

    # -- a standby's shadow run -----------------------------------------------------------

    @property
    def shadow_running(self) -> bool:
        """Whether the script runs in the sandbox, for a standby's warm-up."""
        return self._shadow is not None and self._shadow.running

    def _begin_shadow_run(self) -> bool:
        """A standby with ``standby_shadow_iterations`` begins its shadow run as the rank the
        job's layout gives (:func:`~mover_plugin.deepspeed.shadow_run.shadow_rank`); False
        when it makes none (not a standby, none asked for, or no layout in time)."""
        assert self.resilience is not None
        runtime = self.resilience.runtime
        iterations = runtime.settings.standby_shadow_iterations
        if not runtime.is_standby or iterations == 0:
            return False
        layout = runtime.control.wait_for_layout(runtime.settings.collective_timeout_s)
        if layout is None:
            logger.warning("standby: the job published no layout within %.0f s; no shadow run",
                           runtime.settings.collective_timeout_s)
            return False
        self._shadow = ShadowRun(iterations, shadow_rank(layout), runtime.world_size)
        self._shadow.begin()
        return True

    def end_shadow_run(self, end: Optional[BaseException]) -> bool:
        """The script ended (``end``: how; None if it returned): if that was a shadow run,
        puts DeepSpeed back as it was and returns True (the script then runs again, unless
        ``end`` is a ``KeyboardInterrupt``); otherwise returns False."""
        if not self.shadow_running:
            return False
        assert self._shadow is not None
        self._shadow.end(end)
        return not isinstance(end, KeyboardInterrupt)

    def after_shadow_run(self) -> None:
        """Once the shadow run's frames are gone: what it built is collected, and the
        controller hears of the warm-up."""
        assert self._shadow is not None and self.resilience is not None
        report = self._shadow.release()
        LOADER_SEEDS.forget()  # the script starts over
        control = self.resilience.runtime.control
        control.post("standby_warmed", standby=control.standby_id, time=time.time(), **report)

    # -- hook points ----------------------------------------------------------------------

    def around_init_distributed(self, init: Callable[..., Any], *args: Any,
                                **kwargs: Any) -> Any:
        if not self._passes_through():
            self._start_distributed()
        return self._with_backend_references(init, *args, **kwargs)

    def around_init_process_group(self, init: Callable[..., Any], *args: Any,
                                  **kwargs: Any) -> Any:
        """The script's own default group, made before DeepSpeed's call (Accelerate does on
        CPU): the runtime makes it instead, on the generation's store; otherwise as
        :meth:`around_init_distributed`."""
        if self._starting or self._passes_through():
            return init(*args, **kwargs)
        self._start_distributed()
        return None

    def around_collective(self, name: str, collective: Callable[..., Any], *args: Any,
                          **kwargs: Any) -> Any:
        return self.between.around(name, collective, *args, **kwargs)

    def around_loader_iterator(self, init: Callable[[Any, Any], None], iterator: Any,
                               loader: Any) -> None:
        """Every iterator's base seed is recorded; a joiner's script that makes one while it
        catches up (a new epoch) gives it the replaced rank's. What it would still draw from
        the joiner's own streams (a random sampler's order) makes the recovery inexact."""
        init(iterator, loader)
        if self.shadow_running:
            return
        seeded = LOADER_SEEDS.made_iterator(iterator)
        if self.behind > 0 and self._local is not None and self._inexact is None:
            reason = loader_draws_from_streams(loader, seeded=seeded)
            if reason is not None:
                self._inexact = (f"a data loader's iterator made while the joiner caught up "
                                 f"drew {reason} from the joiner's own random-number streams")

    def _passes_through(self) -> bool:
        """Whether a call that would start distributed training runs as it is: set up already,
        in the shadow run, or a script that drives the runtime itself."""
        return self._distributed or self.shadow_running or (
            self.resilience is None and DeepSpeedResilience.started is not None)

    def _start_distributed(self) -> None:
        """The runtime connects to ``mover-launch``; a standby begins its shadow run (on the
        sandbox's group) or waits for its promotion; then the generation's default group. A
        joiner's collectives act locally from here (module docstring)."""
        self._starting = True
        try:
            if self.resilience is None:
                self.resilience = DeepSpeedResilience.start(self.block, wait=False)
            if self._shadow is None and self._begin_shadow_run():
                return
            self.resilience.wait_if_standby(warmed=self._shadow is not None
                                            and self._shadow.engine_built)
            self._distributed = True
            self.resilience.runtime.switch_at_next_step()
            self.resilience.initialize_distributed()
            if self.resilience.runtime.joiner_of is not None:
                self._local = apply_patches(_LOCAL_COLLECTIVES)
        finally:
            self._starting = False

    def _with_backend_references(self, init: Callable[..., Any], *args: Any,
                                 **kwargs: Any) -> Any:
        """DeepSpeed's ``init_distributed``: the backend it creates takes references to two of
        torch.distributed's collectives, so a joiner's local ones are put back around it and
        applied again after (then to the backend's references too)."""
        if self._local is None or self.iteration is not None:
            return init(*args, **kwargs)
        self._local.revert()
        try:
            return init(*args, **kwargs)
        finally:
            self._local = apply_patches(_LOCAL_COLLECTIVES)

    def around_initialize(self, initialize: Callable[..., Any], *args: Any,
                          **kwargs: Any) -> Any:
        if self.resilience is None and DeepSpeedResilience.started is not None:
            return initialize(*args, **kwargs)  # the script drives the runtime itself
        # A script that made no deepspeed.init_distributed call of its own: the one initialize
        # makes starts the runtime.
        result = initialize(*args, **kwargs)
        assert self.resilience is not None
        if self.shadow_running:
            assert self._shadow is not None
            self._shadow.watch(result[0])
            return result
        engine = self._engine = result[0]
        self.resilience.adopt_engine(engine)
        self.resilience.between = self.between
        if self.resilience.runtime.joiner_of is None:
            self.between.iteration_ended()
        self.resilience.attach(engine, load=_no_rollback_in_place)
        engine.save_checkpoint = self._unless_catching_up(engine.save_checkpoint, True)
        if is_pipeline_engine(engine):
            train_batch, evaluate = engine.train_batch, engine.eval_batch
            engine.train_batch = lambda data_iter=None: self._train_batch(train_batch, data_iter)
            engine.eval_batch = self._unless_catching_up(evaluate, _nan())
        else:
            DataParallelCalls(self, engine)
        return result

    # -- the engine's calls ---------------------------------------------------------------

    def _train_batch(self, train_batch: Callable[..., Any], data_iter: Any) -> Any:
        resilience = self.resilience
        assert resilience is not None
        if self.iteration is None:
            self.start_training()
        if self.behind > 0:
            return self._catch_up(data_iter)
        if self.catching_up:
            self.end_catch_up()
        source = self._replayable(data_iter)
        iteration = self.iteration
        progress = resilience.progress
        self.between.iteration_begins()
        resilience.before_step()
        progress.step_begin(iteration + 1)
        started = time.perf_counter()

        def step(iteration: int) -> Any:
            if source is not None:
                source.rewind() if self._attempted == iteration else source.begin()
            self._attempted = iteration
            return train_batch(data_iter=source)

        loss, self.iteration = resilience.run_step(iteration, step)
        progress.step_end(self.iteration, time.perf_counter() - started)
        self.between.iteration_ended()
        return _nan() if loss is None else loss

    def start_training(self) -> None:
        """At the first iteration (a ``train_batch``, or a data-parallel engine's first
        training ``forward``): a rank that started with the job begins at the engine's step
        count; a joiner receives its state and how far behind its script is."""
        resilience, engine = self.resilience, self._engine
        assert resilience is not None
        started_at = engine.global_steps
        if self._local is not None:  # the state comes over the job's groups
            self._local.revert()
            self._local = None
        self.iteration = resilience.first_iteration(started_at=started_at, streams_now=False)
        self.behind = self.iteration - started_at
        if self.behind == 0:
            resilience.continue_streams()
            self._joined_without_catch_up()
        if resilience.runtime.joiner_of is not None and self.behind > 0:
            self._local = apply_patches(_CATCH_UP_LOCAL)
            self._catch_up_began = (self.behind, time.perf_counter())
            logger.warning("rank %d joined at iteration %d; its script catches up from %d",
                           resilience.runtime.rank, self.iteration, started_at)
        resilience.progress.ready(self.iteration)

    def end_catch_up(self) -> None:
        """The joiner's script reached the job's iteration: its collectives reach the job
        again, and the controller hears how long the catch-up took (the running ranks wait
        for it in their first collective with the joiner)."""
        assert self.resilience is not None
        if self._local is not None:
            self._local.revert()
            self._local = None
        steps, started = self._catch_up_began
        inexact = [reason for reason in (self._inexact, self.between.end_replay()) if reason]
        self._post_caught_up(steps, time.perf_counter() - started, "; ".join(inexact) or None)

    def _joined_without_catch_up(self) -> None:
        """A joiner whose script is at the job's iteration already: what its script's
        collectives between iterations would have needed was made while it was built."""
        assert self.resilience is not None
        if self.resilience.runtime.joiner_of is None:
            return
        inexact = self.between.missed(self.resilience.received_between)
        if inexact is not None:
            self._post_caught_up(0, 0.0, inexact)

    def _post_caught_up(self, steps: int, seconds: float, inexact: Optional[str]) -> None:
        assert self.resilience is not None
        runtime = self.resilience.runtime
        if inexact is not None:
            logger.warning("rank %d: the recovery may be inexact: %s", runtime.rank, inexact)
        runtime.control.post("caught_up", rank=runtime.rank, steps=steps, catch_up_s=seconds,
                             replayed=self.between.replayed, inexact=inexact)

    def _catch_up(self, data_iter: Any) -> Any:
        """A call the joiner's script makes for an iteration the job has trained: draws and
        drops the micro-batches its stage would have read."""
        engine = self._engine
        if data_iter is not None:
            engine.set_dataiterator(data_iter)
        if engine.data_iterator is not None:
            for _ in range(engine.gradient_accumulation_steps()):
                next(engine.data_iterator)
        self.caught_up_one()
        return _nan()

    def caught_up_one(self) -> None:
        """The joiner's script ended a step the job had trained. At the last, the random-number
        streams become those the replaced rank's last step left: the script draws from them
        what that rank drew between its step and the next."""
        self.behind -= 1
        if self.behind == 0:
            assert self.resilience is not None and self._local is not None
            self.resilience.continue_streams()
            self._local.revert()
            self._local = None
            self.between.replay(self.resilience.received_between)

    def _replayable(self, data_iter: Any) -> Optional[ReplayableIterator]:
        """The iterator this call reads, wrapped to record (None on a stage that reads none)."""
        engine = self._engine
        source = data_iter if data_iter is not None else engine.data_iterator
        if source is None or isinstance(source, ReplayableIterator):
            return source
        return ReplayableIterator(source)

    @property
    def catching_up(self) -> bool:
        """A joiner's script is still in a step the job trained before it came: from its
        first iteration until its first real one (the loop body after its last catch-up
        iteration included)."""
        return self.iteration is not None and (self._local is not None
                                               or self.between.mode is Mode.REPLAY)

    def _unless_catching_up(self, method: Callable[..., Any],
                            instead: Any) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if self.catching_up:
                return instead
            with self.between.paused():
                return method(*args, **kwargs)

        return call


def _no_rollback_in_place() -> None:
    """An unmodified script's loop cannot go back: no rollback in place (the job restarts)."""
    logger.error("an unmodified script's loop cannot go back to a checkpoint in place: the "
                 "job restarts, and the script resumes from its own checkpoint")
    return None


def _nan() -> torch.Tensor:
    return torch.tensor(float("nan"))
