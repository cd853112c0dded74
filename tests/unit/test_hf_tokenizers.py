"""Tokenizers travel with the Hugging Face conversion, checked with transformers itself: the byte
tokenizer exports as a tokenizer `AutoTokenizer` and `pipeline("text-generation")` load with
k3train's ids; a run trained with a `tokenizer.json` exports into a Kimi Linear folder
transformers loads (its pad id, not transformers' default 163839, sizes the padding index);
round trips keep the special-token ids and the tokenizer files. Tiny models, CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from k3train.checkpoint.hf_tokenizer import SpecialTokens
from k3train.config import load_config, save_config
from k3train.data.tokenizers import ByteTokenizer, HuggingFaceTokenizer
from k3train.model.config import ModelConfig
from tests.unit.test_hf_conversion import _save_run, convert
from tests.unit.test_hf_kimi_linear import _transformers_model, kimi_linear_model_config

transformers = pytest.importorskip("transformers")
hf_tokenizers = pytest.importorskip("tokenizers")
from transformers import AutoTokenizer, KimiLinearForCausalLM, pipeline  # noqa: E402

TEXT = "Hello, wörld ✓ — 日本語 <x> \n\t end"
SPECIAL = ["<pad>", "<s>", "<|endoftext|>"]  # ids 0, 1, 2


def _to_hf(run: Path, out: Path, *extra: str) -> None:
    assert convert.main(["to-hf", "--load", str(run), "--out", str(out), "--dtype", "fp32", "--quiet", *extra]) == 0


def _from_hf(folder: Path, out: Path) -> None:
    assert convert.main(["from-hf", "--load", str(folder), "--out", str(out), "--quiet"]) == 0


def _ids(folder: Path) -> tuple[dict, dict]:
    config = json.loads((folder / "config.json").read_text())
    generation = json.loads((folder / "generation_config.json").read_text())
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {k: config[k] for k in keys}, {k: generation[k] for k in keys}


def _set_tokenizer(run: Path, tokenizer: str) -> None:
    job = load_config(str(run / "config.yaml"), [])
    job.data.tokenizer = tokenizer
    save_config(job, str(run / "config.yaml"))


@pytest.fixture(scope="module")
def bpe_tokenizer(tmp_path_factory) -> Path:
    """A small BPE `tokenizer.json` with pad, bos and eos at ids 0, 1, 2 (a vocabulary of at most
    300, inside the test model's 384)."""
    folder = tmp_path_factory.mktemp("bpe")
    tokenizer = hf_tokenizers.Tokenizer(hf_tokenizers.models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = hf_tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = hf_tokenizers.decoders.ByteLevel()
    trainer = hf_tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIAL,
        initial_alphabet=hf_tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(["the quick brown fox jumps over the lazy dog " * 20, TEXT * 5], trainer)
    assert [tokenizer.token_to_id(t) for t in SPECIAL] == [0, 1, 2]
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def test_byte_tokenizer_export_loads_in_autotokenizer_and_pipeline_with_k3trains_ids(tmp_path):
    _save_run(tmp_path / "run", ModelConfig().replace(num_hidden_layers=2), with_optimizer=False)
    _to_hf(tmp_path / "run", tmp_path / "hf")
    folder = tmp_path / "hf"
    expected = {"bos_token_id": 257, "eos_token_id": 256, "pad_token_id": 258}
    assert _ids(folder) == (expected, expected)
    tokenizer = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=True)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (257, 256, 258)
    ids = tokenizer(TEXT)["input_ids"]
    assert ids == ByteTokenizer().encode(TEXT)  # no special token added: training packs without bos
    assert tokenizer.decode(ids) == TEXT == ByteTokenizer().decode(ids)
    assert tokenizer.decode([256, 72, 105]) == "<|endoftext|>Hi"

    generator = pipeline("text-generation", model=str(folder), trust_remote_code=True, dtype=torch.float32)
    prompt = "Hello"
    out = generator(prompt, max_new_tokens=6, do_sample=False, return_full_text=False)[0]["generated_text"]
    model = generator.model
    greedy = model.generate(torch.tensor([ByteTokenizer().encode(prompt)]), max_new_tokens=6, do_sample=False)
    assert out == tokenizer.decode(greedy[0, len(prompt) :].tolist())


def test_kimi_linear_export_of_a_tokenizer_json_run_loads_with_its_ids(bpe_tokenizer, tmp_path):
    _save_run(tmp_path / "run", kimi_linear_model_config(), with_optimizer=False)
    _set_tokenizer(tmp_path / "run", str(bpe_tokenizer))
    _to_hf(tmp_path / "run", tmp_path / "hf", "--format", "kimi_linear")
    expected = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    assert _ids(tmp_path / "hf") == (expected, expected)
    model = KimiLinearForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    assert model.model.embed_tokens.padding_idx == 0
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 0)
    assert tokenizer(TEXT)["input_ids"] == HuggingFaceTokenizer(bpe_tokenizer).encode(TEXT)
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == bpe_tokenizer.read_bytes()


def test_a_tokenizer_json_round_trip_keeps_ids_and_files(bpe_tokenizer, tmp_path):
    _save_run(tmp_path / "run", kimi_linear_model_config(), with_optimizer=False)
    _set_tokenizer(tmp_path / "run", str(bpe_tokenizer))
    _to_hf(tmp_path / "run", tmp_path / "hf", "--format", "kimi_linear")
    _from_hf(tmp_path / "hf", tmp_path / "back")
    job = load_config(str(tmp_path / "back" / "config.yaml"), [])
    assert Path(job.data.tokenizer).read_bytes() == bpe_tokenizer.read_bytes()
    assert job.data.eos_token == "<|endoftext|>"
    _to_hf(tmp_path / "back", tmp_path / "again", "--format", "kimi_linear")
    expected = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    assert _ids(tmp_path / "again") == (expected, expected)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "again" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes(), name


def test_a_model_saved_without_a_tokenizer_keeps_its_ids_through_a_round_trip(tmp_path):
    """transformers' Kimi Linear with pad 0, bos 1, eos 2 and no tokenizer files: the run keeps
    the byte tokenizer, and the export writes 0/1/2 back (not the byte tokenizer's 258/257/256)."""
    _transformers_model().save_pretrained(str(tmp_path / "hf"))
    _from_hf(tmp_path / "hf", tmp_path / "run")
    assert load_config(str(tmp_path / "run" / "config.yaml"), []).data.tokenizer == "byte"
    _to_hf(tmp_path / "run", tmp_path / "again", "--format", "kimi_linear")
    expected = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    assert _ids(tmp_path / "again") == (expected, expected)
    assert not (tmp_path / "again" / "tokenizer.json").exists()  # none came in, none is made up
    KimiLinearForCausalLM.from_pretrained(str(tmp_path / "again"))


def test_ids_outside_the_vocabulary_are_written_as_null():
    ids = SpecialTokens(bos_token_id=5, eos_token_id=[7, 400], pad_token_id=163839)
    assert ids.within(384).as_dict() == {"bos_token_id": 5, "eos_token_id": [7], "pad_token_id": None}


def test_a_byte_tokenizer_round_trip_trains_with_the_byte_tokenizer_again(tmp_path):
    _save_run(tmp_path / "run", kimi_linear_model_config(), with_optimizer=False)
    _to_hf(tmp_path / "run", tmp_path / "hf", "--format", "kimi_linear")
    _from_hf(tmp_path / "hf", tmp_path / "back")
    assert load_config(str(tmp_path / "back" / "config.yaml"), []).data.tokenizer == "byte"
    _to_hf(tmp_path / "back", tmp_path / "again", "--format", "kimi_linear")
    expected = {"bos_token_id": 257, "eos_token_id": 256, "pad_token_id": 258}
    assert _ids(tmp_path / "again") == (expected, expected)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "again" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes(), name
