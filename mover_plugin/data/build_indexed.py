"""Turn a JSON-lines text corpus into a Megatron-Core indexed dataset (``.bin`` + ``.idx``).

This is a small counterpart of Megatron-LM's ``tools/preprocess_data.py`` for the byte-level
tokenizer: every JSON line is one document, tokenized with
:class:`~mover_plugin.data.tokenizer.ByteTokenizer` and followed by the end-of-document id, and
the token files are written with ``megatron.core.datasets.indexed_dataset.IndexedDatasetBuilder``::

    python -m mover_plugin.data.build_indexed --input corpus.jsonl --output-prefix data/corpus

Both files are written under temporary names in the destination folder and renamed into place,
the ``.bin`` before the ``.idx``, so a reader that finds the ``.idx`` also finds a complete
``.bin``, and processes racing to build the same prefix from the same input never expose a
half-written file. An existing valid dataset is kept unless a rebuild is forced; a forced
rebuild replaces the two files one after the other, so it should not run while the old dataset
is being read.

:func:`ensure_default_dataset` builds the corpus shipped with the package into a cache folder
once, under a name that includes a hash of the corpus, and returns its prefix.

Megatron is imported only by the functions that read or write token files.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import secrets
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from mover_plugin.data.corpus import JSON_KEY, default_corpus_path
from mover_plugin.data.tokenizer import ByteTokenizer
from mover_plugin.errors import ConfigError

logger = logging.getLogger(__name__)

CACHE_ENV_VAR = "MOVER_PLUGIN_CACHE"
"""Environment variable naming the folder :func:`ensure_default_dataset` builds into."""

FORMAT_VERSION = 1
"""Part of cached dataset names; raised whenever the token layout written here changes."""

_TOKEN_DTYPE = "uint16"
"""The numpy dtype of the token ids on disk; the 257-id vocabulary fits in 16 bits."""


def read_documents(input_path: str | os.PathLike[str], json_key: str = JSON_KEY) -> Iterator[str]:
    """Yield the text under ``json_key`` of every non-blank line of a JSON-lines file.

    Raises :class:`~mover_plugin.errors.ConfigError` naming the file (and the line number) for a
    missing file, a line that is not a JSON object, or a line without a string under the key.
    """
    path = Path(input_path)
    if not path.is_file():
        raise ConfigError(f"corpus file {str(path)!r} does not exist or is not a file")
    with open(path, encoding="utf-8") as stream:
        for number, line in enumerate(stream, start=1):
            if line.strip():
                yield _document_text(line, json_key, f"{path}:{number}")


def _document_text(line: str, json_key: str, where: str) -> str:
    """Return the text of one JSON line; ``where`` names file and line in errors."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ConfigError(f"{where}: not valid JSON ({error.msg})") from error
    if not isinstance(record, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if json_key not in record:
        keys = ", ".join(sorted(map(str, record))) or "none"
        raise ConfigError(f"{where}: no key {json_key!r} (keys present: {keys})")
    text = record[json_key]
    if not isinstance(text, str):
        raise ConfigError(f"{where}: {json_key!r} holds {type(text).__name__}, not a string")
    return text


def is_valid_dataset(output_prefix: str | os.PathLike[str]) -> bool:
    """Return whether ``PREFIX.idx`` and ``PREFIX.bin`` exist, parse and agree in size."""
    idx_path, bin_path = _paths(output_prefix)
    if not (os.path.isfile(idx_path) and os.path.isfile(bin_path)):
        return False
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    try:
        index = IndexedDataset(os.fspath(output_prefix), mmap=False).index
        if len(index) == 0:
            return os.path.getsize(bin_path) == 0
        end = int(index.sequence_pointers[-1]) + int(index.sequence_lengths[-1]) * index.dtype_size
        return end == os.path.getsize(bin_path)
    except Exception:  # any unreadable index makes the dataset invalid; it will be rebuilt
        logger.debug("indexed dataset at %s is not readable", output_prefix, exc_info=True)
        return False


def build_indexed_dataset(
    input_path: str | os.PathLike[str],
    output_prefix: str | os.PathLike[str],
    json_key: str = JSON_KEY,
    *,
    force: bool = False,
) -> str:
    """Build ``PREFIX.bin`` and ``PREFIX.idx`` from a JSON-lines corpus; return the prefix.

    Each non-blank line is one document: its UTF-8 bytes followed by the end-of-document id.
    When a valid dataset already exists at the prefix it is left untouched unless ``force``.
    Raises :class:`~mover_plugin.errors.ConfigError` for a missing input file, a bad line, or a
    corpus without documents; nothing is written at the prefix then.
    """
    prefix = os.fspath(output_prefix)
    if not os.path.isfile(input_path):
        raise ConfigError(f"corpus file {os.fspath(input_path)!r} does not exist or is not a file")
    if not force and is_valid_dataset(prefix):
        logger.info("indexed dataset %s exists; not rebuilding", prefix)
        return prefix
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    idx_path, bin_path = _paths(prefix)
    tmp_idx, tmp_bin = _temporary_name(idx_path), _temporary_name(bin_path)
    try:
        count = _write_token_files(read_documents(input_path, json_key), tmp_bin, tmp_idx)
        if count == 0:
            raise ConfigError(f"corpus file {os.fspath(input_path)!r} holds no documents")
        os.replace(tmp_bin, bin_path)
        os.replace(tmp_idx, idx_path)
    finally:
        for leftover in (tmp_bin, tmp_idx):
            Path(leftover).unlink(missing_ok=True)
    logger.info("built indexed dataset %s from %d documents", prefix, count)
    return prefix


def _write_token_files(documents: Iterator[str], bin_path: str, idx_path: str) -> int:
    """Write one sequence per document to the given files; return the document count."""
    import numpy
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    tokenizer = ByteTokenizer()
    dtype = getattr(numpy, _TOKEN_DTYPE)
    builder = IndexedDatasetBuilder(bin_path, dtype=dtype)
    count = 0
    try:
        for text in documents:
            ids = tokenizer.tokenize(text) + [tokenizer.eod]
            builder.add_item(torch.tensor(ids, dtype=torch.int32))
            builder.end_document()
            count += 1
    except BaseException:
        builder.data_file.close()
        raise
    builder.finalize(idx_path)
    return count


def corpus_digest(input_path: str | os.PathLike[str]) -> str:
    """Return the SHA-256 hex digest of a file's bytes."""
    digest = hashlib.sha256()
    with open(input_path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def default_cache_dir() -> str:
    """Return ``$MOVER_PLUGIN_CACHE`` if set, else ``~/.cache/mover_plugin``."""
    configured = os.environ.get(CACHE_ENV_VAR)
    if configured:
        return os.path.abspath(os.path.expanduser(configured))
    return os.path.join(os.path.expanduser("~"), ".cache", "mover_plugin")


def ensure_default_dataset(cache_dir: str | None = None) -> str:
    """Build the shipped corpus into ``cache_dir`` unless already built; return the prefix.

    ``cache_dir`` defaults to :func:`default_cache_dir`. The file names hold a hash of the corpus
    and the format version, so a changed corpus gets a new dataset instead of a stale one.
    """
    corpus = default_corpus_path()
    if not os.path.isfile(corpus):
        raise ConfigError(f"the shipped corpus {corpus!r} is missing; reinstall mover_plugin")
    folder = cache_dir if cache_dir is not None else default_cache_dir()
    name = f"corpus-{corpus_digest(corpus)[:16]}-v{FORMAT_VERSION}_text_document"
    return build_indexed_dataset(corpus, os.path.join(folder, name))


def _paths(prefix: str | os.PathLike[str]) -> tuple[str, str]:
    """Return the ``.idx`` and ``.bin`` paths of a dataset prefix."""
    prefix = os.fspath(prefix)
    return prefix + ".idx", prefix + ".bin"


def _temporary_name(path: str) -> str:
    """Return an unused name next to ``path``, unique to this process and call."""
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m mover_plugin.data.build_indexed",
        description="Tokenize a JSON-lines corpus byte by byte into a Megatron indexed dataset.",
    )
    parser.add_argument("--input", required=True, help="the .jsonl corpus, one document a line")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    parser.add_argument(
        "--json-key", default=JSON_KEY, help=f"key holding the text (default {JSON_KEY!r})"
    )
    parser.add_argument(
        "--force", action="store_true", help="rebuild even if a valid dataset exists"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the process exit status."""
    args = _parse_args(argv)
    try:
        prefix = build_indexed_dataset(
            args.input, args.output_prefix, args.json_key, force=args.force
        )
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(prefix)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
