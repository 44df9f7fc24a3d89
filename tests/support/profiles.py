"""Per-layer profiles as the tests give them to the planner."""

from dataclasses import replace

from mover_plugin.shrink import profile_record
from mover_plugin.templates import Profile, transformer_profile


def stage_records(profile: Profile, memories: tuple[int, int]) -> list[dict]:
    """``profile`` as two pipeline stages measured it: the embedding and layers 0-1, then
    layers 2-3 and the output layer."""
    return [profile_record(Profile(profile.layers[:3], memories[0])),
            profile_record(Profile(profile.layers[3:], memories[1]))]


def slow_first_layers() -> Profile:
    """The embedding and layers 0-1 take three times a GPT-like layer's time."""
    estimate = transformer_profile(4)
    return Profile(tuple(
        replace(layer, forward_s=3 * layer.forward_s, backward_s=3 * layer.backward_s)
        if index < 3 else layer for index, layer in enumerate(estimate.layers)),
        estimate.host_memory_bytes)
