"""mover report on a run's files written by the test: the table, the picture, bad input; and
the step times an agent batches for it."""

from __future__ import annotations

import json

import pytest

from mover_plugin.errors import ConfigError
from mover_plugin.launch import jobctl
from mover_plugin.launch.report import interruption_table, load_run, report
from mover_plugin.launch.step_times import StepBatch

T0 = 1000.0
FAILURE = {
    "kind": "failure", "rank": 3, "step": 12, "how": "signal SIGKILL", "injected": True,
    "attempt": 0, "generation": 2, "recovery": "standby", "rolled_back_to": None,
    "times": {"failed": T0 + 12.0, "detected": T0 + 12.05, "alarm": T0 + 12.06,
              "left": T0 + 12.07, "switched": T0 + 12.28, "first_step_completed": T0 + 12.34},
    "phases_s": {"failed": 0.0, "detected": 0.05, "alarm": 0.06, "left": 0.07,
                 "switched": 0.28, "first_step_completed": 0.34},
    "left_s": {}, "downtime_s": 0.277,
}
MIGRATION = {
    **FAILURE, "kind": "migration", "rank": 1, "step": 8, "how": "planned", "generation": 1,
    "times": {"requested": T0 + 8.0, "prepared": T0 + 8.45, "boundary": T0 + 8.49,
              "handed_over": T0 + 8.53, "switched": T0 + 8.54,
              "first_step_completed": T0 + 8.63},
    "phases_s": {"requested": 0.0, "prepared": 0.45, "boundary": 0.49, "handed_over": 0.53,
                 "switched": 0.54, "first_step_completed": 0.63},
    "downtime_s": 0.082,
}


def write_run(folder, interruptions=(MIGRATION, FAILURE)):
    summary = {"policy": "resilient", "world_size": 4, "started_at": T0,
               "finished_at": T0 + 20.0, "wall_time_s": 20.0, "exit_code": 0,
               "steps_completed": 20, "restarts": 0, "interruptions": list(interruptions),
               "total_downtime_s": sum(i["downtime_s"] for i in interruptions)}
    records = [
        {"time": T0 + 1.0, "generation": 0, "rank": None, "event": "standby_ready",
         "phase": "pool", "pool": 2},
        {"time": T0 + 5.0, "generation": 0, "rank": None, "event": "steps", "phase": "job",
         "attempt": 0, "steps": [[s, T0 + s, 0.9] for s in range(1, 6)]},
        {"time": T0 + 8.0, "generation": 1, "rank": 1, "event": "migration_requested",
         "phase": "migrate", "pool": 1},
        {"time": T0 + 8.1, "generation": 0, "rank": 0, "event": "left_step", "phase": "switch"},
        {"time": T0 + 12.06, "generation": 2, "rank": 3, "event": "promote",
         "phase": "switch", "pool": 0},
    ]
    (folder / "summary.json").write_text(json.dumps(summary))
    (folder / "events.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def test_the_table_has_one_row_per_interruption_and_the_totals(tmp_path):
    table = interruption_table(load_run([str(write_run(tmp_path))])).splitlines()
    assert table[0].split()[:4] == ["#", "kind", "rank", "step"]
    assert table[2].split()[:4] == ["1", "migration", "1", "8"]
    assert "0.082 s" in table[2] and "prepared 0.450" in table[2]
    assert table[3].split()[:4] == ["2", "failure", "3", "12"]
    assert "detected 0.050  alarm 0.060  left 0.070  switched 0.280" in table[3]
    assert table[4] == ("2 interruption(s), downtime 0.359 s in all; 20 steps in 20.000 s, "
                        "0 restart(s), exit code 0")


def test_a_rollback_and_an_inexact_recovery_are_told_below_their_row(tmp_path):
    rolled_back = {**FAILURE, "rolled_back_to": 10,
                   "inexact": "rank 0: the random-number streams changed between steps"}
    table = interruption_table(load_run([str(write_run(tmp_path, (MIGRATION, rolled_back)))]))
    lines = table.splitlines()
    assert lines[3].split()[:2] == ["2", "failure"]
    assert lines[4:6] == ["    rolled back to the checkpoint of step 10",
                          "    inexact: rank 0: the random-number streams changed between steps"]
    assert "inexact" not in "\n".join(lines[:4])


def test_the_run_gives_steps_the_highest_generation_and_the_pool(tmp_path):
    run = load_run([str(write_run(tmp_path))])
    assert [s[1] for s in run.steps()] == [1, 2, 3, 4, 5]
    # the left_step record of generation 0 after the migration does not move it back
    assert [g for _, g in run.generations()] == [0, 1, 2]
    assert [n for _, n in run.pool()] == [2, 1, 0]


def test_the_picture_is_drawn_beside_the_summary_or_where_asked(tmp_path):
    pytest.importorskip("matplotlib")
    write_run(tmp_path)
    _, picture = report([str(tmp_path)])
    assert picture == tmp_path / "report.png"
    elsewhere = tmp_path / "out" / "timeline.png"
    _, picture = report([str(tmp_path / "events.jsonl"), str(tmp_path / "summary.json")],
                        str(elsewhere))
    for path in (tmp_path / "report.png", elsewhere):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 20_000
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["timeline.png"]


def test_a_run_without_interruptions_or_step_times_still_reports(tmp_path):
    pytest.importorskip("matplotlib")
    write_run(tmp_path, interruptions=())
    (tmp_path / "events.jsonl").write_text("")
    table, picture = report([str(tmp_path)])
    assert table.splitlines()[-1].startswith("0 interruption(s), downtime 0.000 s in all")
    assert picture.exists()


@pytest.mark.parametrize("setup, message", [
    (lambda d: None, "summary.json: no such file (the run's --summary)"),
    (lambda d: (d / "summary.json").write_text("{}"), "not a run summary (no started_at"),
    (lambda d: (write_run(d), (d / "events.jsonl").write_text("oops\n{}\n")),
     "events.jsonl:1: not an event-log line"),
])
def test_bad_run_files_give_one_clear_error(tmp_path, capsys, setup, message):
    setup(tmp_path)
    assert jobctl.main(["report", str(tmp_path)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("mover report: error: ") and message in line
    assert not (tmp_path / "report.png").exists()


def test_a_last_line_cut_short_is_left_out(tmp_path):
    write_run(tmp_path)
    with open(tmp_path / "events.jsonl", "a") as log:
        log.write('{"time": 1')
    assert len(load_run([str(tmp_path)]).events) == 5


def test_an_output_that_is_not_a_png_file_is_refused(tmp_path, capsys):
    write_run(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        jobctl.main(["report", str(tmp_path), "-o", str(tmp_path / "summary.json")])
    assert exit_info.value.code == 2
    assert "is not a .png file name" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="give a run folder"):
        load_run([str(tmp_path / "summary.json")])


def test_an_agent_batches_rank_0s_step_ends_and_posts_them_when_due():
    posted = []
    batch = StepBatch(lambda kind, **fields: posted.append((kind, fields)), period_s=3600)
    batch.add(1, 1, T0 + 1.0, 0.5)  # another rank: not reported
    batch.add(0, 1, T0 + 1.0, 0.5)
    batch.add(0, 2, T0 + 1.6, 0.6)
    batch.post_if_due()
    assert posted == []
    batch.post()
    batch.post()  # nothing new: nothing posted
    assert posted == [("steps", {"steps": [[1, T0 + 1.0, 0.5], [2, T0 + 1.6, 0.6]]})]
