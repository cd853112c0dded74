"""The K3 model's parts against direct references (docs/design.md §1)."""

import dataclasses

import pytest
import torch

from k3train.contracts.stage_io import ResidualState
from k3train.kernels.attn_res import attn_res_mix
from k3train.kernels.situ_glu import situ_glu, swiglu
from k3train.model.balance import ExactQuantileBalancer, HistogramQuantileBalancer, SignBalancer, histogram_quantile
from k3train.model.config import ModelConfig
from k3train.model.decoder import DecoderLayer
from k3train.model.k3 import K3ModelChunk, lm_loss
from k3train.model.kda import KimiDeltaAttention
from k3train.model.mla import GatedMLA
from k3train.model.moe import LatentMoE


def small_config(**changes) -> ModelConfig:
    return dataclasses.replace(ModelConfig(), **changes)


def randomize_attn_res_queries(model: K3ModelChunk, seed: int = 0) -> None:
    """Zero-initialised queries average uniformly; random ones make the wiring tests sharper."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("_res.proj.weight") or name.endswith("_res.norm.weight"):
                param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype))


# ---------------------------------------------------------------------------- MLA
def test_mla_is_causal_and_uses_no_position():
    torch.manual_seed(0)
    mla = GatedMLA(small_config()).double()
    x = torch.randn(1, 12, 128, dtype=torch.float64)
    changed = x.clone()
    changed[:, 7] += 1.0
    out, out_changed = mla(x), mla(changed)
    assert torch.equal(out[:, :7], out_changed[:, :7])
    assert not torch.allclose(out[:, 7:], out_changed[:, 7:])
    # NoPE: permuting the earlier context of the last token does not change its output.
    permuted = x.clone()
    permuted[:, :11] = x[:, torch.randperm(11)]
    torch.testing.assert_close(mla(permuted)[:, -1], out[:, -1], rtol=1e-12, atol=1e-12)


def test_mla_without_q_lora_and_gate():
    mla = GatedMLA(small_config(q_lora_rank=None, mla_use_output_gate=False))
    assert hasattr(mla, "q_proj") and not hasattr(mla, "g_proj")
    assert mla(torch.randn(2, 5, 128)).shape == (2, 5, 128)


# ---------------------------------------------------------------------------- KDA mixer
def test_kda_mixer_state_handover_equals_one_pass():
    torch.manual_seed(0)
    kda = KimiDeltaAttention(small_config()).double()
    x = torch.randn(2, 40, 128, dtype=torch.float64)
    whole, _ = kda.forward_with_cache(x, None)
    first, cache = kda.forward_with_cache(x[:, :17], None)
    second, _ = kda.forward_with_cache(x[:, 17:], cache)
    assert (torch.cat([first, second], 1) - whole).abs().max() < 1e-10


def test_kda_gate_is_bounded():
    kda = KimiDeltaAttention(small_config())
    assert torch.all(kda.A_log == 0)  # K3 initialises A at zero with the bounded gate
    unbounded = KimiDeltaAttention(
        small_config(linear_attn_config=dataclasses.replace(ModelConfig().linear_attn_config, gate_lower_bound=None))
    )
    assert torch.all(unbounded.A_log > 0)


# ---------------------------------------------------------------------------- AttnRes
def direct_attn_res_forward(model: K3ModelChunk, input_ids: torch.Tensor) -> torch.Tensor:
    """Keep every sublayer output and build each sublayer's sources from the definition."""
    config = model.config
    outputs = [model.embed_tokens(input_ids)]  # v_0 = embedding, then f_1, f_2, ...
    sublayers_per_block = 2 * config.attn_res_block_size

    def sources_for(sublayer: int) -> list[torch.Tensor]:
        produced = outputs[1:]
        if config.attn_res == "full":
            return outputs[: sublayer + 1]
        completed = sublayer // sublayers_per_block
        blocks = [outputs[0]] + [
            sum(produced[n * sublayers_per_block : (n + 1) * sublayers_per_block]) for n in range(completed)
        ]
        partial = produced[completed * sublayers_per_block : sublayer]
        return blocks + ([sum(partial)] if partial else [])

    def mix(attn_res, sources):
        if len(sources) == 1:
            return sources[0]
        return attn_res_mix(sources, attn_res.norm.weight, attn_res.proj.weight[0], attn_res.norm.eps)

    # (the model mixes through AttentionResidual.normalized_input; this calls the kernel directly)

    for index, layer in enumerate(model.layers.values()):
        assert isinstance(layer, DecoderLayer)
        hidden = mix(layer.self_attention_res, sources_for(2 * index))
        outputs.append(layer.self_attn(layer.input_layernorm(hidden)))
        hidden = mix(layer.mlp_res, sources_for(2 * index + 1))
        outputs.append(layer.ffn(layer.post_attention_layernorm(hidden)))
    final = mix(model.output_attn_res, sources_for(2 * len(model.layers)))
    return model.lm_head(model.norm(final))


@pytest.mark.parametrize("mode,block_size", [("block", 1), ("block", 2), ("block", 3), ("block", 8), ("full", 2)])
def test_attn_res_wiring_matches_direct_definition(mode, block_size):
    config = small_config(
        attn_res=mode, attn_res_block_size=block_size, hidden_size=64, vocab_size=64, recompute="none"
    )
    model = K3ModelChunk(config).double().eval()
    randomize_attn_res_queries(model)
    input_ids = torch.randint(0, 64, (2, 9))
    difference = (model(input_ids) - direct_attn_res_forward(model, input_ids)).abs().max()
    assert difference < 1e-12


def test_plain_residual_baseline():
    config = small_config(attn_res="none", hidden_size=64, vocab_size=64, num_hidden_layers=2)
    model = K3ModelChunk(config).double().eval()
    input_ids = torch.randint(0, 64, (1, 6))
    hidden = model.embed_tokens(input_ids)
    for layer in model.layers.values():
        hidden = hidden + layer.self_attn(layer.input_layernorm(hidden))
        hidden = hidden + layer.ffn(layer.post_attention_layernorm(hidden))
    assert torch.equal(model(input_ids), model.lm_head(model.norm(hidden)))


def test_attn_res_starts_as_uniform_average_in_fp32():
    sources = [torch.randn(3, 16, dtype=torch.bfloat16) for _ in range(4)]
    mixed = attn_res_mix(sources, torch.ones(16), torch.zeros(16), 1e-5)
    expected = torch.stack([s.float() for s in sources]).mean(0).to(torch.bfloat16)
    assert mixed.dtype == torch.bfloat16 and torch.equal(mixed, expected)


def test_sliced_model_matches_whole_model():
    """The pipeline contract: slices handing over (partial, blocks) equal one model."""
    config = small_config(hidden_size=64, vocab_size=64, num_hidden_layers=5, attn_res_block_size=2)
    whole = K3ModelChunk(config).double().eval()
    first = K3ModelChunk(config, layer_range=(0, 3)).double().eval()
    second = K3ModelChunk(config, layer_range=(3, 5)).double().eval()
    assert not hasattr(first, "lm_head") and not hasattr(second, "embed_tokens")
    input_ids = torch.randint(0, 64, (2, 7))
    state = first(input_ids)
    assert isinstance(state, ResidualState) and len(state.blocks) == 2  # embedding and block 1
    assert torch.equal(second(state=state), whole(input_ids))


# ---------------------------------------------------------------------------- SiTU-GLU
def test_situ_glu_is_bounded_and_close_to_swiglu_near_zero():
    large = torch.linspace(-1e4, 1e4, 4001)
    gate, up = large[:, None].expand(-1, 64), large[None, :4001:63][:, :64].expand(4001, -1)
    assert situ_glu(gate, up).abs().max() <= 100.0
    small = torch.rand(1000, 2) * 0.2 - 0.1
    assert (situ_glu(small[:, 0], small[:, 1]) - swiglu(small[:, 0], small[:, 1])).abs().max() < 1e-3
    assert situ_glu(torch.ones(2, dtype=torch.bfloat16), torch.ones(2, dtype=torch.bfloat16)).dtype == torch.bfloat16


# ---------------------------------------------------------------------------- LatentMoE
def test_latent_moe_matches_dense_reference_and_bias_stays_out_of_weights():
    torch.manual_seed(0)
    config = small_config(num_experts=8, num_experts_per_token=3)
    moe = LatentMoE(config).double().eval()
    for param in moe.parameters():
        torch.nn.init.normal_(param, std=0.1)
    moe.gate.e_score_correction_bias.copy_(torch.randn(8))
    x = torch.randn(2, 5, 128, dtype=torch.float64)
    tokens = x.reshape(-1, 128)
    scores = torch.sigmoid(tokens @ moe.gate.weight.T)
    chosen = (scores + moe.gate.e_score_correction_bias).topk(3, dim=-1).indices
    weights = scores.gather(-1, chosen)
    weights = weights / weights.sum(-1, keepdim=True)  # raw scores only: the bias never enters
    latent = moe.routed_expert_down_proj(tokens)
    routed = torch.zeros_like(latent)
    experts = moe.experts
    for token in range(tokens.shape[0]):
        for slot in range(3):
            e = chosen[token, slot]
            h = experts.activation(latent[token] @ experts.w1[e].T, latent[token] @ experts.w3[e].T) @ experts.w2[e].T
            routed[token] += weights[token, slot] * h
    expected = moe.routed_expert_up_proj(moe.routed_expert_norm(routed)) + moe.shared_experts(x).reshape(-1, 128)
    assert (moe(x).reshape(-1, 128) - expected).abs().max() < 1e-12


# ---------------------------------------------------------------------------- balancers
def test_exact_quantile_bias_lets_q_tokens_through_each_expert():
    torch.manual_seed(0)
    tokens, experts, top_k = 4096, 16, 4
    skew = torch.linspace(-2, 2, experts)
    scores = torch.sigmoid(torch.randn(tokens, experts) + skew)
    balancer = ExactQuantileBalancer(experts, top_k)
    bias = torch.zeros(experts)
    balancer.observe(scores, bias)
    new_bias = balancer.next_bias(bias)
    # Before recentring, b_j > α_i − s_ij holds for q = m·k/n tokens per expert, up to ties
    # (r_ij = 0 exactly for every token whose (k+1)-th choice is j): #{r < b} ≤ q ≤ #{r ≤ b}.
    cutoff = (scores + bias).topk(top_k + 1, dim=-1).values[:, -1:]
    margins = (cutoff - scores).double()
    raw_bias = new_bias.double() + torch.quantile(margins, top_k / experts, dim=0).mean()
    q = tokens * top_k // experts
    assert torch.all((margins < raw_bias - 1e-6).sum(0) <= q)
    assert torch.all((margins <= raw_bias + 1e-6).sum(0) >= q)
    # Iterating on the same scores balances the actual top-k routing.
    loads_before = torch.bincount(scores.topk(top_k, -1).indices.flatten(), minlength=experts).float()
    for _ in range(20):
        balancer.observe(scores, bias)
        bias = balancer.next_bias(bias)
    loads = torch.bincount((scores + bias).topk(top_k, -1).indices.flatten(), minlength=experts).float()
    assert loads.max() / loads.mean() < 1.1 < loads_before.max() / loads_before.mean()
    assert abs(bias.mean()) < 1e-6


def test_histogram_quantile_within_one_bin_of_torch_quantile():
    torch.manual_seed(1)
    experts, bins = 8, 1000
    bias = torch.randn(experts) * 0.3
    low, high = bias.min() - 1, bias.max() + 1
    samples = torch.rand(5000, experts) * (high - low - 0.2) + low + 0.1
    index = ((samples - low) / (high - low) * bins).long().clamp(0, bins - 1)
    counts = torch.zeros(experts, bins, dtype=torch.int64)
    for expert in range(experts):
        counts[expert] = torch.bincount(index[:, expert], minlength=bins)
    level = 0.25
    estimate = histogram_quantile(counts, level, low, high)
    exact = torch.quantile(samples.double(), level, dim=0)
    assert (estimate - exact).abs().max() <= (high - low) / bins


def test_histogram_balancer_accumulates_micro_batches_like_one_batch():
    torch.manual_seed(2)
    scores = torch.sigmoid(torch.randn(1024, 16) + torch.linspace(-1, 1, 16))
    bias = torch.zeros(16)
    one, split = HistogramQuantileBalancer(16, 4, 1000), HistogramQuantileBalancer(16, 4, 1000)
    one.observe(scores, bias)
    split.observe(scores[:300], bias)
    split.observe(scores[300:], bias)
    assert torch.equal(one.counts, split.counts)
    reduced = []

    class RecordingGroup:  # stands in for a process group of one rank
        def all_reduce(self, counts):
            reduced.append(counts.sum().item())
            return counts

    new_bias = split.next_bias(bias, RecordingGroup())
    assert reduced == [1024 * 16] and split.counts is None
    exact = ExactQuantileBalancer(16, 4)
    exact.observe(scores, bias)
    assert (new_bias - exact.next_bias(bias)).abs().max() <= 2 * 3 / 1000 + 1e-6  # a bin each, recentred


def test_sign_balancer_moves_bias_against_load():
    balancer = SignBalancer(4, 1, rate=0.01)
    scores = torch.tensor([[0.9, 0.1, 0.1, 0.1]] * 8)
    balancer.observe(scores, torch.zeros(4))
    new_bias = balancer.next_bias(torch.zeros(4))
    assert new_bias[0] < 0 < new_bias[1] and abs(new_bias.sum()) < 1e-7


def test_bias_changes_only_after_the_step_and_is_saved():
    model = K3ModelChunk(small_config(balancer="quantile"))
    moe = model.moe_layers()[0]
    input_ids = torch.randint(0, 384, (2, 16))
    lm_loss(model(input_ids)[:, :-1], input_ids[:, 1:]).backward()
    assert torch.all(moe.gate.e_score_correction_bias == 0)
    model.update_routing_biases()
    assert not torch.all(moe.gate.e_score_correction_bias == 0)
    assert any(key.endswith("gate.e_score_correction_bias") for key in model.state_dict())


# ---------------------------------------------------------------------------- whole model
def test_debug_model_trains_on_a_fixed_batch():
    torch.manual_seed(0)
    model = K3ModelChunk(ModelConfig())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    input_ids = torch.randint(0, 384, (4, 33))
    losses = []
    for _ in range(30):
        loss = lm_loss(model(input_ids[:, :-1]), input_ids[:, 1:])
        assert torch.isfinite(loss)
        optimizer.zero_grad()
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        optimizer.step()
        model.update_routing_biases()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_k3_preset_builds_on_meta_device():
    config = ModelConfig.preset("k3")
    with torch.device("meta"):
        model = K3ModelChunk(config)
    assert len(model.layers) == 93
    mla_layers = [i for i, layer in model.layers.items() if layer.is_mla]
    assert len(mla_layers) == 24 and mla_layers[-1] == "92" and "3" in mla_layers
    assert model.layers["5"].block_sparse_moe.experts.w1.shape == (896, 3072, 3584)
    assert model.layers["0"].mlp.gate_proj.weight.shape == (33792, 7168)


# ---------------------------------------------------------------------------- activation memory
def saved_activation_bytes(config: ModelConfig, layer_index: int) -> int:
    """Bytes one layer saves for backward, each storage counted once, excluding parameters and
    the block representations and their keys (shared by every later layer, held once per
    micro-batch)."""
    torch.manual_seed(0)
    model = K3ModelChunk(config)
    parameter_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    state = model.embed(torch.randint(0, config.vocab_size, (2, 64)))
    for index, layer in model.layers.items():
        assert isinstance(layer, DecoderLayer)
        if int(index) != layer_index:
            state = layer(state)
            continue
        excluded = parameter_storages | {block.untyped_storage().data_ptr() for block in state.blocks}
        if layer.pushes_block_before_mixer() and state.partial is not None:
            excluded.add(state.partial.untyped_storage().data_ptr())  # becomes a block here
        saved: dict[int, int] = {}

        def record(tensor: torch.Tensor, excluded: set = excluded, saved: dict = saved) -> torch.Tensor:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in excluded:
                saved[storage.data_ptr()] = storage.nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(record, lambda tensor: tensor):
            output = layer(state)
        for entry in getattr(output, "block_keys", []):  # [tokens] vectors per block, held like the blocks
            if entry is not None:
                for key in (entry[1], *entry[2].values()):
                    saved.pop(key.untyped_storage().data_ptr(), None)
        return sum(saved.values())
    raise AssertionError(f"no layer {layer_index}")


# A layer that closes a block before its mixer (the mixer mixes blocks only: one sublayer mixes
# a partial sum), and one that does not (both sublayers do).
@pytest.mark.parametrize("layer_index, partial_sums", [(2, 1), (3, 2)])
def test_checkpointed_attn_res_layer_saves_no_more_than_plain_residual(layer_index, partial_sums):
    plain = saved_activation_bytes(small_config(attn_res="none"), layer_index)
    checkpointed = saved_activation_bytes(small_config(attn_res="block", recompute="attn_res"), layer_index)
    uncheckpointed = saved_activation_bytes(small_config(attn_res="block", recompute="none"), layer_index)
    print(
        f"layer {layer_index}: plain residual {plain} B, Block AttnRes checkpointed {checkpointed} B, "
        f"not checkpointed {uncheckpointed} B"
    )
    # Beyond a plain layer, a checkpointed AttnRes sublayer keeps the partial sum it mixes (a plain
    # layer's norm saves its normalised output, not its input): one [tokens, d] fp32 tensor per
    # sublayer that mixes one. Without the checkpoint it keeps more.
    partial_bytes = partial_sums * (2 * 64) * small_config().hidden_size * 4  # batch 2 × 64 tokens
    assert checkpointed <= plain + partial_bytes
    assert checkpointed < uncheckpointed


def test_router_and_attn_res_stay_fp32_under_bf16_autocast():
    """Precision (docs/design.md §1.3, §1.4): AttnRes scores and the router in fp32 even inside a bf16 autocast region."""
    model = K3ModelChunk(small_config(hidden_size=64, vocab_size=64, num_hidden_layers=2))
    randomize_attn_res_queries(model)
    moe = model.moe_layers()[0]
    x = torch.randn(1, 5, 64)
    sources = [torch.randn(1, 5, 64) for _ in range(3)]
    attn_res = model.layers["1"].mlp_res
    with torch.autocast("cpu", dtype=torch.bfloat16):
        scores, _, weights = moe.gate(x.reshape(-1, 64))
        mixed = attn_res.mix(sources)
    assert scores.dtype == torch.float32 and weights.dtype == torch.float32
    expected_scores = torch.sigmoid(x.reshape(-1, 64) @ moe.gate.weight.T)
    assert (scores - expected_scores).abs().max() < 1e-6  # a bf16 matmul would be off by ~1e-3
    assert mixed.dtype == torch.float32
    assert (mixed - attn_res.mix(sources)).abs().max() < 1e-6


@pytest.mark.parametrize("mode", ["block", "full"])
def test_attn_res_gradients_equal_across_recompute_modes_and_the_stacked_reference(mode, monkeypatch):
    """float64, whole model: `recompute: attn_res` (mix and norm fused, backward recomputing the
    scores), `none` (the mix function, then the norm) and the stacked autograd reference
    give one loss and one set of gradients (to 1e-10)."""
    from k3train.kernels import attn_res as attn_res_kernels
    from k3train.model import attn_res as attn_res_model

    input_ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))

    def loss_and_grads(recompute: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        config = small_config(
            attn_res=mode,
            attn_res_block_size=2,
            hidden_size=64,
            vocab_size=64,
            num_hidden_layers=3,
            recompute=recompute,
        )
        model = K3ModelChunk(config).double()
        randomize_attn_res_queries(model)
        loss = lm_loss(model(input_ids), input_ids)
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    runs = [loss_and_grads("attn_res"), loss_and_grads("none")]
    monkeypatch.setattr(attn_res_model, "attn_res_mix", attn_res_kernels.attn_res_mix_reference)
    runs.append(loss_and_grads("none"))
    (loss, grads), *others = runs
    for other_loss, other_grads in others:
        assert (loss - other_loss).abs() < 1e-12
        assert grads.keys() == other_grads.keys()
        for name, grad in grads.items():
            assert (grad - other_grads[name]).abs().max() < 1e-10, name
