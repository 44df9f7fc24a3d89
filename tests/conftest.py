"""The suite's layout and shared fixtures.

``tests/unit/`` (mirroring the package) holds the pure tests; ``tests/jobs/<feature>/`` the
multi-process jobs, each marked ``job`` here, so that ``pytest -m "not job" tests`` runs the
pure tests alone; ``tests/support/`` what both share. The pure tests run first. The fixtures
are failure-free reference runs of the example, computed once per session.
"""

from pathlib import Path

import pytest

JOBS = Path(__file__).resolve().parent / "jobs"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks every test under ``tests/jobs/`` ``job`` and runs the pure tests first."""
    for item in items:
        if JOBS in item.path.parents:
            item.add_marker(pytest.mark.job)
    items.sort(key=lambda item: JOBS in item.path.parents)  # stable: file order kept

from support.gpt_jobs import pretrain
from support.template_runs import RUN, STEPS


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
    from mover_plugin.testing.template_run import train_without_interruption
    from mover_plugin.testing import run_ranks

    return run_ranks(train_without_interruption, 4, RUN, STEPS, timeout_s=240,
                     group_timeout_s=60)
