"""Tests of the patch registry and of the ``megatron-cpu`` shims.

The first part exercises the registry with small patches on plain objects and on real installed
distributions (``packaging``, ``torch``). The last test applies the ``megatron-cpu`` group, trains a
tiny GPTModel with Megatron's DDP, optimizer and schedule on a one-rank gloo group, and checks
that everything is put back afterwards.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import math
import os
import subprocess
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from support.rank_jobs import init_mover_group, rank_job, stop_forkserver_after_module  # noqa: F401

from mover_plugin.errors import PatchError, UnsupportedVersionError
from mover_plugin.patches import (
    AppliedPatches,
    AttributeSwap,
    Patch,
    PatchRegistry,
    apply_patches,
    available_patches,
    megatron_cpu,
    patch_groups,
)

PACKAGING_VERSION = importlib.metadata.version("packaging")


def _setting_patch(
    name: str,
    target: object,
    attr: str,
    value: object,
    *,
    distribution: str = "packaging",
    tested_versions: str = ">=1",
    condition: Callable[[], bool] = lambda: True,
    groups: tuple[str, ...] = ("fake",),
) -> Patch:
    def apply() -> Callable[[], None]:
        swap = AttributeSwap()
        swap.set_attr(target, attr, value)
        return swap.restore

    return Patch(
        name=name,
        distribution=distribution,
        tested_versions=tested_versions,
        description=f"sets {attr}",
        apply=apply,
        condition=condition,
        groups=groups,
    )


@pytest.fixture
def target() -> types.SimpleNamespace:
    return types.SimpleNamespace(alpha=object(), beta=object())


# --- registry logic ------------------------------------------------------------------------------


def test_apply_and_revert_restore_the_original_objects(target: types.SimpleNamespace) -> None:
    registry = PatchRegistry()
    alpha, beta = target.alpha, target.beta
    registry.register(_setting_patch("a", target, "alpha", "A"))
    registry.register(_setting_patch("b", target, "beta", "B"))
    registry.register(_setting_patch("new", target, "gamma", "G"))

    applied = registry.apply("fake")
    assert applied.names == ("a", "b", "new")
    assert (target.alpha, target.beta, target.gamma) == ("A", "B", "G")
    assert registry.active() == ("a", "b", "new")

    applied.revert()
    assert target.alpha is alpha and target.beta is beta
    assert not hasattr(target, "gamma")
    assert not applied.active and registry.active() == ()
    applied.revert()  # a second revert does nothing
    assert target.alpha is alpha


def test_inherited_attribute_is_removed_again_not_shadowed() -> None:
    class Base:
        def method(self) -> str:
            return "base"

    class Child(Base):
        pass

    registry = PatchRegistry()
    registry.register(_setting_patch("m", Child, "method", lambda self: "patched"))
    with registry.apply("m"):
        assert Child().method() == "patched"
    assert "method" not in vars(Child)
    assert Child.method is Base.method


def test_context_manager_reverts_on_exit_and_on_error(target: types.SimpleNamespace) -> None:
    registry = PatchRegistry()
    alpha = target.alpha
    registry.register(_setting_patch("a", target, "alpha", "A"))
    with registry.apply(["a"]) as applied:
        assert isinstance(applied, AppliedPatches) and applied.active
        assert target.alpha == "A"
    assert target.alpha is alpha and not applied.active

    with pytest.raises(RuntimeError, match="boom"):
        with registry.apply("a"):
            raise RuntimeError("boom")
    assert target.alpha is alpha and registry.active() == ()


def test_applying_twice_is_an_error_until_reverted(target: types.SimpleNamespace) -> None:
    registry = PatchRegistry()
    registry.register(_setting_patch("a", target, "alpha", "A"))
    first = registry.apply("a")
    with pytest.raises(PatchError, match="'a' is already applied"):
        registry.apply("fake")
    assert target.alpha == "A"
    first.revert()
    with registry.apply("a"):
        assert target.alpha == "A"


def test_version_outside_range_names_patch_version_and_range(
    target: types.SimpleNamespace,
) -> None:
    registry = PatchRegistry()
    alpha, beta = target.alpha, target.beta
    registry.register(_setting_patch("fine", target, "alpha", "A", tested_versions=">=1"))
    registry.register(_setting_patch("old", target, "beta", "B", tested_versions=">=0.1,<1"))

    with pytest.raises(UnsupportedVersionError) as caught:
        registry.apply("fake")
    message = str(caught.value)
    assert "'old'" in message
    assert PACKAGING_VERSION in message
    assert ">=0.1,<1" in message
    # All-or-nothing: the first patch, although in range, was not applied either.
    assert target.alpha is alpha and target.beta is beta
    assert registry.active() == ()


def test_version_check_accepts_local_versions_and_rejects_outside() -> None:
    torch_version = importlib.metadata.version("torch")
    inside = _setting_patch("t", object(), "x", 1, distribution="torch", tested_versions=">=2.4")
    assert inside.check_version() == torch_version
    outside = _setting_patch("t", object(), "x", 1, distribution="torch", tested_versions="<2")
    with pytest.raises(UnsupportedVersionError, match=r"torch <2"):
        outside.check_version()


def test_missing_distribution_is_a_clear_patch_error(target: types.SimpleNamespace) -> None:
    registry = PatchRegistry()
    alpha = target.alpha
    registry.register(
        _setting_patch("ghost", target, "alpha", "A", distribution="no-such-distribution-xyz")
    )
    expected = "'ghost'.*'no-such-distribution-xyz'.*not installed"
    with pytest.raises(PatchError, match=expected) as caught:
        registry.apply("ghost")
    assert not isinstance(caught.value, UnsupportedVersionError)
    assert target.alpha is alpha


def test_failing_apply_reverts_the_patches_already_applied(target: types.SimpleNamespace) -> None:
    def explode() -> Callable[[], None]:
        raise ValueError("cannot patch")

    registry = PatchRegistry()
    alpha = target.alpha
    registry.register(_setting_patch("a", target, "alpha", "A"))
    registry.register(
        Patch("broken", "packaging", ">=1", "always fails", explode, groups=("fake",))
    )
    with pytest.raises(PatchError, match="'broken' failed") as caught:
        registry.apply("fake")
    assert isinstance(caught.value.__cause__, ValueError)
    assert target.alpha is alpha and registry.active() == ()


def test_false_condition_skips_without_checking_the_distribution(
    target: types.SimpleNamespace,
) -> None:
    registry = PatchRegistry()
    alpha = target.alpha
    registry.register(
        _setting_patch(
            "gpu-only",
            target,
            "alpha",
            "A",
            distribution="no-such-distribution-xyz",
            condition=lambda: False,
        )
    )
    with registry.apply("gpu-only") as applied:
        assert applied.names == () and applied.skipped == ("gpu-only",)
        assert target.alpha is alpha


def test_unknown_names_duplicates_and_bad_ranges(target: types.SimpleNamespace) -> None:
    registry = PatchRegistry()
    registry.register(_setting_patch("a", target, "alpha", "A"))
    registry.register(_setting_patch("b", target, "beta", "B", groups=("other",)))
    assert [p.name for p in registry.resolve(["b", "fake", "a"])] == ["a", "b"]
    assert registry.groups() == {"fake": ("a",), "other": ("b",)}
    with pytest.raises(PatchError, match="unknown patch or group 'nope'"):
        registry.apply(["a", "nope"])
    assert registry.active() == ()
    with pytest.raises(PatchError, match="already registered"):
        registry.register(_setting_patch("a", target, "alpha", "A"))
    with pytest.raises(PatchError, match="invalid version range"):
        _setting_patch("c", target, "alpha", "A", tested_versions="about 0.16")


def test_a_nested_apply_sees_the_patches_its_outer_apply_has_applied(
    target: types.SimpleNamespace,
) -> None:
    # An apply function that imports a module can trigger a nested apply (the worker command's
    # import hook); it must see what the outer call applied so far, and apply nothing twice.
    registry = PatchRegistry()
    registry.register(_setting_patch("first", target, "alpha", "A"))
    nested: list[tuple[str, ...]] = []

    def apply_second() -> Callable[[], None]:
        inner = registry.apply([name for name in ("first",) if name not in registry.active()])
        nested.append(inner.names)
        with pytest.raises(PatchError, match="already applied"):
            registry.apply(["first"])
        return lambda: None

    registry.register(Patch("second", "packaging", ">=1", "nests", apply_second,
                            groups=("fake",)))
    applied = registry.apply("fake")
    assert nested == [()] and applied.names == ("first", "second")
    assert registry.active() == ("first", "second") and target.alpha == "A"
    applied.revert()
    assert registry.active() == ()


def test_swap_restores_mapping_entries() -> None:
    mapping = {"kept": 1}
    swap = AttributeSwap()
    swap.set_item(mapping, "kept", 2)
    swap.set_item(mapping, "added", 3)
    assert mapping == {"kept": 2, "added": 3}
    swap.restore()
    assert mapping == {"kept": 1}


# --- the megatron-cpu group, without Megatron ----------------------------------------------------


def test_megatron_cpu_group_is_registered_with_its_range() -> None:
    group = patch_groups()[megatron_cpu.GROUP]
    assert group == ("notriton", "rng", "curdev", "factory", "sync", "stream", "clip", "typestr",
                     "optstate", "moesplits")
    patches = {p.name: p for p in available_patches()}
    for name in group:
        assert patches[name].distribution == "megatron-core"
        assert patches[name].tested_versions == ">=0.19.0,<0.20"
        assert patches[name].description and patches[name].apply.__doc__
        wanted = (importlib.util.find_spec("triton") is None if name == "notriton"
                  else not torch.cuda.is_available())
        assert patches[name].condition() is wanted


def test_importing_the_package_applies_nothing_and_imports_no_megatron() -> None:
    code = (
        "import sys, torch\n"
        "before = (torch.zeros, torch.cuda.current_device, torch.Tensor.type)\n"
        "import mover_plugin.patches as p\n"
        "import mover_plugin.patches.megatron_cpu\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'megatron']\n"
        "assert before == (torch.zeros, torch.cuda.current_device, torch.Tensor.type)\n"
        "assert p.active_patches() == ()\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


def test_factory_and_typestr_rewrite_only_what_they_should() -> None:
    pytest.importorskip("megatron.core")
    if torch.cuda.is_available():
        pytest.skip("the megatron-cpu shims apply only without CUDA")
    with apply_patches(["factory", "typestr"]):
        for device in ("cuda", "cuda:1", torch.device("cuda", 0), 0):
            assert torch.zeros(2, device=device).device.type == "cpu"
        assert torch.full((1,), 3.0, device="cuda").item() == 3.0
        x = torch.ones(2)
        assert x.cuda() is x
        assert x.type() == "torch.cuda.FloatTensor"
        assert x.long().type() == "torch.LongTensor"
        assert x.type(torch.float64).dtype == torch.float64
    assert torch.ones(2).type() == "torch.FloatTensor"
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")


# --- the megatron-cpu group on a real Megatron training step -------------------------------------

VOCAB, SEQ, MICRO_BATCH, MICRO_BATCHES, STEPS, SEED = 64, 16, 2, 2, 2, 123
_ABSENT = object()


def _patched_attributes() -> dict[tuple[str, str], object]:
    """Every attribute the megatron-cpu group replaces, read from the owner's own ``__dict__``."""
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.optimizer as optimizer
    import megatron.core.tensor_parallel.random as random

    owners: dict[str, tuple[object, tuple[str, ...]]] = {
        "torch.cuda": (
            torch.cuda,
            (
                "get_rng_state",
                "set_rng_state",
                "manual_seed",
                "current_device",
                "synchronize",
                "Stream",
                "current_stream",
                "default_stream",
                "stream",
            ),
        ),
        "torch": (torch, megatron_cpu.FACTORY_FUNCTIONS),
        "torch.Tensor": (torch.Tensor, ("cuda", "type")),
        "random": (random, ("_get_cuda_rng_state", "_set_cuda_rng_state")),
        "optimizer": (optimizer, ("clip_grad_by_total_norm_fp32",)),
        "clip_grads": (clip_grads, ("clip_grad_by_total_norm_fp32",)),
    }
    return {
        (label, name): vars(owner).get(name, _ABSENT)
        for label, (owner, names) in owners.items()
        for name in names
    }


def _build(distributed_optimizer: bool) -> tuple[torch.nn.Module, object, object]:
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    model_parallel_cuda_manual_seed(SEED)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
        hidden_dropout=0.1,
        attention_dropout=0.1,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
    )
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=distributed_optimizer, overlap_grad_reduce=distributed_optimizer
    )
    ddp = DistributedDataParallel(config, ddp_config, model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=1e-2,
            clip_grad=1.0,
            use_distributed_optimizer=distributed_optimizer,
        ),
        [ddp],
    )
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    return ddp, optimizer, config


def _forward_step(
    data_iterator: Iterator[torch.Tensor], model: torch.nn.Module
) -> tuple[torch.Tensor, Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]]:
    """One micro-batch: next-token-is-token+1 labels; returns per-token loss and a loss_func."""
    tokens = next(data_iterator)
    positions = torch.arange(SEQ).expand(tokens.shape[0], -1)
    per_token_loss = model(tokens, positions, None, labels=(tokens + 1) % VOCAB)

    def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = output.float().mean()
        # The schedule divides the returned loss in place by the number of micro-batches,
        # so the logged value must be a copy.
        return loss, {"lm loss": loss.detach().clone()}

    return per_token_loss, loss_func


def _train(
    distributed_optimizer: bool,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[float]]:
    """Build a fresh model from SEED and train it; return parameters before, after, and losses."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ddp, optimizer, _ = _build(distributed_optimizer)
    before = [p.detach().clone() for p in ddp.parameters()]
    data = torch.Generator().manual_seed(0)
    losses: list[float] = []
    for _ in range(STEPS):
        batches = [
            torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=data)
            for _ in range(MICRO_BATCHES)
        ]
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        reduced = get_forward_backward_func()(
            forward_step_func=_forward_step,
            data_iterator=iter(batches),
            model=[ddp],
            num_microbatches=MICRO_BATCHES,
            seq_length=SEQ,
            micro_batch_size=MICRO_BATCH,
            forward_only=False,
        )
        succeeded, grad_norm, _ = optimizer.step()
        assert succeeded and math.isfinite(grad_norm)
        losses.extend(r["lm loss"].item() for r in reduced)
    return before, [p.detach().clone() for p in ddp.parameters()], losses


def _check_rng_tracker() -> None:
    """Named tracker states are distinct, and fork() swaps the CPU generator in and out."""
    from megatron.core.tensor_parallel.random import (
        get_cuda_rng_tracker,
        model_parallel_cuda_manual_seed,
    )

    model_parallel_cuda_manual_seed(SEED)
    tracker = get_cuda_rng_tracker()
    states = tracker.get_states()
    assert set(states) == {"data-parallel-rng", "model-parallel-rng", "expert-parallel-rng"}
    assert not torch.equal(states["model-parallel-rng"], states["data-parallel-rng"])
    assert not torch.equal(states["model-parallel-rng"], states["expert-parallel-rng"])

    outside = torch.get_rng_state()
    with tracker.fork():
        assert torch.equal(torch.get_rng_state(), states["model-parallel-rng"])
        torch.rand(8)
    assert torch.equal(torch.get_rng_state(), outside)
    assert not torch.equal(tracker.get_states()["model-parallel-rng"], states["model-parallel-rng"])


def _check_dropout_replays_after_restoring_rng() -> None:
    """Restoring torch.get_rng_state() and the tracker states replays dropout bit for bit."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    ddp, _, _ = _build(distributed_optimizer=False)
    ddp.train()
    tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(SEQ).expand(MICRO_BATCH, -1)
    tracker = get_cuda_rng_tracker()
    cpu_state, tracker_states = torch.get_rng_state(), tracker.get_states()
    with torch.no_grad():
        first = ddp(tokens, positions, None)
        again = ddp(tokens, positions, None)
        torch.set_rng_state(cpu_state)
        # set_states adopts the dict it is given, and fork() writes into it: pass a copy.
        tracker.set_states(dict(tracker_states))
        replay = ddp(tokens, positions, None)
    assert not torch.equal(first, again)  # dropout is active
    assert torch.equal(first, replay)


def _check_rng_snapshot_goes_back_every_time() -> None:
    """An iteration dropped twice (a second rank lost while it is redone) starts both times
    from the snapshot taken at its start: restoring it does not tie it to the live RNG."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    from mover_plugin.megatron.checkpoint import capture_rng_state, restore_rng_state

    tracker = get_cuda_rng_tracker()
    snapshot = capture_rng_state()
    draws = []
    for _ in range(3):
        restore_rng_state(snapshot)
        with tracker.fork():
            draws.append(torch.rand(8))
    assert torch.equal(draws[0], draws[1]) and torch.equal(draws[1], draws[2])


def test_megatron_cpu_group_trains_deterministically_and_reverts() -> None:
    pytest.importorskip("megatron.core")
    if torch.cuda.is_available():
        pytest.skip("the megatron-cpu shims apply only without CUDA")
    import torch.distributed as dist
    from megatron.core import parallel_state

    assert not dist.is_initialized(), "another test left a default process group behind"
    originals = _patched_attributes()
    tracker_logger = logging.getLogger("megatron.core.tensor_parallel.random")
    filters_before = list(tracker_logger.filters)
    level_before = tracker_logger.level

    applied = apply_patches("megatron-cpu")
    try:
        skipped = ("notriton",) if megatron_cpu.triton_missing() is False else ()
        assert applied.skipped == skipped
        assert applied.names == tuple(name for name in patch_groups()["megatron-cpu"]
                                      if name not in skipped)
        assert torch.cuda.current_device() == "cpu"
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        parallel_state.initialize_model_parallel(1, 1)

        _check_rng_tracker()
        _check_dropout_replays_after_restoring_rng()
        _check_rng_snapshot_goes_back_every_time()

        before, after, losses = _train(distributed_optimizer=False)
        assert all(math.isfinite(loss) for loss in losses)
        assert abs(losses[0] - math.log(VOCAB)) < 0.5  # an untrained model is near uniform
        assert any(not torch.equal(b, a) for b, a in zip(before, after, strict=True))

        _, after_again, losses_again = _train(distributed_optimizer=False)
        assert losses_again == losses
        assert all(torch.equal(a, b) for a, b in zip(after, after_again, strict=True))

        # The distributed optimizer needs the typestr patch. Its gradient norm is summed in
        # another order, so parameters agree to well below one Adam step (lr 1e-2), not bitwise.
        _, after_distributed, _ = _train(distributed_optimizer=True)
        for a, b in zip(after, after_distributed, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
    finally:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
        applied.revert()

    restored = _patched_attributes()
    changed = [key for key, value in originals.items() if restored[key] is not value]
    assert changed == []
    assert tracker_logger.filters == filters_before and tracker_logger.level == level_before
    # No notriton stand-in outlives the revert (with triton installed, another test of this
    # process may have imported the real module, which is not a leftover of the patch).
    left_behind = [name for name in megatron_cpu.TRITON_MODULES
                   if "mover_plugin notriton" in (getattr(sys.modules.get(name), "__doc__", None)
                                                  or "")]
    assert left_behind == []
    # A CPU build of torch asserts; a CUDA build on a machine without a GPU finds no driver.
    with pytest.raises((AssertionError, RuntimeError),
                       match="not compiled with CUDA|NVIDIA driver"):
        torch.cuda.current_device()


# --- the megatron-lm-cpu group and the megatron-lm hooks (Megatron-LM's megatron.training) -------

_LM_CPU_CHECK = """
import sys, torch
{block_triton}
from mover_plugin.patches import apply_patches, patch_groups
from mover_plugin.patches import megatron_lm_cpu as lm
originals = (torch.cuda.device_count, torch.cuda.set_device)
applied = apply_patches(["megatron-cpu", "megatron-lm-cpu"])
import megatron.training.training as training, megatron.training.initialize as initialize
import megatron.training.arguments as arguments, megatron.core.datasets.utils as utils
assert torch.cuda.device_count() == 1 and not torch.cuda.is_available()
assert training.initialize_megatron.__wrapped__ is initialize.initialize_megatron
assert utils.compile_helpers is lm.use_prebuilt_helpers
assert arguments.get_device_arch_version() == 0
print("APPLIED", ",".join(applied.names))
print("SKIPPED", ",".join(applied.skipped))
print("STAND_IN", sys.modules["megatron.core.transformer.moe.ops.paged_stash"].__doc__)
applied.revert()
assert (torch.cuda.device_count, torch.cuda.set_device) == originals
assert training.initialize_megatron is initialize.initialize_megatron
assert utils.compile_helpers.__module__ == "megatron.core.datasets.utils"
print("REVERTED")
"""


def _run_lm_cpu_check(block_triton: bool) -> subprocess.CompletedProcess:
    code = _LM_CPU_CHECK.format(block_triton="sys.modules['triton'] = None" if block_triton
                                else "")
    # With the NVML-based check (DeepSpeed's import sets it; children inherit it)
    # torch.cuda.is_available() asks device_count(), which the stand-in answers with 1.
    environment = {**os.environ, "PYTORCH_NVML_BASED_CUDA_CHECK": "1" if block_triton else "0"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=180, env=environment)


def test_megatron_lm_cpu_group_applies_before_megatron_training_and_reverts() -> None:
    pytest.importorskip("megatron.training")
    if torch.cuda.is_available():
        pytest.skip("the megatron-lm-cpu shims apply only without CUDA")
    # Without triton (sys.modules entry None: find_spec says absent, import fails), the
    # stand-in takes the name of the one module that imports it.
    result = _run_lm_cpu_check(block_triton=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert ("APPLIED notriton,rng,curdev,factory,sync,stream,clip,typestr,optstate,moesplits,"
            "nocuda-assert,devcount,setdev,helpers,nowarmup,devarch") in result.stdout
    assert "Stand-in without triton" in result.stdout and "REVERTED" in result.stdout
    # With triton installed (as PyPI's CUDA build of torch brings it), notriton is skipped.
    if importlib.util.find_spec("triton") is not None:
        installed = _run_lm_cpu_check(block_triton=False)
        assert installed.returncode == 0, installed.stderr[-3000:]
        assert "SKIPPED notriton" in installed.stdout
    # Negative control: without the stand-in, megatron.training cannot be imported then.
    control = subprocess.run(
        [sys.executable, "-c", "import sys; sys.modules['triton'] = None\n"
         "import megatron.training"], capture_output=True, text=True, timeout=180)
    assert control.returncode != 0 and "triton" in control.stderr


def test_megatron_lm_hooks_pass_through_and_revert() -> None:
    pytest.importorskip("megatron.training")
    code = (
        "import sys\n"
        "from mover_plugin.patches.megatron_lm_hooks import MegatronLMHooks, install_hooks\n"
        "import megatron.training.arguments as a, megatron.training.training as t\n"
        "originals = (a.parse_args, a.parse_and_validate_args, t.train)\n"
        "class Flags(MegatronLMHooks):\n"
        "    def add_arguments(self, parser):\n"
        "        parser.add_argument('--extra-flag', type=int, default=0)\n"
        "        return parser\n"
        "applied = install_hooks(Flags())\n"
        "assert (a.parse_args, a.parse_and_validate_args, t.train) != originals\n"
        "sys.argv = ['x', '--extra-flag', '3', '--num-layers', '2']\n"
        "args = a.parse_args()\n"
        "print('EXTRA', args.extra_flag, args.num_layers)\n"
        "applied.revert()\n"
        "assert (a.parse_args, a.parse_and_validate_args, t.train) == originals\n"
        "install_hooks(MegatronLMHooks()).revert()\n"
        "print('REVERTED')\n"
    )
    result = _run_in_child(code)
    assert "EXTRA 3 2" in result.stdout and "REVERTED" in result.stdout


def test_deepspeed_hooks_see_every_entry_point_and_revert() -> None:
    """The hooks see a script's deepspeed.init_distributed, the one deepspeed.initialize makes
    through deepspeed.comm, deepspeed.initialize, and each new iterator of a DataLoader (made
    by the original, then used as it is); revert puts DeepSpeed's and torch's own back."""
    pytest.importorskip("deepspeed")
    code = (
        "import deepspeed, deepspeed.comm as comm\n"
        "from torch.utils.data import DataLoader, dataloader\n"
        "from mover_plugin.errors import PatchError\n"
        "from mover_plugin.patches.deepspeed_hooks import DeepSpeedHooks, install_hooks\n"
        "originals = (deepspeed.init_distributed, comm.init_distributed, deepspeed.initialize,"
        " dataloader._BaseDataLoaderIter.__init__)\n"
        "seen = []\n"
        "class Record(DeepSpeedHooks):\n"
        "    def around_loader_iterator(self, init, iterator, loader):\n"
        "        init(iterator, loader)\n"
        "        seen.append(('iterator', init is originals[3], loader.batch_size))\n"
        "    def around_init_distributed(self, init, *args, **kwargs):\n"
        "        seen.append(('init', init is originals[1], kwargs))\n"
        "    def around_initialize(self, initialize, *args, **kwargs):\n"
        "        seen.append(('initialize', initialize is originals[2], kwargs))\n"
        "        return 'engine', None, None, None\n"
        "applied = install_hooks(Record())\n"
        "try:\n"
        "    install_hooks(DeepSpeedHooks())\n"
        "except PatchError as error:\n"
        "    print('TWICE', error)\n"
        "deepspeed.init_distributed(dist_backend='gloo')\n"
        "comm.init_distributed(dist_backend='gloo')\n"
        "print('RESULT', deepspeed.initialize(model=None, config={})[0])\n"
        "print('BATCHES', [b.tolist() for b in DataLoader(list(range(4)), batch_size=3)])\n"
        "print('SEEN', seen)\n"
        "applied.revert()\n"
        "assert (deepspeed.init_distributed, comm.init_distributed, deepspeed.initialize,"
        " dataloader._BaseDataLoaderIter.__init__) == originals\n"
        "print('REVERTED')\n"
    )
    result = _run_in_child(code)
    assert "TWICE DeepSpeed hooks are installed already; revert them first" in result.stdout
    assert "RESULT engine" in result.stdout and "REVERTED" in result.stdout
    seen = result.stdout.split("SEEN ", 1)[1].splitlines()[0]
    assert "BATCHES [[0, 1, 2], [3]]" in result.stdout
    assert seen == ("[('init', True, {'dist_backend': 'gloo'}), "
                    "('init', True, {'dist_backend': 'gloo'}), "
                    "('initialize', True, {'model': None, 'config': {}}), "
                    "('iterator', True, 3)]")


def _run_in_child(code: str) -> subprocess.CompletedProcess:
    """Runs ``code`` in a fresh interpreter (patches of imported frameworks stay out of this
    one); fails the test unless it exits 0."""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


# --- the mover-comm group (torch's own functions on the mover backend's groups) ---------------


_MOVER_COMM_CHECK = """
import torch.distributed as dist, torch.distributed.distributed_c10d as c10d
from mover_plugin.patches import active_patches, apply_patches
original = dist.batch_isend_irecv
applied = apply_patches("mover-comm")
assert applied.names == ("batch-p2p",), applied.names
assert dist.batch_isend_irecv is c10d.batch_isend_irecv is not original
assert dist.batch_isend_irecv.__wrapped__ is original
applied.revert()
assert dist.batch_isend_irecv is original and c10d.batch_isend_irecv is original
from mover_plugin.comm import register_backend
register_backend()
print("ACTIVE", ",".join(active_patches()))
"""


def test_batch_p2p_patch_applies_reverts_and_comes_with_the_backend() -> None:
    """In a fresh process; what the patched function does is tested in tests/jobs/comm/test_comm.py
    (a mover group's batch is one work of its own)."""
    result = subprocess.run([sys.executable, "-c", _MOVER_COMM_CHECK], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ACTIVE batch-p2p"


def _signal_handler_gather(rank: int, store: Any, port: int) -> dict:
    """Megatron-LM's ``--exit-signal-handler`` all-gather on a ``mover`` world of two."""
    import torch.distributed as dist
    from megatron.training import dist_signal_handler

    init_mover_group(store, "gen0", rank, 2)
    report: dict[str, Any] = {}
    try:
        dist_signal_handler.get_device()
        report["unpatched"] = "no error"
    except RuntimeError:
        report["unpatched"] = "RuntimeError"
    with apply_patches("megatron-lm-backend"):
        report["device"] = str(dist_signal_handler.get_device())
        report["gathered"] = dist_signal_handler.all_gather_item(rank + 1, dtype=torch.int32)
    report["reverted"] = not hasattr(dist_signal_handler.get_device, "__wrapped__")
    dist.destroy_process_group()
    return report


def test_the_exit_signal_handler_s_all_gather_runs_on_the_mover_backend(
        stop_forkserver_after_module):
    """Megatron-LM's helper raises for any backend name but nccl and gloo; patched, it picks
    the device a mover group carries here (cpu without CUDA) and the all-gather runs."""
    with rank_job() as job:
        for rank in range(2):
            job.start(rank, _signal_handler_gather)
        reports = job.collect([0, 1])
    for report in reports.values():
        assert report == {"unpatched": "RuntimeError", "device": "cpu", "gathered": [1, 2],
                          "reverted": True}, report
