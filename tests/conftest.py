"""Shared fixtures: failure-free reference runs of the example, computed once per session."""

import pytest

from gpt_jobs import pretrain
from template_runs import RUN, STEPS


@pytest.fixture(scope="session")
def reference_pp2():
    """TP1 x PP2 x DP2, 10 steps, no interruption."""
    result = pretrain("--pipeline-model-parallel-size", "2", "--train-iters", "10")
    assert result.returncode == 0, result.output[-4000:]
    return result


@pytest.fixture(scope="session")
def reference_tp2_pp2():
    """TP2 x PP2 x DP1, 6 steps, no interruption."""
    result = pretrain("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                      "--train-iters", "6")
    assert result.returncode == 0, result.output[-4000:]
    return result


@pytest.fixture(scope="session")
def reference_pp2_40():
    """TP1 x PP2 x DP2, 40 steps, no interruption (long enough for several migrations)."""
    result = pretrain("--pipeline-model-parallel-size", "2", "--train-iters", "40")
    assert result.returncode == 0, result.output[-4000:]
    return result


@pytest.fixture(scope="session")
def template_reference():
    """The pipeline-template tests' model (template_runs.RUN) trained in-process without
    interruption for STEPS steps: every rank's losses and final parameters by name."""
    from mover_plugin.megatron.template_run import train_without_interruption
    from mover_plugin.testing import run_ranks

    return run_ranks(train_without_interruption, 4, RUN, STEPS, timeout_s=240,
                     group_timeout_s=60)
