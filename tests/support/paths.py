"""The repository's folders the tests read from."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository's root."""
EXAMPLES = ROOT / "examples"
"""The examples users run (the example's ``pretrain_gpt.py``, Megatron-LM's, DeepSpeed's)."""
SCRIPTS = Path(__file__).resolve().parent / "scripts"
"""The small training scripts only the tests run."""
