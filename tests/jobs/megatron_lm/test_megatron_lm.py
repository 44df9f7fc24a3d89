"""Megatron-LM's own training loop (``megatron.training``) under mover-launch and torchrun.

The entry script is ``examples/megatron_lm/pretrain_gpt.py`` (in the form of Megatron-LM's:
``parse_and_validate_args`` and ``pretrain``, a model provider, mock data); it calls nothing of
mover_plugin. On this machine (no CUDA) the CPU stand-ins come from the worker command
(``python -m mover_plugin.launch.run``), not from a flag.
"""

from __future__ import annotations

import json
import re
import sys
import textwrap
from pathlib import Path

import pytest

from support.gpt_jobs import digest, read_events
from support.megatron_lm_jobs import (
    ENV,
    FLAGS,
    GPT3_RECIPE,
    GPT_OSS_RECIPE,
    INTERLEAVED_PP4,
    MIXTRAL_RECIPE,
    PP2,
    SCRIPT,
    lm_losses,
    router_losses,
    mover_launch,
    torchrun,
)
from mover_plugin.testing import run_command
from mover_plugin.testing.megatron_lm import LLAMA3_RECIPE

def iterations_logged(output: str) -> int:
    return sum(1 for line in output.splitlines() if "| lm loss:" in line)


@pytest.fixture(scope="module")
def failure_free_pp2(tmp_path_factory):
    """TP1 x PP2 x DP2 under mover-launch, no interruption: the digest every resilient run of
    this module must end with."""
    result = mover_launch(*PP2, cwd=tmp_path_factory.mktemp("failure-free"))
    assert result.returncode == 0, result.output[-4000:]
    return result


@pytest.fixture(scope="module")
def failure_free_llama3(tmp_path_factory):
    """Megatron-LM's Llama 3 recipe scaled down (TP2 x DP2, the distributed optimizer with
    overlapped gradient reductions and parameter gathers, bf16), no interruption."""
    result = mover_launch(*LLAMA3_RECIPE, cwd=tmp_path_factory.mktemp("failure-free-llama"))
    assert result.returncode == 0, result.output[-4000:]
    return result


@pytest.mark.parametrize("layout", [PP2, LLAMA3_RECIPE], ids=["tp1-pp2", "llama3-recipe-tp2"])
def test_mover_launch_trains_megatron_lm_exactly_as_torchrun_does(layout, tmp_path,
                                                                  failure_free_pp2,
                                                                  failure_free_llama3):
    launched = failure_free_pp2 if layout is PP2 else failure_free_llama3
    assert launched.returncode == 0, launched.output[-4000:]
    reference = torchrun(*layout, cwd=tmp_path)
    assert reference.returncode == 0, reference.output[-4000:]
    assert iterations_logged(launched.stdout) == iterations_logged(reference.stdout) == 6
    assert "DP_REPLICAS identical" in launched.stdout
    assert digest(launched) == digest(reference)


@pytest.mark.parametrize("flags, launcher_flags, message", [
    (["--no-such-flag"], [], "unrecognized arguments: --no-such-flag"),
    (["--num-layers", "5"], [], "divisible by the pipeline-model-parallel size"),
    (["--resilient-failure-timeout-s", "100"], [],
     "--resilient-failure-timeout-s 100.0 must be below --resilient-collective-timeout-s"),
    ([], ["--policy", "resilient", "--standbys", "1"],
     "--policy resilient: pretrain_gpt.py does not run resilient; add --resilient"),
    (["--resilient", "--tensor-model-parallel-size", "2"], ["--policy", "resilient"],
     "--resilient needs a data-parallel twin for every rank, but the data-parallel size is 1"),
    (["--resilient", "--num-experts", "4", "--expert-model-parallel-size", "2"],
     ["--policy", "resilient"], "--resilient needs a twin for every rank's experts or the "
     "distributed optimizer (whose shard then carries them), but the expert-data-parallel size "
     "is 1 (data-parallel size 2 x tensor 1 / expert-model-parallel size 2 x "
     "expert-tensor-parallel size 1)"),
    (["--resilient", "--resilient-fault-tolerance", "4"], ["--policy", "resilient"],
     "--resilient-fault-tolerance 4 is too large: it needs 5 pipelines"),
    (["--resilient", "--resilient-template-profile", "/nonexistent/profile.json"],
     ["--policy", "resilient"], "/nonexistent/profile.json: no such profile"),
    (["--resilient", "--log-params-norm", "--resilient-fault-tolerance", "1"],
     ["--policy", "resilient"], "--resilient-fault-tolerance 1: this job cannot shrink onto "
     "pipeline templates (--log-params-norm), so a rank lost with no standby ready restarts it"),
    (["--save", "checkpoints"], [],
     "AssertionError in Megatron-LM's validate_args: assert args.save_interval is not None"),
], ids=["unknown-flag", "megatron-check", "resilience-setting", "policy-without-flag",
        "resilient-without-twin", "experts-without-twin", "templates-tolerance",
        "templates-profile", "templates-refused", "megatron-assertion"])
def test_bad_megatron_lm_input_stops_the_job_before_any_worker(flags, launcher_flags, message,
                                                               tmp_path):
    result = mover_launch(*PP2, *flags, launcher_flags=launcher_flags, cwd=tmp_path,
                          timeout_s=120)
    assert result.returncode == 2, result.output[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("mover-launch: error")]
    assert len(errors) == 1 and message in errors[0], result.stderr[-3000:]
    # Nothing trained: no worker started.
    assert "iteration" not in result.stdout


# --- --resilient: a standby takes a lost rank's place inside Megatron-LM's loop ---------------

RESILIENT = ["--resilient", "--log-interval", "2"]
"""A log interval above 1: Megatron-LM's logging collectives then run only every other
iteration, and a joiner must run them in step with the others."""


def resilient_run(tmp_path: Path, *, standbys: int = 1, injections=(), flags=(), layout=PP2,
                  nproc: int = 4):
    summary, events = tmp_path / "summary.json", tmp_path / "events.jsonl"
    launcher = ["--policy", "resilient", "--standbys", str(standbys), "--summary", str(summary),
                "--event-log", str(events), "--stop-grace-s", "2", *injections]
    result = mover_launch(*layout, *RESILIENT, *flags, launcher_flags=launcher, cwd=tmp_path,
                          nproc=nproc)
    assert result.returncode == 0, result.output[-5000:]
    return result, json.loads(summary.read_text()), read_events(events)


def switched_roles(events, generation: int) -> dict[int, str]:
    return {e["rank"]: e["role"] for e in events
            if e["event"] == "switched" and e["generation"] == generation}


def adopted_by_rank(events) -> dict[int, bool]:
    """For each joiner's rank, whether it trains with the objects its warm-up kept."""
    return {e["rank"]: e["adopted"] for e in events
            if e["event"] == "switched" and e["role"] == "joiner"}


def test_sigkilled_ranks_of_megatron_lm_are_replaced_in_place_exactly(tmp_path, failure_free_pp2):
    """Rank 0 (first stage) SIGKILLed at step 3, then rank 3 (last stage) at step 5, each
    replaced by one of two standbys."""
    kills = ((0, 3), (3, 5))
    result, summary, events = resilient_run(
        tmp_path, standbys=2,
        injections=[flag for rank, step in kills for flag in ("--inject-failure", f"{rank}:{step}")])
    assert digest(result) == digest(failure_free_pp2)
    assert summary["steps_completed"] == 6 and summary["restarts"] == 0
    assert len(summary["interruptions"]) == len(kills)
    for interruption, (rank, step) in zip(summary["interruptions"], kills):
        assert (interruption["kind"], interruption["recovery"], interruption["rank"]) == (
            "failure", "standby", rank)
        assert interruption["how"] == "signal SIGKILL" and interruption["downtime_s"] > 0
        assert interruption["step"] >= step
        # Every survivor left the failed iteration and kept its process; only the standby is
        # new.
        assert sorted(int(r) for r in interruption["left_s"]) == sorted({0, 1, 2, 3} - {rank})
        assert switched_roles(events, interruption["generation"]) == {
            r: "joiner" if r == rank else "survivor" for r in range(4)}
    assert not [e for e in events if e["event"] in ("restart", "fallback")]
    # The interrupted iterations were redone: each iteration is counted once in the log.
    assert "iteration        6/       6" in result.stdout
    # Each standby warmed up as both stages with Megatron-LM's own model set-up and
    # train_step, and trains with the objects of the lost rank's stage.
    warmed = [e for e in events if e["event"] == "standby_warmed"]
    assert len(warmed) == 2 and all(w["roles"] == w["kept"] == ["first", "last"]
                                    and w["shadow_iterations"] == 2
                                    and w["sandbox_operations"] > 0 for w in warmed)
    assert adopted_by_rank(events) == {0: True, 3: True}


def test_megatron_lm_survives_a_migration_and_a_hang_exactly(tmp_path, failure_free_pp2):
    """One run: rank 1 moved to a standby (mover migrate's request, injected at step 2), then
    rank 2 stopped with SIGSTOP at step 4 (found by its missing heartbeats, killed, replaced)."""
    result, summary, events = resilient_run(
        tmp_path, standbys=2, flags=["--resilient-failure-timeout-s", "3"],
        injections=["--inject-migration", "1:2", "--inject-failure", "2:4:SIGSTOP"])
    assert digest(result) == digest(failure_free_pp2)
    assert summary["steps_completed"] == 6 and summary["restarts"] == 0
    migration, hang = summary["interruptions"]
    assert (migration["kind"], migration["rank"], migration["recovery"]) == (
        "migration", 1, "standby")
    assert (hang["kind"], hang["rank"], hang["recovery"]) == ("hang", 2, "standby")
    assert switched_roles(events, migration["generation"]) == {
        r: "joiner" if r == 1 else "stayer" for r in range(4)}
    assert [e["how"] for e in events if e["event"] == "leaver_exit"] == ["exit code 0"]
    assert [e["rank"] for e in events if e["event"] == "hung"] == [2]
    assert not [e for e in events if e["event"] in ("restart", "fallback")]
    # Each standby warmed up as both stages; ranks 1 (first stage) and 2 (last stage) are
    # taken with the objects kept for their stage.
    assert [e["kept"] for e in events if e["event"] == "standby_warmed"] == [
        ["first", "last"]] * 2
    assert adopted_by_rank(events) == {1: True, 2: True}


def test_the_llama3_recipe_continues_in_place_from_the_peer_copy(tmp_path,
                                                                 failure_free_llama3):
    """Megatron-LM's Llama 3 recipe scaled down (the distributed optimizer with overlapped
    gradient reductions and parameter gathers, bf16 with bf16 reductions, per-token loss):
    rank 1 SIGKILLed at step 3 (its shard, the fp32 main copy included, comes from the copy its
    data-parallel peer keeps; the joiner's first iteration gathers the parameters with the
    others'), then rank 2 moved to a standby at step 4 (it hands over its own shard). Neither
    rolls back. A checkpoint in the recipe's format after every iteration: Megatron-LM gathers
    the parameters before it saves, so the ranks a migration keeps would skip the next
    gather that their joiner makes unless the switch drops their dispatch marks."""
    ckpt = str(tmp_path / "ckpt")
    result, summary, events = resilient_run(
        tmp_path, standbys=2, layout=LLAMA3_RECIPE,
        flags=["--log-interval", "1", "--save", ckpt, "--save-interval", "1"],
        injections=["--inject-failure", "1:3", "--inject-migration", "2:4"])
    assert digest(result) == digest(failure_free_llama3)
    losses = lm_losses(result.stdout)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    assert losses == lm_losses(failure_free_llama3.stdout)
    assert summary["steps_completed"] == 6 and summary["restarts"] == 0
    crash, migration = summary["interruptions"]
    assert (crash["kind"], crash["rank"], crash["recovery"]) == ("failure", 1, "standby")
    assert (migration["kind"], migration["rank"], migration["recovery"]) == (
        "migration", 2, "standby")
    assert crash["rolled_back_to"] is None and migration["rolled_back_to"] is None
    assert switched_roles(events, crash["generation"]) == {
        r: "joiner" if r == 1 else "survivor" for r in range(4)}
    assert not [e for e in events if e["event"] in ("rolled_back", "restart", "fallback")]
    # Every rank at its end reports the copy's host memory and its training thread's time in
    # it; the survivors exchanged after each of the 6 steps.
    copies = {e["rank"]: e for e in events if e["event"] == "peer_copy"}
    assert sorted(copies) == [0, 1, 2, 3] and all(c["bytes"] > 0 for c in copies.values())
    assert copies[0]["exchanges"] == copies[3]["exchanges"] == 6
    assert all(0 < c["critical_s"] < 60 for c in copies.values())
    # A sharded optimizer's kept objects fit only tensor- and data-parallel index 0: rank 1
    # (tensor-parallel index 1) and rank 2 (data-parallel index 1) are built on promotion.
    assert adopted_by_rank(events) == {1: False, 2: False}


def test_an_interleaved_pipeline_of_four_stages_survives_middle_stage_losses_exactly(tmp_path):
    """PP4 x DP2 with two virtual stages per rank, the distributed optimizer and
    --overlap-grad-reduce (8 processes, dropout on): rank 2 (stage 1) SIGKILLed inside iteration
    3, while its data-parallel peers have gradient reductions in flight (each survivor drops
    them before the redo), then rank 5 (stage 2) moved to a standby at step 4."""
    (tmp_path / "reference").mkdir()
    reference = torchrun(*INTERLEAVED_PP4, *RESILIENT[1:], cwd=tmp_path / "reference", nproc=8)
    assert reference.returncode == 0, reference.output[-4000:]
    result, summary, events = resilient_run(
        tmp_path, standbys=2, layout=INTERLEAVED_PP4, nproc=8,
        injections=["--inject-failure", "2:3", "--inject-migration", "5:4"])
    assert digest(result) == digest(reference)
    # Every iteration Megatron-LM logged (1, 2, 4, 6) has the failure-free loss.
    assert lm_losses(result.stdout) == lm_losses(reference.stdout)
    assert sorted(lm_losses(reference.stdout)) == [1, 2, 4, 6]
    assert summary["steps_completed"] == 6 and summary["restarts"] == 0
    crash, migration = summary["interruptions"]
    assert (crash["kind"], crash["rank"], crash["recovery"]) == ("failure", 2, "standby")
    assert (migration["kind"], migration["rank"], migration["recovery"]) == (
        "migration", 5, "standby")
    assert crash["rolled_back_to"] is None and migration["rolled_back_to"] is None
    assert switched_roles(events, crash["generation"]) == {
        r: "joiner" if r == 2 else "survivor" for r in range(8)}
    assert not [e for e in events if e["event"] in ("rolled_back", "restart", "fallback")]
    # The standbys warmed up as the first, last and a middle stage (each rank's two model
    # chunks); rank 2 (stage 1, data-parallel index 0) takes the middle stage's objects, rank
    # 5 (stage 2) is built on promotion.
    assert [e["kept"] for e in events if e["event"] == "standby_warmed"] == [
        ["first", "last", "middle"]] * 2
    assert adopted_by_rank(events) == {2: True, 5: False}


def skipped_iterations(output: str) -> list[int]:
    """The iterations whose update the fp16 loss scaler skipped (Megatron-LM logs no gradient
    norm for them), with --log-interval 1."""
    return [int(step) for step, line in ITERATION_LINE.findall(output)
            if "| grad norm:" not in line]


ITERATION_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ (\|.*)")


def launched_as_under_torchrun(tmp_path: Path, recipe: list[str], nproc: int):
    """A recipe's failure-free run (log interval 1) under mover-launch and under torchrun:
    the same digest. Returns torchrun's run, the reference."""
    (tmp_path / "launched").mkdir()
    (tmp_path / "reference").mkdir()
    launched = mover_launch(*recipe, "--log-interval", "1", cwd=tmp_path / "launched",
                            nproc=nproc)
    assert launched.returncode == 0, launched.output[-4000:]
    reference = torchrun(*recipe, "--log-interval", "1", cwd=tmp_path / "reference",
                         nproc=nproc)
    assert reference.returncode == 0, reference.output[-4000:]
    assert digest(launched) == digest(reference)
    return reference


def assert_recovered_in_place(summary, events, *, steps: int, crashed: int,
                              migrated: int) -> None:
    """Every step trained, a crash of ``crashed`` then a migration of ``migrated``, both by a
    standby, without a restart, a fallback or a rollback."""
    assert summary["steps_completed"] == steps and summary["restarts"] == 0
    assert [(item["kind"], item["rank"], item["recovery"]) for item in
            summary["interruptions"]] == [("failure", crashed, "standby"),
                                          ("migration", migrated, "standby")]
    assert not [e for e in events if e["event"] in ("rolled_back", "restart", "fallback")]


def test_the_gpt3_recipe_in_fp16_survives_losses_in_skipped_updates_exactly(tmp_path):
    """Megatron-LM's GPT-3 recipe scaled down (TP2 x PP2 x DP2, fp16 with its loss scaler):
    under mover-launch as under torchrun; with --resilient, rank 5 (a tensor-parallel rank of
    the last stage) SIGKILLed at step 2, an iteration whose update the loss scaler skips and
    before any update was applied, then rank 2 (first stage) moved to a standby at step 5,
    skipped too. Each skipped iteration counts as completed with a null update; a redone one
    starts from the loss scaler's state at its start."""
    reference = launched_as_under_torchrun(tmp_path, GPT3_RECIPE, nproc=8)
    assert skipped_iterations(reference.stdout) == [1, 2, 5]
    result, summary, events = resilient_run(
        tmp_path, standbys=2, layout=GPT3_RECIPE, nproc=8, flags=["--log-interval", "1"],
        injections=["--inject-failure", "5:2", "--inject-migration", "2:5"])
    assert digest(result) == digest(reference)
    assert lm_losses(result.stdout) == lm_losses(reference.stdout)
    assert skipped_iterations(result.stdout) == [1, 2, 5]
    assert_recovered_in_place(summary, events, steps=8, crashed=5, migrated=2)


def test_the_mixtral_recipe_survives_losing_expert_parallel_ranks_exactly(tmp_path):
    """Megatron-LM's Mixtral recipe scaled down (TP1 x PP2 x DP2, 4 experts over EP2, top-2
    routing with the load-balancing loss, the alltoall dispatcher, bf16, the distributed
    optimizer with both overlaps), where no other rank holds a rank's experts: under
    mover-launch as under torchrun; with --resilient, rank 1 (first stage, the second pair of
    experts) SIGKILLed inside iteration 3 and replaced from rank 0 (its dense parameters) and
    the copy of its shard rank 0 holds (its experts with their optimizer state), then rank 2
    (last stage, the first pair) moved to a standby at step 5: the failure-free digest, every
    logged loss and load-balancing loss equal, no restart."""
    reference = launched_as_under_torchrun(tmp_path, MIXTRAL_RECIPE, nproc=4)
    assert len(router_losses(reference.stdout)) == 6
    result, summary, events = resilient_run(
        tmp_path, standbys=2, layout=MIXTRAL_RECIPE, flags=["--log-interval", "1"],
        injections=["--inject-failure", "1:3", "--inject-migration", "2:5"])
    assert digest(result) == digest(reference)
    assert lm_losses(result.stdout) == lm_losses(reference.stdout)
    assert router_losses(result.stdout) == router_losses(reference.stdout)
    assert_recovered_in_place(summary, events, steps=6, crashed=1, migrated=2)
    assert [e["twin"] for e in events if e["event"] == "promote" and e["rank"] == 1] == [0]


def test_experts_no_other_rank_holds_come_from_the_shard_copy_in_fp32(tmp_path):
    """The Mixtral set in fp32 and without --overlap-param-gather, where the experts'
    parameters are the optimizer shard's own (views of the model's, not a main copy) and no
    gather rewrites them: a joiner of rank 1 gets its dense parameters from rank 0 and its
    experts from the copy rank 0 keeps of its shard, which then carries the parameters
    themselves. Without them in the shard the run ends with other parameters."""
    recipe = [flag for flag in MIXTRAL_RECIPE if flag not in ("--bf16", "--overlap-param-gather")]
    (tmp_path / "reference").mkdir()
    reference = torchrun(*recipe, "--log-interval", "1", cwd=tmp_path / "reference")
    assert reference.returncode == 0, reference.output[-4000:]
    result, summary, events = resilient_run(
        tmp_path, standbys=2, layout=recipe, flags=["--log-interval", "1"],
        injections=["--inject-failure", "1:3", "--inject-migration", "2:5"])
    assert digest(result) == digest(reference)
    assert router_losses(result.stdout) == router_losses(reference.stdout)
    assert_recovered_in_place(summary, events, steps=6, crashed=1, migrated=2)


def test_the_gpt_oss_recipe_survives_a_crash_and_a_migration_exactly(tmp_path):
    """Megatron-LM's gpt-oss recipe scaled down (TP1 x DP4, 4 experts over EP2; learnable
    softmax offsets, sliding windows, quick-GeGLU, the load-balancing and z losses): with
    --resilient, rank 3 SIGKILLed inside iteration 3 and replaced from rank 1's copy (the
    same experts), then rank 0 migrated at step 5: torchrun's digest, every logged loss and
    router loss equal, no restart. Only rank 0's joiner takes over a model its standby built
    in the warm-up: a MoE layer holds the experts of the rank it was built for."""
    (tmp_path / "reference").mkdir()
    reference = torchrun(*GPT_OSS_RECIPE, "--log-interval", "1", cwd=tmp_path / "reference")
    assert reference.returncode == 0, reference.output[-4000:]
    assert len(router_losses(reference.stdout, "z_loss")) == 6
    result, summary, events = resilient_run(
        tmp_path, standbys=2, layout=GPT_OSS_RECIPE, flags=["--log-interval", "1"],
        injections=["--inject-failure", "3:3", "--inject-migration", "0:5"])
    assert digest(result) == digest(reference)
    assert lm_losses(result.stdout) == lm_losses(reference.stdout)
    for name in ("load_balancing_loss", "z_loss"):
        assert router_losses(result.stdout, name) == router_losses(reference.stdout, name)
    assert_recovered_in_place(summary, events, steps=6, crashed=3, migrated=0)
    assert [e["twin"] for e in events if e["event"] == "promote" and e["rank"] == 3] == [1]
    # A standby warmed up as the first pair of experts' rank: rank 0 adopts, rank 3 builds.
    assert adopted_by_rank(events) == {3: False, 0: True}


NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]
"""Megatron-LM's own resume is exact only without dropout: it restores the RNG states of the
checkpoint before it builds the data loaders, whose iterators draw a seed from torch's
generator, so the first dropout masks after a resume differ (under torchrun just the same)."""


def test_the_restart_policy_resumes_megatron_lm_from_its_own_checkpoint_exactly(tmp_path):
    """Without --resilient, a lost rank costs a restart of every worker, which resume from the
    checkpoint Megatron-LM saved with --save (its torch format), through its own --load."""
    summary_path = tmp_path / "summary.json"
    ckpt = str(tmp_path / "ckpt")
    (tmp_path / "reference").mkdir()
    reference = mover_launch(*PP2, *NO_DROPOUT, cwd=tmp_path / "reference")
    assert reference.returncode == 0, reference.output[-4000:]
    launcher = ["--policy", "restart", "--max-restarts", "1", "--summary", str(summary_path),
                "--stop-grace-s", "2", "--inject-failure", "3:4"]
    result = mover_launch(*PP2, *NO_DROPOUT, "--save", ckpt, "--load", ckpt, "--save-interval",
                          "1", "--ckpt-format", "torch", launcher_flags=launcher, cwd=tmp_path)
    assert result.returncode == 0, result.output[-5000:]
    summary = json.loads(summary_path.read_text())
    assert summary["restarts"] == 1 and summary["steps_completed"] == 6
    (interruption,) = summary["interruptions"]
    assert (interruption["rank"], interruption["recovery"]) == (3, "restart")
    loaded = [line for line in result.stdout.splitlines()
              if "successfully loaded checkpoint from" in line]
    assert len(loaded) == 1 and loaded[0].endswith("at iteration 3"), loaded
    assert digest(result) == digest(reference)


DISTRIBUTED_PP2 = [*PP2, *NO_DROPOUT, "--use-distributed-optimizer", "--overlap-grad-reduce",
                   "--overlap-param-gather"]


@pytest.fixture(scope="module")
def failure_free_distributed_pp2(tmp_path_factory):
    """TP1 x PP2 x DP2 with the distributed optimizer (gradient reductions and parameter
    gathers overlapped) and no dropout, no interruption."""
    result = mover_launch(*DISTRIBUTED_PP2, cwd=tmp_path_factory.mktemp("failure-free-distopt"))
    assert result.returncode == 0, result.output[-4000:]
    return result


def test_the_restart_policy_resumes_a_distributed_optimizer_from_the_default_checkpoint(
        tmp_path, failure_free_distributed_pp2):
    """The same with --use-distributed-optimizer and Megatron-LM's default checkpoint format
    (torch_dist): every restarted rank loads its optimizer shard with Megatron-LM's --load at
    start-up (on CPU, torch's Adam: its state is created first and its step counters set from
    the checkpoint after)."""
    summary_path = tmp_path / "summary.json"
    ckpt = str(tmp_path / "ckpt")
    launcher = ["--policy", "restart", "--max-restarts", "1", "--summary", str(summary_path),
                "--stop-grace-s", "2", "--inject-failure", "1:5"]
    result = mover_launch(*DISTRIBUTED_PP2, "--save", ckpt, "--load", ckpt, "--save-interval",
                          "2", launcher_flags=launcher, cwd=tmp_path)
    assert result.returncode == 0, result.output[-5000:]
    summary = json.loads(summary_path.read_text())
    assert summary["restarts"] == 1 and summary["steps_completed"] == 6
    loaded = [line for line in result.stdout.splitlines()
              if "successfully loaded checkpoint from" in line]
    assert len(loaded) == 1 and loaded[0].endswith("at iteration 4"), loaded
    assert digest(result) == digest(failure_free_distributed_pp2)


def test_without_a_peer_copy_every_rank_rolls_back_in_place_to_the_checkpoint(
        tmp_path, failure_free_distributed_pp2):
    """The distributed optimizer with --resilient-no-peer-copy: the lost rank's shard exists
    nowhere, so every rank, processes kept, loads Megatron-LM's last checkpoint (its default
    torch_dist format, saved every 2 iterations) and trains on from iteration 4 (entering
    train() again: its config set-up, forward pre-hooks and parameter gathers as at a
    start)."""
    ckpt = str(tmp_path / "ckpt")
    result, summary, events = resilient_run(
        tmp_path, layout=DISTRIBUTED_PP2, injections=["--inject-failure", "1:6"],
        flags=["--resilient-no-peer-copy", "--save", ckpt, "--load", ckpt,
               "--save-interval", "2"])
    assert digest(result) == digest(failure_free_distributed_pp2)
    assert summary["steps_completed"] == 6 and summary["restarts"] == 0
    (interruption,) = summary["interruptions"]
    assert (interruption["rank"], interruption["recovery"]) == (1, "standby")
    assert interruption["rolled_back_to"] == 4
    rolled = [e for e in events if e["event"] == "rolled_back"]
    assert sorted(e["rank"] for e in rolled) == [0, 1, 2, 3]
    assert all(e["iteration"] == 4 and "--resilient-no-peer-copy" in e["reason"]
               for e in rolled)


FP16_DISTRIBUTED_PP2 = [*PP2, "--use-distributed-optimizer", "--fp16",
                        "--initial-loss-scale", "1048576", "--loss-scale-window", "2",
                        "--hysteresis", "1"]


def test_the_distributed_optimizer_in_fp16_continues_from_the_peer_copy_after_a_skipped_update(
        tmp_path):
    """TP1 x PP2 x DP2, the distributed optimizer in fp16 (dropout on): rank 1 SIGKILLed at
    step 3, an iteration whose update the loss scaler skips. The optimizer's state exists
    from the first iteration, so the shard the peer copy keeps has its full size although
    the first update was skipped; the survivors redo the iteration from the loss scaler's
    state at its start and the joiner's shard comes from its peer's copy."""
    (tmp_path / "reference").mkdir()
    reference = mover_launch(*FP16_DISTRIBUTED_PP2, "--log-interval", "1",
                             cwd=tmp_path / "reference")
    assert reference.returncode == 0, reference.output[-4000:]
    assert skipped_iterations(reference.stdout) == [1, 3, 6]
    result, summary, events = resilient_run(tmp_path, layout=FP16_DISTRIBUTED_PP2,
                                            flags=["--log-interval", "1"],
                                            injections=["--inject-failure", "1:3"])
    assert digest(result) == digest(reference)
    assert lm_losses(result.stdout) == lm_losses(reference.stdout)
    (crash,) = summary["interruptions"]
    assert (crash["rank"], crash["recovery"], crash["rolled_back_to"]) == (1, "standby", None)
    assert summary["restarts"] == 0
    assert not [e for e in events if e["event"] in ("rolled_back", "restart", "fallback")]


def test_a_script_that_imports_no_framework_runs_through_the_worker_command_unchanged(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text(textwrap.dedent("""
        import sys, os
        print("ARGV", sys.argv)
        print("PATH0", sys.path[0] == os.path.dirname(os.path.abspath(__file__)))
        print("MAIN", __name__)
        print("MEGATRON", "megatron.training" in sys.modules)
    """))
    result = run_command([sys.executable, "-m", "mover_plugin.launch.run", str(script), "--x",
                          "1"], timeout_s=60, cwd=str(tmp_path))
    assert result.returncode == 0, result.output
    assert f"ARGV ['{script}', '--x', '1']" in result.stdout
    assert "PATH0 True" in result.stdout and "MAIN __main__" in result.stdout
    assert "MEGATRON False" in result.stdout


def test_first_import_hook_runs_around_the_module_code_once(tmp_path, monkeypatch):
    """Also when the spec was asked for first without importing (Transformers asks so
    whether DeepSpeed is installed)."""
    import builtins
    import importlib.util

    from mover_plugin.launch.run import FirstImportHook

    package = tmp_path / "hooked_package"
    package.mkdir()
    (package / "__init__.py").write_text("import builtins\nbuiltins.hook_calls.append('module')\n")
    calls: list[str] = []
    monkeypatch.setattr(builtins, "hook_calls", calls, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    hook = FirstImportHook("hooked_package", lambda: calls.append("before"),
                           lambda: calls.append("after"))
    hook.install()
    try:
        assert importlib.util.find_spec("hooked_package") is not None
        assert calls == [] and hook in sys.meta_path
        import hooked_package  # noqa: F401

        import hooked_package as again  # noqa: F401
    finally:
        sys.modules.pop("hooked_package", None)
    assert calls == ["before", "module", "after"]
    assert hook not in sys.meta_path
