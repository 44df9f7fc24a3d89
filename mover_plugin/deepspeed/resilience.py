"""The resilience runtime of a DeepSpeed training process (a ``"resilience"`` block).

Same controller, agent, generations and step protocol as the Megatron path
(:mod:`mover_plugin.runtime.resilience`); this adapter (:mod:`mover_plugin.runtime.adapter`)
knows the DeepSpeed side:

- **Groups.** ``init_process_group`` uses the abortable ``mover`` backend, so every group
  DeepSpeed makes afterwards (``PipelineModule``'s grid, the engine's, ZeRO's) is one too. After
  a switch the references DeepSpeed caches are rewritten: the engine (and through it the module,
  its grid and the ZeRO optimizer) and the module globals of ``deepspeed.utils.groups`` and
  ``deepspeed.runtime.pipe.p2p``. Once the engine is built, WORLD is covered by a pipeline
  engine's grid (its model-parallel and data-parallel groups, :mod:`mover_plugin.comm.world`),
  so pipeline point-to-point, which DeepSpeed sends on WORLD by global rank, travels over the
  pipeline group; or by a data-parallel engine's data-parallel group (DeepSpeed's copy of
  WORLD).
- **The commit rule.** The WORLD all-reduce runs right before the optimizer changes anything:
  ZeRO's per-group update (after its gradient norm), or the optimizer's ``step`` without ZeRO.
- **After a crash** every rank posts its record: iterations completed, whether its interrupted
  step had begun updating, and which peer's shard copy it holds, of which iteration. The ranks
  continue from the same iteration without rollback only if all completed the same number of
  iterations, none was caught inside an update, and the optimizer shard of every lost rank is
  held, current, by a live peer (``"peer_copy": true``). The survivors then undo what the
  dropped step left behind and redo it; the holder of the shard copy sends the joiner its
  stage's parameters, the shard, the engine's counters and the scheduler. Otherwise every rank,
  the joiner included, rolls back to the last checkpoint the script saved (``load`` given to
  :meth:`DeepSpeedResilience.attach`) and trains on from there; the event log says which.
- **Peer copy** (opt-in): after every step each rank sends its ZeRO shard (fp32 partition and
  Adam moments), packed into one host buffer, to the next rank of its data-parallel group,
  which keeps it (:class:`~mover_plugin.runtime.peer_copy.PeerCopy`, shared with the Megatron
  path: the exchange runs in the background until the next step is about to begin). It costs two
  shards of host memory per rank (the copy and the packing buffer,
  :attr:`DeepSpeedResilience.peer_copy_bytes`).
- **Planned migration**: the leaver sends its parameters and its own shard; the joiner's copy
  of its peer's shard comes with the next step's exchange.
- **Random numbers.** A joiner continues with the random-number streams of the rank it
  replaces (:mod:`mover_plugin.runtime.random_streams`), as they were after that rank's last
  step: the leaver hands over its own, and with the peer copy each rank's travel with its
  shard, with the base seeds of the data loader iterators it made (a joiner's script that
  makes them again while it catches up gives its loaders' workers that rank's seeds). So
  dropout and a script's draws continue as in the run without the interruption, for ranks
  seeded alike or by rank. A rollback cannot be exact when the model draws random
  numbers (DeepSpeed's checkpoints hold no random-number states): when a rank's streams
  changed between steps, its ``rolled_back`` event says the recovery may be inexact, and the
  run summary's interruption too (``inexact``).

Limitations: pipeline engines (``PipelineModule``, ZeRO stage 0 or 1) and data-parallel
engines without model parallelism (ZeRO stage 0 to 3, no offload), with an Adam-family
optimizer; a standby imports what ``deepspeed.initialize`` would import on first use
and waits, or, under the drop-in with ``"standby_shadow_iterations"``, first runs its script in
the sandbox (:mod:`mover_plugin.deepspeed.shadow_run`).
"""

from __future__ import annotations

import importlib
import logging
import time
import types
from typing import Any, Callable, ClassVar, Optional

import torch
import torch.distributed as dist

from mover_plugin.comm.world import cover_world
from mover_plugin.contract import GenerationPlan
from mover_plugin.deepspeed.between_calls import BetweenCalls, Recorded
from mover_plugin.deepspeed.config import DeepSpeedResilience as ResilienceBlock
from mover_plugin.deepspeed.engine_state import (
    counters,
    data_parallel_group,
    ensure_optimizer_state,
    hyperparameters,
    is_pipeline_engine,
    last_grad_norm,
    loss_scale_state,
    module_tensors,
    optimizer_steps,
    partitions_parameters,
    refresh_parameter_partitions,
    release_parameters,
    reset_interrupted_step,
    restore_counters,
    restore_loss_scale_state,
    set_hyperparameters,
    set_last_grad_norm,
    set_optimizer_steps,
    shard_tensors,
    zero_optimizer,
)
from mover_plugin.errors import LaunchError
from mover_plugin.layout import ParallelLayout
from mover_plugin.progress import ProgressReporter
from mover_plugin.runtime.adapter import Continuation, Transfer
from mover_plugin.runtime.peer_copy import (
    PeerCopy,
    decide_continuation,
    ring_neighbours,
    shard_record,
)
from mover_plugin.runtime.random_streams import LOADER_SEEDS, RandomStreams, empty_packed
from mover_plugin.runtime.resilience import ResilienceRuntime

logger = logging.getLogger(__name__)

_LAZY_MODULES = ("torch._dynamo", "deepspeed.runtime.zero.muon.muon_optimizer",
                 "deepspeed.module_inject.auto_ep_layer")
"""Modules ``deepspeed.initialize`` imports on its first call (DeepSpeed 0.19.8): seconds that a
standby spends before it reports ready instead of after its promotion."""

Load = Callable[[], Optional[int]]
"""Loads the latest checkpoint into the engine; returns its iteration, or None if none."""


class DeepSpeedResilience:
    """The runtime of a DeepSpeed training process.

    The script calls :meth:`start`, :meth:`initialize_distributed`, :meth:`build_engine`,
    :meth:`attach`, :meth:`first_iteration`, then :meth:`run_step` for every iteration and
    :meth:`finish`; the :class:`~mover_plugin.runtime.resilience.ResilienceRuntime` it holds
    calls back the adapter methods below them (:class:`~mover_plugin.runtime.adapter.
    FrameworkAdapter`).
    """

    started: ClassVar[Optional["DeepSpeedResilience"]] = None
    """The runtime this process started, if any (the drop-in leaves a script that drives the
    runtime itself alone)."""
    templates: ClassVar[None] = None
    """A DeepSpeed job does not train on pipeline templates (it publishes no template spec,
    so the controller never plans it a shrink)."""

    def __init__(self, block: ResilienceBlock,
                 pipeline_parallel_size: Optional[int] = None) -> None:
        self.peer_copy = block.peer_copy
        self._engine: Any = None
        self._load: Load = lambda: None
        self._peer_copy: Optional[PeerCopy] = None
        """This rank's side of the shard-copy ring of its data-parallel group (with
        ``"peer_copy": true``, once the engine is attached)."""
        self._streams_after_step: Optional[RandomStreams] = None
        """This rank's random-number streams as its last step left them."""
        self._streams_moved = False
        """Whether those streams changed from one step to the next: then a rollback to
        DeepSpeed's checkpoint, which holds none, may draw other numbers."""
        self._received_streams = empty_packed()
        """A joiner receives the streams of the rank it replaces into this."""
        self._joined_streams: Optional[RandomStreams] = None
        """A joiner's streams, from the state it received until its first iteration begins
        (:meth:`continue_streams`)."""
        self.between: Optional[BetweenCalls] = None
        """The script's collectives between iterations, recorded (an unmodified script's
        drop-in sets it; a joiner receives the open iteration's)."""
        self.received_between: list[Recorded] = []
        self.runtime = ResilienceRuntime.connect(block.settings, self)
        self._layout = None if pipeline_parallel_size is None else ParallelLayout.for_world(
            self.runtime.world_size, 1, pipeline_parallel_size)
        """None: published from the engine's grid once it is built."""

    # -- what the training script calls ---------------------------------------------------

    @classmethod
    def start(cls, block: ResilienceBlock, *, pipeline_parallel_size: Optional[int] = None,
              wait: bool = True) -> "DeepSpeedResilience":
        """Connects to ``mover-launch``; a standby blocks here until it is promoted (unless
        ``wait`` is false: then in :meth:`wait_if_standby`). Without
        ``pipeline_parallel_size`` the layout is taken from the engine (:meth:`adopt_engine`)."""
        resilience = cls.started = cls(block, pipeline_parallel_size)
        if wait:
            if resilience.runtime.is_standby and block.settings.standby_shadow_iterations:
                logger.warning("standby: \"standby_shadow_iterations\" is for unmodified "
                               "scripts under the drop-in; a script that drives the runtime "
                               "itself makes no shadow run")
            resilience.wait_if_standby(warmed=False)
        return resilience

    def wait_if_standby(self, *, warmed: bool) -> None:
        """A standby reports ready and blocks until it is promoted; one that did not warm up
        imports first what ``deepspeed.initialize`` imports on its first call."""
        if self.runtime.is_standby:
            if not warmed:
                self._import_lazy_modules()
            self.runtime.wait_for_promotion()

    @property
    def progress(self) -> ProgressReporter:
        return self.runtime.progress

    def _import_lazy_modules(self) -> None:
        started = time.perf_counter()
        imported = []
        for name in _LAZY_MODULES:
            try:
                importlib.import_module(name)
                imported.append(name)
            except ImportError as error:
                logger.info("standby: %s not imported ahead (%s)", name, error)
        control = self.runtime.control
        control.post("standby_warmed", standby=control.standby_id, time=time.time(),
                     imported=imported, warm_up_s=time.perf_counter() - started)

    def initialize_distributed(self) -> None:
        """``init_process_group`` for this generation with abortable groups (call before
        ``deepspeed.init_distributed``, which then keeps it)."""
        self.runtime.init_distributed(self._layout)

    def build_engine(self, build: Callable[[], Any]) -> Any:
        """``build()`` (the ``PipelineModule`` and ``deepspeed.initialize``); a promoted
        standby builds with its collectives kept local (their results are replaced by the
        state it receives, or by the checkpoint)."""
        if self.runtime.joiner_of is None:
            engine = build()
        else:
            from mover_plugin.patches import apply_patches

            with apply_patches("local-collectives"), apply_patches("deepspeed-local-collectives"):
                engine = build()
        self.adopt_engine(engine)
        return engine

    def adopt_engine(self, engine: Any) -> None:
        """Covers WORLD with the engine's groups (a pipeline engine's grid; a data-parallel
        engine's data-parallel group, which must hold every rank); the first rank publishes
        the layout if :meth:`start` was not given it."""
        if is_pipeline_engine(engine):
            grid = engine.grid
            cover_world([grid.get_model_parallel_group(), grid.get_data_parallel_group()])
            stages = engine.num_stages
        else:
            group = data_parallel_group(engine)
            if dist.get_world_size(group) != self.runtime.world_size:
                raise LaunchError(f"the resilience runtime needs a data-parallel engine to be "
                                  f"data-parallel over every rank; its group has "
                                  f"{dist.get_world_size(group)} of {self.runtime.world_size} "
                                  f"(a model-parallel mpu is not supported)")
            cover_world([group])
            stages = 1
        if self._layout is None and self.runtime.rank == 0:
            self.runtime.control.publish_layout(
                ParallelLayout.for_world(self.runtime.world_size, 1, stages))

    def attach(self, engine: Any, *, load: Load) -> None:
        """Registers the engine, gates its optimizer update and counts its completed
        iterations; ``load`` restores the latest checkpoint (for a start or a rollback)."""
        self._engine, self._load = engine, load
        zero, runtime = zero_optimizer(engine), self.runtime
        owner, name = (zero, "_optimizer_step") if zero is not None else (engine.optimizer,
                                                                         "step")
        update = getattr(owner, name)
        if self.peer_copy:
            self._peer_copy = PeerCopy(runtime.control.store, runtime.rank, runtime.timeout())
        peer_copy = self._peer_copy

        def gated_update(*args: Any, **kwargs: Any) -> Any:
            step = runtime.ledger.step
            if step is not None and not step.reached_commit:
                if peer_copy is not None:
                    peer_copy.before_update()
                runtime.commit()
            return update(*args, **kwargs)

        setattr(owner, name, gated_update)
        if not is_pipeline_engine(engine):
            return  # the drop-in counts a data-parallel engine's iterations at its step
        train_batch = engine.train_batch

        def counted_train_batch(*args: Any, **kwargs: Any) -> Any:
            loss = train_batch(*args, **kwargs)
            runtime.ledger.count_running_iteration()
            return loss

        engine.train_batch = counted_train_batch

    def first_iteration(self, started_at: Optional[int] = None, *,
                        streams_now: bool = True) -> int:
        """The iteration to start from: ``started_at`` if given, else the checkpoint's (or 0);
        for a joiner, what the live ranks continue from, with the random-number streams of
        the rank it replaces (unless ``streams_now`` is false: then the caller calls
        :meth:`continue_streams` where its script is where that rank's step left it)."""
        if self.runtime.joiner_of is not None:
            iteration = self.runtime.join()
            if streams_now:
                self.continue_streams()
            return iteration
        if started_at is None:
            started_at = self._load() or 0
        return self.runtime.begin(started_at)

    def run_step(self, iteration: int, step: Callable[[int], Any]) -> tuple[Any, int]:
        """See :meth:`ResilienceRuntime.run_step`."""
        return self.runtime.run_step(iteration, step)

    def finish(self) -> None:
        """Training is over: the runtime stops following the job; with the peer copy, the
        host memory it used is reported (a ``peer_copy`` event)."""
        if self._peer_copy is not None:
            self._peer_copy.report_and_close(self.runtime.control.post, self.runtime.rank)
        self.runtime.finish()

    @property
    def peer_copy_bytes(self) -> int:
        """Host memory this rank spends on the shard copy it keeps for a peer and on packing
        its own shard for the exchange."""
        return 0 if self._peer_copy is None else self._peer_copy.nbytes

    # -- peer copy ------------------------------------------------------------------------

    def after_step(self, iteration: int) -> None:
        """Keeps this rank's random-number streams as the step left them, and starts the
        exchange of its shard (and those streams) as of ``iteration + 1`` completed
        iterations; it runs on until :meth:`before_step`."""
        streams, before = RandomStreams.capture(), self._streams_after_step
        self._streams_moved = self._streams_moved or (before is not None
                                                      and not streams.same_as(before))
        self._streams_after_step = streams
        if self._peer_copy is not None:
            self._peer_copy.refresh(shard_tensors(self._engine), iteration + 1,
                                    self.runtime.generation, self._ring(),
                                    side=streams.packed())

    def before_step(self) -> None:
        """Waits for the exchange the last step started (call before a step reports its
        begin): a rank lost from here on, until the next update, has a current copy on its
        peer. The exchange overlaps what the script does between two steps."""
        if self._peer_copy is not None:
            self._peer_copy.settle()

    def _ring(self) -> tuple[int, int]:
        """The next and the previous global rank of this rank's data-parallel group."""
        return ring_neighbours(dist.get_process_group_ranks(data_parallel_group(self._engine)),
                               self.runtime.rank)

    # -- after a crash (FrameworkAdapter) -------------------------------------------------

    def _agree(self, contribute: bool) -> tuple[int, Optional[str], dict[int, int]]:
        if self._peer_copy is not None:
            self._peer_copy.settle()  # an exchange in flight ends, completed or failed
        records: list[Any] = [None] * self.runtime.world_size
        dist.all_gather_object(records, shard_record(self.runtime.ledger, self._peer_copy)
                               if contribute else None)
        return decide_continuation(records, self.peer_copy, off="peer_copy is off")

    def continue_after_crash(self, plan: GenerationPlan,
                             snapshot: dict[str, Any]) -> Continuation:
        target, rollback, holders = self._agree(contribute=True)
        reset_interrupted_step(self._engine)
        if rollback is not None:
            return self._roll_back(rollback)
        step = self.runtime.ledger.step
        if step is not None and step.iteration == target:
            self.restore_snapshot(snapshot)  # the dropped iteration is redone
        return Continuation(target, holders)

    def continue_as_joiner(self) -> Continuation:
        # The held copy of a lost rank comes back with the next step's exchange.
        target, rollback, _ = self._agree(contribute=False)
        return self._roll_back(rollback) if rollback is not None else Continuation(target)

    def _roll_back(self, why: str) -> Continuation:
        if self._peer_copy is not None:
            self._peer_copy.forget()
        inexact = ("the random-number streams changed between steps (dropout, augmentation, "
                   "layers seeding them) and DeepSpeed's checkpoint holds none: the steps "
                   "after the rollback may draw other numbers" if self._streams_moved else None)
        return self.runtime.roll_back(why, self._load, inexact=inexact)

    # -- groups, snapshot and state (FrameworkAdapter) ------------------------------------

    def init_groups(self) -> None:
        """DeepSpeed makes its groups when the engine is built (:meth:`build_engine`)."""

    def group_holders(self) -> tuple[list[Any], list[types.ModuleType]]:
        import deepspeed.runtime.pipe.p2p as p2p
        import deepspeed.utils.groups as groups

        return [self._engine], [groups, p2p]

    def after_switch(self) -> None:
        engine = self._engine
        if engine is None:
            return
        # The joiner's engine announces its activation shapes on its first send; every rank
        # does so again, so that each pair of neighbours agrees.
        if is_pipeline_engine(engine):
            engine.reset_activation_shape()
        # ZeRO-3: the joiner has no prefetch trace; no rank keeps one, so that all gather the
        # same parameters in the same order.
        if partitions_parameters(engine):
            release_parameters(engine)

    def teardown(self) -> None:
        """DeepSpeed's groups go with the process group."""

    def capture_snapshot(self) -> dict[str, Any]:
        return {"streams": RandomStreams.capture(), "counters": counters(self._engine),
                "loss_scale": loss_scale_state(self._engine)}

    def restore_snapshot(self, snapshot: dict[str, Any]) -> None:
        """A redone iteration starts from the streams it began with; a joiner receiving its
        state (whose sender's streams are its own) from the streams of the rank it
        replaces."""
        streams = self._joined_streams or snapshot["streams"]
        streams.restore()
        restore_counters(self._engine, snapshot["counters"])
        restore_loss_scale_state(self._engine, snapshot["loss_scale"])

    def continue_streams(self) -> None:
        """A joiner's first iteration begins: its streams are put back to those of the rank
        it replaces (whatever its script drew while it caught up) and dropped."""
        streams, self._joined_streams = self._joined_streams, None
        if streams is not None:
            streams.restore()

    def state_tensors(self, transfer: Transfer) -> list[torch.Tensor]:
        """The stage's parameters, its optimizer shard and the random-number streams after
        the last step: from the holder of a lost rank's shard copy, that copy (with the lost
        rank's streams); from a leaver, its own; at a joiner, its own shard (whose optimizer
        state it creates first) and a buffer for the streams."""
        module = module_tensors(self._engine)
        if transfer is Transfer.COPY_SENT:
            assert self._peer_copy is not None
            return module + self._peer_copy.held()
        ensure_optimizer_state(self._engine)
        if transfer is Transfer.HANDOVER_SENT:
            streams = self._streams_after_step or RandomStreams.capture()
            return module + shard_tensors(self._engine) + [streams.packed()]
        return module + shard_tensors(self._engine) + [self._received_streams]

    def state_blob(self) -> dict[str, Any]:
        scheduler = self._engine.lr_scheduler
        between = [] if self.between is None else self.between.before_open_iteration()
        return {"scheduler": scheduler.state_dict() if scheduler is not None else None,
                "hyperparameters": hyperparameters(self._engine),
                "optimizer_steps": optimizer_steps(self._engine), "between_calls": between,
                "grad_norm": last_grad_norm(self._engine)}

    def load_state(self, state: dict[str, Any], transfer: Transfer) -> None:
        self._joined_streams = RandomStreams.unpacked(self._received_streams)
        LOADER_SEEDS.give(self._joined_streams.loader_seeds)
        if state["scheduler"] is not None:
            self._engine.lr_scheduler.load_state_dict(state["scheduler"])
        # The scheduler sets the learning rate only after the next update.
        set_hyperparameters(self._engine, state["hyperparameters"])
        set_optimizer_steps(self._engine, state["optimizer_steps"])
        self.received_between = state["between_calls"]
        set_last_grad_norm(self._engine, state["grad_norm"])
        if partitions_parameters(self._engine):
            refresh_parameter_partitions(self._engine)
            release_parameters(self._engine)  # gathered again from the received partitions
