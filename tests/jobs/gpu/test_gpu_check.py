"""``python -m mover_plugin.gpu_check`` on this machine: one line per check, a summary, and the
exit status (its GPU checks skip here, with the reason, when torch sees no GPU)."""

from __future__ import annotations

import re
import sys

import torch

from mover_plugin.gpu_check import CHECKS
from mover_plugin.testing import run_command

LINE = re.compile(r"GPU_CHECK (\w+) (PASS|FAIL|SKIP) (.+)")


def test_every_check_prints_one_line_and_the_summary_counts_them():
    result = run_command([sys.executable, "-m", "mover_plugin.gpu_check"], timeout_s=600)
    lines = result.stdout.splitlines()
    checks = [LINE.fullmatch(line) for line in lines[:-1]]
    assert all(checks), result.output[-3000:]
    statuses = {m[1]: m[2] for m in checks}
    assert list(statuses) == [check.name for check in CHECKS]
    counts = [list(statuses.values()).count(s) for s in ("PASS", "FAIL", "SKIP")]
    assert lines[-1] == "GPU_CHECK summary passed {} failed {} skipped {}".format(*counts)
    assert result.returncode == (1 if counts[1] else 0), result.output[-3000:]
    assert statuses["nccl_env"] == "PASS"
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=0" in result.stdout
    if not torch.cuda.is_available():
        needs_gpu = [check.name for check in CHECKS if check.gpus > 0]
        assert all(statuses[name] == "SKIP" for name in needs_gpu)
        assert "GPU_CHECK cuda SKIP needs CUDA; torch sees no GPU here" in lines
        assert result.returncode == 0
