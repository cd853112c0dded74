"""`train.compile=true` (k3train/training/compile.py): the compiled model computes the eager
model's losses to 1e-6 in fp32 (inductor may reorder the fp32 reductions of the norms; measured
4.8e-7 on the debug model) and keeps every parameter name, so checkpoints are interchangeable.

Inductor compiles C++ for the CPU on first use (tens of seconds on a shared two-core machine), so
this test uses a tiny model and two steps; the speed-up is measured by
`benchmarks/step_vs_dense.py --compile`, not here.
"""

import shutil

import pytest
import torch

from k3train.model.attn_res import AttentionResidual
from k3train.model.config import LinearAttnConfig, ModelConfig
from k3train.model.k3 import K3ModelChunk, lm_loss
from k3train.training.compile import REGIONS, CompiledMixNorm, compile_elementwise

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None, reason="inductor on the CPU needs a C++ compiler"
)

TINY = ModelConfig(
    vocab_size=128,
    hidden_size=32,
    num_hidden_layers=4,
    num_attention_heads=2,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    linear_attn_config=LinearAttnConfig(num_heads=2, head_dim=8),
    intermediate_size=64,
    num_experts=4,
    num_experts_per_token=2,
    moe_intermediate_size=16,
    routed_expert_hidden_size=16,
)


def _losses(compiled: bool, regions=REGIONS) -> tuple[list[float], list[str]]:
    model = K3ModelChunk(TINY, seed=0)
    if compiled:
        counts = compile_elementwise(model, regions)
        expected = {"norms": "norms", "activations": "activations", "attn_res_mixes": "attn_res"}
        assert all((counts[name] > 0) == (region in regions) for name, region in expected.items()), counts
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(2):
        tokens = torch.randint(0, TINY.vocab_size, (2, 33), generator=generator)
        loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    if compiled and "attn_res" in regions:  # the AttnRes mixes ran compiled (one function per source count)
        mixes = [m for m in model.modules() if isinstance(m, AttentionResidual)]
        assert mixes
        mix_norm = mixes[0].compiled_mix_norm
        assert isinstance(mix_norm, CompiledMixNorm) and len(mix_norm.compiled) > 1
    return losses, list(model.state_dict())


def rounding_bound(losses: list[float]) -> float:
    """Compiled regions fuse and reorder fp32 elementwise work (norms, activations, mixes), each op
    rounding once instead of per pass: over a token's path through the layers a few dozen such
    ops change their rounding, so the losses may differ by up to 64 units of fp32 rounding (2^-24)
    of the loss; a wrong compiled region changes them by orders of magnitude more."""
    return 64 * 2.0**-24 * max(abs(loss) for loss in losses)


@pytest.mark.slow
def test_compiled_model_matches_eager():
    eager, eager_names = _losses(compiled=False)
    compiled, compiled_names = _losses(compiled=True)
    assert compiled_names == eager_names
    assert max(abs(a - b) for a, b in zip(eager, compiled)) <= rounding_bound(eager), (eager, compiled)
    assert eager[0] != eager[1]  # the second step saw the first update (backward ran through the compiled parts)


@pytest.mark.slow
def test_only_the_attn_res_region_matches_eager():
    # `train.compile_regions=[attn_res]` (what pays on a CPU): the mixes compiled, the norms and
    # activations eager, the same losses.
    eager, _ = _losses(compiled=False)
    compiled, _ = _losses(compiled=True, regions=["attn_res"])
    assert max(abs(a - b) for a, b in zip(eager, compiled)) <= rounding_bound(eager), (eager, compiled)


def test_unknown_or_empty_regions_are_refused():
    with pytest.raises(ValueError, match="unknown compile regions"):
        compile_elementwise(K3ModelChunk(TINY, seed=0), ["attn_res", "everything"])
    from k3train.config.recipe import ConfigError
    from k3train.training.config import TrainConfig

    with pytest.raises(ConfigError, match="train.compile_regions is empty"):
        TrainConfig(compile=True, compile_regions=[]).validate()
