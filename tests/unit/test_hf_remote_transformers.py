"""The K3 remote-code export used as transformers users use its own causal LMs: tied embeddings
through `_tied_weights_keys`, `labels` → loss, `logits_to_keep`, `inputs_embeds`, resizing the
vocabulary, gradient checkpointing, transformers' `Cache` (manual decode loops, beam search),
left-padded batches, and weights read only inside their module's accelerate hook.

Checks that compare two orders of the same arithmetic run in float64, where the orders agree to
~1e-13 (a few hundred roundings of 2^-53 on logits of size ~10); they are held to 1e-9."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from k3train.model.config import LinearAttnConfig, ModelConfig
from tests.unit.test_hf_conversion import _save_run, convert
from tests.unit.test_hf_remote_code import TOLERANCE, _load_remote, _score, fp32_forward_error_bound

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
    _export_run(root, model_config())
    return root


def model_config() -> ModelConfig:
    return ModelConfig(linear_attn_config=LinearAttnConfig(chunk_size=16))


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


def _full_forward_log_probability(model, sequence: torch.Tensor, prompt_length: int) -> float:
    """Σ log p(token_t | tokens_<t) over the generated tokens, from one forward without cache."""
    with torch.no_grad():
        log_probs = model(input_ids=sequence[None]).logits[0].log_softmax(-1)
    generated = sequence[prompt_length:]
    return log_probs[prompt_length - 1 : -1].gather(-1, generated[:, None]).sum().item()


def test_cache_is_a_transformers_cache_and_beam_search_reorders_it(export):
    model = _load_remote(export / "hf").double()
    prompt = _tokens(1, 6, 5)
    with torch.no_grad():
        output = model(input_ids=prompt, use_cache=True)
        assert isinstance(output.past_key_values, transformers.DynamicCache)
        assert output.past_key_values.get_seq_length() == prompt.shape[1]
        beams = model.generate(
            prompt,
            max_new_tokens=8,
            num_beams=3,
            num_return_sequences=3,
            do_sample=False,
            length_penalty=0.0,  # a beam's score is then the sum of its tokens' log-probabilities
            early_stopping=True,
            return_dict_in_generate=True,
            output_scores=True,
        )
    # Every returned beam's score, accumulated through the reordered cache, is its log-probability
    # from a forward of the whole sequence: a beam continuing another beam's state would not be.
    differences = [
        abs(score.item() - _full_forward_log_probability(model, sequence, prompt.shape[1]))
        for sequence, score in zip(beams.sequences, beams.sequences_scores)
    ]
    # generate() takes each step's log-softmax in fp32 (logits cast to fp32, a sum over the
    # vocabulary: ~(2 + log2 V) roundings) and adds 8 of them: the beam scores carry that much fp32
    # error; a beam scored on another beam's state would be off by the log-probabilities' spread.
    steps = 8
    bound = steps * (2 + math.log2(VOCAB)) * 2.0**-24 * max(abs(s.item()) for s in beams.sequences_scores)
    print(
        f"beam search: {len(differences)} beams, max |score − full-forward log-probability| {max(differences):.3g} "
        f"(fp32 bound {bound:.3g})"
    )
    assert len({tuple(s.tolist()) for s in beams.sequences}) == 3
    assert max(differences) <= bound


def test_manual_decode_loop_with_past_key_values_equals_full_forwards(export):
    model = _load_remote(export / "hf").double()
    tokens = _tokens(2, 24, 6)
    with torch.no_grad():
        whole = model(input_ids=tokens).logits
        output = model(input_ids=tokens[:, :5], use_cache=True)
        steps = [output.logits]
        for position in range(5, tokens.shape[1]):
            output = model(
                input_ids=tokens[:, position : position + 1],
                past_key_values=output.past_key_values,
                attention_mask=torch.ones(2, position + 1, dtype=torch.long),
                use_cache=True,
            )
            steps.append(output.logits)
    difference = _difference(torch.cat(steps, dim=1), whole)
    print(
        f"manual decode loop: 5-token prefill + 19 single tokens vs one forward, fp64 max abs difference {difference:.3g}"
    )
    assert difference <= FLOAT64_AGREEMENT


def test_prompt_lookup_decoding_equals_greedy_decoding(export):
    """Prompt lookup drafts tokens from n-grams of the prompt, verifies them in one forward and
    crops the cache to the accepted ones: the KDA state is recomputed over the kept tokens, so
    the tokens and logits are greedy decoding's (the logits to fp32 rounding: generate() returns
    fp32 copies of the float64 logits, which may round to neighbouring fp32 values)."""
    model = _load_remote(export / "hf").double()
    phrase = _tokens(1, 7, 7)
    prompt = torch.cat([phrase, phrase, phrase[:, :3]], dim=1)  # repeats, so lookups find drafts
    settings = {"max_new_tokens": 24, "do_sample": False, "return_dict_in_generate": True, "output_logits": True}
    with torch.no_grad():
        greedy = model.generate(prompt, **settings)
        cache = transformers.DynamicCache(config=model.config)
        pieces: list[int] = []
        model.register_forward_hook(
            lambda module, args, kwargs, out: pieces.append(kwargs["input_ids"].shape[1]), with_kwargs=True
        )
        lookup = model.generate(prompt, prompt_lookup_num_tokens=4, past_key_values=cache, **settings)
    difference = _difference(torch.stack(lookup.logits), torch.stack(greedy.logits))
    bound = 2.0**-23 * torch.stack(greedy.logits).abs().max().item()
    drafted = sum(1 for length in [pieces[0] - prompt.shape[1] + 1, *pieces[1:]] if length > 1)  # forwards with drafts
    print(
        f"prompt lookup: {len(pieces)} forwards of {pieces} tokens, {drafted} verifying drafts; tokens equal to greedy "
        f"{bool(torch.equal(lookup.sequences, greedy.sequences))}, max abs logit difference {difference:.3g} "
        f"(bound {bound:.3g})"
    )
    assert torch.equal(lookup.sequences, greedy.sequences) and difference <= bound
    assert drafted > 0  # drafts were verified and the rejected ones cropped off the cache
    assert cache.get_seq_length() == lookup.sequences.shape[1] - 1


def test_cache_crop_keeps_the_accepted_tokens_of_a_piece(export):
    """A forward of 6 drafted tokens, 4 of them rejected (`crop(-4)`), then the next tokens: the
    logits equal one forward of the kept sequence (the random model accepts few real drafts)."""
    model = _load_remote(export / "hf").double()
    tokens = _tokens(1, 20, 9)
    with torch.no_grad():
        whole = model(input_ids=tokens).logits
        cache = transformers.DynamicCache(config=model.config)
        cache.activate_past_recording()  # what assisted generation does first
        first = model(input_ids=tokens[:, :8], past_key_values=cache, use_cache=True).logits
        drafts = torch.cat([tokens[:, 8:10], _tokens(1, 4, 10)], dim=1)
        model(input_ids=drafts, past_key_values=cache, use_cache=True)
        cache.crop(-4)
        rest = model(input_ids=tokens[:, 10:], past_key_values=cache, use_cache=True).logits
    kept = torch.cat([first, rest], dim=1)
    difference = _difference(kept, torch.cat([whole[:, :8], whole[:, 10:]], dim=1))
    print(f"crop: 8 + 6 drafted − 4 cropped + 10 tokens vs one forward, fp64 max abs difference {difference:.3g}")
    assert cache.is_croppable and cache.get_seq_length() == tokens.shape[1]
    assert difference <= FLOAT64_AGREEMENT


def _left_padded(prompts: list[torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), longest), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt) :], mask[row, longest - len(prompt) :] = prompt, 1
    return ids, mask


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_left_padded_batch_generates_each_prompt_alone(export, dtype):
    """3 prompts of 5, 11 and 19 tokens, left-padded to 19, 30 greedy tokens each (through the
    KDA chunk edges at 16 and 32): the batch's tokens are each prompt's own generation. float64:
    the padded rows' logits equal the unpadded ones to rounding. fp32: padding moves the chunk
    edges, so the logits differ by rounding, held to twice the worst-case forward error; the
    tokens must agree wherever no greedy choice is within that bound of a tie."""
    model = _load_remote(export / "hf").to(dtype)
    prompts = [_tokens(1, length, 10 + length)[0] for length in (5, 11, 19)]
    ids, mask = _left_padded(prompts, pad=0)
    settings = {"max_new_tokens": 30, "do_sample": False, "return_dict_in_generate": True, "output_logits": True}
    with torch.no_grad():
        batch = model.generate(ids, attention_mask=mask, pad_token_id=0, **settings)
        alone = [model.generate(p[None], pad_token_id=0, **settings) for p in prompts]
        prefill = model(input_ids=ids, attention_mask=mask).logits
        prefill_alone = [model(input_ids=p[None]).logits for p in prompts]
    matching = []
    for row, single in enumerate(alone):
        new_tokens = batch.sequences[row, ids.shape[1] :]
        matching.append(int((new_tokens == single.sequences[0, len(prompts[row]) :]).sum()))
    logit_gap = max(
        _difference(torch.stack(batch.logits)[:, row], torch.stack(single.logits)[:, 0])
        for row, single in enumerate(alone)
    )
    prefill_gap = max(
        _difference(prefill[row, ids.shape[1] - len(p) :], single[0])
        for row, (p, single) in enumerate(zip(prompts, prefill_alone))
    )
    top_two = torch.stack([torch.stack(single.logits)[:, 0] for single in alone]).topk(2, dim=-1).values
    closest_choice = (top_two[..., 0] - top_two[..., 1]).min().item()
    print(
        f"left padding ({dtype}): tokens equal to each prompt alone {matching} of 30; max abs logit difference: "
        f"prefill {prefill_gap:.3g}, generated steps {logit_gap:.3g}; closest greedy choice alone {closest_choice:.3g}; "
        f"fp32 bound {2 * fp32_forward_error_bound(model_config(), 49, 1.0):.3g} per unit logit"
    )
    if dtype == torch.float64:
        assert matching == [30, 30, 30]
        assert prefill_gap <= FLOAT64_AGREEMENT and logit_gap <= FLOAT64_AGREEMENT
    else:  # fp32: padding changes the chunk edges, hence the rounding, within fp32's forward error
        bound = 2 * fp32_forward_error_bound(model_config(), 49, top_two.abs().max().item())
        assert prefill_gap <= bound and logit_gap <= bound
        if closest_choice > bound:  # no greedy choice within rounding of a tie: the tokens must agree
            assert matching == [30, 30, 30]


class OffloadHook:
    """What accelerate's disk/CPU offload hook does to a module, without accelerate: the module's
    own weights are real only between `pre_forward` and `post_forward` (NaN otherwise), so a weight
    read anywhere but inside its module's call, or `hooks_fired`, turns the logits NaN."""

    def __init__(self, module: torch.nn.Module):
        tensors = dict(module.named_parameters(recurse=False)) | dict(module.named_buffers(recurse=False))
        self.real = {name: tensor.detach().clone() for name, tensor in tensors.items()}
        self.depth = 0
        self.offload(module)

    def offload(self, module):
        for name, tensor in self.real.items():
            getattr(module, name).data = torch.full_like(tensor, float("nan"))

    def pre_forward(self, module, *args, **kwargs):
        if self.depth == 0:
            for name, tensor in self.real.items():
                getattr(module, name).data = tensor.clone()
        self.depth += 1
        return args, kwargs

    def post_forward(self, module, output):
        self.depth -= 1
        if self.depth == 0:
            self.offload(module)
        return output


def _attach_offload_hooks(model: torch.nn.Module) -> int:
    hooked = 0
    for module in model.modules():
        if not any(True for _ in module.parameters(recurse=False)) and not any(True for _ in module.buffers(False)):
            continue
        hook = OffloadHook(module)
        forward = module.forward

        def hooked_forward(*args, _hook=hook, _module=module, _forward=forward, **kwargs):
            args, kwargs = _hook.pre_forward(_module, *args, **kwargs)
            return _hook.post_forward(_module, _forward(*args, **kwargs))

        object.__setattr__(module, "forward", hooked_forward)
        object.__setattr__(module, "_hf_hook", hook)  # a plain attribute, as accelerate sets it
        hooked += 1
    return hooked


def test_every_weight_is_read_inside_its_modules_hook(export):
    """Offload's contract: each module's weights are present only while its hook runs."""
    model = _load_remote(export / "hf").double()
    tokens = _tokens(2, 20, 8)
    with torch.no_grad():
        expected = model(input_ids=tokens).logits
        generated = model.generate(tokens[:1, :6], max_new_tokens=6, do_sample=False)
        hooked = _attach_offload_hooks(model)
        offloaded = model(input_ids=tokens).logits
        generated_offloaded = model.generate(tokens[:1, :6], max_new_tokens=6, do_sample=False)
    print(f"offload hooks on {hooked} modules: logits finite {bool(torch.isfinite(offloaded).all())}")
    assert torch.equal(offloaded, expected) and torch.equal(generated_offloaded, generated)


def test_a_model_without_mla_layers_generates_through_the_cache(tmp_path):
    """Every layer KDA: the cache's length comes from the KDA layers' token count."""
    config = ModelConfig(num_hidden_layers=3, linear_attn_config=LinearAttnConfig(chunk_size=16, full_attn_layers=[]))
    model = _load_remote(_export_run(tmp_path, config)).double()
    prompt = _tokens(1, 6, 11)
    with torch.no_grad():
        generated = model.generate(prompt, max_new_tokens=12, do_sample=False, return_dict_in_generate=True)
        full = model(input_ids=generated.sequences).logits
        cache = model(input_ids=prompt, use_cache=True).past_key_values
    assert cache.get_seq_length() == prompt.shape[1]
    assert torch.equal(full[0, prompt.shape[1] - 1 : -1].argmax(-1), generated.sequences[0, prompt.shape[1] :])


def test_cache_batch_repeat_interleave_and_select_indices(export):
    """One prompt's cache repeated for 3 continuations (as contrastive search does), then 2 of them
    kept: each continuation's logits equal a forward of its whole sequence."""
    model = _load_remote(export / "hf").double()
    prompt, continuations = _tokens(1, 9, 12), _tokens(3, 4, 13)
    with torch.no_grad():
        cache = model(input_ids=prompt, use_cache=True).past_key_values
        cache.batch_repeat_interleave(3)
        first = model(input_ids=continuations[:, :2], past_key_values=cache, use_cache=True).logits
        cache.batch_select_indices(torch.tensor([2, 0]))
        second = model(input_ids=continuations[[2, 0], 2:], past_key_values=cache, use_cache=True).logits
        whole = model(input_ids=torch.cat([prompt.expand(3, -1), continuations], dim=1)).logits
    difference = max(_difference(first, whole[:, 9:11]), _difference(second, whole[[2, 0], 11:]))
    print(f"batch_repeat_interleave + batch_select_indices: fp64 max abs difference to full forwards {difference:.3g}")
    assert difference <= FLOAT64_AGREEMENT
