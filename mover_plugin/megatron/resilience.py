"""The resilience runtime of a Megatron-Core training process (``--resilient``): the
Megatron-Core adapter (:mod:`mover_plugin.runtime.adapter`) of
:mod:`mover_plugin.runtime.resilience`, which holds the protocol.

Under ``mover-launch --policy resilient`` every worker runs its training steps through
:meth:`MegatronResilience.run_step`. When a rank dies, the survivors leave the failed step (a
communication error, or the controller's alarm aborting the collective they wait in), rebuild
the process groups that contain the lost rank (and any other group left in the middle of an
operation) under the next generation's store namespace, keep the others
(:mod:`mover_plugin.comm.delta`), rewrite every cached reference to a rebuilt group in
``parallel_state``, the model, DDP and optimizer, agree on which side of the optimizer update
each of them is, and redo the dropped iteration with the same micro-batches and the RNG states
saved at its start. Every rank of the new generation, the newcomer included, also forgets the
flags its optimizer agreed on with its peers by a collective and caches (Megatron-Core 0.19's
grad-norm groups, :func:`forget_agreed_flags`), so that all of them agree on them again in the
same step. A standby process, started and warmed up beforehand (every pipeline role
played in a sandbox, :mod:`mover_plugin.megatron.standby`), takes the lost global rank: it
adopts the model it built for the rank's role during its warm-up, or builds the rank's
model with its collectives kept local, receives parameters, optimizer and scheduler state, RNG
states and the iteration from a data-parallel twin, and joins the loop.

**Planned migration.** When an operator moves a rank (``mover migrate``), phase 1 runs while
training goes on: a standby is promoted to the rank, builds its groups and its model, and every
other rank builds, in a thread of its own, the next generation's version of its groups that
contain the leaving rank (a *prepare* notice starts it). When all are ready the controller posts
a *switch* notice. Each rank carries "I saw it" in the commit all-reduce, so all of them learn
in the same iteration that the switch is due, finish that iteration, and switch at its end
(phase 2): the stayers put the prepared groups in place, and the leaver sends its own state to
the joiner (:mod:`mover_plugin.runtime.handover`) and exits with status 0.

**The commit rule.** The optimizer update of an iteration is applied only after a WORLD
all-reduce that every rank enters with complete, reduced and clipped gradients. If any rank
passed that all-reduce, every rank had reached it, so a survivor that had not yet applied the
update applies it during the switch; if none passed it, nobody applied anything and the
iteration is redone. Either way all ranks continue from the same iteration.

**The distributed optimizer** (``--use-distributed-optimizer``): a rank's optimizer shard
exists nowhere else, so after every step each rank sends it to the next rank of its
data-parallel group, which keeps it in host memory (:mod:`mover_plugin.runtime.peer_copy`;
``--resilient-no-peer-copy`` turns it off). The step waits for the exchange (in Megatron-LM's
loop the next step does, so that the exchange overlaps the loop's own work between two steps).
After a crash the ranks continue in place only if every lost rank's shard is held, current,
by a live rank and no rank had begun the update of the interrupted iteration; the holder then
sends the joiner the parameters and the shard.
Otherwise every rank, the joiner included, rolls back in place to the last checkpoint (the
``load`` given to :meth:`MegatronResilience.first_iteration`) and trains on from there.

**No standby ready.** A script that hands its stage recipe to
:meth:`MegatronResilience.enable_templates` lets the controller shrink the job instead of
restarting it: the survivors train on pipeline templates, and grow back to the job's own layout
once standbys are ready (:mod:`mover_plugin.megatron.templates.shrunk`).

Limitations: a lost rank needs a live data-parallel twin (otherwise the controller falls back to
the restart baseline, or shrinks when the script enabled templates); every group uses the
``mover`` backend, so Megatron's extra gloo groups are not created (``--resilient`` implies
``--disable-gloo-process-groups``).
"""

from __future__ import annotations

import argparse
import logging
import time
import types
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from mover_plugin.comm.world import cover_world
from mover_plugin.contract import GenerationPlan
from mover_plugin.errors import LaunchError
from mover_plugin.layout import ParallelLayout
from mover_plugin.megatron.checkpoint import capture_rng_state, restore_rng_state
from mover_plugin.megatron.ddp_syncs import drop_syncs_in_flight
from mover_plugin.megatron.distributed_optimizer import (
    create_state_up_front,
    ensure_shard_state,
    publish_received_shard,
    restore_step_counters,
    shard_tensors,
    uses_distributed_optimizer,
)
from mover_plugin.megatron.moe import capture_moe_metrics, restore_moe_metrics
from mover_plugin.megatron.templates.participant import CoreLoop, MegatronTemplates, TemplateLoop
from mover_plugin.megatron.standby import (
    StandbyWarmUp,
    TrainingObjects,
    WarmedStandby,
    parallel_layout,
    warm_up,
)
from mover_plugin.megatron.templates.stage import StageRecipe, load_schedule
from mover_plugin.megatron.update_gate import UpdateGate
from mover_plugin.progress import ProgressReporter
from mover_plugin.runtime.adapter import Continuation, Transfer
from mover_plugin.runtime.handover import module_state_tensors
from mover_plugin.runtime.peer_copy import (
    PeerCopy,
    decide_continuation,
    ring_neighbours,
    shard_record,
)
from mover_plugin.runtime.resilience import ResilienceRuntime
from mover_plugin.runtime.settings import ResilienceSettings

logger = logging.getLogger(__name__)


class MegatronResilience:
    """The runtime of a Megatron-Core process: the model, optimizer and scheduler it guards.

    The script calls :meth:`start`, :meth:`initialize_distributed`, :meth:`build_model`,
    :meth:`attach`, :meth:`first_iteration`, then :meth:`run_step` for every iteration and
    :meth:`finish`; the :class:`~mover_plugin.runtime.resilience.ResilienceRuntime` it holds
    calls back the adapter methods below them (:class:`~mover_plugin.runtime.adapter.
    FrameworkAdapter`).
    """

    def __init__(self, args: argparse.Namespace,
                 settings: Optional[ResilienceSettings] = None,
                 loop: Optional[TemplateLoop] = None,
                 reload: Optional[Callable[[], Optional[int]]] = None) -> None:
        """``settings``: the checked resilience settings (by default ``args.resilience``);
        ``loop``: where the training loop differs on pipeline templates (by default a
        Megatron-Core script's own, :class:`~mover_plugin.megatron.templates.participant.
        CoreLoop`); ``reload``: how a rollback loads the last checkpoint in place and returns
        its iteration, None without one (by default the ``load`` given to
        :meth:`first_iteration`)."""
        self.args = args
        self._parallel_kwargs: dict[str, Any] = {}
        self._experts_in_shard = False
        """Whether experts that no other rank holds travel in this rank's optimizer shard
        (:class:`~mover_plugin.layout.ParallelLayout`)."""
        self._model: Any = None
        self._optimizer: Any = None
        self._scheduler: Any = None
        self._gate: Optional[UpdateGate] = None
        """The commit gate in the optimizer's step (set by :meth:`attach`)."""
        self._warmed: Optional[WarmedStandby] = None
        """A standby's model of the role it kept from its warm-up in the sandbox."""
        self._adopted = False
        """Whether this joiner trains with the model it warmed up (rather than a new one)."""
        self._sharded = False
        """Whether the optimizer is Megatron-Core's distributed optimizer."""
        self._peer_copy: Optional[PeerCopy] = None
        self._copy_ring = (-1, -1)
        """The next and the previous rank of the peer copy's ring (set with the copy)."""
        self._load: Callable[[], Optional[int]] = lambda: None
        """Loads the last checkpoint into the model and optimizer (for a rollback)."""
        self._reload = reload or self._reload_loaded
        self.templates = MegatronTemplates(self, loop or CoreLoop())
        """The adapter's part in pipeline templates (the runtime's shrink and growth)."""
        self.copy_between_steps = False
        """Whether the peer copy's exchange may run on after a step returns, until
        :meth:`before_step` (for a loop that calls it before each step reports its begin, and
        does work of its own between two steps that the exchange overlaps); otherwise each
        step waits for its exchange before it returns."""
        self.runtime = ResilienceRuntime.connect(settings or args.resilience, self)

    # -- what the training script calls ---------------------------------------------------

    @classmethod
    def start(cls, args: argparse.Namespace,
              warm: Optional[StandbyWarmUp] = None) -> Optional["MegatronResilience"]:
        """None without ``--resilient``. A standby warms up with ``warm`` (when given, see
        :mod:`mover_plugin.megatron.standby`) and then blocks here until it is promoted."""
        if not getattr(args, "resilient", False):
            return None
        resilience = cls(args)
        runtime = resilience.runtime
        if runtime.is_standby:
            if warm is not None and runtime.settings.standby_shadow_iterations > 0:
                resilience._warm_up(warm)
            runtime.wait_for_promotion()
        return resilience

    @property
    def progress(self) -> ProgressReporter:
        return self.runtime.progress

    def _warm_up(self, warm: StandbyWarmUp) -> None:
        runtime = self.runtime
        self._warmed = warm_up(warm, runtime.world_size,
                               runtime.settings.standby_shadow_iterations,
                               runtime.settings.standby_memory_mb)
        if self._warmed is not None:
            runtime.control.post("standby_warmed", standby=runtime.control.standby_id,
                                 time=time.time(), **self._warmed.report)

    def initialize_distributed(self, **parallel_kwargs: Any) -> None:
        """``init_process_group`` and Megatron's ``initialize_model_parallel`` for this
        generation, with abortable groups."""
        self._parallel_kwargs = dict(parallel_kwargs)
        self.runtime.init_distributed(self.job_layout())

    def job_layout(self) -> ParallelLayout:
        """The job's parallel layout (from ``initialize_model_parallel``'s arguments)."""
        return parallel_layout(self.runtime.world_size, self._parallel_kwargs,
                               experts_in_shard=self._experts_in_shard)

    def build_model(self, build: Callable[[], TrainingObjects]) -> TrainingObjects:
        """This rank's (model, optimizer, scheduler), from ``build()`` after
        :meth:`initialize_distributed`. A promoted standby adopts the model it warmed up when
        its role is this rank's, and otherwise builds with its collectives kept local (their
        results are overwritten by the state it receives from its twin)."""
        if self.runtime.joiner_of is None:
            return build()
        objects = self.adopt_warmed()
        if objects is not None:
            return objects
        from mover_plugin.patches import apply_patches

        with apply_patches("local-collectives"):
            return build()

    def adopt_warmed(self) -> Optional[TrainingObjects]:
        """A promoted standby's objects of this rank's role kept from its warm-up, moved onto
        this generation's groups; None when it kept none that fits (it then builds). Every
        other kept role is released either way."""
        warmed, self._warmed = self._warmed, None
        if warmed is None:
            return None
        objects = warmed.adopt(self.runtime.rank,
                               self.job_layout())
        self._adopted = objects is not None
        return objects

    def attach(self, model: Any, optimizer: Any, scheduler: Any) -> None:
        """Registers the training objects and puts the commit gate before every update."""
        self._model, self._optimizer, self._scheduler = model, optimizer, scheduler
        runtime = self.runtime
        self._sharded = uses_distributed_optimizer(optimizer)
        if self._sharded:
            create_state_up_front(optimizer)
        if self._sharded and not getattr(self.args, "resilient_no_peer_copy", False):
            self._peer_copy = PeerCopy(runtime.control.store, runtime.rank, runtime.timeout())
            # The ring: this rank and its twins (with experts, only the data-parallel peers
            # that hold its experts too), so that the holder of a rank's copy also holds the
            # parameters its joiner needs.
            twins = self.job_layout().data_parallel_twins(runtime.rank)
            self._copy_ring = ring_neighbours(sorted([runtime.rank, *twins]), runtime.rank)
        self._gate = UpdateGate(optimizer, scheduler, runtime, self._peer_copy,
                                self.scheduler_increment)
        self.templates.publish_spec()

    def scheduler_increment(self) -> int:
        """What the scheduler steps by in one iteration: its global batch's samples."""
        return self.args.global_batch_size

    @property
    def training_objects(self) -> tuple[Any, Any, Any]:
        """The script's (model, optimizer, scheduler), once :meth:`attach` registered them."""
        return self._model, self._optimizer, self._scheduler

    @property
    def sharded(self) -> bool:
        """Whether the optimizer is Megatron-Core's distributed optimizer."""
        return self._sharded

    def enable_templates(self, recipe: StageRecipe) -> None:
        """Lets the job shrink onto pipeline templates when a rank is lost and no standby is
        ready (:mod:`mover_plugin.megatron.templates.shrunk`): ``recipe`` builds and trains a
        stage with the script's own model, optimizer, schedule and data. Call it before
        :meth:`attach`."""
        self.templates.recipe = recipe

    @property
    def on_templates(self) -> bool:
        """Whether the job shrank and this rank trains on pipeline templates (the script's
        model and optimizer rest)."""
        return self.templates.on_templates

    def first_iteration(self, load: Callable[[], int]) -> int:
        """The iteration to start from: a joiner's comes from its twin, others ``load()``
        (which loads the last checkpoint, or returns 0 without one; a rollback calls it
        too)."""
        self._load = load
        if self.runtime.joiner_of is None:
            return self.runtime.begin(load())
        return self.runtime.join(adopted=self._adopted)

    def run_step(self, iteration: int, step: Callable[[int], Any]) -> tuple[Any, int]:
        """See :meth:`ResilienceRuntime.run_step`."""
        return self.runtime.run_step(iteration, step)

    def finish(self) -> None:
        """Training is over: the runtime stops following the job; with the peer copy, the
        host memory it used is reported (a ``peer_copy`` event)."""
        if self._peer_copy is not None:
            self._peer_copy.report_and_close(self.runtime.control.post, self.runtime.rank)
        self.templates.save_final(getattr(self.args, "save", None))
        self.runtime.finish()

    # -- after a crash (FrameworkAdapter) -------------------------------------------------

    def continue_after_crash(self, plan: GenerationPlan,
                             snapshot: dict[str, Any]) -> Continuation:
        if self._sharded:
            return self._continue_sharded(snapshot)
        target = self.agree_on_iteration(contribute=True)
        self.settle_iteration(target, snapshot)
        return Continuation(target, {item.rank: item.twin for item in plan.replacements})

    def continue_as_joiner(self) -> Continuation:
        if self._sharded:
            return self._continue_sharded(None)
        return Continuation(self.agree_on_iteration(contribute=False))

    def _continue_sharded(self, snapshot: Optional[dict[str, Any]]) -> Continuation:
        """With the distributed optimizer: in place when every lost rank's current shard is
        held by a live rank, otherwise a rollback (module docstring). ``snapshot`` is None at
        a joiner."""
        target, rollback, holders = self._agree_on_shards(contribute=snapshot is not None)
        if rollback is not None:
            return self._roll_back(rollback)
        step = self.runtime.ledger.step
        if snapshot is not None and step is not None and step.iteration == target:
            self.restore_snapshot(snapshot)  # the dropped iteration is redone
        return Continuation(target, holders)

    def _agree_on_shards(self, *, contribute: bool) -> tuple[int, Optional[str], dict[int, int]]:
        copy = self._peer_copy
        if copy is not None:
            copy.settle()  # an exchange in flight ends, completed or failed
        mine = None
        if contribute:
            mine = shard_record(self.runtime.ledger, copy)
        records: list[Any] = [None] * self.runtime.world_size
        dist.all_gather_object(records, mine)
        return decide_continuation(records, copy is not None, off="--resilient-no-peer-copy")

    def _roll_back(self, why: str) -> Continuation:
        if self._peer_copy is not None:
            self._peer_copy.forget()
        self._drop_syncs_in_flight()
        continuation = self.runtime.roll_back(why, self._reload)
        restore_step_counters(self._optimizer)
        forget_agreed_flags(self._optimizer)
        return continuation

    def _reload_loaded(self) -> Optional[int]:
        """The last checkpoint, loaded in place by the script's ``load``; None if there is
        none."""
        iteration = self._load()
        return iteration or None

    def agree_on_iteration(self, *, contribute: bool) -> int:
        """All ranks of the new generation learn the iteration everyone will be at.

        A rank of the previous generation contributes its commit record (a survivor
        interrupted inside ``run_step``); a joiner, which has none, contributes nothing. A
        rank that passed the commit but has not applied the update yet counts the iteration as
        done."""
        mine = self.runtime.ledger.completed_by_commit() if contribute else None
        records: list[Any] = [None] * self.runtime.world_size
        dist.all_gather_object(records, mine)
        return max(record for record in records if record is not None)

    @property
    def update_gate(self) -> Optional[UpdateGate]:
        """The commit gate of the optimizer this rank trains with: on pipeline templates its
        stage's, otherwise the script's (None before :meth:`attach`)."""
        return self.templates.gate or self._gate

    def settle_iteration(self, target: int, snapshot: dict[str, Any]) -> None:
        """Brings this survivor to ``target`` completed iterations
        (:meth:`~mover_plugin.megatron.update_gate.UpdateGate.settle`) through the commit gate
        of the optimizer it trains with."""
        gate = self.update_gate
        assert gate is not None, "a crash before attach()"
        gate.settle(target)
        step = self.runtime.ledger.step
        if step is not None and step.iteration == target:
            # The interrupted iteration is dropped and will be redone from its start.
            self.restore_snapshot(snapshot)

    # -- groups, snapshot and state (FrameworkAdapter) ------------------------------------

    def init_groups(self) -> None:
        from megatron.core import parallel_state

        if self._parallel_kwargs.get("create_gloo_process_groups", True):
            raise LaunchError("--resilient needs initialize_model_parallel("
                              "create_gloo_process_groups=False): plain gloo groups can be "
                              "neither left nor replaced")
        parallel_state.initialize_model_parallel(**self._parallel_kwargs)
        cover_world([parallel_state.get_model_parallel_group(),
                     parallel_state.get_data_parallel_group(with_context_parallel=True)])

    def group_holders(self) -> tuple[list[Any], list[types.ModuleType]]:
        from megatron.core import parallel_state

        return [self._model, self._optimizer, self._scheduler], [parallel_state]

    def after_switch(self) -> None:
        """The optimizer's agreed flags are forgotten, and so are the parameter gathers'
        dispatch marks: a rank that gathered its parameters outside an iteration (Megatron-LM
        forces the gather before it saves a checkpoint) would skip the gather at its next
        forward pass, which a joiner makes, and the two would wait on different collectives."""
        forget_agreed_flags(self._optimizer)
        self._drop_syncs_in_flight()

    def teardown(self) -> None:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()

    def capture_snapshot(self) -> dict[str, Any]:
        gate = self.update_gate
        update = {} if gate is None else {"update": gate.snapshot()}
        return {**capture_rng_state(), **update, "moe_metrics": capture_moe_metrics()}

    def restore_snapshot(self, snapshot: dict[str, Any]) -> None:
        restore_rng_state(snapshot)
        gate = self.update_gate
        if gate is not None and "update" in snapshot:
            gate.restore(snapshot["update"])
        restore_moe_metrics(snapshot.get("moe_metrics", {}))
        self._drop_syncs_in_flight()

    def _drop_syncs_in_flight(self) -> None:
        """What an interrupted iteration left in flight (:mod:`mover_plugin.megatron.ddp_syncs`)."""
        if self._model is not None:
            drop_syncs_in_flight(self._model if isinstance(self._model, list) else [self._model])

    def after_step(self, iteration: int) -> None:
        copy = self._peer_copy
        if copy is not None:
            copy.refresh(shard_tensors(self._optimizer), iteration + 1, self.runtime.generation,
                         self._copy_ring)
            if not self.copy_between_steps:
                copy.settle()

    def before_step(self) -> None:
        """Waits for the peer copy's exchange of the last step (see
        :attr:`copy_between_steps`): a rank lost after this point, until the commit of the
        next step, has a current copy on its peer."""
        if self._peer_copy is not None:
            self._peer_copy.settle()

    def model_state_tensors(self) -> list[torch.Tensor]:
        """The model's parameters and buffers: a data-parallel twin holds the same."""
        return module_state_tensors(self._model.module)

    def state_tensors(self, transfer: Transfer) -> list[torch.Tensor]:
        """The model's parameters and buffers; with the distributed optimizer also the shard:
        the leaver's own in a hand-over, the copy its holder keeps of a lost rank's, received
        into the joiner's own shard (whose state is created first)."""
        model = self.model_state_tensors()
        if not self._sharded:
            return model
        if transfer is Transfer.COPY_SENT:
            assert self._peer_copy is not None
            return model + self._peer_copy.held()
        ensure_shard_state(self._optimizer)
        return model + shard_tensors(self._optimizer)

    def state_blob(self) -> dict[str, Any]:
        return {"optimizer": self._optimizer.state_dict(),
                "scheduler": self._scheduler.state_dict()}

    def load_state(self, state: dict[str, Any], transfer: Transfer) -> None:
        self._optimizer.load_state_dict(state["optimizer"])
        restore_step_counters(self._optimizer)
        publish_received_shard(self._optimizer)
        load_schedule(self._scheduler, state["scheduler"])  # a warmed-up standby's has stepped
        forget_agreed_flags(self._optimizer)


AGREED_FLAGS_ATTRIBUTE = "_has_grad_norm_group_cache"
"""Where Megatron-Core's optimizers cache a flag agreed on by a collective: whether any rank
of the optimizer's gradient-statistics group holds parameters of a separate grad-norm group.
It is computed with an all-reduce on the first ``step()`` and never again."""


def forget_agreed_flags(optimizer: Any) -> None:
    """Drops the flags an optimizer (and each optimizer it chains) agreed on with its peers.

    Megatron-Core 0.19 runs the all-reduce behind such a flag only while the flag is not
    cached, so a rank that has it and one that has not (a joiner, or a standby that computed
    it alone in the sandbox) issue different collectives in the same step, and the step hangs.
    Every rank of a new generation forgets them (the stayers once their groups are switched,
    a joiner once its state is loaded): all compute them again together in the next step.
    """
    for item in [optimizer, *getattr(optimizer, "chained_optimizers", ())]:
        if getattr(item, AGREED_FLAGS_ATTRIBUTE, None) is not None:
            setattr(item, AGREED_FLAGS_ATTRIBUTE, None)
