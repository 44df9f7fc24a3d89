"""Tests of the data pipeline: corpus, tokenizer, indexed dataset, GPT samples and sample order."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from mover_plugin.data import build_indexed, corpus, gpt_data
from mover_plugin.data.build_indexed import build_indexed_dataset, ensure_default_dataset
from mover_plugin.data.gpt_data import (
    build_gpt_dataset,
    get_microbatch,
    microbatch_sample_indices,
    num_microbatches,
)
from mover_plugin.data.tokenizer import EOD_ID, ByteTokenizer, make_byte_tokenizer
from mover_plugin.errors import ConfigError

SEQ_LENGTH = 32


# ---------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def shipped_texts() -> list[str]:
    with open(corpus.default_corpus_path(), encoding="utf-8") as stream:
        return [json.loads(line)["text"] for line in stream]


@pytest.fixture(scope="module")
def shipped_prefix(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("indexed")
    return build_indexed_dataset(corpus.default_corpus_path(), str(folder / "shipped"))


def _write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def _small_corpus(folder: Path, texts: tuple[str, ...] = ("one doc", "two docs")) -> Path:
    return _write_lines(folder / "small.jsonl", [json.dumps({"text": text}) for text in texts])


def _stat(path: str) -> tuple[int, int, int]:
    info = os.stat(path)
    return info.st_ino, info.st_mtime_ns, info.st_size


# ---------------------------------------------------------------------------------------------
# corpus


def test_corpus_generation_is_deterministic_and_seeded() -> None:
    first = corpus.generate_documents(20, seed=5)
    assert first == corpus.generate_documents(20, seed=5)
    assert first != corpus.generate_documents(20, seed=6)
    assert len(first) == 20 and all(text.strip() for text in first)


def test_shipped_corpus_equals_default_generation(shipped_texts: list[str]) -> None:
    path = corpus.default_corpus_path()
    data = Path(path).read_bytes()
    assert data == corpus.corpus_jsonl(corpus.generate_documents()).encode("utf-8")
    assert 150_000 <= len(data) <= 400_000
    assert len(shipped_texts) == corpus.DEFAULT_NUM_DOCUMENTS


def test_corpus_main_writes_requested_corpus(tmp_path: Path) -> None:
    output = tmp_path / "sub" / "out.jsonl"
    assert corpus.main(["--output", str(output), "--documents", "3", "--seed", "7"]) == 0
    expected = corpus.corpus_jsonl(corpus.generate_documents(3, seed=7))
    assert output.read_text(encoding="utf-8") == expected
    assert [p.name for p in output.parent.iterdir()] == ["out.jsonl"]


def test_corpus_rejects_no_documents() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        corpus.generate_documents(0)


# ---------------------------------------------------------------------------------------------
# tokenizer


def test_tokenizer_round_trip_and_special_ids() -> None:
    tokenizer = make_byte_tokenizer()
    assert isinstance(tokenizer, ByteTokenizer)
    text = "The red box is on the table. Ünïcödé ✓\n"
    ids = tokenizer.tokenize(text)
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.detokenize(ids + [tokenizer.eod]) == text
    assert (tokenizer.vocab_size, tokenizer.eod, tokenizer.eos) == (257, 256, 256)
    assert tokenizer.pad not in range(tokenizer.vocab_size)
    assert len(tokenizer.vocab) == len(tokenizer.inv_vocab) == 257
    assert tokenizer.vocab["<eod>"] == EOD_ID
    json.dumps(tokenizer.unique_identifiers)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tokenizer.detokenize([65, 257])


def test_importing_data_package_does_not_import_megatron() -> None:
    code = (
        "import sys, mover_plugin, mover_plugin.data, mover_plugin.data.tokenizer;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('megatron', 'torch')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


# ---------------------------------------------------------------------------------------------
# indexed dataset


def test_indexed_dataset_holds_corpus_documents(
    shipped_prefix: str, shipped_texts: list[str]
) -> None:
    import numpy
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(shipped_prefix)
    assert len(dataset) == len(shipped_texts)
    assert list(dataset.document_indices) == list(range(len(shipped_texts) + 1))
    assert dataset.index.dtype == numpy.uint16
    for number, text in enumerate(shipped_texts):
        expected = list(text.encode("utf-8")) + [EOD_ID]
        assert dataset[number].tolist() == expected


def test_second_build_leaves_existing_files_untouched(tmp_path: Path) -> None:
    source = _small_corpus(tmp_path)
    prefix = str(tmp_path / "out" / "small")
    assert build_indexed_dataset(source, prefix) == prefix
    before = [_stat(prefix + suffix) for suffix in (".bin", ".idx")]
    assert build_indexed_dataset(source, prefix) == prefix
    assert [_stat(prefix + suffix) for suffix in (".bin", ".idx")] == before
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["small.bin", "small.idx"]

    build_indexed_dataset(source, prefix, force=True)
    assert _stat(prefix + ".bin")[0] != before[0][0]
    assert build_indexed.is_valid_dataset(prefix)


def test_invalid_existing_dataset_is_rebuilt(tmp_path: Path) -> None:
    source = _small_corpus(tmp_path)
    prefix = str(tmp_path / "small")
    build_indexed_dataset(source, prefix)
    good = Path(prefix + ".bin").read_bytes()
    Path(prefix + ".bin").write_bytes(good[:-3])
    assert not build_indexed.is_valid_dataset(prefix)
    build_indexed_dataset(source, prefix)
    assert Path(prefix + ".bin").read_bytes() == good


def test_racing_builds_leave_one_complete_dataset(tmp_path: Path) -> None:
    source = _small_corpus(tmp_path, tuple(f"document number {i}" for i in range(200)))
    prefix = str(tmp_path / "race" / "small")
    errors: list[BaseException] = []

    def build() -> None:
        try:
            build_indexed_dataset(source, prefix, force=True)
        except BaseException as error:  # reported by the assertion below
            errors.append(error)

    threads = [threading.Thread(target=build) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert build_indexed.is_valid_dataset(prefix)
    assert sorted(p.name for p in (tmp_path / "race").iterdir()) == ["small.bin", "small.idx"]


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ([], "holds no documents"),
        (["", "   "], "holds no documents"),
        (['{"text": "fine"}', "{not json"], "bad.jsonl:2: not valid JSON"),
        (
            ['{"text": "fine"}', "", '{"body": "x"}'],
            "bad.jsonl:3: no key 'text' (keys present: body)",
        ),
        (['{"text": 3}'], "bad.jsonl:1: 'text' holds int, not a string"),
        (['["text"]'], "bad.jsonl:1: expected a JSON object, got list"),
    ],
)
def test_bad_corpus_is_reported_and_nothing_written(
    tmp_path: Path, lines: list[str], message: str
) -> None:
    source = _write_lines(tmp_path / "bad.jsonl", lines)
    with pytest.raises(ConfigError) as caught:
        build_indexed_dataset(source, str(tmp_path / "out" / "bad"))
    assert message in str(caught.value)
    assert list((tmp_path / "out").iterdir()) == []


def test_missing_input_and_custom_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        build_indexed_dataset(tmp_path / "absent.jsonl", str(tmp_path / "x"))
    source = _write_lines(tmp_path / "body.jsonl", ['{"body": "hi"}'])
    prefix = build_indexed_dataset(source, str(tmp_path / "body"), json_key="body")
    assert Path(prefix + ".bin").read_bytes() == bytes([ord("h"), 0, ord("i"), 0, 0, 1])


def test_build_indexed_main(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = _small_corpus(tmp_path)
    prefix = str(tmp_path / "cli")
    assert build_indexed.main(["--input", str(source), "--output-prefix", prefix]) == 0
    assert capsys.readouterr().out.strip() == prefix
    missing = str(tmp_path / "no.jsonl")
    assert build_indexed.main(["--input", missing, "--output-prefix", prefix]) == 2
    assert "no.jsonl" in capsys.readouterr().err


def test_ensure_default_dataset_builds_once_per_corpus_hash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shipped_texts: list[str]
) -> None:
    monkeypatch.setenv(build_indexed.CACHE_ENV_VAR, str(tmp_path / "env-cache"))
    prefix = ensure_default_dataset()
    digest = build_indexed.corpus_digest(corpus.default_corpus_path())
    assert prefix.startswith(str(tmp_path / "env-cache"))
    assert digest[:16] in os.path.basename(prefix)
    before = _stat(prefix + ".idx")
    assert ensure_default_dataset() == prefix
    assert _stat(prefix + ".idx") == before

    explicit = ensure_default_dataset(str(tmp_path / "explicit"))
    assert os.path.dirname(explicit) == str(tmp_path / "explicit")
    assert Path(explicit + ".bin").read_bytes() == Path(prefix + ".bin").read_bytes()


# ---------------------------------------------------------------------------------------------
# GPT dataset


def test_gpt_samples_have_megatron_layout(shipped_prefix: str) -> None:
    import torch

    folder_before = sorted(os.listdir(os.path.dirname(shipped_prefix)))
    dataset = build_gpt_dataset(
        shipped_prefix, seq_length=SEQ_LENGTH, num_samples=64, seed=3, tokenizer=ByteTokenizer()
    )
    assert len(dataset) >= 64
    sample = dataset[0]
    assert set(sample) == set(gpt_data.SAMPLE_KEYS)
    assert sample["tokens"].shape == sample["labels"].shape == (SEQ_LENGTH,)
    assert sample["tokens"].dtype == sample["labels"].dtype == torch.int64
    assert sample["loss_mask"].dtype == torch.float32 and bool(sample["loss_mask"].all())
    assert torch.equal(sample["position_ids"], torch.arange(SEQ_LENGTH))
    mask = sample["attention_mask"]
    assert mask.shape == (1, SEQ_LENGTH, SEQ_LENGTH) and mask.dtype == torch.bool
    assert torch.equal(mask[0], torch.ones(SEQ_LENGTH, SEQ_LENGTH).triu(1).bool())
    assert torch.equal(sample["tokens"][1:], sample["labels"][:-1])
    assert int(sample["tokens"].max()) <= EOD_ID
    # the indices stay in memory: nothing is cached next to the data
    assert sorted(os.listdir(os.path.dirname(shipped_prefix))) == folder_before


def test_gpt_dataset_is_reproducible_from_seed(shipped_prefix: str) -> None:
    import torch

    def tokens(seed: int) -> torch.Tensor:
        dataset = build_gpt_dataset(
            shipped_prefix, seq_length=SEQ_LENGTH, num_samples=16, seed=seed,
            tokenizer=ByteTokenizer(),
        )  # fmt: skip
        return get_microbatch(dataset, range(16))["tokens"]

    assert torch.equal(tokens(11), tokens(11))
    assert not torch.equal(tokens(11), tokens(12))


def test_gpt_dataset_argument_errors(shipped_prefix: str, tmp_path: Path) -> None:
    tokenizer = ByteTokenizer()
    with pytest.raises(ConfigError, match="no indexed dataset at prefix"):
        build_gpt_dataset(
            str(tmp_path / "none"), seq_length=8, num_samples=1, seed=0, tokenizer=tokenizer
        )
    with pytest.raises(ConfigError, match="seq_length must be a positive integer, got 0"):
        build_gpt_dataset(shipped_prefix, seq_length=0, num_samples=1, seed=0, tokenizer=tokenizer)


def test_get_microbatch_stacks_samples(shipped_prefix: str) -> None:
    import torch

    dataset = build_gpt_dataset(
        shipped_prefix, seq_length=SEQ_LENGTH, num_samples=8, seed=0, tokenizer=ByteTokenizer()
    )
    batch = get_microbatch(dataset, [5, 2])
    assert batch["tokens"].shape == (2, SEQ_LENGTH)
    assert batch["attention_mask"].shape == (2, 1, SEQ_LENGTH, SEQ_LENGTH)
    assert torch.equal(batch["labels"][1], dataset[2]["labels"])
    with pytest.raises(ConfigError, match=f"sample index {len(dataset)} is outside"):
        get_microbatch(dataset, [0, len(dataset)])
    with pytest.raises(ConfigError, match="at least one"):
        get_microbatch(dataset, [])


_COLLECTIVES = (
    "barrier", "all_reduce", "broadcast", "all_gather", "all_gather_object",
    "broadcast_object_list", "gather", "scatter", "reduce", "monitored_barrier",
)  # fmt: skip


def test_gpt_dataset_builds_without_collectives_in_gloo_group(
    shipped_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    def build() -> torch.Tensor:
        dataset = build_gpt_dataset(
            shipped_prefix, seq_length=SEQ_LENGTH, num_samples=8, seed=9,
            tokenizer=ByteTokenizer(),
        )  # fmt: skip
        return get_microbatch(dataset, range(8))["tokens"]

    expected = build()
    assert not dist.is_initialized()

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("building the dataset made a collective call")

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
        timeout=datetime.timedelta(seconds=30),
    )  # fmt: skip
    try:
        for name in _COLLECTIVES:
            monkeypatch.setattr(dist, name, forbidden)
        assert torch.equal(build(), expected)
    finally:
        monkeypatch.undo()
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# sample order


def _sampler_reference(total: int, micro_batch_size: int, dp_size: int, dp_rank: int) -> list:
    """The micro-batches one rank reads, in the way Megatron-LM's pretraining sampler slices."""
    per_step = micro_batch_size * dp_size
    return [
        list(range(start + dp_rank * micro_batch_size, start + (dp_rank + 1) * micro_batch_size))
        for start in range(0, total - per_step + 1, per_step)
    ]


@pytest.mark.parametrize(
    ("mbs", "dp", "gbs"), [(1, 1, 1), (2, 1, 8), (1, 4, 8), (2, 3, 12), (4, 64, 4096), (3, 5, 1500)]
)
def test_microbatch_indices_cover_each_global_batch_once(mbs: int, dp: int, gbs: int) -> None:
    count = num_microbatches(micro_batch_size=mbs, data_parallel_size=dp, global_batch_size=gbs)
    assert count == gbs // (mbs * dp)
    sizes = dict(micro_batch_size=mbs, data_parallel_size=dp, global_batch_size=gbs)
    for iteration in (0, 1, 7):
        seen = [
            index
            for microbatch in range(count)
            for rank in range(dp)
            for index in microbatch_sample_indices(iteration, microbatch, rank, **sizes)
        ]
        assert sorted(seen) == list(range(iteration * gbs, (iteration + 1) * gbs))
    iterations = 3
    for rank in {0, dp // 2, dp - 1}:
        ours = [
            list(microbatch_sample_indices(iteration, microbatch, rank, **sizes))
            for iteration in range(iterations)
            for microbatch in range(count)
        ]
        assert ours == _sampler_reference(iterations * gbs, mbs, dp, rank)


@pytest.mark.parametrize(
    ("args", "sizes", "message"),
    [
        ((0, 0, 0), (2, 2, 6), r"global_batch_size \(6\) must be a multiple of"),
        ((0, 0, 0), (0, 1, 4), "micro_batch_size must be a positive integer, got 0"),
        ((0, 0, 2), (1, 2, 4), r"dp_rank must be an integer in \[0, 2\), got 2"),
        ((0, 2, 0), (1, 2, 4), r"microbatch must be an integer in \[0, 2\), got 2"),
        ((-1, 0, 0), (1, 2, 4), "iteration must be a non-negative integer, got -1"),
    ],
)
def test_microbatch_indices_reject_bad_arguments(
    args: tuple[int, int, int], sizes: tuple[int, int, int], message: str
) -> None:
    mbs, dp, gbs = sizes
    with pytest.raises(ConfigError, match=message):
        microbatch_sample_indices(
            *args, micro_batch_size=mbs, data_parallel_size=dp, global_batch_size=gbs
        )
