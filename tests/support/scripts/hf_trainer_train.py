#!/usr/bin/env python
"""A Hugging Face user's training script: ``transformers.Trainer`` with DeepSpeed, nothing else.

The arguments are Transformers' own ``TrainingArguments`` (parsed by ``HfArgumentParser``, as
Transformers' example scripts do), so the DeepSpeed config comes in as ``--deepspeed PATH``
and the Trainer drives DeepSpeed through Accelerate. The model is a tiny GPT-2 built from its
config (its dropout on: 0.1 on embeddings, attention and residuals); the data is made in
memory: random token sequences whose labels hide a random-length prefix (-100), so every rank
counts other tokens in its batches (the Trainer gathers the counts before each iteration).
The Trainer shuffles its sampler with the seed. Nothing is downloaded. ``--step_time_s S``
makes every step last at least S seconds (a callback sleeps after it).

Rank 0 prints each step's log as ``LOG {"step": N, "loss": L, "grad_norm": G}`` (full
precision; a joiner's catch-up logs loss 0.0, the Trainer's stand-in for NaN), and at the end
``PARAMS_DIGEST <hex>``: a SHA-256 of every parameter (gathered at ZeRO stage 3), equal for
two runs only if they ended bit-identical.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any

import deepspeed
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    HfArgumentParser,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

VOCAB, LENGTH, SAMPLES = 64, 16, 256


@dataclass
class ScriptArguments:
    layers: int = 2
    hidden: int = 32
    step_time_s: float = 0.0
    """Each step takes at least this long (a larger model's step), so that a migration's
    joiner gets ready while the job still trains."""


class StepTime(TrainerCallback):
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.began = 0.0

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.began = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        time.sleep(max(0.0, self.began + self.seconds - time.perf_counter()))


class PrintLogs(TrainerCallback):
    """Rank 0 prints each step's log as the Trainer logs it, at full precision."""

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None,
               **kwargs: Any) -> None:
        if state.is_world_process_zero and logs is not None and "loss" in logs:
            record = {"step": state.global_step, "loss": logs["loss"],
                      "grad_norm": logs.get("grad_norm")}
            print("LOG " + json.dumps(record), flush=True)


class Tokens(torch.utils.data.Dataset):
    """Fixed random sequences; each hides a prefix of 0 to 7 of its labels."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, VOCAB, (SAMPLES, LENGTH), generator=generator)
        self.hidden = torch.randint(0, 8, (SAMPLES,), generator=generator)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        labels = self.tokens[index].clone()
        labels[: int(self.hidden[index])] = -100
        return {"input_ids": self.tokens[index], "labels": labels}


def digest(model: torch.nn.Module) -> str:
    sha = hashlib.sha256()
    parameters = list(model.parameters())
    with deepspeed.zero.GatheredParameters(parameters):
        for name, tensor in sorted(model.state_dict().items()):
            sha.update(name.encode())
            sha.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


def main() -> None:
    script, args = HfArgumentParser((ScriptArguments, TrainingArguments)) \
        .parse_args_into_dataclasses()
    config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=script.hidden,
                        n_layer=script.layers, n_head=2, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(args.seed)
    trainer = Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=Tokens(),
                      callbacks=[StepTime(script.step_time_s), PrintLogs()])
    trainer.train()
    parameters = digest(trainer.model)
    if trainer.is_world_process_zero():
        print(f"PARAMS_DIGEST {parameters}", flush=True)


if __name__ == "__main__":
    main()
