"""Megatron-Core shims for machines without CUDA: the ``megatron-cpu`` patch group.

Megatron-Core 0.19 runs on CPU with the gloo backend except for a few hard-coded CUDA
assumptions: CUDA RNG calls, ``torch.cuda.current_device()`` used as a device, tensors created
with ``device="cuda"``, ``torch.cuda.synchronize()``, CUDA streams, and ``'torch.cuda.*Tensor'``
type-string checks, and a distributed optimizer over torch's Adam that cannot load a checkpoint
before its first step. Each patch below removes one of them with the smallest change, and names
the Megatron call site that needs it (each checked on 0.19.2: without the patch, training
TP1 x PP2 x DP2 on CPU fails at that site). Every patch is applied only while
``torch.cuda.is_available()`` is False (a CPU build of torch, or a CUDA build on a machine
without a GPU), and only to megatron-core ``>=0.19.0,<0.20``.

Importing this module registers the patches; it neither applies them nor imports Megatron.
Megatron modules are imported inside the apply functions. Use::

    from mover_plugin.patches import apply_patches

    with apply_patches("megatron-cpu"):
        ...  # build and train a Megatron model on CPU

One patch of the group has its own condition: ``notriton`` applies only when triton (about
1 GB, installed with PyPI's CUDA build of torch) is not installed. Two modules of megatron-core
0.19 import it unconditionally: ``transformer.moe.ops.paged_stash`` (imported by ``GPTModel``
and the pipeline schedules, for MoE paged stashing) and
``transformer.custom_layers.batch_invariant_kernels`` (imported by Megatron-LM's
``megatron.training.initialize``). Stand-ins take their names; their kernels raise if called
(MoE paged stashing and batch-invariant mode need triton). ``notriton`` is registered first
and must be applied before any module of megatron-core is imported.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import logging
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

from mover_plugin.errors import PatchError
from mover_plugin.patches.registry import AttributeSwap, Patch, Undo, register_patch

logger = logging.getLogger(__name__)

GROUP = "megatron-cpu"
"""Name of the group holding every patch of this module."""

DISTRIBUTION = "megatron-core"
TESTED_VERSIONS = ">=0.19.0,<0.20"

RNG_WARNING = "CPU RNG state changed within GPU RNG context"
"""Warning that ``CudaRNGStatesTracker.fork`` logs whenever work inside it used the CPU RNG."""

_RANDOM_MODULE = "megatron.core.tensor_parallel.random"


def cuda_unavailable() -> bool:
    """The condition of every patch in the group: this process cannot use CUDA."""
    return not torch.cuda.is_available()


def triton_missing() -> bool:
    """The condition of ``notriton``: triton is not installed."""
    return importlib.util.find_spec("triton") is None


def _cpu_patch(name: str, description: str, condition: Callable[[], bool] = cuda_unavailable
               ) -> Callable[[Callable[[], Undo]], Callable[[], Undo]]:
    """Register the decorated apply function as a patch of the ``megatron-cpu`` group."""

    def decorate(apply: Callable[[], Undo]) -> Callable[[], Undo]:
        register_patch(
            Patch(
                name=name,
                distribution=DISTRIBUTION,
                tested_versions=TESTED_VERSIONS,
                description=description,
                apply=apply,
                condition=condition,
                groups=(GROUP,),
            )
        )
        return apply

    return decorate


# --- notriton ------------------------------------------------------------------------------------

TRITON_MODULES = {
    "megatron.core.transformer.moe.ops.paged_stash": {
        "GLOBAL_BLOCK_SIZE": 1024,
        "paged_stash_copy_kernel": None,
        "paged_stash_pop_kernel": None,
    },
    "megatron.core.transformer.custom_layers.batch_invariant_kernels": {
        "enable_batch_invariant_mode": None,
        "set_batch_invariant_mode": None,
        "is_batch_invariant_mode_enabled": lambda: False,
    },
}
"""The modules of megatron-core that import triton unconditionally, and what their stand-ins
hold (None: a function that raises, the feature needs triton)."""


def _needs_triton(name: str) -> Callable[..., Any]:
    def unavailable(*args: Any, **kwargs: Any) -> None:
        raise PatchError(f"{name} needs triton, which is not installed")

    return unavailable


def _triton_free_stand_in(module_name: str, contents: dict[str, Any]) -> types.ModuleType:
    module = types.ModuleType(module_name, "Stand-in without triton (mover_plugin notriton).")
    for name, value in contents.items():
        setattr(module, name, _needs_triton(f"{module_name}.{name}") if value is None else value)
    return module


@_cpu_patch("notriton", "without triton, stand-ins for the two megatron-core modules that "
            "import it", condition=triton_missing)
def apply_notriton() -> Undo:
    """Put the stand-ins into ``sys.modules`` before any module of megatron-core imports them.

    Needed by ``GPTModel`` and ``pipeline_parallel.schedules`` (through
    ``transformer.moe.paged_stash``) and by Megatron-LM's ``training.initialize``. A stub
    ``triton`` package would not do: ``torch._dynamo`` reads ``triton.language.dtype`` whenever
    triton is importable."""
    imported = [name for name in TRITON_MODULES if name in sys.modules]
    if imported:
        raise PatchError(f"{', '.join(imported)} imported already; apply 'notriton' before "
                         "any module of megatron-core is imported")
    swap = AttributeSwap()
    for module_name, contents in TRITON_MODULES.items():
        swap.set_item(sys.modules, module_name, _triton_free_stand_in(module_name, contents))
    return swap.restore


# --- rng -----------------------------------------------------------------------------------------


def _get_cpu_rng_state(
    device: Any = "cuda", clone: bool = False, graph_safe: bool = False
) -> torch.Tensor:
    """Return a copy of the CPU generator's state; stands in for the CUDA generator's state."""
    if graph_safe:
        raise NotImplementedError("graph-safe (CUDA graph) RNG states do not exist on CPU")
    return torch.default_generator.get_state()


def _set_cpu_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    """Load ``new_state`` into the CPU generator; stands in for setting the CUDA generator."""
    if graph_safe:
        raise NotImplementedError("graph-safe (CUDA graph) RNG states do not exist on CPU")
    torch.default_generator.set_state(new_state)


def _seed_cpu_generator(seed: int) -> None:
    """Seed the CPU generator; stands in for ``torch.cuda.manual_seed``."""
    torch.default_generator.manual_seed(int(seed))


class _DropRngWarning(logging.Filter):
    """Drops :data:`RNG_WARNING`, which is expected when the tracker forks the CPU generator."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != RNG_WARNING


@_cpu_patch("rng", "CUDA RNG calls and Megatron's RNG tracker use the CPU generator")
def apply_rng() -> Undo:
    """Make the CPU generator play the part of the CUDA generator.

    Needed by ``tensor_parallel.random.model_parallel_cuda_manual_seed`` →
    ``CudaRNGStatesTracker.add`` (``torch.cuda.get_rng_state``, ``torch.cuda.manual_seed``) and by
    ``CudaRNGStatesTracker.fork`` (the module functions ``_get_cuda_rng_state`` /
    ``_set_cuda_rng_state``), which attention dropout runs inside. On a CPU-only build
    ``torch.cuda.manual_seed`` and ``_set_cuda_rng_state`` do not fail but are silently queued and
    never run, which would give every tracker state the same stream; so they are replaced too.

    With the patch, each named tracker state is a distinct CPU generator state: ``fork(name)``
    loads it into the CPU generator, and on exit stores the advanced state and puts the previous
    one back, so ``get_states()`` / ``set_states()`` with ``torch.get_rng_state()`` /
    ``torch.set_rng_state()`` reproduce dropout bit for bit. The tracker's warning
    :data:`RNG_WARNING`, logged on every such fork, is filtered out.
    """
    import importlib

    random_module = importlib.import_module(_RANDOM_MODULE)
    swap = AttributeSwap()
    swap.set_attr(torch.cuda, "get_rng_state", _get_cpu_rng_state)
    swap.set_attr(torch.cuda, "set_rng_state", _set_cpu_rng_state)
    swap.set_attr(torch.cuda, "manual_seed", _seed_cpu_generator)
    swap.set_attr(random_module, "_get_cuda_rng_state", _get_cpu_rng_state)
    swap.set_attr(random_module, "_set_cuda_rng_state", _set_cpu_rng_state)
    tracker_logger = logging.getLogger(_RANDOM_MODULE)
    warning_filter = _DropRngWarning()
    tracker_logger.addFilter(warning_filter)

    def undo() -> None:
        tracker_logger.removeFilter(warning_filter)
        swap.restore()

    return undo


# --- curdev --------------------------------------------------------------------------------------


def _cpu_current_device() -> str:
    """Stands in for ``torch.cuda.current_device()``; Megatron passes the result as a device."""
    return "cpu"


@_cpu_patch("curdev", "torch.cuda.current_device() returns 'cpu'")
def apply_curdev() -> Undo:
    """Make ``torch.cuda.current_device()`` return ``"cpu"``.

    Needed by ``distributed.param_and_grad_buffer._ParamAndGradBuffer`` (built by
    ``DistributedDataParallel.__init__``), which allocates its buffers with
    ``device=torch.cuda.current_device()``; Megatron uses the call as a ``device=`` argument
    throughout.
    """
    swap = AttributeSwap()
    swap.set_attr(torch.cuda, "current_device", _cpu_current_device)
    return swap.restore


# --- factory -------------------------------------------------------------------------------------

FACTORY_FUNCTIONS = (
    "arange",
    "as_tensor",
    "empty",
    "empty_like",
    "empty_strided",
    "eye",
    "full",
    "full_like",
    "linspace",
    "logspace",
    "ones",
    "ones_like",
    "rand",
    "rand_like",
    "randint",
    "randint_like",
    "randn",
    "randn_like",
    "randperm",
    "tensor",
    "zeros",
    "zeros_like",
)
"""The ``torch`` functions whose ``device=`` keyword the ``factory`` patch rewrites."""


def is_cuda_device(device: object) -> bool:
    """True for ``"cuda"``, ``"cuda:N"``, ``torch.device("cuda"...)`` and a bare device index."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device == "cuda" or device.startswith("cuda:")
    return isinstance(device, int) and not isinstance(device, bool)


def _on_cpu(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Wrap a torch factory function so that a CUDA ``device=`` keyword becomes ``"cpu"``."""

    @functools.wraps(factory)
    def create(*args: Any, **kwargs: Any) -> torch.Tensor:
        if is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return create


def _stay_on_cpu(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Stands in for ``Tensor.cuda()``: the tensor is already where the work runs."""
    return self


@_cpu_patch("factory", "torch factory functions map device='cuda' to CPU; Tensor.cuda() is a no-op")
def apply_factory() -> Undo:
    """Create ``device="cuda"`` tensors on CPU, and make ``Tensor.cuda()`` return the tensor.

    Needed by ``optimizer.optimizer.FP32Optimizer.__init__``
    (``torch.tensor([1.0], device='cuda')``), the schedules in
    ``pipeline_parallel.schedules`` (``torch.zeros([], dtype=torch.int, device="cuda")``),
    ``optimizer.clip_grads.get_grad_norm_fp32``, ``MegatronOptimizer.has_grad_norm_group``
    (0.19) and ``transformer.utils.get_default_causal_mask`` (``torch.ones(..., device="cuda")``).
    ``Tensor.cuda()`` is called by
    ``LanguageModule.setup_embeddings_and_output_layer`` (tied embeddings with pipeline
    parallelism) and ``MegatronOptimizer.restore_from_cpu``.
    """
    swap = AttributeSwap()
    for name in FACTORY_FUNCTIONS:
        swap.set_attr(torch, name, _on_cpu(getattr(torch, name)))
    swap.set_attr(torch.Tensor, "cuda", _stay_on_cpu)
    return swap.restore


# --- sync ----------------------------------------------------------------------------------------


def _nothing_to_wait_for(device: Any = None) -> None:
    """Stands in for ``torch.cuda.synchronize``: CPU work has already finished."""


@_cpu_patch("sync", "torch.cuda.synchronize() is a no-op")
def apply_sync() -> Undo:
    """Make ``torch.cuda.synchronize()`` a no-op.

    Needed by ``pipeline_parallel.p2p_communication`` (``_communicate`` synchronizes after the
    batched send/recv) and ``timers.Timer.start/stop``. ``torch.cuda.empty_cache()`` already
    does nothing on a CPU-only build and is left alone.
    """
    swap = AttributeSwap()
    swap.set_attr(torch.cuda, "synchronize", _nothing_to_wait_for)
    return swap.restore


# --- stream --------------------------------------------------------------------------------------


class CpuEvent:
    """Stands in for ``torch.cuda.Event``: recorded on a synchronous stream, it is complete."""

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def wait(self, stream: object = None) -> None:
        """Nothing to wait for."""

    def query(self) -> bool:
        """The work before it is complete."""
        return True


class CpuStream:
    """Stands in for ``torch.cuda.Stream``: CPU work is synchronous, so every wait is met."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.device = torch.device("cpu")
        self.priority = priority

    def wait_stream(self, stream: object) -> None:
        """Nothing to wait for."""

    def wait_event(self, event: object) -> None:
        """Nothing to wait for."""

    def record_event(self, event: object = None) -> object:
        """``event``, or a new complete one (as torch's returns a new event when given none:
        the alltoall token dispatcher of MoE layers synchronizes on it)."""
        return CpuEvent() if event is None else event

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def query(self) -> bool:
        """All work is complete."""
        return True


_CPU_STREAM = CpuStream()


def _cpu_stream(device: Any = None) -> CpuStream:
    """Stands in for ``torch.cuda.current_stream`` / ``default_stream``."""
    return _CPU_STREAM


def _use_stream(stream: object) -> contextlib.AbstractContextManager[None]:
    """Stands in for ``torch.cuda.stream``: there is only one stream."""
    return contextlib.nullcontext()


@_cpu_patch("stream", "torch.cuda.Stream/current_stream/default_stream/stream are CPU stand-ins")
def apply_stream() -> Undo:
    """Replace the CUDA stream API with synchronous stand-ins.

    Needed by ``_ParamAndGradBucketGroup.start_grad_sync``, which in 0.19 waits on
    ``torch.cuda.current_stream()`` for events of CUDA-graph replays before every gradient
    reduction (any DDP config); also by ``DistributedDataParallel.__init__``
    (``torch.cuda.Stream(...)``) and ``finish_grad_sync`` (``torch.cuda.stream``,
    ``default_stream().wait_stream``) when ``num_distributed_optimizer_instances > 1``, and by
    Megatron-LM's ``training.get_model``, and by the MoE ``alltoall`` token dispatcher
    (``_maybe_dtoh_and_synchronize``: a side stream, an event recorded on it and synchronized).
    """
    swap = AttributeSwap()
    swap.set_attr(torch.cuda, "Stream", CpuStream)
    swap.set_attr(torch.cuda, "current_stream", _cpu_stream)
    swap.set_attr(torch.cuda, "default_stream", _cpu_stream)
    swap.set_attr(torch.cuda, "stream", _use_stream)
    return swap.restore


# --- clip ----------------------------------------------------------------------------------------


def clip_grad_by_total_norm_cpu(
    parameters: list[torch.Tensor] | torch.Tensor,
    max_norm: float,
    total_norm: float,
    use_decoupled_grad: bool = False,
) -> None:
    """Scale gradients in place by ``max_norm / total_norm`` when that is below 1.

    Same arithmetic as Megatron's ``clip_grad_by_total_norm_fp32`` (grad * coefficient, in
    place), with a dtype check instead of its ``'torch.cuda.FloatTensor'`` type-string check.
    """
    from megatron.core.utils import to_local_if_dtensor

    params = [parameters] if isinstance(parameters, torch.Tensor) else parameters
    grads = []
    for param in params:
        grad = getattr(param, "decoupled_grad", None) if use_decoupled_grad else param.grad
        if grad is None:
            continue
        allowed = (torch.float32, torch.bfloat16) if use_decoupled_grad else (torch.float32,)
        if grad.dtype not in allowed:
            raise TypeError(f"gradient clipping expects {allowed} gradients, got {grad.dtype}")
        grads.append(to_local_if_dtensor(grad).detach())
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


@_cpu_patch("clip", "gradient clipping without the 'torch.cuda.FloatTensor' assertion")
def apply_clip() -> Undo:
    """Replace ``clip_grad_by_total_norm_fp32`` with :func:`clip_grad_by_total_norm_cpu`.

    Needed by ``MegatronOptimizer.clip_grad_norm`` (from ``optimizer.step`` when
    ``clip_grad > 0``), which calls ``optimizer.optimizer.clip_grad_by_total_norm_fp32``; that
    asserts ``param.grad.type() == 'torch.cuda.FloatTensor'``. Both the name bound in
    ``megatron.core.optimizer.optimizer`` and the one in ``megatron.core.optimizer.clip_grads``
    are replaced. While ``typestr`` is applied that assertion holds anyway; this patch keeps
    clipping independent of that type-string stand-in (and of Apex's fused scaling).
    """
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.optimizer as optimizer

    swap = AttributeSwap()
    swap.set_attr(optimizer, "clip_grad_by_total_norm_fp32", clip_grad_by_total_norm_cpu)
    swap.set_attr(clip_grads, "clip_grad_by_total_norm_fp32", clip_grad_by_total_norm_cpu)
    return swap.restore


# --- typestr -------------------------------------------------------------------------------------

CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}
"""What ``Tensor.type()`` reports for CPU tensors of these dtypes while ``typestr`` is applied."""


def _cuda_type_name(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``Tensor.type`` so that, with no arguments, CPU float tensors report a CUDA type."""

    @functools.wraps(original)
    def type_(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs and self.device.type == "cpu":
            name = CUDA_TYPE_NAMES.get(self.dtype)
            if name is not None:
                return name
        return original(self, *args, **kwargs)

    return type_


@_cpu_patch("typestr", "Tensor.type() reports torch.cuda.*Tensor for CPU float tensors")
def apply_typestr() -> Undo:
    """Make ``Tensor.type()`` (no arguments) name the CUDA type for CPU float32/16/bf16 tensors.

    Needed only with ``use_distributed_optimizer=True``:
    ``DistributedOptimizer._build_model_and_main_param_groups`` raises ``TypeError`` unless each
    parameter's ``type()`` is ``torch.cuda.FloatTensor``, ``HalfTensor`` or ``BFloat16Tensor``.
    ``Tensor.type(dtype)`` (a cast) is unchanged.
    """
    swap = AttributeSwap()
    swap.set_attr(torch.Tensor, "type", _cuda_type_name(torch.Tensor.type))
    return swap.restore


# --- optstate ------------------------------------------------------------------------------------


def _with_state_for_loading(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``DistributedOptimizer.sharded_state_dict`` so that, when it is built for loading,
    an optimizer without state gets one first."""

    @functools.wraps(original)
    def sharded_state_dict(self: Any, *args: Any, **kwargs: Any) -> Any:
        loading = kwargs["is_loading"] if "is_loading" in kwargs else (
            len(args) > 1 and bool(args[1]))
        if loading and len(self.optimizer.state) == 0:
            self._init_optimizer_states_with_dummy_values()
        return original(self, *args, **kwargs)

    return sharded_state_dict


@_cpu_patch("optstate", "a distributed optimizer without state makes one before it loads a "
            "checkpoint in the torch_dist format")
def apply_optstate() -> Undo:
    """Make ``DistributedOptimizer.sharded_state_dict(..., is_loading=True)`` create the
    optimizer's state first when it has none.

    Needed by Megatron-LM's ``load_checkpoint`` of a ``--use-distributed-optimizer`` checkpoint
    in its default format (``torch_dist``) at start-up: building the sharded state dict calls
    ``state_dict()``, which without TE or Apex (torch's Adam, as on CPU) asserts that the
    optimizer's state has exactly one step counter, and torch's Adam has no state before its
    first step. The state comes from Megatron-Core's own dummy step
    (``_init_optimizer_states_with_dummy_values``, which it runs itself before Megatron-FSDP
    loads); the load then overwrites it and the parameters it moved. Nothing changes for an
    optimizer that has state, or outside a load.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    swap = AttributeSwap()
    swap.set_attr(DistributedOptimizer, "sharded_state_dict",
                  _with_state_for_loading(DistributedOptimizer.sharded_state_dict))
    return swap.restore



# --- moesplits -----------------------------------------------------------------------------------


def _host_copy(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False,
                                 record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return maybe_move_tensor_to_cpu


@_cpu_patch("moesplits", "the MoE alltoall dispatcher's split sizes become host arrays, as "
            "after its device-to-host copy")
def apply_moesplits() -> Undo:
    """Make ``maybe_move_tensor_to_cpu(tensor, as_numpy=True)`` return a NumPy array for a
    tensor already on the host, as it does for one on a GPU after the copy.

    Needed by the ``alltoall`` token dispatcher of MoE layers
    (``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize``): it moves the expert-parallel
    split sizes to the host as NumPy arrays, which ``torch.distributed.all_to_all_single``
    accepts as sizes; a host tensor is left a tensor, and ``all_to_all_single`` refuses it
    ("incompatible function arguments"). Only the dispatcher's module name is replaced.
    """
    token_dispatcher = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    swap = AttributeSwap()
    swap.set_attr(token_dispatcher, "maybe_move_tensor_to_cpu",
                  _host_copy(token_dispatcher.maybe_move_tensor_to_cpu))
    return swap.restore
