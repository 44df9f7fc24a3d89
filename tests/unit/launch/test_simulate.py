"""mover simulate: the waste model against hand-computed values and TrainMover's published
comparison, costs read from a run summary, the table, the chart and bad input."""

from __future__ import annotations

import json

import pytest

from mover_plugin import waste
from mover_plugin.launch import jobctl

RESTART = {"kind": "failure", "recovery": "restart", "downtime_s": 12.0}


def test_the_llama3_mix_gives_back_its_own_counts_over_its_own_run() -> None:
    failures = waste.FailureModel.llama3()
    unplanned, planned = failures.per_week(waste.LLAMA3_GPUS)
    weeks = waste.LLAMA3_DAYS / 7
    assert unplanned * weeks == pytest.approx(419)
    assert planned * weeks == pytest.approx(47)
    # The rate is proportional to the job's size.
    assert failures.per_week(2 * waste.LLAMA3_GPUS)[0] == pytest.approx(2 * unplanned)


def test_weekly_waste_is_every_gpu_over_the_downtime_plus_the_idle_standby_hosts() -> None:
    failures = waste.FailureModel.from_mttf(10.0, per_gpus=8, planned_per_unplanned=0.5)
    scenario = waste.Scenario(failures, gpus_per_host=8, rescheduling_s=60,
                              checkpoint_interval_s=1200)
    # 800 GPUs = 100 hosts of a 10 h MTTF: 10 failures an hour, 1,680 a week, 840 planned.
    system = waste.SystemCosts("s", unplanned_s=30, planned_s=10, standby_hosts=2)
    row = waste.weekly_waste(system, scenario, 800)
    assert (row.unplanned_per_week, row.planned_per_week) == pytest.approx((1680, 840))
    downtime_s = 1680 * (30 + 60) + 840 * (10 + 60)
    assert row.downtime_hours_per_week == pytest.approx(downtime_s / 3600)
    assert row.standby_gpu_hours_per_week == 2 * 8 * 168
    assert row.wasted_gpu_hours_per_week == pytest.approx(800 * downtime_s / 3600 + 2 * 8 * 168)
    # A restart counts its own rescheduling and loses half a checkpoint interval per failure.
    restart = waste.SystemCosts("r", 300, 300, includes_rescheduling=True, loses_work=True)
    restarted = waste.weekly_waste(restart, scenario, 800)
    assert restarted.downtime_hours_per_week == pytest.approx(
        (1680 * (300 + 600) + 840 * 300) / 3600)


def test_trainmovers_assumptions_reproduce_its_published_comparison_at_8k_gpus() -> None:
    """TrainMover's Figure 9 / §8.2: at 8K GPUs with a 3 h MTTF, one standby host wastes
    35.91 % less than none; the model must come within 10 % of that."""
    scenario = waste.trainmover_scenario()
    unplanned, planned = scenario.failures.per_week(8192)
    assert unplanned == pytest.approx(168 / 3) and planned == pytest.approx(unplanned / 8.9)
    rows = waste.simulate([waste.restart_system(), *waste.trainmover_systems()], scenario,
                          [1024, 8192])
    (gpus, published), *_ = waste.TRAINMOVER_PUBLISHED
    model = waste.reduction(rows, "trainmover", "trainmover-no-standby", gpus)
    assert abs(model - published) / published < 0.10
    # At 1K GPUs the idle standby host outweighs what it saves, as the paper says too.
    assert waste.reduction(rows, "trainmover", "trainmover-no-standby", 1024) < 0


def test_costs_come_from_a_run_summary_and_flags_win(tmp_path) -> None:
    summary = tmp_path / "summary.json"
    interruptions = [{"kind": "failure", "recovery": "standby", "downtime_s": 0.5},
                     {"kind": "hang", "recovery": "standby", "downtime_s": 0.3},
                     {"kind": "host_loss", "recovery": "standby", "downtime_s": 2.4},
                     {"kind": "migration", "recovery": "standby", "downtime_s": -0.01},
                     {"kind": "failure", "recovery": "standby", "downtime_s": None}, RESTART]
    summary.write_text(json.dumps({"interruptions": interruptions}))
    assert jobctl.simulation.summary_costs(summary) == {
        "crash_s": 0.5, "migration_s": 0.0, "restart_s": 12.0}
    rows = _simulate("--costs", str(summary), "--crash-s", "0.25", "--gpus", "8192")
    mover = {row["system"]: row for row in rows["rows"]}
    systems = {s["system"]: s for s in rows["systems"]}
    assert systems["mover"]["unplanned_s"] == 0.25 and systems["mover"]["planned_s"] == 0.0
    assert systems["mover-no-spare"]["unplanned_s"] == 12.0
    assert "mover-templates" not in systems
    assert mover["mover"]["standby_gpu_hours_per_week"] == 8 * 168


def test_mover_simulate_prints_a_table_a_chart_and_json_rows(tmp_path, capsys) -> None:
    chart = tmp_path / "waste.png"
    assert jobctl.main(["simulate", "--assume", "trainmover", "--crash-s", "0.4",
                        "--migration-s", "0.2", "--shrink-s", "30", "-o", str(chart)]) == 0
    table = capsys.readouterr().out
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "TRAINMOVER 8192 GPUs: trainmover wastes" in table and "(published 35.91 %)" in table
    assert f"chart in {chart}" in table
    lines = [line.split() for line in table.splitlines() if line.split()[:1] == ["131072"]]
    assert len(lines) == 1 and len(lines[0]) == 2 + 6  # GPUs, failures, six systems

    result = _simulate("--mttf-host-hours", "5000", "--crash-s", "1",
                       "--migration-s", "1")
    assert {row["gpus"] for row in result["rows"]} == set(jobctl.simulation.SCALES)
    assert all({"system", "gpus", "wasted_gpu_hours_per_week"} <= set(row)
               for row in result["rows"])
    by = {(row["system"], row["gpus"]): row["wasted_gpu_hours_per_week"]
          for row in result["rows"]}
    # Waste grows with the job; a standby costs more than it saves only at small scale.
    assert by["restart", 131072] > by["restart", 1024]
    assert by["mover", 131072] < by["mover-no-spare", 131072]


@pytest.mark.parametrize("flags, message", [
    (["--assume", "trainmover", "--mttf-gpu-hours", "3"],
     "--assume trainmover sets the failure model and rescheduling; drop --mttf-gpu-hours"),
    (["--crash-s", "1"], "this project's costs need --migration-s: give --migration-s"),
    (["--gpus", "1020"], "a job of 1020 GPUs: the GPU counts must be positive multiples of the "
                         "host size (8)"),
    (["--costs", "missing.json"], "--costs missing.json: no such file"),
    (["--planned-per-unplanned", "0.1"], "--planned-per-unplanned goes with --mttf-gpu-hours"),
    (["-o", "chart.svg"], "'chart.svg' is not a .png file name"),
])
def test_bad_simulate_input_is_one_error_line(flags, message, capsys) -> None:
    assert jobctl.main(["simulate", *flags]) == 2
    error = capsys.readouterr().err
    assert error.startswith("mover simulate: error: ") and message in error
    assert len(error.strip().splitlines()) == 1


def test_a_summary_without_a_migration_names_the_missing_cost(tmp_path, capsys) -> None:
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"interruptions": [RESTART, {
        "kind": "failure", "recovery": "standby", "downtime_s": 0.4}]}))
    assert jobctl.main(["simulate", "--costs", str(summary)]) == 2
    assert (f"{summary} has no such interruption; give --migration-s"
            in capsys.readouterr().err)


def _simulate(*flags: str) -> dict:
    args = jobctl._parser().parse_args(["simulate", "--json", *flags])
    return jobctl.simulation.run(args)
