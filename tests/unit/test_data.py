"""k3train.data: the MMIDIDX format, tokenizers, the default corpus, packing, split, blending,
shuffling, the resumable sampler and tools/preprocess_data.py. Tiny datasets only."""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from k3train.data import (
    ByteTokenizer,
    DataConfig,
    DataError,
    IndexedDataset,
    IndexedDatasetWriter,
    PackedDataset,
    build_data,
    build_tokenizer,
    default_corpus_prefix,
    greedy_blend,
    split_documents,
    write_indexed_dataset,
)
from k3train.data.samples import permutation

CHECKOUT = Path(__file__).resolve().parents[2]
EOS = ByteTokenizer.eos_id
VOCAB = 384  # the debug model's vocabulary


def random_documents(count: int, seed: int, low: int = 4, high: int = 40) -> list[np.ndarray]:
    """Documents of random bytes (no eos inside) with random lengths in [low, high)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=int(rng.integers(low, high))) for _ in range(count)]


def byte_dataset(tmp_path: Path, name: str, documents) -> str:
    """Write `documents` as a uint16 dataset (byte-tokenizer vocabulary) and return the prefix."""
    prefix = str(tmp_path / name)
    write_indexed_dataset(prefix, documents, vocab_size=ByteTokenizer.vocab_size)
    return prefix


# -- the indexed dataset format ---------------------------------------------------------------


def test_round_trip_with_multi_sequence_and_empty_documents(tmp_path):
    with IndexedDatasetWriter(tmp_path / "ds", vocab_size=259) as writer:
        writer.add_document([1, 2, 3])
        writer.add_sequence([4, 5])
        writer.add_sequence([6])
        writer.end_document()
        writer.add_document([])
        writer.add_document(np.arange(250, 259))
    ds = IndexedDataset(tmp_path / "ds")
    assert ds.dtype == np.uint16
    assert len(ds) == 5 and ds.num_documents == 4 and ds.num_tokens == 15
    assert ds.get(1).tolist() == [4, 5] and ds[2].tolist() == [6] and ds.get(3).tolist() == []
    assert ds.get(4, offset=2, length=3).tolist() == [252, 253, 254]
    assert ds.document_indices.tolist() == [0, 1, 3, 4, 5]
    assert ds.get_document(1).tolist() == [4, 5, 6]
    starts, ends = ds.document_spans()
    assert starts.tolist() == [0, 3, 6, 6] and ends.tolist() == [3, 6, 6, 15]
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]  # temporaries renamed away


def test_large_vocabulary_uses_int32(tmp_path):
    write_indexed_dataset(tmp_path / "big", [[70000, 1]], vocab_size=100_000)
    ds = IndexedDataset(tmp_path / "big")
    assert ds.dtype == np.int32 and ds.get(0).tolist() == [70000, 1]
    with pytest.raises(DataError, match="do not fit uint16"):
        write_indexed_dataset(tmp_path / "small", [[70000]], vocab_size=259)


def test_idx_bytes_match_megatron_layout(tmp_path):
    """Pins docs/design.md §2.3 byte for byte: documents [[1, 2, 3], [4, 5]], uint16."""
    write_indexed_dataset(tmp_path / "tiny", [[1, 2, 3], [4, 5]], vocab_size=259)
    expected_idx = (
        b"MMIDIDX\x00\x00"  # magic
        + b"\x01\x00\x00\x00\x00\x00\x00\x00"  # version 1, uint64
        + b"\x08"  # dtype code 8 = uint16
        + b"\x02\x00\x00\x00\x00\x00\x00\x00"  # 2 sequences
        + b"\x03\x00\x00\x00\x00\x00\x00\x00"  # 3 document indices (D + 1)
        + b"\x03\x00\x00\x00"
        + b"\x02\x00\x00\x00"  # lengths, int32
        + b"\x00\x00\x00\x00\x00\x00\x00\x00"  # byte offsets, int64: 0
        + b"\x06\x00\x00\x00\x00\x00\x00\x00"  #   3 tokens * 2 bytes
        + b"\x00\x00\x00\x00\x00\x00\x00\x00"  # document indices, int64: 0, 1, 2
        + b"\x01\x00\x00\x00\x00\x00\x00\x00"
        + b"\x02\x00\x00\x00\x00\x00\x00\x00"
    )
    assert (tmp_path / "tiny.idx").read_bytes() == expected_idx
    assert (tmp_path / "tiny.bin").read_bytes() == b"\x01\x00\x02\x00\x03\x00\x04\x00\x05\x00"


def _corrupt(kind: str, bin_path: Path, idx_path: Path) -> Path:
    """Damage one file the way `kind` says; return the file the error must name."""
    idx = bytearray(idx_path.read_bytes())
    if kind == "missing bin":
        bin_path.unlink()
        return bin_path
    if kind == "missing idx":
        idx_path.unlink()
        return idx_path
    if kind == "truncated bin":
        bin_path.write_bytes(bin_path.read_bytes()[:-2])
        return bin_path
    if kind == "bad magic":
        idx[:7] = b"NOTIDX!"
    elif kind == "bad version":
        idx[9:17] = struct.pack("<Q", 2)
    elif kind == "unknown dtype":
        idx[17] = 42
    elif kind == "truncated idx":
        idx = idx[:-5]
    elif kind == "truncated header":
        idx = idx[:20]
    idx_path.write_bytes(bytes(idx))
    return idx_path


@pytest.mark.parametrize(
    "kind",
    [
        "missing bin",
        "missing idx",
        "truncated bin",
        "bad magic",
        "bad version",
        "unknown dtype",
        "truncated idx",
        "truncated header",
    ],
)
def test_damaged_dataset_errors_name_the_file(tmp_path, kind):
    bin_path, idx_path = write_indexed_dataset(tmp_path / "ds", [[1, 2, 3], [4, 5]], vocab_size=259)
    culprit = _corrupt(kind, bin_path, idx_path)
    with pytest.raises(DataError) as info:
        IndexedDataset(tmp_path / "ds")
    message = str(info.value)
    assert str(culprit) in message and "preprocess_data" in message


def test_failed_write_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(tmp_path / "ds", vocab_size=259) as writer:
            writer.add_document([1, 2])
            raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []


# -- tokenizers ----------------------------------------------------------------------------


def test_byte_tokenizer():
    tokenizer = build_tokenizer("byte")
    ids = tokenizer.encode("héllo")
    assert ids == list("héllo".encode()) and tokenizer.decode(ids + [EOS]) == "héllo"
    assert (tokenizer.vocab_size, tokenizer.eos_id) == (259, 256)


def test_huggingface_tokenizer(tmp_path):
    import tokenizers as hf

    assert hasattr(hf, "Tokenizer")  # the PyPI package, not k3train.data.tokenizers
    tokenizer = hf.Tokenizer(hf.models.BPE())
    tokenizer.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = hf.decoders.ByteLevel()
    trainer = hf.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>", "</s>"], initial_alphabet=hf.pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(["the quick brown fox", "jumps over the lazy dog"] * 20, trainer)
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))

    loaded = build_tokenizer(str(path))
    assert loaded.eos_id == tokenizer.token_to_id("</s>") and loaded.vocab_size == tokenizer.get_vocab_size()
    assert loaded.decode(loaded.encode("the lazy fox")) == "the lazy fox"
    assert build_tokenizer(str(path), eos_token="<pad>").eos_id == tokenizer.token_to_id("<pad>")
    with pytest.raises(DataError, match="data.eos_token"):
        build_tokenizer(str(path), eos_token="<nope>")
    with pytest.raises(DataError, match="neither 'byte'"):
        build_tokenizer(str(tmp_path / "missing.json"))


# -- packing, split, blend, shuffle --------------------------------------------------------


def test_packing_puts_eos_between_documents_and_covers_every_token(tmp_path):
    # Document i holds 100*i+1 .. 100*i+n: unique ids, eos = 0. Stream = 20 + 5 eos = 25 tokens,
    # so seq_length 4 packs it into exactly (25 - 1) / 4 = 6 samples.
    lengths = [5, 3, 7, 1, 4]
    documents = [np.arange(1, n + 1) + 100 * i for i, n in enumerate(lengths)]
    write_indexed_dataset(tmp_path / "ds", documents, vocab_size=1000)
    ds = IndexedDataset(tmp_path / "ds")
    stream = np.concatenate([np.append(doc, 0) for doc in documents])
    last_tokens = {int(doc[-1]) for doc in documents}

    ordered = PackedDataset(ds, np.arange(5), 4, 0, seed=1, salt=0, shuffle=False, name="ds")
    assert ordered.samples_per_epoch == 6
    rows = ordered.samples(np.arange(6))
    rebuilt = np.concatenate([rows[0]] + [row[1:] for row in rows[1:]])  # rows overlap by one token
    assert rebuilt.tolist() == stream.tolist()

    shuffled = PackedDataset(ds, np.arange(5), 4, 0, seed=1, salt=0, shuffle=True, name="ds")
    for epoch in range(3):
        rows = shuffled.samples(np.arange(6) + 6 * epoch)
        inputs = rows[:, :-1].ravel()
        # Every document token is an input exactly once per epoch; every eos but the stream's last too.
        assert sorted(inputs[inputs != 0].tolist()) == sorted(np.concatenate(documents).tolist())
        assert (inputs == 0).sum() == len(documents) - 1
        for row in rows:
            for a, b in zip(row[:-1].tolist(), row[1:].tolist()):
                if a != 0:
                    assert b == (0 if a in last_tokens else a + 1)  # eos right after each document


def test_documents_already_ending_in_eos_get_no_second_eos(tmp_path):
    write_indexed_dataset(tmp_path / "ds", [[1, 2, 0], [3, 0], [4, 5, 6, 0]], vocab_size=10)
    packed = PackedDataset(
        IndexedDataset(tmp_path / "ds"), np.arange(3), 2, 0, seed=0, salt=0, shuffle=False, name="ds"
    )
    assert packed.num_tokens == 9
    assert packed.samples(np.arange(4)).tolist() == [[1, 2, 0], [0, 3, 0], [0, 4, 5], [5, 6, 0]]


def test_split_is_disjoint_deterministic_and_sized():
    train, valid = split_documents(100, 0.1)
    assert len(valid) == 10 and len(train) == 90
    assert not set(train) & set(valid) and sorted([*train, *valid]) == list(range(100))
    assert np.array_equal(split_documents(100, 0.1)[1], valid)
    assert len(split_documents(5, 0.02)[1]) == 1  # a positive fraction holds out at least one
    assert len(split_documents(1, 0.5)[1]) == 0 and len(split_documents(10, 0.0)[1]) == 0


def test_validation_batches_come_from_validation_documents_only(tmp_path):
    # Each document is one repeated byte (its index); validation documents are known from the split.
    documents = [np.full(30, i) for i in range(50)]
    prefix = byte_dataset(tmp_path, "ds", documents)
    config = DataConfig(paths=[prefix], seq_length=8, validation_fraction=0.2)
    data = build_data(config, global_batch_size=4, total_steps=2, vocab_size=VOCAB)
    train_ids, valid_ids = split_documents(50, 0.2)
    batches = list(data.validation_batches(4))
    assert len(batches) == data.num_validation_batches(4) > 0
    seen = set(torch.cat(batches).unique().tolist()) - {EOS}
    assert seen <= set(valid_ids.tolist())
    again = list(data.validation_batches(4, dp_rank=1, dp_size=2))
    assert len(again) == len(batches) and all(torch.equal(a, b[2:]) for a, b in zip(again, batches))
    assert len(list(data.validation_batches(4, 1))) == 1
    trained = set(torch.cat([data.next_global_batch(4) for _ in range(2)]).unique().tolist()) - {EOS}
    assert trained <= set(train_ids.tolist())


def test_greedy_blend_follows_weights_within_one_sample():
    weights = [0.5, 0.3, 0.2]
    dataset_ids, sample_ids, taken = greedy_blend(weights, [0, 0, 0], 1000)
    counts = np.cumsum(np.eye(3, dtype=np.int64)[dataset_ids], axis=0)
    n = np.arange(1, 1001)[:, None]
    assert np.abs(counts - np.array(weights) * n).max() <= 1.0
    for d in range(3):  # each dataset's samples are drawn in order
        assert sample_ids[dataset_ids == d].tolist() == list(range(int(taken[d])))
    # Drawn in two parts, the stream is the same.
    first = greedy_blend(weights, [0, 0, 0], 400)
    second = greedy_blend(weights, first[2], 600)
    assert np.array_equal(np.concatenate([first[0], second[0]]), dataset_ids)


def test_blended_batches_follow_weights(tmp_path):
    a = byte_dataset(tmp_path, "a", [np.full(40, 1)] * 40)
    b = byte_dataset(tmp_path, "b", [np.full(40, 2)] * 40)
    config = DataConfig(paths=[a, b], weights=[3.0, 1.0], seq_length=8, validation_fraction=0.0)
    data = build_data(config, global_batch_size=8, total_steps=10, vocab_size=VOCAB)
    rows = torch.cat([data.next_global_batch(8) for _ in range(10)])
    from_b = int((rows == 2).any(dim=1).sum())
    assert not ((rows == 1).any(dim=1) & (rows == 2).any(dim=1)).any()  # a sample never mixes datasets
    assert abs(from_b - 20) <= 1


def test_shuffle_is_deterministic_by_seed_and_differs_across_seeds_and_epochs(tmp_path):
    prefix = byte_dataset(tmp_path, "ds", random_documents(60, seed=0))

    def first_batches(seed: int) -> torch.Tensor:
        config = DataConfig(paths=[prefix], seq_length=16, seed=seed, validation_fraction=0.0)
        data = build_data(config, global_batch_size=4, total_steps=3, vocab_size=VOCAB)
        return torch.cat([data.next_global_batch(4) for _ in range(3)])

    assert torch.equal(first_batches(1), first_batches(1))
    assert not torch.equal(first_batches(1), first_batches(2))
    assert not np.array_equal(permutation(50, 1, 0, 0, 0), permutation(50, 1, 0, 1, 0))


# -- the resumable sampler ------------------------------------------------------------------


def _two_dataset_config(tmp_path: Path) -> DataConfig:
    a = byte_dataset(tmp_path, "a", random_documents(30, seed=1))
    b = byte_dataset(tmp_path, "b", random_documents(15, seed=2))
    return DataConfig(paths=[a, b], weights=[0.7, 0.3], seq_length=16, validation_fraction=0.1, max_epochs=4)


def test_resume_yields_exactly_the_next_batches(tmp_path):
    config = _two_dataset_config(tmp_path)  # 10 batches of 8 cross an epoch boundary of both
    data = build_data(config, global_batch_size=8, total_steps=10, vocab_size=VOCAB)
    for _ in range(5):
        data.next_global_batch(8)
    state = json.loads(json.dumps(data.state_dict()))  # survives any checkpoint serialisation
    expected = [data.next_global_batch(8) for _ in range(5)]

    taken = data.state_dict()["taken_per_dataset"]
    assert all(t > packed.samples_per_epoch for t, packed in zip(taken, data.train))  # both reshuffled

    fresh = build_data(config, global_batch_size=8, total_steps=10, vocab_size=VOCAB)
    fresh.load_state_dict(state)
    assert fresh.consumed_samples == 40
    for want in expected:
        assert torch.equal(fresh.next_global_batch(8), want)


def test_dp_ranks_split_the_same_global_batch(tmp_path):
    config = _two_dataset_config(tmp_path)
    single = build_data(config, global_batch_size=8, total_steps=6, vocab_size=VOCAB)
    ranks = [build_data(config, global_batch_size=8, total_steps=6, vocab_size=VOCAB) for _ in range(2)]
    for _ in range(6):
        whole = single.next_global_batch(8)
        parts = [data.next_global_batch(8, dp_rank=r, dp_size=2) for r, data in enumerate(ranks)]
        assert parts[0].shape == (4, 17) and parts[0].dtype == torch.long
        assert torch.equal(torch.cat(parts), whole)


def test_resume_against_other_data_is_refused(tmp_path):
    config = _two_dataset_config(tmp_path)
    data = build_data(config, global_batch_size=8, total_steps=2, vocab_size=VOCAB)
    data.next_global_batch(8)
    config.seq_length = 12
    other = build_data(config, global_batch_size=8, total_steps=2, vocab_size=VOCAB)
    with pytest.raises(DataError, match="data.seq_length 16 -> 12"):
        other.load_state_dict(data.state_dict())
    other.load_state_dict(data.state_dict(), strict=False)
    assert other.consumed_samples == 8


def test_too_small_data_is_refused(tmp_path):
    prefix = byte_dataset(tmp_path, "ds", random_documents(6, seed=3, low=10, high=12))  # ~70 tokens
    config = DataConfig(paths=[prefix], seq_length=16, validation_fraction=0.0)
    with pytest.raises(DataError, match="cannot fill one global batch"):
        build_data(config, global_batch_size=8, total_steps=1, vocab_size=VOCAB)
    with pytest.raises(DataError, match=r"train\.steps = 10 .*data\.max_epochs = 1; raise data\.max_epochs"):
        build_data(config, global_batch_size=2, total_steps=10, vocab_size=VOCAB)
    # Built for fewer steps than it is then asked for: refused when the pass would start.
    data = build_data(config, global_batch_size=2, total_steps=1, vocab_size=VOCAB)
    with pytest.raises(DataError, match="data.max_epochs"):
        for _ in range(10):
            data.next_global_batch(2)
    config.max_epochs = 3
    assert build_data(config, global_batch_size=2, total_steps=5, vocab_size=VOCAB)


def test_vocabulary_checks_name_the_setting(tmp_path):
    prefix = byte_dataset(tmp_path, "ds", random_documents(20, seed=4))
    with pytest.raises(DataError, match=r"model\.vocab_size = 200 .*'byte'"):
        build_data(DataConfig(paths=[prefix]), global_batch_size=2, total_steps=1, vocab_size=200)
    write_indexed_dataset(tmp_path / "wide", [[1, 500, 2] * 20] * 5, vocab_size=1000)
    with pytest.raises(DataError, match=r"wide\.bin holds token ids 1\.\.500, outside model\.vocab_size = 384"):
        build_data(DataConfig(paths=[str(tmp_path / "wide")]), global_batch_size=2, total_steps=1, vocab_size=VOCAB)


# -- the default corpus and the preprocessing tool ------------------------------------------


def test_default_corpus_builds_once_and_is_reused(tmp_path, capsys):
    prefix = default_corpus_prefix(tmp_path, max_bytes=200_000)
    # The first build says what it does and how long it took (seconds of silence otherwise).
    before, after = capsys.readouterr().out.splitlines()
    assert before.startswith("building the default corpus (first use): ") and str(tmp_path) in before
    assert after.startswith("built the default corpus in ") and " s: " in after and "tokens" in after
    ds = IndexedDataset(prefix)
    assert ds.num_documents > 5 and ds.num_tokens <= 200_000 + ds.num_documents
    assert ds.dtype == np.uint16 and int(ds.tokens.max()) == EOS
    stamp = os.stat(prefix + ".bin").st_mtime_ns
    assert default_corpus_prefix(tmp_path, max_bytes=200_000) == prefix
    assert os.stat(prefix + ".bin").st_mtime_ns == stamp
    assert capsys.readouterr().out == ""  # reused: nothing to say
    assert not [p for p in (tmp_path / "corpus").iterdir() if p.name.startswith(".")]

    config = DataConfig(cache_dir=str(tmp_path), corpus_max_bytes=200_000)
    data = build_data(config, global_batch_size=4, total_steps=3, vocab_size=VOCAB)
    assert data.next_global_batch(4).shape == (4, config.seq_length + 1)


def _run_preprocess(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(CHECKOUT / "tools" / "preprocess_data.py"), *args, "--quiet"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_preprocess_cli_txt_and_jsonl(tmp_path):
    text = "First paragraph,\nstill first.\n\nSecond paragraph.\n"
    (tmp_path / "a.txt").write_text(text, encoding="utf-8")
    records = [{"text": "héllo"}, {"text": "world", "id": 2}]
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n", encoding="utf-8")

    done = _run_preprocess("--input", "a.txt", "b.jsonl", "--output-prefix", "out/mixed", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "3 documents" in done.stdout and "uint16" in done.stdout and "mixed.idx" in done.stdout
    ds = IndexedDataset(tmp_path / "out" / "mixed")
    tokenizer = ByteTokenizer()
    assert [int(ds.get_document(d)[-1]) for d in range(3)] == [EOS] * 3
    assert [tokenizer.decode(ds.get_document(d)) for d in range(3)] == [text, "héllo", "world"]

    done = _run_preprocess(
        "--input", "a.txt", "--output-prefix", "paras", "--txt-documents", "paragraph", "--no-append-eos", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    ds = IndexedDataset(tmp_path / "paras")
    assert [tokenizer.decode(ds.get_document(d)) for d in range(ds.num_documents)] == [
        "First paragraph,\nstill first.",
        "Second paragraph.",
    ]


def _preprocess_module():
    """tools/preprocess_data.py imported as a module, to call its `main` in-process."""
    spec = importlib.util.spec_from_file_location("preprocess_data", CHECKOUT / "tools" / "preprocess_data.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_preprocess_reports_bad_jsonl(tmp_path, capsys):
    preprocess_data = _preprocess_module()
    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n', encoding="utf-8")
    status = preprocess_data.main(
        ["--input", str(tmp_path / "bad.jsonl"), "--output-prefix", str(tmp_path / "bad"), "--quiet"]
    )
    assert status == 2 and "bad.jsonl:1" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["bad.jsonl"]  # no .bin/.idx or temporaries left


def test_preprocess_reports_an_unwritable_output_prefix_in_one_line(tmp_path, capsys):
    preprocess_data = _preprocess_module()
    (tmp_path / "a.txt").write_text("hello\n", encoding="utf-8")
    (tmp_path / "taken").write_text("a file, not a folder\n", encoding="utf-8")
    status = preprocess_data.main(
        ["--input", str(tmp_path / "a.txt"), "--output-prefix", str(tmp_path / "taken" / "out"), "--quiet"]
    )
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and "cannot write" in err and "Traceback" not in err
