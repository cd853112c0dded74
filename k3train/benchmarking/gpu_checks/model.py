"""Whole-model checks: the debug model under bf16 autocast against fp32 on the CPU, and bf16
against fp32 training steps (loss, finite gradients, tokens/s) of the debug and a larger model."""

from __future__ import annotations

import copy
import math
import sys
import traceback
from collections.abc import Iterator

import torch

from k3train.model.config import LinearAttnConfig, ModelConfig
from k3train.model.k3 import K3ModelChunk

from . import kda as kda_checks
from .common import BF16, F64, TOL, Context, Row, describe, error, guarded, skip, verdict


def large_config() -> ModelConfig:
    """A ~0.4B-parameter K3-shaped model: hidden 1024, 8 layers, 64 experts (top-8)."""
    return ModelConfig(
        vocab_size=32768,
        hidden_size=1024,
        num_hidden_layers=8,
        num_attention_heads=8,
        q_lora_rank=384,
        kv_lora_rank=256,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        linear_attn_config=LinearAttnConfig(num_heads=8, head_dim=128),
        intermediate_size=2816,
        num_experts=64,
        num_experts_per_token=8,
        num_shared_experts=1,
        moe_intermediate_size=384,
        routed_expert_hidden_size=512,
        attn_res_block_size=2,
    )


def train_step(model: K3ModelChunk, tokens: torch.Tensor, labels: torch.Tensor, bf16: bool) -> torch.Tensor:
    """Forward (under bf16 autocast if asked) and backward; returns the loss."""
    model.zero_grad(set_to_none=True)
    with torch.autocast(tokens.device.type, dtype=BF16, enabled=bf16):
        logits = model(tokens)
    loss = model.loss(logits, labels)
    loss.backward()
    return loss.detach()


def token_batch(
    config: ModelConfig, batch: int, seq: int, device: torch.device, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=gen)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def gradients(model: K3ModelChunk) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def kda_backend_in_use(ctx: Context) -> str:
    return "fla" if kda_checks.fla_unavailable_reason(ctx) is None else "torch"


def model_speed_row(ctx: Context, name: str, config: ModelConfig, batch: int, seq: int) -> Row:
    """bf16-autocast vs fp32 training steps of one model on the device: the loss difference,
    finite gradients, tokens/s. The bf16 step (what training runs) goes first; if the fp32 step
    fails the row fails but keeps the bf16 numbers. ref ms: the fp32 step; fast ms: the bf16 step."""
    model = K3ModelChunk(config).to(ctx.device)
    params = sum(p.numel() for p in model.parameters())
    tokens, labels = token_batch(config, batch, seq, ctx.device, seed=17)
    reps, warmup = ctx.pick(5, 1), ctx.pick(2, 0)  # the step before each timing warms up too
    loss16 = train_step(model, tokens, labels, bf16=True)
    finite = all(bool(torch.isfinite(g).all()) for g in gradients(model).values())
    fast_ms = ctx.time_ms(lambda: train_step(model, tokens, labels, bf16=True), reps=reps, warmup=warmup)
    note = (
        f"{params / 1e6:.1f}M params, B={batch} T={seq}: {batch * seq / fast_ms * 1e3:,.0f} tok/s bf16; "
        f"loss {float(loss16):.4f}; grads finite: {finite}; KDA backend {kda_backend_in_use(ctx)}"
    )
    try:
        loss32 = train_step(model, tokens, labels, bf16=False)
        ref_ms = ctx.time_ms(lambda: train_step(model, tokens, labels, bf16=False), reps=reps, warmup=warmup)
    except Exception as exc:
        traceback.print_exc(file=sys.stderr)
        return Row(name, "FAIL", fast_ms=fast_ms, note=f"{note}; fp32 step failed: {describe(exc)}")
    max_abs, rel = error(loss16, loss32)
    tol = TOL["model_loss_bf16"]
    return Row(
        name,
        verdict(rel, tol, finite),
        max_abs,
        rel,
        tol,
        ref_ms,
        fast_ms,
        f"{note}; {batch * seq / ref_ms * 1e3:,.0f} tok/s fp32",
    )


def check_model_debug(ctx: Context) -> Iterator[Row]:
    """The debug model (`ModelConfig()`): one step under bf16 autocast on the device vs fp32 on
    the CPU, same weights: loss difference, finite gradients, and the global relative gradient
    difference (noted, not gated: bf16 may flip near-tied expert choices, which moves the expert
    gradients). Then fp32 vs bf16 steps timed on the device (model_speed_row)."""
    yield guarded(ctx, "model_debug bf16-vs-cpu-fp32", lambda: model_debug_accuracy_row(ctx))
    batch, seq = ctx.pick((8, 1024), (2, 64))
    name = "model_debug speed"
    yield guarded(ctx, name, lambda: model_speed_row(ctx, name, ModelConfig(), batch, seq))


def model_debug_accuracy_row(ctx: Context) -> Row:
    config = ModelConfig()
    cpu_model = K3ModelChunk(config)
    device_model = copy.deepcopy(cpu_model).to(ctx.device)
    tokens, labels = token_batch(config, 2, 64, torch.device("cpu"), seed=18)
    loss_ref = train_step(cpu_model, tokens, labels, bf16=False)
    loss_fast = train_step(device_model, tokens.to(ctx.device), labels.to(ctx.device), bf16=True)
    grads_ref, grads_fast = gradients(cpu_model), gradients(device_model)
    finite = all(bool(torch.isfinite(g).all()) for g in grads_fast.values())
    same_params = grads_ref.keys() == grads_fast.keys()
    diff2 = sum(float((grads_fast[n].to("cpu", F64) - grads_ref[n].to(F64)).pow(2).sum()) for n in grads_ref)
    ref2 = sum(float(grads_ref[n].to(F64).pow(2).sum()) for n in grads_ref)
    grad_rel = math.sqrt(diff2 / ref2) if ref2 > 0 else math.inf
    max_abs, rel = error(loss_fast, loss_ref)
    tol = TOL["model_loss_bf16"]
    return Row(
        "model_debug bf16-vs-cpu-fp32",
        verdict(rel, tol, finite, same_params),
        max_abs,
        rel,
        tol,
        None,
        None,
        f"B=2 T=64; loss {float(loss_ref):.4f} vs {float(loss_fast):.4f}; {len(grads_fast)} grads, "
        f"finite: {finite}; global grad rel diff {grad_rel:.2e} (not gated)",
    )


def check_model_large(ctx: Context) -> Iterator[Row]:
    """A larger K3-shaped model (hidden 1024, 8 layers, 64 experts): bf16 vs fp32 loss on the
    device, finite gradients, tokens/s. CUDA only (too large for a CPU test run)."""
    if not ctx.cuda:
        yield skip("model_large", "needs CUDA (a ~0.4B-parameter model)")
        return
    batch, seq = ctx.pick((4, 2048), (1, 512))
    yield guarded(ctx, "model_large", lambda: model_speed_row(ctx, "model_large", large_config(), batch, seq))
