"""GPT training samples from an indexed dataset, and Megatron's order of handing them out.

:func:`build_gpt_dataset` wraps an indexed dataset (see :mod:`mover_plugin.data.build_indexed`)
in Megatron-Core's ``GPTDataset``: all documents go to the training split, samples are
``seq_length`` tokens with next-token labels, and the document/sample/shuffle indices are built
in memory from the seed alone.

The dataset is constructed directly rather than through ``BlendedMegatronDatasetBuilder``. In
megatron-core 0.16 to 0.19 that builder, once ``torch.distributed`` is initialized, builds on rank 0
first and then calls ``torch.distributed.barrier()`` on the default group, so it hangs unless
every rank of the job calls it at the same point. Constructing ``GPTDataset`` directly makes no
collective call: each process that needs data builds the same dataset on its own, whether or not
``torch.distributed`` is initialized and whichever ranks take part.

``GPTDataset`` caches its indices as ``.npy`` files when given a cache path, and with
``path_to_cache=None`` it picks ``<prefix>/cache/GPTDataset_indices`` for real data; rank 0
writes there while the other ranks read what it wrote. An empty cache path is the one setting
for which it neither reads nor writes cache files, so that is what is passed here.

:func:`microbatch_sample_indices` reproduces the sample order of Megatron-LM's
``MegatronPretrainingSampler`` as a pure function, and :func:`get_microbatch` stacks those
samples into a batch.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from mover_plugin.errors import ConfigError

if TYPE_CHECKING:
    import torch
    from megatron.core.datasets.gpt_dataset import GPTDataset

logger = logging.getLogger(__name__)

SAMPLE_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask")
"""The tensors in every sample of :func:`build_gpt_dataset`'s dataset."""

_NO_INDEX_CACHE = ""
"""``path_to_cache`` value for which ``GPTDataset`` keeps its indices in memory only."""


def build_gpt_dataset(
    data_prefix: str,
    *,
    seq_length: int,
    num_samples: int,
    seed: int,
    tokenizer: Any,
) -> GPTDataset:
    """Return a Megatron ``GPTDataset`` over every document of the indexed dataset at the prefix.

    The dataset holds at least ``num_samples`` samples (more epochs are drawn as needed); each is
    a dict of ``tokens`` and ``labels`` (int64, ``[seq_length]``), ``loss_mask`` (float32,
    ``[seq_length]``), ``position_ids`` (int64, ``[seq_length]``) and ``attention_mask`` (bool,
    ``[1, seq_length, seq_length]``, True where attention is masked out). Equal arguments give
    equal samples in every process; no collective call is made and no file is written.

    ``tokenizer`` is any object with Megatron's tokenizer attributes, e.g.
    :class:`~mover_plugin.data.tokenizer.ByteTokenizer`. Raises
    :class:`~mover_plugin.errors.ConfigError` for non-positive sizes or a missing dataset.
    """
    _check_positive(seq_length=seq_length, num_samples=num_samples)
    if not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"seed must be a non-negative integer, got {seed!r}")
    prefix = os.fspath(data_prefix)
    if not (os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")):
        raise ConfigError(
            f"no indexed dataset at prefix {prefix!r} (expected {prefix}.bin and {prefix}.idx); "
            "build one with `python -m mover_plugin.data.build_indexed`"
        )
    from megatron.core.datasets.gpt_dataset import GPTDataset

    config = _gpt_config(prefix, seq_length=seq_length, seed=seed, tokenizer=tokenizer)
    return _construct(GPTDataset, prefix, num_samples, config)


def _gpt_config(prefix: str, *, seq_length: int, seed: int, tokenizer: Any) -> Any:
    """Return the ``GPTDatasetConfig`` for a single prefix used entirely for training."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    return GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=([prefix], None),
        split="1,0,0",
        path_to_cache=_NO_INDEX_CACHE,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=True,
    )


def _construct(dataset_class: Any, prefix: str, num_samples: int, config: Any) -> GPTDataset:
    """Open the indexed dataset and build the training-split ``GPTDataset`` over all of it."""
    import numpy
    from megatron.core.datasets.utils import Split

    indexed = dataset_class.build_low_level_dataset(prefix, config)
    count = dataset_class.numel_low_level_dataset(indexed)
    indices = numpy.arange(count, dtype=numpy.int32)
    dataset = dataset_class(indexed, prefix, indices, num_samples, Split.train, config)
    logger.debug("built %s over %d documents with %d samples", prefix, count, len(dataset))
    return dataset


def num_microbatches(
    *, micro_batch_size: int, data_parallel_size: int, global_batch_size: int
) -> int:
    """Return how many micro-batches make one global batch on each data-parallel rank.

    Raises :class:`~mover_plugin.errors.ConfigError` unless all sizes are positive and
    ``global_batch_size`` is a multiple of ``micro_batch_size * data_parallel_size``.
    """
    _check_positive(
        micro_batch_size=micro_batch_size,
        data_parallel_size=data_parallel_size,
        global_batch_size=global_batch_size,
    )
    per_step = micro_batch_size * data_parallel_size
    if global_batch_size % per_step:
        raise ConfigError(
            f"global_batch_size ({global_batch_size}) must be a multiple of micro_batch_size * "
            f"data_parallel_size ({micro_batch_size} * {data_parallel_size} = {per_step})"
        )
    return global_batch_size // per_step


def microbatch_sample_indices(
    iteration: int,
    microbatch: int,
    dp_rank: int,
    *,
    micro_batch_size: int,
    data_parallel_size: int,
    global_batch_size: int,
) -> range:
    """Return the dataset indices of one micro-batch of one data-parallel rank.

    Global batch ``iteration`` is samples ``[iteration * GB, (iteration + 1) * GB)``; its
    micro-batch ``microbatch`` is the next ``micro_batch_size * data_parallel_size`` of them, of
    which rank ``dp_rank`` takes the ``dp_rank``-th slice of ``micro_batch_size``, as Megatron-LM's
    ``MegatronPretrainingSampler`` hands them out.
    """
    count = num_microbatches(
        micro_batch_size=micro_batch_size,
        data_parallel_size=data_parallel_size,
        global_batch_size=global_batch_size,
    )
    _check_in_range("iteration", iteration, None)
    _check_in_range("microbatch", microbatch, count)
    _check_in_range("dp_rank", dp_rank, data_parallel_size)
    start = (
        iteration * global_batch_size
        + microbatch * micro_batch_size * data_parallel_size
        + dp_rank * micro_batch_size
    )
    return range(start, start + micro_batch_size)


def get_microbatch(dataset: Any, indices: Sequence[int]) -> dict[str, torch.Tensor]:
    """Return the samples at ``indices`` stacked along a new leading batch dimension.

    Raises :class:`~mover_plugin.errors.ConfigError` for no indices or an index past the end of
    the dataset (build it with a larger ``num_samples``).
    """
    import torch

    if len(indices) == 0:
        raise ConfigError("a micro-batch needs at least one sample index")
    size = len(dataset)
    for index in indices:
        if not 0 <= index < size:
            raise ConfigError(
                f"sample index {index} is outside the dataset of {size} samples; "
                "build the dataset with a larger num_samples"
            )
    samples: list[Mapping[str, torch.Tensor]] = [dataset[int(index)] for index in indices]
    return {key: torch.stack([sample[key] for sample in samples]) for key in samples[0]}


def _check_positive(**values: int) -> None:
    """Raise ConfigError naming the first value that is not a positive integer."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def _check_in_range(name: str, value: int, stop: int | None) -> None:
    """Raise ConfigError unless ``0 <= value`` (and ``value < stop`` when ``stop`` is given)."""
    valid = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    if valid and stop is not None:
        valid = value < stop
    if not valid:
        bound = "a non-negative integer" if stop is None else f"an integer in [0, {stop})"
        raise ConfigError(f"{name} must be {bound}, got {value!r}")
