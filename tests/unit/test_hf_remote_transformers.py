"""The K3 remote-code export used as transformers users use its own causal LMs: tied embeddings
through `_tied_weights_keys`, `labels` → loss, `logits_to_keep`, `inputs_embeds`, resizing the
vocabulary, gradient checkpointing, transformers' `Cache` (manual decode loops, beam search),
left-padded batches, and weights read only inside their module's accelerate hook.

Checks that compare two orders of the same arithmetic run in float64, where the orders agree to
~1e-13 (a few hundred roundings of 2^-53 on logits of size ~10); they are held to 1e-9."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from k3train.model.config import LinearAttnConfig, ModelConfig
from tests.unit.test_hf_conversion import _save_run, convert
from tests.unit.test_hf_remote_code import TOLERANCE, _load_remote, _score

transformers = pytest.importorskip("transformers")

FLOAT64_AGREEMENT = 1e-9
VOCAB = 384


def _export_run(root: Path, config: ModelConfig) -> Path:
    _save_run(root / "run", config)
    arguments = ["to-hf", "--load", str(root / "run"), "--out", str(root / "hf"), "--dtype", "fp32", "--quiet"]
    assert convert.main(arguments) == 0
    return root / "hf"


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    """A Block-AttnRes export with KDA chunks of 16 (MLA at layers 4 and 8)."""
    root = tmp_path_factory.mktemp("remote")
    _export_run(root, ModelConfig(linear_attn_config=LinearAttnConfig(chunk_size=16)))
    return root


def _tokens(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def test_tied_embeddings_load_through_tied_weights_keys(tmp_path):
    config = ModelConfig(tie_word_embeddings=True, linear_attn_config=LinearAttnConfig(chunk_size=16))
    hf = _export_run(tmp_path, config)
    model = _load_remote(hf)  # asserts no missing, unexpected or mismatched key (lm_head.weight included)
    head, embedding = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert head is embedding
    tokens = _tokens(2, 17, 0)
    with torch.no_grad():
        logits = model(input_ids=tokens).logits
    difference = _difference(logits, _score(tmp_path, tokens))
    print(
        f"tied export: logits finite {bool(torch.isfinite(logits).all())}, max abs difference to k3train {difference:.3g}"
    )
    assert torch.isfinite(logits).all() and difference <= TOLERANCE


def test_labels_give_the_shifted_cross_entropy_ignoring_minus_100(export):
    model = _load_remote(export / "hf").double()
    tokens = _tokens(2, 12, 1)
    labels = tokens.clone()
    labels[0, :4] = -100  # e.g. a prompt left out of the loss
    with torch.no_grad():
        output = model(input_ids=tokens, labels=labels)
    logits = output.logits[:, :-1].reshape(-1, VOCAB)
    kept = labels[:, 1:].reshape(-1)
    expected = F.cross_entropy(logits, kept, ignore_index=-100)  # float64
    # transformers' causal-LM loss upcasts the logits to fp32 (not further): each token's
    # log-sum-exp over the vocabulary and the mean over the kept tokens round in fp32.
    bound = (VOCAB + int((kept != -100).sum())) * 2.0**-24 * expected.item()
    difference = abs(output.loss.item() - expected.item())
    print(
        f"labels: loss {output.loss.item():.7f}, float64 by hand {expected.item():.7f} (difference {difference:.3g}, bound {bound:.3g})"
    )
    assert output.loss is not None and output.loss.dtype == torch.float32 and difference <= bound


def test_logits_to_keep_and_inputs_embeds(export):
    model = _load_remote(export / "hf").double()
    tokens = _tokens(2, 20, 2)
    with torch.no_grad():
        full = model(input_ids=tokens).logits
        last = model(input_ids=tokens, logits_to_keep=1).logits
        embedded = model(inputs_embeds=model.get_input_embeddings()(tokens)).logits
        with pytest.raises(ValueError, match="exactly one of input_ids and inputs_embeds"):
            model(input_ids=tokens, inputs_embeds=model.get_input_embeddings()(tokens))
        prompt = tokens[:1, :7]
        from_ids = model.generate(prompt, max_new_tokens=5, do_sample=False)
        from_embeds = model.generate(
            inputs_embeds=model.get_input_embeddings()(prompt), max_new_tokens=5, do_sample=False
        )
    assert last.shape == (2, 1, VOCAB) and _difference(last, full[:, -1:]) <= FLOAT64_AGREEMENT
    assert torch.equal(embedded, full)
    assert torch.equal(from_embeds, from_ids[:, prompt.shape[1] :])  # generate(inputs_embeds) returns new tokens only


def test_resize_token_embeddings_keeps_the_old_vocabulary(export):
    model = _load_remote(export / "hf").double()
    tokens = _tokens(2, 9, 3)
    with torch.no_grad():
        before = model(input_ids=tokens).logits
        model.resize_token_embeddings(VOCAB + 16)
        after = model(input_ids=tokens).logits
    assert model.get_input_embeddings().weight.shape[0] == VOCAB + 16
    assert model.get_output_embeddings().weight.shape[0] == VOCAB + 16
    assert after.shape[-1] == VOCAB + 16 and _difference(after[..., :VOCAB], before) <= FLOAT64_AGREEMENT


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_trains_the_same_gradients(export, reentrant):
    model = _load_remote(export / "hf").double().train()
    tokens = _tokens(2, 18, 4)

    def gradients() -> dict[str, torch.Tensor]:
        model.zero_grad()
        model(input_ids=tokens, labels=tokens).loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    plain = gradients()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # 5.23 names it activation_checkpointing_enable
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    assert all(layer.gradient_checkpointing for layer in model.language_model.model.layers)
    checkpointed = gradients()
    worst = max(_difference(plain[name], checkpointed[name]) for name in plain)
    print(f"gradient checkpointing (use_reentrant={reentrant}): {len(plain)} gradients, max abs difference {worst:.3g}")
    assert plain.keys() == checkpointed.keys() and worst <= FLOAT64_AGREEMENT
