"""FP8 with every recompute mode, each FP8 recipe, and FP8 weight casts once per step, on the TE
stand-in (tests/unit/te_stand_in.py with `quantize=True`: the GEMM operands rounded to E4M3 by
the recipe's scaling, TE's argument checks, TE's checkpoint semantics).

What is held, per recipe (delayed, current, mxfp8, blockwise):
- `recompute: sublayer` under FP8 (TE's checkpoint) gives the loss of FP8 without recompute
  exactly and its gradients up to fp32 accumulation order (the recompute re-enters the forward's
  FP8 region and reuses its scales and weight casts): bound 1e-6 norm-wise, a few fp32 roundings
  (6e-8 each) of the gradient sums; measured 2.4e-8 to 2.8e-8, the same as bf16 with and without
  recompute (2.4e-8). torch's checkpoint in its place reruns the projections outside the FP8
  region, another graph than the forward's, and torch refuses the recompute.
- FP8 matches bf16 (the same model, FP8 off) within the stand-in's FP8 tolerance:
  E4M3 keeps 3 mantissa bits, a relative rounding of at most 2⁻⁴ = 6.25% per element and about
  2⁻⁴/√3 ≈ 3.6% RMS; a GEMM with both operands rounded is ≈ √2 · 3.6% ≈ 5% off norm-wise in its
  output. The loss, a mean over every token of a few such layers' sum, moves far less than one
  GEMM's output: bound 2e-2 relative (measured 1.4e-4 to 1.2e-3). The gradient, norm-wise over
  every parameter, carries each GEMM's ≈ 5% through backward's GEMMs of rounded operands, a few
  layers deep: bound 0.25 (measured 0.149 to 0.160). mxfp8 and blockwise measure the same: their
  scales are powers of two, and E4M3 rounding is the same at every power-of-two scale unless
  values leave the normal range.
"""

from __future__ import annotations

import pytest
import torch

from k3train.kernels import te as te_kernels
from k3train.model.attn_res import torch_checkpoint
from k3train.model.config import ModelConfig
from k3train.model.decoder import DecoderLayer
from k3train.model.k3 import K3ModelChunk
from tests.unit.te_stand_in import NotModelled, make_stand_in
from tests.unit.test_te import small_model  # widths multiples of 16, rows of 8: what FP8 GEMMs take

CPU = torch.device("cpu")
LOSS_TOLERANCE = 2e-2
GRAD_TOLERANCE = 0.25
RECOMPUTE_TOLERANCE = 1e-6
RECIPES = ("delayed", "current", "mxfp8", "blockwise")


def batches(config: ModelConfig, count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(0, config.vocab_size, (2, 17), generator=generator) for _ in range(count)]


def run(model: K3ModelChunk, te, recipe: str | None, micro_batches: list[torch.Tensor]):
    """Forward and backward of every micro-batch under bf16 autocast (and FP8 when `recipe`),
    gradients accumulated; returns (mean loss, gradients)."""
    model.zero_grad(set_to_none=True)
    losses = []
    for tokens in micro_batches:
        fp8 = te_kernels.fp8_autocast(
            te, enabled=recipe is not None, recipe=te_kernels.make_fp8_recipe(te, recipe) if recipe else None
        )
        with torch.autocast("cpu", dtype=torch.bfloat16), fp8:
            loss = model.loss(model(tokens[:, :-1]), tokens[:, 1:])
        (loss / len(micro_batches)).backward()
        losses.append(float(loss.detach()))
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return sum(losses) / len(losses), grads


def models(te, recompute: str) -> tuple[K3ModelChunk, K3ModelChunk]:
    """The same weights with and without sublayer recompute (both through the TE factory)."""
    built = [
        K3ModelChunk(small_model(recompute=mode), seed=3, linear_factory=te_kernels.TELinearFactory(te, CPU))
        for mode in (recompute, "none")
    ]
    built[1].load_state_dict(built[0].state_dict())
    return built[0], built[1]


def relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    diff = sum(float((a[n].double() - b[n].double()).pow(2).sum()) for n in b)
    return (diff / sum(float(b[n].double().pow(2).sum()) for n in b)) ** 0.5


def te_linears(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, te_kernels.FP8StateMixin) and hasattr(m, "weight")]


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_with_sublayer_recompute_matches_fp8_without_and_bf16(recipe):
    te = make_stand_in(quantize=True)
    recomputed, plain = models(te, "sublayer")
    micro_batches = batches(small_model(), 2)
    if recipe == "delayed":  # delayed scaling's first call scales by 1: give both an amax history
        for model in (recomputed, plain):
            run(model, te, recipe, micro_batches[:1])
    loss_fp8, grads_fp8 = run(recomputed, te, recipe, micro_batches)
    loss_plain, grads_plain = run(plain, te, recipe, micro_batches)
    assert loss_fp8 == loss_plain
    assert relative(grads_fp8, grads_plain) < RECOMPUTE_TOLERANCE
    in_fp8 = [m for m in te_linears(recomputed) if not m.keep_out_of_fp8]
    assert in_fp8 and all(m.recompute_calls == m.fp8_calls > 0 for m in in_fp8)  # each forward recomputed once
    assert all(not m.saved_scales for m in in_fp8)  # every recompute took back its forward's scales

    loss_bf16, grads_bf16 = run(plain, te, None, micro_batches)
    assert abs(loss_fp8 - loss_bf16) / abs(loss_bf16) < LOSS_TOLERANCE, (loss_fp8, loss_bf16)
    grad_error = relative(grads_fp8, grads_bf16)
    assert 0 < grad_error < GRAD_TOLERANCE, grad_error  # FP8 did round (0 would mean it never ran)


def test_torch_checkpoint_would_recompute_outside_the_fp8_region():
    """The reason for TE's checkpoint: with torch's in its place, the recompute runs the
    projections in bf16 while the forward ran them in FP8: another graph, which torch's
    checkpoint notices (a different number of saved tensors) and refuses."""
    te = make_stand_in(quantize=True)
    recomputed, plain = models(te, "sublayer")
    for layer in recomputed.modules():
        if isinstance(layer, DecoderLayer):
            layer.checkpoint_function = torch_checkpoint
    micro_batches = batches(small_model(), 1)
    with pytest.raises(torch.utils.checkpoint.CheckpointError, match="different number of tensors"):
        run(recomputed, te, "current", micro_batches)
    run(plain, te, "current", micro_batches)  # the same model without recompute runs


@pytest.mark.parametrize("recompute", ["none", "attn_res", "sublayer"])
def test_weights_are_cast_to_fp8_once_per_step(recompute):
    """Four micro-batches of one step: each FP8 linear casts its weight once (TE's
    `is_first_microbatch`: True first, then False), its recompute included; after the optimizer
    step (`new_fp8_weights`, or an in-place update autograd counts) the next forward casts again."""
    te = make_stand_in(quantize=True)
    model, _ = models(te, recompute)
    micro_batches = batches(small_model(), 4)
    run(model, te, "current", micro_batches)
    in_fp8 = [m for m in te_linears(model) if not m.keep_out_of_fp8]
    assert in_fp8 and all(m.fp8_calls == 4 and m.weight_casts == 1 for m in in_fp8)
    with torch.no_grad():  # a step written through .data: no version counter sees it
        for p in model.parameters():
            p.data.mul_(0.5)
    te_kernels.new_fp8_weights([model])
    run(model, te, "current", micro_batches[:1])
    assert all(m.weight_casts == 2 for m in in_fp8)
    with torch.no_grad():  # an in-place update autograd counts: noticed without being told
        for m in in_fp8:
            m.weight.mul_(2.0)
    run(model, te, "current", micro_batches[:1])
    assert all(m.weight_casts == 3 for m in in_fp8)


def test_blockwise_recipe_and_te_argument_checks():
    te = make_stand_in()
    recipe = te_kernels.make_fp8_recipe(te, "blockwise")
    assert type(recipe).__name__ == "Float8BlockScaling" and recipe.fp8_format == te.recipe.Format.E4M3
    assert (recipe.x_block_scaling_dim, recipe.w_block_scaling_dim) == (1, 2)
    with pytest.raises(AssertionError, match="2D by 2D"):
        te.recipe.Float8BlockScaling(x_block_scaling_dim=2)
    with pytest.raises(AssertionError, match="E5M2"):
        te.recipe.Float8CurrentScaling(fp8_format=te.recipe.Format.E5M2)
    linear = te_kernels.TELinearFactory(te, CPU)(32, 48)
    with te_kernels.fp8_autocast(te, enabled=True, recipe=recipe), pytest.raises(ValueError, match="divisible by 8"):
        linear(torch.randn(6, 32))  # 6 rows: TE's FP8 GEMM refuses them
    with pytest.raises(NotModelled, match="use_reentrant=False"):
        te.pytorch.checkpoint(linear, torch.randn(8, 32))  # TE's default is reentrant
    with pytest.raises(RuntimeError, match="not initialized"):
        te.pytorch.checkpoint(linear, torch.randn(8, 32), distribute_saved_activations=True)
    older = make_stand_in()
    del older.recipe.Float8BlockScaling
    with pytest.raises(ValueError, match="Float8BlockScaling"):
        te_kernels.make_fp8_recipe(older, "blockwise")


def test_start_up_takes_fp8_with_sublayer_recompute_and_checks_blockwise_support(monkeypatch):
    """`check_precision_support` on a (pretend) CUDA device with TE: fp8 with every recompute
    mode passes; blockwise is refused in one line naming the field where TE says this GPU cannot
    run Float8BlockScaling, and passes where it can."""
    from k3train.config import JobConfig, apply_overrides
    from k3train.config.recipe import ConfigError
    from k3train.training.build import check_precision_support

    te = make_stand_in()
    support = {"available": (True, "")}
    te.pytorch.is_fp8_block_scaling_available = lambda return_reason=False: support["available"]
    monkeypatch.setattr(te_kernels, "te_missing", lambda device: None)
    monkeypatch.setattr(te_kernels, "import_transformer_engine", lambda: (te, ""))
    cuda = torch.device("cuda")
    for recompute in ("none", "attn_res", "sublayer"):
        config = apply_overrides(JobConfig(), ["train.precision=fp8", f"model.recompute={recompute}"])
        check_precision_support(config, cuda)
    blockwise = apply_overrides(JobConfig(), ["train.precision=fp8", "train.fp8_recipe=blockwise"])
    check_precision_support(blockwise, cuda)
    support["available"] = (False, "FP8 block scaled GEMM requires compute capability 9.0 or higher and CUDA >= 12.9.")
    with pytest.raises(ConfigError, match=r"train.fp8_recipe=blockwise .*compute capability 9.0"):
        check_precision_support(blockwise, cuda)
