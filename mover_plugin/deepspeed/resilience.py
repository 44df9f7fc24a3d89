"""The resilience runtime of a DeepSpeed pipeline training process (a ``"resilience"`` block).

Same controller, agent, generations and step protocol as the Megatron path
(:mod:`mover_plugin.runtime.resilience`); this adapter knows the DeepSpeed side:

- **Groups.** ``init_process_group`` uses the abortable ``mover`` backend, so every group
  DeepSpeed makes afterwards (``PipelineModule``'s grid, the engine's, ZeRO's) is one too. After
  a switch the references DeepSpeed caches are rewritten: the engine (and through it the module,
  its grid and the ZeRO optimizer) and the module globals of ``deepspeed.utils.groups`` and
  ``deepspeed.runtime.pipe.p2p``. Once the engine is built, WORLD is covered by the grid's
  model-parallel and data-parallel groups (:mod:`mover_plugin.comm.world`), so pipeline
  point-to-point, which DeepSpeed sends on WORLD by global rank, travels over the pipeline
  group.
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
  Adam moments), packed into one buffer, to the next rank of its data-parallel group, which
  keeps it. It costs two shards of memory per rank (the copy and the packing buffer,
  :attr:`DeepSpeedResilience.peer_copy_bytes`) and one exchange per step.
- **Planned migration**: the leaver sends its parameters, its own shard and the copy it holds.

Limitations: pipeline engines (``PipelineModule``) with ZeRO stage 0 or 1 and an Adam-family
optimizer; the model must not draw random numbers while training (no dropout) for a rollback
to be exact, since DeepSpeed's checkpoints do not hold RNG states (the redo without rollback
restores them); a standby imports what ``deepspeed.initialize`` would import on first use
and waits, it does not warm up in a sandbox.
"""

from __future__ import annotations

import importlib
import logging
import random
import time
import types
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from mover_plugin.comm.world import cover_world
from mover_plugin.deepspeed.config import DeepSpeedResilience as ResilienceBlock
from mover_plugin.deepspeed.engine_state import (
    counters,
    ensure_optimizer_state,
    reset_interrupted_step,
    hyperparameters,
    restore_counters,
    set_hyperparameters,
    shard_tensors,
    zero_optimizer,
)
from mover_plugin.errors import LaunchError
from mover_plugin.layout import ParallelLayout
from mover_plugin.progress import ProgressReporter
from mover_plugin.runtime.control import ControlClient
from mover_plugin.runtime.resilience import (
    ResilienceRuntime,
    exit_now,
    connect_to_controller,
)

logger = logging.getLogger(__name__)

_LAZY_MODULES = ("torch._dynamo", "deepspeed.runtime.zero.muon.muon_optimizer",
                 "deepspeed.module_inject.auto_ep_layer")
"""Modules ``deepspeed.initialize`` imports on its first call (DeepSpeed 0.19.8): seconds that a
standby spends before it reports ready instead of after its promotion."""

Load = Callable[[], Optional[int]]
"""Loads the latest checkpoint into the engine; returns its iteration, or None if none."""


def decide_continuation(records: list[Optional[dict[str, Any]]],
                        peer_copy: bool) -> tuple[int, Optional[str], dict[int, int]]:
    """From every rank's record after a crash (None for the lost ranks, whose joiners have
    none): the iteration to continue from, why every rank must roll back to the checkpoint
    (None if not), and for each lost rank the live rank holding its current shard."""
    known = [r for r in records if r is not None]
    lost = [rank for rank, record in enumerate(records) if record is None]
    target = max(r["applied"] for r in known)
    holders = {r["held_of"]: rank for rank, r in enumerate(records)
               if r is not None and r["held_version"] == target}
    if any(r["updating"] for r in known):
        return target, "a rank was lost while the optimizer update was being applied", {}
    if any(r["applied"] != target for r in known):
        return target, "the ranks had completed different numbers of iterations", {}
    missing = [rank for rank in lost if rank not in holders]
    if missing:
        why = ("no live rank holds a current copy of the optimizer shard of rank(s) "
               f"{missing}" + ("" if peer_copy else " (peer_copy is off)"))
        return target, why, {}
    return target, None, {rank: holders[rank] for rank in lost}


class DeepSpeedResilience(ResilienceRuntime):
    """The runtime of a DeepSpeed pipeline-engine process."""

    def __init__(self, block: ResilienceBlock, control: ControlClient,
                 progress: ProgressReporter, pipeline_parallel_size: int) -> None:
        super().__init__(block.settings, control, progress)
        self.peer_copy = block.peer_copy
        self._layout = ParallelLayout.for_world(self.world_size, 1, pipeline_parallel_size)
        self._engine: Any = None
        self._load: Load = lambda: None
        self._held: list[torch.Tensor] = []
        """The shard copy this rank keeps for the previous rank of its data-parallel group
        (views into ``_held_flat``)."""
        self._held_flat: Optional[torch.Tensor] = None
        self._outgoing: Optional[torch.Tensor] = None
        """This rank's shard packed into one buffer for the exchange."""
        self._held_of = -1
        self._held_version = -1
        """The iteration the held copy belongs to (-1: none, or being replaced)."""
        self._receiving_lost_shard = False
        """Set while a joiner receives a lost rank's shard from the peer holding its copy."""

    # -- start-up -------------------------------------------------------------------------

    @classmethod
    def start(cls, block: ResilienceBlock, *,
              pipeline_parallel_size: int) -> "DeepSpeedResilience":
        """Connects to ``mover-launch``; a standby blocks here until it is promoted."""
        runtime = cls(block, connect_to_controller(), ProgressReporter.from_env(),
                      pipeline_parallel_size)
        runtime._start()
        if runtime.control.standby_id is not None:
            runtime._import_lazy_modules()
            runtime._wait_for_promotion()
        return runtime

    def _import_lazy_modules(self) -> None:
        started = time.perf_counter()
        imported = []
        for name in _LAZY_MODULES:
            try:
                importlib.import_module(name)
                imported.append(name)
            except ImportError as error:
                logger.info("standby: %s not imported ahead (%s)", name, error)
        self.control.post("standby_warmed", standby=self.control.standby_id, time=time.time(),
                          imported=imported, warm_up_s=time.perf_counter() - started)

    def initialize_distributed(self) -> None:
        """``init_process_group`` for this generation with abortable groups (call before
        ``deepspeed.init_distributed``, which then keeps it)."""
        self._init_distributed(self._layout)

    def build_engine(self, build: Callable[[], Any]) -> Any:
        """``build()`` (the ``PipelineModule`` and ``deepspeed.initialize``); a promoted
        standby builds with its collectives kept local (their results are replaced by the
        state it receives, or by the checkpoint)."""
        if self.joiner_of is None:
            engine = build()
        else:
            from mover_plugin.patches import apply_patches

            with apply_patches("local-collectives"), apply_patches("deepspeed-local-collectives"):
                engine = build()
        grid = getattr(engine, "grid", None)
        if grid is None:
            raise LaunchError(f"the resilience runtime needs a pipeline engine (a "
                              f"PipelineModule given to deepspeed.initialize); got "
                              f"{type(engine).__name__}")
        cover_world([grid.get_model_parallel_group(), grid.get_data_parallel_group()])
        return engine

    def attach(self, engine: Any, *, load: Load) -> None:
        """Registers the engine, gates its optimizer update and counts its completed
        iterations; ``load`` restores the latest checkpoint (for a start or a rollback)."""
        self._engine, self._load = engine, load
        zero = zero_optimizer(engine)
        owner, name = (zero, "_optimizer_step") if zero is not None else (engine.optimizer,
                                                                         "step")
        update = getattr(owner, name)

        def gated_update(*args: Any, **kwargs: Any) -> Any:
            if self._step is not None and not self._step.reached_commit:
                self._commit()
            return update(*args, **kwargs)

        setattr(owner, name, gated_update)
        train_batch = engine.train_batch

        def counted_train_batch(*args: Any, **kwargs: Any) -> Any:
            loss = train_batch(*args, **kwargs)
            if self._step is not None:
                self._applied = self._step.iteration + 1
            return loss

        engine.train_batch = counted_train_batch

    def first_iteration(self) -> int:
        """The iteration to start from: the checkpoint's (or 0), or for a joiner what the
        live ranks continue from."""
        if self.joiner_of is None:
            return self._begin(self._load() or 0)
        return self._first_iteration_of_joiner()

    @property
    def peer_copy_bytes(self) -> int:
        """Memory this rank spends on the shard copy it keeps for a peer and on packing its own
        shard for the exchange."""
        return sum(t.numel() * t.element_size() for t in (self._held_flat, self._outgoing)
                   if t is not None)

    # -- peer copy ------------------------------------------------------------------------

    def _after_step(self, iteration: int) -> None:
        if self.peer_copy:
            self._exchange_shards(iteration + 1)

    def _ring(self) -> tuple[Any, int, int]:
        """This rank's data-parallel group and its next and previous global ranks there."""
        group = self._engine.grid.get_data_parallel_group()
        size, index = dist.get_world_size(group), dist.get_rank(group)
        return (group, dist.get_global_rank(group, (index + 1) % size),
                dist.get_global_rank(group, (index - 1) % size))

    def _exchange_shards(self, version: int) -> None:
        group, following, previous = self._ring()
        if following == self.rank:
            return  # no data-parallel peer
        mine = shard_tensors(self._engine)
        self._held_buffers(mine)
        # One message each way: a point-to-point operation costs far more than packing.
        if self._outgoing is None:
            self._outgoing = torch.empty_like(self._held_flat)
        torch.cat([tensor.reshape(-1) for tensor in mine], out=self._outgoing)
        self._held_version = -1
        operations = [dist.P2POp(dist.isend, self._outgoing, following, group=group),
                      dist.P2POp(dist.irecv, self._held_flat, previous, group=group)]
        for work in dist.batch_isend_irecv(operations):
            work.wait()
        self._held_of, self._held_version = previous, version

    # -- after a crash --------------------------------------------------------------------

    def _record(self) -> dict[str, Any]:
        step = self._step
        updating = (step is not None and step.reached_commit
                    and self._applied != step.iteration + 1)
        return {"applied": self._applied, "updating": updating,
                "held_of": self._held_of, "held_version": self._held_version}

    def _agree(self, contribute: bool) -> tuple[int, Optional[str], dict[int, int]]:
        records: list[Any] = [None] * self.world_size
        dist.all_gather_object(records, self._record() if contribute else None)
        return decide_continuation(records, self.peer_copy)

    def _recover(self, plan: dict[str, Any], snapshot: dict[str, Any]) -> int:
        target, rollback, holders = self._agree(contribute=True)
        reset_interrupted_step(self._engine)
        if rollback is not None:
            return self._roll_back(rollback)
        if self._step is not None and self._step.iteration == target:
            self._restore_snapshot(snapshot)  # the dropped iteration is redone
        for lost, holder in holders.items():
            if holder == self.rank:
                self._send_state(lost, target)
        return target

    def _join(self) -> int:
        if self._joining_migration:
            self._receive_or_exit()
            return self._applied
        target, rollback, _ = self._agree(contribute=False)
        if rollback is not None:
            return self._roll_back(rollback)
        # The held copy of a lost rank comes back with the next step's exchange.
        self._receiving_lost_shard = True
        try:
            self._receive_or_exit()
        finally:
            self._receiving_lost_shard = False
        return target

    def _roll_back(self, why: str) -> int:
        started = time.time()
        iteration = self._load()
        if iteration is None:
            # The launcher sees the exit at once and falls back to restarting the job.
            logger.error("rank %d: cannot continue in place (%s) and there is no checkpoint "
                         "to roll back to; exiting", self.rank, why)
            self.finish()
            exit_now(status=1)
        self._applied = iteration
        self._held_version = -1
        self.control.post("rolled_back", rank=self.rank, iteration=iteration, reason=why,
                          load_s=time.time() - started, time=time.time())
        logger.warning("rank %d rolled back to the checkpoint of iteration %d: %s", self.rank,
                       iteration, why)
        return iteration

    # -- framework hooks ------------------------------------------------------------------

    def _group_holders(self) -> tuple[list[Any], list[types.ModuleType]]:
        import deepspeed.runtime.pipe.p2p as p2p
        import deepspeed.utils.groups as groups

        return [self._engine], [groups, p2p]

    def _after_switch(self) -> None:
        # The joiner's engine announces its activation shapes on its first send; every rank
        # does so again, so that each pair of neighbours agrees.
        if self._engine is not None:
            self._engine.reset_activation_shape()

    def _capture_snapshot(self) -> dict[str, Any]:
        snapshot = {"random": random.getstate(), "numpy": np.random.get_state(),
                    "torch": torch.get_rng_state(), "counters": counters(self._engine)}
        if torch.cuda.is_available():
            snapshot["cuda"] = torch.cuda.get_rng_state_all()
        return snapshot

    def _restore_snapshot(self, snapshot: dict[str, Any]) -> None:
        random.setstate(snapshot["random"])
        np.random.set_state(snapshot["numpy"])
        torch.set_rng_state(snapshot["torch"])
        if "cuda" in snapshot:
            torch.cuda.set_rng_state_all(snapshot["cuda"])
        restore_counters(self._engine, snapshot["counters"])

    def _module_tensors(self) -> list[torch.Tensor]:
        return [tensor.data for _, tensor in
                sorted(self._engine.module.state_dict(keep_vars=True).items())
                if isinstance(tensor, torch.Tensor)]

    def _state_tensors(self) -> list[torch.Tensor]:
        """Parameters and this rank's own shard, and (except while a joiner receives a lost
        rank's shard) the shard copy it holds; a joiner receives into them, so its optimizer
        state and held copy are created first."""
        ensure_optimizer_state(self._engine)
        shard = shard_tensors(self._engine)
        if self._receiving_lost_shard:
            return self._module_tensors() + shard
        return self._module_tensors() + shard + self._held_buffers(shard)

    def _held_buffers(self, shard: list[torch.Tensor]) -> list[torch.Tensor]:
        """The held copy, shaped like ``shard``: views into one flat buffer."""
        if not self._held:
            dtypes = {tensor.dtype for tensor in shard}
            if len(dtypes) != 1:
                raise TypeError(f"the optimizer shard mixes dtypes {sorted(map(str, dtypes))}; "
                                "the peer copy packs it into one buffer of one dtype")
            sizes = [tensor.numel() for tensor in shard]
            self._held_flat = torch.empty(sum(sizes), dtype=dtypes.pop())
            self._held = [piece.view_as(tensor) for piece, tensor in
                          zip(self._held_flat.split(sizes), shard)]
        return self._held

    def _state_tensors_for(self, joiner: int) -> list[torch.Tensor]:
        """What the holder of a lost rank's shard copy sends that rank's joiner."""
        return self._module_tensors() + self._held

    def _state_blob(self) -> dict[str, Any]:
        scheduler = self._engine.lr_scheduler
        return {"scheduler": scheduler.state_dict() if scheduler is not None else None,
                "hyperparameters": hyperparameters(self._engine),
                "held_of": self._held_of, "held_version": self._held_version}

    def _load_state_blob(self, state: dict[str, Any]) -> None:
        if state["scheduler"] is not None:
            self._engine.lr_scheduler.load_state_dict(state["scheduler"])
        # The scheduler sets the learning rate only after the next update.
        set_hyperparameters(self._engine, state["hyperparameters"])
        if not self._receiving_lost_shard:  # a leaver's copy comes with its rank
            self._held_of, self._held_version = state["held_of"], state["held_version"]
