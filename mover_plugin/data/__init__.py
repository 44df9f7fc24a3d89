"""Training data for the example Megatron-Core GPT pretraining script.

The pipeline has four steps, one module each:

* :mod:`~mover_plugin.data.corpus` generates the synthetic text corpus shipped with the package;
* :mod:`~mover_plugin.data.tokenizer` maps text to byte-level token ids;
* :mod:`~mover_plugin.data.build_indexed` writes a corpus as a Megatron indexed dataset
  (``.bin`` + ``.idx``), and builds the shipped corpus into a cache folder on first use;
* :mod:`~mover_plugin.data.gpt_data` wraps an indexed dataset in Megatron's ``GPTDataset`` and
  computes which samples each data-parallel rank reads in each micro-batch.

Importing this package does not import Megatron-Core or torch; the functions that need them
import them when called.
"""

from mover_plugin.data.build_indexed import build_indexed_dataset, ensure_default_dataset
from mover_plugin.data.corpus import default_corpus_path, generate_documents
from mover_plugin.data.gpt_data import (
    build_gpt_dataset,
    get_microbatch,
    microbatch_sample_indices,
    num_microbatches,
)
from mover_plugin.data.tokenizer import ByteTokenizer, make_byte_tokenizer

__all__ = [
    "ByteTokenizer",
    "build_gpt_dataset",
    "build_indexed_dataset",
    "default_corpus_path",
    "ensure_default_dataset",
    "generate_documents",
    "get_microbatch",
    "make_byte_tokenizer",
    "microbatch_sample_indices",
    "num_microbatches",
]
