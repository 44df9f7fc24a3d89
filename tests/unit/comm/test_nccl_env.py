"""The NCCL environment an abortable group sets (mover_plugin/comm/nccl_env.py; pure)."""

from __future__ import annotations

import logging
import os

from mover_plugin.comm.nccl_env import RESILIENT_NCCL_ENV, set_resilient_nccl_env


def test_what_the_job_leaves_unset_is_set_so_the_watchdog_ends_no_survivor():
    environ = {"PATH": "/bin"}
    assert set_resilient_nccl_env(environ) == RESILIENT_NCCL_ENV
    assert environ == {"PATH": "/bin", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
                       "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0"}
    assert set_resilient_nccl_env(environ) == {}  # once is enough


def test_a_value_of_the_job_s_own_is_kept_and_one_that_ends_the_process_is_named(caplog):
    environ = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0"}
    with caplog.at_level(logging.WARNING, logger="mover_plugin.comm.nccl_env"):
        assert set_resilient_nccl_env(environ) == {}
    assert environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    (warning,) = caplog.messages
    assert warning.startswith("TORCH_NCCL_ASYNC_ERROR_HANDLING=3: NCCL's watchdog ends this "
                              "process when a peer is lost")
    caplog.clear()
    set_resilient_nccl_env({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"})  # clean-up only: kept
    assert caplog.messages == []


def test_registering_the_backend_sets_it_in_the_process(monkeypatch):
    from mover_plugin.comm import register_backend

    for name in RESILIENT_NCCL_ENV:
        monkeypatch.delenv(name, raising=False)
    register_backend()
    assert {name: os.environ.get(name) for name in RESILIENT_NCCL_ENV} == RESILIENT_NCCL_ENV
