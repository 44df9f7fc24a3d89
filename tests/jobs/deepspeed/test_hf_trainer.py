"""A Hugging Face ``Trainer`` script with DeepSpeed (tests/support/scripts/hf_trainer_train.py)
under mover-launch on CPU: Transformers' own arguments (``--deepspeed PATH``, ``--use_cpu``),
the Trainer driving DeepSpeed ZeRO-2 through Accelerate, a GPT-2 with its dropout, a shuffled
sampler, and labels whose counted tokens differ by rank (the Trainer gathers them before every
iteration). With the ``"resilience"`` block in its config alone, a migration and a SIGKILL are
recovered in place and the job ends with the failure-free parameters and logs. The SIGKILL's
step is drawn at random (tests/support/drawn.py prints it)."""

import json
import re

from support.drawn import drawn_step
from support.gpt_jobs import LAUNCH, digest, read_events
from mover_plugin.testing import run_command
from support.paths import SCRIPTS

SCRIPT = str(SCRIPTS / "hf_trainer_train.py")
STEPS = 60
"""Long enough for a migration requested at step 3 (its joiner builds the Trainer while the job
trains, at least STEP_TIME_S per step) and the SIGKILL after it."""
KILL_STEPS = (8, 20)
"""The SIGKILL comes as rank 0 begins a step drawn from these, or, if the migration is still
under way then, one of its first steps in the migration's generation. (The joiner catches up
through every step before it: a later SIGKILL makes a longer test.)"""
STEP_TIME_S = 0.3
CONFIG = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "train_batch_size": "auto", "gradient_clipping": "auto",
          "zero_optimization": {"stage": 2},
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}}}
LOG_LINE = re.compile(r"^LOG (\{.*\})$", re.MULTILINE)


def hf_job(tmp_path, block, *launcher_flags, step_time_s=0.0):
    config = {**CONFIG, "resilience": block} if block is not None else CONFIG
    tmp_path.mkdir()
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    return run_command([*LAUNCH, "--standalone", "--nproc-per-node", "2", "--stop-grace-s", "2",
                        *launcher_flags, SCRIPT, "--output_dir", str(tmp_path / "out"),
                        "--max_steps", str(STEPS), "--per_device_train_batch_size", "2",
                        "--gradient_accumulation_steps", "2", "--learning_rate", "1e-3",
                        "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none",
                        "--use_cpu", "--seed", "1234", "--disable_tqdm", "true",
                        "--deepspeed", str(path), "--step_time_s", str(step_time_s)],
                       timeout_s=300)


def trained_logs(result) -> dict[int, dict]:
    """Step -> the Trainer's log of it, as rank 0 printed it (a joiner's catch-up logs loss
    0.0, its stand-in for NaN); a step logged twice (by a rank and then by its joiner, for
    the step it joined after) must be logged alike."""
    logs: dict[int, dict] = {}
    for line in LOG_LINE.findall(result.stdout):
        record = json.loads(line)
        if record["loss"] != 0.0:
            assert logs.setdefault(record["step"], record) == record, result.stdout[-3000:]
    return logs


def test_a_trainer_script_recovers_a_migration_and_a_sigkill_with_the_failure_free_result(
        tmp_path):
    reference = hf_job(tmp_path / "reference", None, "--max-restarts", "0")
    assert reference.returncode == 0, reference.output[-4000:]
    events_path, summary_path = tmp_path / "events.jsonl", tmp_path / "summary.json"
    killed_at = drawn_step("SIGKILL of rank 0", *KILL_STEPS)
    result = hf_job(tmp_path / "resilient", {"peer_copy": True, "standbys": 2},
                    "--event-log", str(events_path), "--summary", str(summary_path),
                    "--inject-migration", "1:3", "--inject-failure", f"0:{killed_at}",
                    step_time_s=STEP_TIME_S)
    assert result.returncode == 0, result.output[-5000:]
    summary, events = json.loads(summary_path.read_text()), read_events(events_path)

    assert digest(result) == digest(reference)
    assert trained_logs(result) == trained_logs(reference)
    assert sorted(trained_logs(result)) == list(range(1, STEPS + 1))
    kinds = [(i["kind"], i["rank"], i["recovery"], i.get("inexact"))
             for i in summary["interruptions"]]
    assert kinds == [("migration", 1, "standby", None), ("failure", 0, "standby", None)]
    assert summary["restarts"] == 0
    killed_in = summary["interruptions"][1]["step"] - 1
    assert killed_in + 1 >= killed_at
    assert re.search(rf"rank 1 redoes iteration {killed_in}: \d micro-batch", result.output)
    # Each joiner's script gathered the token counts (and the last step's loss for its log)
    # before its first iteration: answered with what the ranks it replaced had received.
    caught_up = [(e["rank"], e["inexact"]) for e in events if e["event"] == "caught_up"]
    assert caught_up == [(1, None), (0, None)]
    assert all(e["replayed"] >= 2 for e in events if e["event"] == "caught_up")
