"""Progress reports over a real pipe (``mover_plugin.progress``): what the agent reads."""

import os

from mover_plugin.progress import STEP_END, ProgressLineReader, ProgressReporter


def _read_all(fd: int) -> list:
    return ProgressLineReader().feed(os.read(fd, 65536))


def test_a_step_end_carries_the_busy_time_once_waits_are_measured():
    read_end, write_end = os.pipe()
    try:
        reporter = ProgressReporter(write_end)
        reporter.step_begin(1)
        reporter.step_end(1, 0.5)  # no clock yet: not measured
        waited = [10.0]
        reporter.measure_busy_time(lambda: waited[0])
        reporter.step_begin(2)
        waited[0] = 10.3  # 0.3 s of the step spent waiting for peers
        reporter.step_end(2, 0.5)
        ends = [e for e in _read_all(read_end) if e.kind == STEP_END]
    finally:
        os.close(read_end)
        os.close(write_end)
    assert [(e.step, e.duration_s) for e in ends] == [(1, 0.5), (2, 0.5)]
    assert ends[0].busy_s == -1.0
    assert abs(ends[1].busy_s - 0.2) < 1e-9
