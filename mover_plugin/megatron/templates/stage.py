"""Training a Megatron-Core model on a pipeline-template placement: pipelines of different
lengths side by side, and moving layers between ranks when the placement changes.

A rank of a :class:`~mover_plugin.placement.Placement` builds the model of its stage alone
(its transformer layers, with the embeddings on a first stage and the final norm and output
layer on a last one) with explicit process groups (Megatron-Core's ``pg_collection``): its
pipeline's group for the point-to-point traffic of the 1F1B schedule, the pipeline's two ends
for the tied word embedding, all ranks for the gradient norm, itself alone for everything
data-parallel. Megatron-Core's own schedule, ``DistributedDataParallel`` (over one rank) and
optimizer train it. The data-parallel reduction is this module's: after the schedule's own
finalisation, every gradient is scaled by the rank's share of the global batch
(:meth:`~mover_plugin.placement.Placement.weight`; the schedule has divided by the pipeline's
own micro-batch count) and summed over the gradient group of the ranks holding the same
parameters, so every holder applies the update of the full job: the mean over all the global
batch's micro-batches (up to the order of float additions). A pipeline's last stage holds a
copy of the tied word embedding whose gradient the schedule has already summed with the first
stage's; it adds nothing to the sum. Every holder ends with the same summed gradient, and the
gradient norm for clipping is one for the whole job: computed over all ranks, each parameter
counted only by the first rank that holds it (the others' copies are marked ``shared``, which
is how Megatron-Core leaves a parameter out of the norm). So every copy of a layer takes the
same update, and the copies stay equal.

:func:`relayout` moves parameters and optimizer state (Adam's moments and step) unit by unit
(:func:`~mover_plugin.placement.transfers`) from the ranks that hold them to those that need
them, from a model of any placement (or the job's own Megatron-Core model, as a
:class:`StageState`) to the new stage's. With bf16 or fp16 parameters a stage is built in
Megatron-Core's ``Float16Module`` (as Megatron-LM builds the job's) and a unit carries each
parameter's fp32 main copy too, which the mixed-precision optimizer updates.

Limits: tensor-parallel size 1 (a stage is one rank); no dropout in a test that compares with
the full job (which rank runs a micro-batch changes its dropout masks). Written and tested for
CPU and gloo with fp32, bf16 or fp16 parameters and Megatron-Core's plain (not distributed)
optimizer over torch's Adam, whose ``step`` is a per-parameter tensor: the transfers and the
loss all-reduce use CPU tensors (NCCL needs them on the GPU), and fused Adam keeps its step per
group.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from mover_plugin.placement import Placement, StageRole, Transfer, embedding_ends, layer_unit

logger = logging.getLogger(__name__)

ModelBuilder = Callable[..., Any]
"""``(num_layers=, pre_process=, post_process=, pg_collection=)`` -> a Megatron-Core model
with ``config`` (its ``TransformerConfig``, pipeline size 1) for one stage."""


@dataclass
class StageRecipe:
    """What a stage needs from the training script: its model, optimizer, schedule and data."""

    build_model: ModelBuilder
    optimizer_config: Any
    """Megatron-Core's ``OptimizerConfig``."""
    build_scheduler: Callable[[Any], Any]
    """optimizer -> Megatron-Core's ``OptimizerParamScheduler``."""
    forward_step: Callable[[Iterator[Any], Any], Any]
    microbatch: Callable[[int, int], Any]
    """(iteration, slot of the global batch) -> the micro-batch."""
    seq_length: int
    micro_batch_size: int
    global_batch_size: int
    optimizer_overrides: Any = None
    """Megatron-Core's per-parameter optimizer settings (``config_overrides``), as the job's
    optimizer was built with them (None: none)."""
    grad_reduce_in_fp32: bool = False
    """Whether the job's gradient buffers are fp32 with 16-bit parameters (Megatron-LM's
    ``--accumulate-allreduce-grads-in-fp32``, its default with ``--bf16`` unless
    ``--grad-reduce-in-bf16``; not with ``--fp16`` unless given): a stage's are the same."""


class StageStep(NamedTuple):
    """What one iteration on a stage gives: the loss over the global batch, the gradient
    norm, and whether the optimizer skipped the update (fp16's loss scaler found inf/NaN)."""

    loss: float
    grad_norm: float
    skipped: bool = False


# -- groups -----------------------------------------------------------------------------------


class PlacementGroups:
    """The groups of a placement, made by every rank of the current world in one order."""

    def __init__(self, placement: Placement, rank: int) -> None:
        self.rank = rank
        self.ranks = placement.ranks
        self._groups: dict[tuple[int, ...], Any] = {}
        for ranks in placement.rank_sets():
            group = dist.new_group(list(ranks))
            if rank in ranks:
                self._groups[ranks] = group

    def __getitem__(self, ranks: Sequence[int]) -> Any:
        return self._groups[tuple(sorted(ranks))]

    def collection(self, role: StageRole) -> Any:
        """Megatron-Core's ``ProcessGroupCollection`` of ``role``'s stage."""
        from megatron.core.process_groups_config import ProcessGroupCollection

        alone = self[(self.rank,)]
        pipeline = self[role.pipeline_ranks]
        ends = embedding_ends(role.pipeline_ranks)
        return ProcessGroupCollection(
            tp=alone, cp=alone, tp_cp=alone, ep=alone, expt_tp=alone, tp_ep=alone,
            dp=alone, dp_cp=alone, tp_dp_cp=alone, expt_dp=alone, intra_dp_cp=alone,
            intra_expt_dp=alone, intra_dist_opt=alone, inter_dist_opt=alone,
            pp=pipeline, mp=self[self.ranks], tp_ep_pp=pipeline,
            embd=self[ends] if self.rank in ends else None,
            pos_embd=alone if role.pre_process else None,
        )

    def destroy(self) -> None:
        for group in self._groups.values():
            dist.destroy_process_group(group)
        self._groups.clear()


# -- names --------------------------------------------------------------------------------------


def canonical_name(name: str, first_layer: int) -> str:
    """A stage's parameter name as the full model's: its transformer layers by their global
    numbers (:meth:`StageState.of_model` also names a tied output weight as the word
    embedding)."""
    prefix = "decoder.layers."
    if name.startswith(prefix):
        local, rest = name[len(prefix):].split(".", 1)
        return f"{prefix}{first_layer + int(local)}.{rest}"
    return name


def canonical_parameters(named: Iterable[tuple[str, Any]], first_layer: int, *,
                         tied: bool = True) -> dict[str, Any]:
    """A stage's parameters (or their values) by canonical name; with ``tied`` the output
    layer's weight is named as the word embedding it copies."""
    names = {}
    for name, value in named:
        canonical = canonical_name(name, first_layer)
        if tied and name.startswith("output_layer."):
            canonical = canonical.replace("output_layer.", "embedding.word_embeddings.", 1)
        names[canonical] = value
    return names


def unit_of(name: str, tied: bool) -> str:
    """The placement unit of a canonical parameter name."""
    if name.startswith("decoder.layers."):
        return layer_unit(int(name.split(".")[2]))
    if name.startswith("embedding.word_embeddings.") or (tied and name.startswith("output_layer.")):
        return "embedding"
    if name.startswith("embedding.position_embeddings."):
        return "position"
    if name.startswith("output_layer."):
        return "output"
    return "final_norm"


@dataclass
class StageState:
    """A stage's parameters by canonical name, and the optimizer holding their state."""

    parameters: dict[str, torch.nn.Parameter]
    optimizer: Any
    tied: bool = True

    @classmethod
    def of_model(cls, module: torch.nn.Module, optimizer: Any, first_layer: int, *,
                 tied: bool = True) -> "StageState":
        """``module`` (a Megatron-Core model, unwrapped) whose first transformer layer is global
        layer ``first_layer``."""
        return cls(canonical_parameters(module.named_parameters(), first_layer, tied=tied),
                   optimizer, tied)

    def unit_parameters(self, unit: str) -> list[tuple[str, torch.nn.Parameter]]:
        return sorted((name, param) for name, param in self.parameters.items()
                      if unit_of(name, self.tied) == unit)

    def unit_tensors(self, unit: str) -> list[torch.Tensor]:
        """Each parameter of ``unit``, its fp32 main copy where the optimizer keeps one (bf16
        parameters: Megatron-Core's ``param.main_param``), and the Adam state (moments and step)
        of what the optimizer updates, created empty if it has not stepped yet."""
        tensors = []
        for _, param in self.unit_parameters(unit):
            main = getattr(param, "main_param", None)
            if main is not None:
                tensors += [param.data, main.data]
            else:
                tensors.append(param.data)
            state = adam_state(self.optimizer, param if main is None else main)
            tensors += [state["exp_avg"], state["exp_avg_sq"], state["step"]]
        return tensors


def torch_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a Megatron-Core one (chained or not)."""
    chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [item.optimizer for item in chained]


def adam_state(optimizer: Any, param: torch.nn.Parameter) -> dict[str, torch.Tensor]:
    for inner in torch_optimizers(optimizer):
        if any(param is p for group in inner.param_groups for p in group["params"]):
            state = inner.state[param]
            if "exp_avg" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(param.data)
                state["exp_avg_sq"] = torch.zeros_like(param.data)
            if not torch.is_tensor(state["step"]):
                state["step"] = torch.tensor(float(state["step"]))
            return state
    raise KeyError("the parameter is in none of the optimizer's groups")


def relayout(moves: Sequence[Transfer], rank: int, old: Optional[StageState],
             new: StageState, group: Any = None) -> int:
    """Sends and receives ``moves`` (every rank calls it with the same list): each unit's
    parameters and optimizer state, in one message per unit; the rest of ``new`` is taken from
    ``old`` where both hold it. Returns the bytes this rank received."""
    received = 0
    if old is not None:
        _copy_kept(old, new, {m.unit for m in moves if m.destination == rank})
    for move in moves:
        if move.source == rank and move.destination == rank:
            continue
        if move.source == rank:
            assert old is not None, f"rank {rank} has no state to send {move.unit}"
            dist.send(_packed(old.unit_tensors(move.unit)), dst=move.destination, group=group)
        elif move.destination == rank:
            tensors = new.unit_tensors(move.unit)
            packed = _packed(tensors)
            dist.recv(packed, src=move.source, group=group)
            _unpack(packed, tensors)
            received += packed.numel()
    return received


def _packed(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The bytes of ``tensors`` one after the other (one message for a unit whose tensors
    differ in dtype: bf16 parameters, their fp32 main copies and moments)."""
    return torch.cat([torch.empty(0, dtype=torch.uint8),
                      *(_bytes(tensor.detach()) for tensor in tensors)])


def _unpack(packed: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    offset = 0
    with torch.no_grad():
        for tensor in tensors:
            size = tensor.numel() * tensor.element_size()
            _bytes(tensor).copy_(packed[offset:offset + size])
            offset += size


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's storage (a copy would lose what is
    unpacked into it)."""
    if not tensor.is_contiguous():
        raise ValueError(f"a {tuple(tensor.shape)} tensor moved between stages is not contiguous")
    return tensor.view(-1).view(torch.uint8)


def _copy_kept(old: StageState, new: StageState, incoming: set[str]) -> None:
    """Copies into ``new`` every unit both hold that is not coming from another rank."""
    units = {unit_of(name, new.tied) for name in new.parameters} - incoming
    with torch.no_grad():
        for unit in units:
            source = old.unit_tensors(unit)
            target = new.unit_tensors(unit)
            if source and len(source) == len(target):
                for to, fro in zip(target, source):
                    to.copy_(fro)


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One buffer of ``tensors`` (gradients of one dtype), to all-reduce."""
    return _flatten_dense_tensors([t.detach() for t in tensors])


def _unflatten(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    with torch.no_grad():
        for tensor, value in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
            tensor.copy_(value)


# -- the stage ----------------------------------------------------------------------------------


class StageTrainer:
    """One rank's stage of a placement: its model, optimizer and scheduler, and its step."""

    def __init__(self, placement: Placement, rank: int, recipe: StageRecipe,
                 groups: PlacementGroups) -> None:
        from megatron.core.distributed import (DistributedDataParallel,
                                               DistributedDataParallelConfig)
        from megatron.core.optimizer import get_megatron_optimizer

        self.placement = placement
        self.role = placement.role(rank)
        self.rank = rank
        self.recipe = recipe
        self.groups = groups
        self.pg_collection = groups.collection(self.role)
        ensure_megatron_globals()
        module = recipe.build_model(num_layers=self.role.num_layers,
                                    pre_process=self.role.pre_process,
                                    post_process=self.role.post_process,
                                    pg_collection=self.pg_collection)
        self.config = module.config
        wrapped = in_model_precision(module)
        if placement.tied and self.role.post_process and not self.role.pre_process:
            # As Megatron-Core marks the last stage's copy in a pipeline of its own layout.
            module.output_layer.weight.shared_embedding = True
        self._count_each_parameter_once(module)
        self.module = module
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=recipe.grad_reduce_in_fp32)
        self.model = DistributedDataParallel(config=self.config, ddp_config=ddp_config,
                                             module=wrapped, pg_collection=self.pg_collection)
        self.optimizer = get_megatron_optimizer(recipe.optimizer_config, [self.model],
                                                config_overrides=recipe.optimizer_overrides,
                                                use_gloo_process_groups=False,
                                                pg_collection=self.pg_collection)
        self.scheduler = recipe.build_scheduler(self.optimizer)
        self.config.finalize_model_grads_func = self._finalize_grads
        self.config.grad_scale_func = self.optimizer.scale_loss
        self.config.no_sync_func = self.model.no_sync
        self.state = StageState.of_model(module, self.optimizer, self.role.layers[0],
                                         tied=placement.tied)
        self._reductions = self._gradient_reductions()
        self.voted = False
        """Whether a rank voted in the last :meth:`train_step`."""
        self._p2p = None
        if len(self.role.pipeline_ranks) > 1:
            from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

            self._p2p = P2PCommunicator(pp_group=self.pg_collection.pp, config=self.config)

    def _count_each_parameter_once(self, module: torch.nn.Module) -> None:
        """Leaves out of the job-wide gradient norm every copy but the first holder's."""
        holders = self.placement.holders()
        names = StageState.of_model(module, None, self.role.layers[0], tied=self.placement.tied)
        for name, param in names.parameters.items():
            param.shared = holders[unit_of(name, self.placement.tied)][0] != self.rank

    def _gradient_reductions(self) -> list[tuple[Any, list[tuple[torch.nn.Parameter, float]]]]:
        """(gradient group, [(parameter, the scale of its gradient)]) for each of this rank's
        gradient groups, in the placement's order."""
        weight = self.placement.weight(self.rank)
        mine = []
        for ranks, units in self.placement.gradient_groups():
            if self.rank in ranks:
                scaled = [(param, 0.0 if self._adds_nothing(name) else weight)
                          for unit in units for name, param in self.state.unit_parameters(unit)]
                mine.append((self.groups[ranks], scaled))
        return mine

    def _adds_nothing(self, name: str) -> bool:
        """Whether the parameter is a last stage's copy of the tied word embedding, whose
        gradient already holds the first stage's (its pipeline's share is counted there)."""
        return (self.placement.tied and self.role.post_process and not self.role.pre_process
                and unit_of(name, True) == "embedding")

    def _finalize_grads(self, model_chunks: list, num_tokens: Any = None, **_: Any) -> None:
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads(model_chunks, num_tokens, pg_collection=self.pg_collection)
        for group, scaled in self._reductions:
            grads = []
            for param, scale in scaled:
                param.main_grad.mul_(scale)
                grads.append(param.main_grad)
            flat = _flat(grads)
            dist.all_reduce(flat, group=group)
            _unflatten(flat, grads)

    def train_step(self, iteration: int, vote: bool = False,
                   repeat: Optional[Callable[[Callable[[], list]], list]] = None
                   ) -> StageStep:
        """One optimizer step on global batch ``iteration``; every rank of the world calls it.
        The learning-rate schedule steps only with an update applied, as Megatron-LM's
        ``train_step`` steps it. The loss all-reduce also carries ``vote``: afterwards
        :attr:`voted` says whether any rank voted. ``repeat`` runs the forward and backward
        passes (given as a function returning their losses) as the training loop runs them
        (Megatron-LM's rerun state machine may run them again); by default once."""
        from megatron.core.pipeline_parallel.schedules import (
            forward_backward_no_pipelining,
            forward_backward_pipelining_without_interleaving,
        )

        role, recipe = self.role, self.recipe

        def forward_backward() -> list:
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            data = (recipe.microbatch(iteration, slot) for slot in range(*role.microbatches))
            common = dict(forward_step_func=recipe.forward_step, data_iterator=data,
                          model=[self.model], num_microbatches=role.num_microbatches,
                          seq_length=recipe.seq_length,
                          micro_batch_size=recipe.micro_batch_size, forward_only=False,
                          pg_collection=self.pg_collection)
            if self._p2p is not None:
                return forward_backward_pipelining_without_interleaving(
                    p2p_communicator=self._p2p, **common)
            return forward_backward_no_pipelining(**common)

        losses = repeat(forward_backward) if repeat is not None else forward_backward()
        applied, grad_norm, _ = self.optimizer.step()
        if applied:
            self.scheduler.step(increment=recipe.global_batch_size)
        return StageStep(self._global_loss(losses, vote), float(grad_norm or 0.0),
                         skipped=not applied)

    def _global_loss(self, losses: list[dict[str, torch.Tensor]], vote: bool) -> float:
        """The loss over the global batch, as the job reports it (``lm loss``, or the first
        value a micro-batch reports): the mean of the micro-batches' losses, or, where each
        micro-batch reports ``[loss sum, tokens]`` (as Megatron-LM's GPT loss does), the sum of
        the sums over the sum of the tokens."""
        total = torch.zeros(3, dtype=torch.float64)
        if self.role.post_process:
            for item in losses:
                value = item.get("lm loss", next(iter(item.values())))
                value = value.detach().double().view(-1)
                total[:2] += value if value.numel() == 2 else torch.cat([value, value.new_ones(1)])
        total[2] = float(vote)
        dist.all_reduce(total)
        self.voted = bool(total[2] > 0)
        return (total[0] / total[1]).item()

    def take_scheduler_state(self, state: dict[str, Any]) -> None:
        """The learning-rate schedule where the job's was."""
        load_schedule(self.scheduler, state)


def load_schedule(scheduler: Any, state: dict[str, Any]) -> None:
    """Puts a Megatron-Core ``OptimizerParamScheduler`` where ``state`` says. It loads by
    stepping on from where it is, so it starts from zero (a warmed-up standby's has stepped in
    its shadow iterations)."""
    scheduler.num_steps = 0
    scheduler.load_state_dict(state)


def in_model_precision(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` in Megatron-Core's ``Float16Module`` (its parameters converted) when its
    config asks for fp16 or bf16, as Megatron-LM's ``get_model`` wraps a stage; else itself."""
    from megatron.core.transformer.module import Float16Module

    config = module.config
    return Float16Module(config, module) if (config.fp16 or config.bf16) else module


def inner_model(module: torch.nn.Module) -> torch.nn.Module:
    """The model inside Megatron-Core's ``Float16Module``, if ``module`` is one."""
    from megatron.core.transformer.module import Float16Module

    return module.module if isinstance(module, Float16Module) else module


def ensure_megatron_globals() -> None:
    """What Megatron-Core's layers read from ``parallel_state`` even with explicit groups: the
    global memory buffer and the model-parallel RNG tracker (one tensor-parallel rank)."""
    from megatron.core import parallel_state, tensor_parallel

    if getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None) is None:
        parallel_state._set_global_memory_buffer()
    tracker = tensor_parallel.get_cuda_rng_tracker()
    if "model-parallel-rng" not in tracker.get_states():
        tensor_parallel.model_parallel_cuda_manual_seed(torch.initial_seed() % (2 ** 31),
                                                        tp_rank=0, ep_rank=0, etp_rank=0)
