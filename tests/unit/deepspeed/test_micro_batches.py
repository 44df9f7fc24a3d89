"""The records a data-parallel iteration is redone from (mover_plugin.deepspeed.micro_batches),
pure autograd: the tap keeps the gradient a script's loss gives the outputs, and the replay
scalar gives a redone forward's outputs exactly that gradient."""

import pytest
import torch

from mover_plugin.deepspeed.micro_batches import (
    MicroBatch,
    ReplayError,
    fresh_stand_in,
    replay_loss,
    stand_in,
    tap,
)
from mover_plugin.runtime.random_streams import RandomStreams


def model_and_inputs():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.5),
                                torch.nn.Linear(16, 4))
    return model, torch.randn(3, 8)


def gradients(model):
    return [parameter.grad.clone() for parameter in model.parameters()]


def scripts_loss(outputs):
    """A loss the script computes outside the model, from several outputs."""
    logits, extra = outputs["logits"], outputs["parts"][0]
    return (logits.log_softmax(-1)[:, 1].sum() + (extra ** 2).mean()) / 2


def forward(model, inputs):
    hidden = model(inputs)
    return {"logits": hidden, "parts": (hidden[:, :2] * 3, torch.arange(3)), "name": "x"}


def test_a_replayed_backward_gives_the_parameters_the_original_gradients_bit_for_bit():
    model, inputs = model_and_inputs()
    record = MicroBatch((inputs,), {}, RandomStreams.capture())
    outputs = tap(forward(model, inputs), record)
    assert outputs["name"] == "x" and torch.equal(outputs["parts"][1], torch.arange(3))
    scripts_loss(outputs).backward()
    original = gradients(model)
    assert record.output_grads is not None and len(record.output_grads) == 2

    model.zero_grad(set_to_none=True)
    torch.randn(5)  # the random state moved on since
    record.streams.restore()  # the dropout mask is drawn again alike
    replay_loss(forward(model, inputs), record).backward()
    assert all(torch.equal(a, b) for a, b in zip(original, gradients(model)))


def test_a_micro_batch_whose_outputs_saw_no_gradient_cannot_be_replayed():
    model, inputs = model_and_inputs()
    record = MicroBatch((inputs,), {}, RandomStreams.capture())
    tap(forward(model, inputs), record)  # the backward never came
    with pytest.raises(ReplayError, match="received no gradient"):
        replay_loss(forward(model, inputs), record)
    record.output_grads = [None]
    with pytest.raises(ReplayError, match="returned 2 differentiable tensors, the original 1"):
        replay_loss(forward(model, inputs), record)


def test_a_stand_in_keeps_the_structure_with_nan_values():
    model, inputs = model_and_inputs()
    outputs = stand_in(forward(model, inputs))
    assert torch.isnan(scripts_loss(outputs))
    assert outputs["logits"].shape == (3, 4) and outputs["logits"].requires_grad
    assert torch.equal(outputs["parts"][1], torch.arange(3)) and outputs["name"] == "x"
    scripts_loss(outputs).backward()  # a script's own backward call goes through
    assert all(parameter.grad is None for parameter in model.parameters())


def test_an_output_computed_from_another_and_a_loss_scaled_in_place_replay_exactly():
    """A Transformers model returns its loss with its logits (the loss computed from them
    inside the model), and the Trainer scales that loss in place before its backward: the
    replay gives the logits only what the script's own code gave them."""
    model, inputs = model_and_inputs()

    def forward_with_loss():
        logits = model(inputs)
        return {"loss": logits.log_softmax(-1)[:, 1].mean(), "logits": logits}

    record = MicroBatch((inputs,), {}, RandomStreams.capture())
    outputs = tap(forward_with_loss(), record)
    loss = outputs["loss"]
    loss *= 3  # the Trainer's in-place scaling
    loss.backward()
    original = gradients(model)
    assert record.output_grads is not None and record.output_grads[1] is None  # logits unused

    model.zero_grad(set_to_none=True)
    record.streams.restore()
    replay_loss(forward_with_loss(), record).backward()
    assert all(torch.equal(a, b) for a, b in zip(original, gradients(model)))


def test_a_fresh_stand_in_may_be_scaled_in_place():
    model, inputs = model_and_inputs()
    template = stand_in({"loss": model(inputs).sum(), "logits": model(inputs)})
    outputs = fresh_stand_in(template)
    loss = outputs["loss"]
    loss *= 3
    assert torch.isnan(loss) and torch.isnan(template["loss"]) and loss is not template["loss"]
