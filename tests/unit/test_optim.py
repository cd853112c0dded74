"""Per-Head Muon, its Newton–Schulz core, parameter routing, lr schedules and gradient clipping."""

import io
import math

import pytest
import torch
from torch import nn

from k3train.contracts.param_roles import mark_adamw_only, mark_head_blocks
from k3train.optim import (
    NormShare,
    OptimizerConfig,
    PerHeadMuon,
    ScheduleConfig,
    block_layout,
    build_optimizer,
    clip_grad_norm_,
    describe_param_groups,
    grad_squared_norm,
    lr_at,
    ns_compute_dtype,
    parameter_costs,
    route_parameters,
    set_lr,
    summarize_param_groups,
)
from k3train.optim.newton_schulz import newton_schulz, ns_flops, resolve_ns_dtype

# ---------------------------------------------------------------------------------------------
# Newton–Schulz


@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16], ids=["fp32", "bf16-as-on-cuda"])
def test_newton_schulz_singular_values_in_band(compute_dtype):
    """NS5 maps every singular value into [0.5, 1.5] and keeps the singular vectors.

    Shapes are rectangular on purpose: a square Gaussian matrix has a smallest singular value
    near 0 (about 1e-3 of the norm), which five steps cannot lift to 0.5 — a property of NS5
    itself, not of this code (measured: σ_min ≈ 0.07-0.12 for 64×64 and 128×128 draws).
    """
    torch.manual_seed(0)
    for shape in [(32, 128), (128, 32), (64, 256), (200, 96), (8, 64), (4, 16, 48), (3, 40, 12)]:
        x = torch.randn(shape)
        y = newton_schulz(x, compute_dtype=compute_dtype)
        assert y.shape == x.shape
        sv = torch.linalg.svdvals(y.double())
        assert sv.min() >= 0.5 and sv.max() <= 1.5, (shape, sv.min().item(), sv.max().item())


def test_newton_schulz_keeps_singular_vectors_and_blocks_independent():
    """In float64: U^T NS(X) V is diagonal (X = U S V^T); a batch equals its blocks one by one."""
    torch.manual_seed(1)
    x = torch.randn(3, 24, 80, dtype=torch.float64)
    y = newton_schulz(x)
    assert y.dtype == torch.float64
    u, _, vh = torch.linalg.svd(x, full_matrices=False)
    core = u.mT @ y @ vh.mT
    off_diagonal = core - torch.diag_embed(torch.diagonal(core, dim1=-2, dim2=-1))
    assert off_diagonal.abs().max() < 1e-10
    for i in range(3):
        torch.testing.assert_close(newton_schulz(x[i]), y[i], rtol=0, atol=1e-12)
    # Scale invariance (Frobenius normalisation; eps = 1e-7 on a norm of ~44 shows at 1e-9),
    # and a zero block stays zero, not NaN.
    torch.testing.assert_close(newton_schulz(1e3 * x), y, rtol=0, atol=1e-7)
    assert torch.equal(newton_schulz(torch.zeros(2, 4, 6)), torch.zeros(2, 4, 6))


def test_newton_schulz_compute_dtype():
    """bf16 on CUDA; on a CPU bf16 from the crossover call size on (fp32 below, never with an
    infinite crossover); float64 kept."""
    large, small = torch.zeros(16, 64, 64), torch.zeros(16, 32, 128)  # 126 and 47 MFLOP per call
    assert ns_compute_dtype(large, 1e8) == ns_compute_dtype(large.bfloat16(), 1e8) == torch.bfloat16
    assert ns_compute_dtype(small, 1e8) == torch.float32
    assert ns_compute_dtype(large, math.inf) == torch.float32
    assert ns_compute_dtype(large.double(), 0.0) == torch.float64
    if torch.cuda.is_available():
        assert ns_compute_dtype(torch.zeros(2, 2, device="cuda"), math.inf) == torch.bfloat16


def test_auto_newton_schulz_dtype_follows_the_measured_probe(tmp_path, monkeypatch):
    """ "auto" on a CPU is decided by the probe's measurement (patched both ways here), not by a
    CPU feature flag: where bf16 measured faster it runs bf16, where slower fp32; the value is
    cached per machine, so a second process reads it instead of measuring."""
    from k3train.optim import bf16_probe

    monkeypatch.setenv("K3TRAIN_CACHE_DIR", str(tmp_path))
    large, small = torch.zeros(16, 64, 64), torch.zeros(16, 32, 128)
    faster = [[16, 64, 64, 2.3], [16, 32, 128, 0.9], [4, 256, 256, 2.5]]  # an AVX512-BF16 CPU
    slower = [[16, 64, 64, 0.6], [16, 32, 128, 0.5], [4, 256, 256, 0.7]]  # a CPU without bf16
    for speedups, expected in ((faster, torch.bfloat16), (slower, torch.float32)):
        calls = []
        monkeypatch.setattr(bf16_probe, "measure_bf16_speedups", lambda s=speedups, c=calls: c.append(1) or s)
        for file in tmp_path.glob("*.json"):
            file.unlink()
        for _ in range(2):
            bf16_probe.cpu_bf16_min_flops.cache_clear()  # a new process: the file cache answers
            assert resolve_ns_dtype("auto", large) == expected
            assert resolve_ns_dtype("auto", small) == torch.float32  # the 47 MFLOP call did not pay
        assert calls == [1]
    bf16_probe.cpu_bf16_min_flops.cache_clear()


def test_bf16_crossover_is_where_every_larger_call_pays():
    from k3train.optim.bf16_probe import bf16_crossover_flops
    from k3train.optim.newton_schulz import ns_flops

    assert bf16_crossover_flops([[1, 64, 64, 1.5], [1, 128, 128, 2.0]]) == ns_flops(64, 64)
    assert bf16_crossover_flops([[1, 64, 64, 1.5], [1, 128, 128, 0.9], [1, 256, 256, 2.0]]) == ns_flops(256, 256)
    assert bf16_crossover_flops([[1, 64, 64, 3.0], [1, 256, 256, 1.05]]) == math.inf


def test_probe_measures_real_newton_schulz_calls():
    """The probe itself, run small: one speedup per shape, positive and finite."""
    from k3train.optim.bf16_probe import measure_bf16_speedups

    speedups = measure_bf16_speedups([(2, 32, 32), (1, 64, 64)], min_seconds=0.005, trials=1)
    assert [row[:3] for row in speedups] == [[2, 32, 32], [1, 64, 64]]
    assert all(0 < row[3] < math.inf for row in speedups)


NS_BF16_REL_TOL = 5e-2
"""bf16 vs fp32 Newton–Schulz, norm-wise relative: the `newton_schulz_bf16` tolerance of
`tools/gpu_check.py` (in `k3train/benchmarking/gpu_checks/common.py`; five bf16 steps through NS's steep slope;
Muon only needs the singular-value band)."""


def test_newton_schulz_dtype_setting():
    x32, x64 = torch.zeros(2, 2), torch.zeros(2, 2, dtype=torch.float64)
    assert resolve_ns_dtype("auto", x32) == ns_compute_dtype(x32)
    assert resolve_ns_dtype("float32", x32) == torch.float32
    assert resolve_ns_dtype("bfloat16", x32) == torch.bfloat16
    assert resolve_ns_dtype("float32", torch.zeros(2, 2, dtype=torch.bfloat16)) == torch.float32
    assert resolve_ns_dtype("bfloat16", x64) == torch.float64  # float64 checks stay exact
    with pytest.raises(ValueError, match="newton_schulz_dtype"):
        resolve_ns_dtype("fp8", x32)


def test_bf16_newton_schulz_matches_fp32_on_cpu():
    """The CPU runs bf16 matmuls too: the bf16 iteration (what CUDA runs by default, and what
    `optimizer.newton_schulz_dtype=bfloat16` asks for on the CPU) against fp32, on the block shapes
    Per-Head Muon uses, and one optimizer step through `PerHeadMuon(ns_dtype=...)`."""
    torch.manual_seed(0)
    for shape in [(8, 64, 32), (4, 32, 128), (2, 96, 96), (128, 40)]:
        x = torch.randn(shape)
        fast = newton_schulz(x, compute_dtype=torch.bfloat16).double()
        ref = newton_schulz(x, compute_dtype=torch.float32).double()
        rel = ((fast - ref).norm() / ref.norm()).item()
        assert rel < NS_BF16_REL_TOL, (shape, rel)
    updates = {}
    for ns_dtype in ("float32", "bfloat16"):
        param = nn.Parameter(torch.zeros(64, 48))
        param.grad = torch.randn(64, 48, generator=torch.Generator().manual_seed(1))
        PerHeadMuon([param], lr=1.0, weight_decay=0.0, ns_dtype=ns_dtype).step()
        updates[ns_dtype] = param.detach().double()
    rel = ((updates["bfloat16"] - updates["float32"]).norm() / updates["float32"].norm()).item()
    assert 0 < rel < NS_BF16_REL_TOL, rel  # 0 would mean the setting did nothing


@pytest.mark.parametrize("shape", [(32, 128), (128, 32), (3, 40, 12), (24, 24)])
def test_ns_flops_counts_the_matmuls(shape):
    """`ns_flops` (reported per step, apart from model FLOPs) equals what FlopCounterMode sees."""
    from torch.utils.flop_counter import FlopCounterMode

    x = torch.randn(shape)
    with FlopCounterMode(display=False) as counter:
        newton_schulz(x, steps=5)
    batch = x.shape[0] if x.ndim == 3 else 1
    assert counter.get_total_flops() == batch * ns_flops(shape[-2], shape[-1], 5)


def test_step_stats_count_newton_schulz_work():
    params = [nn.Parameter(torch.randn(16, 32)), nn.Parameter(torch.randn(4, 8, 16))]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = PerHeadMuon(params, lr=0.1)
    optimizer.step()
    assert optimizer.step_stats.ns_flops == ns_flops(16, 32) + 4 * ns_flops(8, 16)
    assert optimizer.step_stats.ns_seconds > 0 and optimizer.step_stats.exchange_seconds == 0


# ---------------------------------------------------------------------------------------------
# Per-Head Muon


def _one_update(param: nn.Parameter, grad: torch.Tensor, **options) -> torch.Tensor:
    """The update `-(W_after - W_before)` of one Muon step with lr 1, no decay, no momentum."""
    opt = PerHeadMuon([param], lr=1.0, weight_decay=0.0, momentum=0.0, **options)
    before = param.detach().clone()
    param.grad = grad
    opt.step()
    return before - param.detach()


@pytest.mark.parametrize(
    "shape, heads, expected_layout",
    [
        ((512, 128), (0, 16), "per-head 16×[32,128]"),  # q/k/v-like: row blocks
        ((128, 64), (0, 4), "per-head 4×[32,64]"),
        ((64, 256), (1, 4), "per-head 4×[64,64]"),  # o_proj: column blocks, square blocks
        ((96, 128), (1, 4), "per-head 4×[96,32]"),
        ((8, 32, 96), None, "experts 8×[32,96]"),
    ],
    ids=["q-rows-16-heads", "q-rows-4-heads", "o-cols-square-blocks", "o-cols-tall-blocks", "experts"],
)
def test_update_rms_per_block(shape, heads, expected_layout):
    """Every block's update RMS is ≈ 0.2, i.e. the scale comes from the block's own shape.

    Band [0.75, 1.1] × 0.2: with exact orthogonalisation the RMS would be exactly 0.2, but NS5's
    singular values sit at ≈0.68–1.13 for Gaussian inputs, so measured RMS is ≈0.157–0.172.
    The second check pins the scale exactly to 0.2·sqrt(max(rows, cols)) of the block: a scale
    from the whole matrix's shape or Keller's `max(1, rows/cols)**0.5` fails it (and the band,
    for the q-like and expert cases).
    """
    torch.manual_seed(2)
    param = nn.Parameter(torch.zeros(shape))
    if heads:
        mark_head_blocks(param, *heads)
    layout = block_layout(param)
    assert layout.describe() == expected_layout
    grad = torch.randn(shape)
    update = _one_update(param, grad)
    rms = layout.to_blocks(update).pow(2).mean(dim=(-2, -1)).sqrt()
    assert rms.numel() == layout.num_blocks
    assert ((rms > 0.15) & (rms < 0.22)).all(), rms
    # Exactly 0.2·sqrt(max(rows, cols)) times each block's own NS output.
    ns_rms = newton_schulz(layout.to_blocks(grad)).float().pow(2).mean(dim=(-2, -1)).sqrt()
    # (Where NS runs in bf16 (a CPU whose probe measured bf16 faster), the scaled update is rounded to bf16 once more:
    # 2^-8 relative per element; any other scale rule is off by a factor of at least √2.)
    bf16 = resolve_ns_dtype("auto", grad) == torch.bfloat16
    torch.testing.assert_close(
        rms, 0.2 * math.sqrt(max(layout.rows, layout.cols)) * ns_rms, **({"rtol": 4e-3, "atol": 0.0} if bf16 else {})
    )


@pytest.mark.parametrize("dim", [0, 1])
def test_per_head_equals_separate_muon_per_head_and_differs_from_whole(dim):
    """Three steps with momentum, Nesterov and weight decay, in float64: a head-split parameter
    moves exactly as if each head were its own plain Muon matrix, and not like the whole matrix."""
    torch.manual_seed(3)
    heads, shape = 4, (64, 48) if dim == 0 else (48, 64)
    start = torch.randn(shape, dtype=torch.float64) * 0.02
    per_head = nn.Parameter(start.clone())
    mark_head_blocks(per_head, dim, heads)
    whole = nn.Parameter(start.clone())
    mark_head_blocks(whole, dim, heads)
    slices = [nn.Parameter(s.clone()) for s in start.chunk(heads, dim=dim)]
    options = dict(lr=0.05, weight_decay=0.1, momentum=0.95, nesterov=True)
    optimizers = [
        PerHeadMuon([per_head], **options),
        PerHeadMuon([whole], per_head=False, **options),
        PerHeadMuon(slices, **options),
    ]
    for _ in range(3):
        grad = torch.randn(shape, dtype=torch.float64)
        per_head.grad, whole.grad = grad.clone(), grad.clone()
        for s, g in zip(slices, grad.chunk(heads, dim=dim)):
            s.grad = g.clone()
        for opt in optimizers:
            opt.step()
    separately = torch.cat([s.detach() for s in slices], dim=dim)
    torch.testing.assert_close(per_head.detach(), separately, rtol=0, atol=1e-12)
    difference = (per_head - whole).norm() / (per_head - start).norm()
    assert difference > 0.1, difference


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon not in this torch")
@pytest.mark.parametrize("shape", [(64, 128), (128, 64)])
@pytest.mark.parametrize("nesterov", [True, False])
def test_plain_matrix_matches_torch_muon(shape, nesterov):
    """Same maths as `torch.optim.Muon(adjust_lr_fn="match_rms_adamw")` on a plain matrix.

    torch runs NS in bf16 even on CPU (we use fp32 there) and clamps the norm instead of adding
    eps; tolerance: relative Frobenius error of the parameter change < 3e-2 (measured 7-8e-3).
    torch keeps an EMA momentum buffer, exactly (1 - μ) times Moonlight's sum-style one.
    """
    try:
        reference_options = dict(adjust_lr_fn="match_rms_adamw", nesterov=nesterov)
        probe = torch.optim.Muon([nn.Parameter(torch.zeros(2, 2))], **reference_options)
    except (TypeError, ValueError):
        pytest.skip("torch.optim.Muon without adjust_lr_fn='match_rms_adamw'")
    del probe
    torch.manual_seed(4)
    start = torch.randn(shape)  # unit weights: weight decay is a third of each step's change
    ours, theirs = nn.Parameter(start.clone()), nn.Parameter(start.clone())
    momentum = 0.95
    options = dict(lr=0.02, weight_decay=0.1, momentum=momentum)
    opt_ours = PerHeadMuon([ours], nesterov=nesterov, **options)
    opt_theirs = torch.optim.Muon([theirs], **options, **reference_options)
    for _ in range(4):
        grad = torch.randn(shape)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        opt_ours.step()
        opt_theirs.step()
    delta_ours, delta_theirs = (ours - start).detach(), (theirs - start).detach()
    relative_error = (delta_ours - delta_theirs).norm() / delta_theirs.norm()
    assert relative_error < 3e-2, relative_error
    sum_style = opt_ours.state[ours]["momentum_buffer"]
    torch.testing.assert_close(sum_style * (1 - momentum), opt_theirs.state[theirs]["momentum_buffer"])


@pytest.mark.parametrize("fused", [False, True])
def test_adamw_groups_match_torch_adamw_bitwise(fused):
    torch.manual_seed(5)
    start = [torch.randn(16, 8), torch.randn(8)]
    ours = [nn.Parameter(t.clone()) for t in start]
    theirs = [nn.Parameter(t.clone()) for t in start]
    options = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))
    opt_ours = PerHeadMuon([{"params": ours, "algorithm": "adamw"}], adam_eps=1e-8, fused=fused, **options)
    opt_theirs = torch.optim.AdamW(theirs, eps=1e-8, fused=fused, **options)
    for _ in range(3):
        for a, b in zip(ours, theirs):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        opt_ours.step()
        opt_theirs.step()
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    assert opt_ours.state_dict()["state"][0]["step"] == opt_theirs.state_dict()["state"][0]["step"] == 3


def test_fused_adamw_is_the_default_and_can_be_turned_off():
    """`optimizer.adamw_fused` (default true) reaches both optimizers; fused and for-loop AdamW
    agree to rounding (float64: 1e-12 after three steps)."""
    results = {}
    for fused in (True, False):
        for name in ("adamw", "muon"):
            torch.manual_seed(3)
            model = TinyModel().double()
            optimizer = build_optimizer(model, OptimizerConfig(name=name, adamw_fused=fused))
            adamw_groups = (
                [optimizer.param_groups[0]]
                if name == "adamw"
                else [g for g in optimizer.param_groups if g["algorithm"] == "adamw"]
            )
            assert adamw_groups and all(g["fused"] is fused for g in adamw_groups)
            for _ in range(3):
                for p in model.parameters():
                    p.grad = torch.randn_like(p)
                optimizer.step()
            results[name, fused] = [p.detach().clone() for p in model.parameters()]
    for name in ("adamw", "muon"):
        for a, b in zip(results[name, True], results[name, False]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (bf16 Newton–Schulz path)")
def test_cuda_step_matches_cpu():
    """On CUDA, NS runs in bf16: two steps of the whole optimizer stay within bf16 tolerance of
    the fp32 CPU run (relative error of every parameter's change < 3e-2)."""
    torch.manual_seed(11)
    cpu_model = TinyModel()
    cuda_model = TinyModel().cuda()
    cuda_model.load_state_dict(cpu_model.state_dict())
    start = [p.detach().clone() for p in cpu_model.parameters()]
    optimizers = [build_optimizer(m, OptimizerConfig(lr=1e-2)) for m in (cpu_model, cuda_model)]
    for _ in range(2):
        for p, q in zip(cpu_model.parameters(), cuda_model.parameters()):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.cuda()
        for opt in optimizers:
            opt.step()
    for (name, p), q, s in zip(cpu_model.named_parameters(), cuda_model.parameters(), start):
        relative = (q.detach().cpu() - p.detach()).norm() / (p.detach() - s).norm()
        assert relative < 3e-2, (name, relative.item())


# ---------------------------------------------------------------------------------------------
# Routing and the start-up table


class TinyModel(nn.Module):
    """One of each parameter kind the optimizer must route."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 64)
        mark_adamw_only(self.embed.weight)
        self.layers = nn.ModuleList()
        for _ in range(2):
            layer = nn.Module()
            layer.norm = nn.RMSNorm(64)
            layer.q_proj = nn.Linear(64, 128, bias=False)  # 4 heads × 32 rows
            mark_head_blocks(layer.q_proj.weight, 0, 4)
            layer.o_proj = nn.Linear(128, 64, bias=True)  # 4 heads × 32 columns, with a bias
            mark_head_blocks(layer.o_proj.weight, 1, 4)
            layer.A_log = nn.Parameter(torch.zeros(4))
            layer.dt_bias = nn.Parameter(torch.zeros(128))
            layer.experts = nn.Parameter(torch.randn(8, 32, 64) * 0.02)
            layer.router = nn.Linear(64, 8, bias=False)
            self.layers.append(layer)
        self.attn_res_query = nn.Parameter(torch.zeros(2, 64))
        mark_adamw_only(self.attn_res_query)
        self.final_norm = nn.RMSNorm(64)
        self.head = nn.Linear(64, 50, bias=False)
        mark_adamw_only(self.head.weight)


def _names_by_role(optimizer: torch.optim.Optimizer) -> dict[str, set[str]]:
    return {g["role"]: set(g["param_names"]) for g in optimizer.param_groups}


def test_routing_and_description():
    model = TinyModel()
    optimizer = build_optimizer(model, OptimizerConfig())
    assert isinstance(optimizer, PerHeadMuon)
    roles = _names_by_role(optimizer)
    matrices = ("q_proj.weight", "o_proj.weight", "experts", "router.weight")
    assert roles["muon"] == {f"layers.{i}.{n}" for i in range(2) for n in matrices}
    assert roles["adamw"] == {"embed.weight", "head.weight", "attn_res_query"}
    vectors = ("norm.weight", "o_proj.bias", "A_log", "dt_bias")
    layer_vectors = {f"layers.{i}.{n}" for i in range(2) for n in vectors}
    assert roles["adamw_no_decay"] == layer_vectors | {"final_norm.weight"}
    weight_decay = {g["role"]: g["weight_decay"] for g in optimizer.param_groups}
    assert weight_decay == {"muon": 0.1, "adamw": 0.1, "adamw_no_decay": 0.0}

    # Work items: the explicit unit a distributed Muon will hand to owner ranks.
    items = {id(item.param): item for item in optimizer.work_items()}
    q_item = items[id(model.layers[0].q_proj.weight)]
    assert (q_item.layout.kind, q_item.layout.num_blocks) == ("heads", 4)
    assert q_item.cost == 4 * 32 * 64 * 32  # blocks · rows · cols · min(rows, cols)
    assert items[id(model.layers[1].experts)].cost == 8 * 32 * 64 * 32

    table = describe_param_groups(model, OptimizerConfig())
    expected_parts = (
        "layers.*.q_proj.weight",
        "per-head 4×[32,64]",
        "per-head 4×[64,32]",
        "experts 8×[32,64]",
        "matrix [8,64]",
        "embed.weight",
        "head.weight",
        "adamw_only",
        "layers.*.A_log",
        "AdamW wd=0",
    )
    for expected in expected_parts:
        assert expected in table, (expected, table)
    assert "layers.0." not in table  # layer numbers collapse into patterns
    assert "matrix [128,64]" in describe_param_groups(model, OptimizerConfig(muon_per_head=False))

    # A scheduler's lr reaches every group: with lr 0 nothing moves, weight decay included.
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    set_lr(optimizer, 0.0)
    optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_start_up_summary_is_a_few_lines_per_optimizer():
    """What the job prints by default (the table is behind logging.optimizer_table): the settings,
    then one line per route with its groups, tensors and parameters, adding up to the table's."""
    model = TinyModel()
    config = OptimizerConfig()
    summary = summarize_param_groups(model, config).splitlines()
    table = describe_param_groups(model, config).splitlines()
    assert summary[0] == table[0] and len(summary) == 5 < len(table), summary
    routes = {line.split()[0] + (" wd=0" if "wd=0" in line else ""): line for line in summary[1:4]}
    assert set(routes) == {"Muon", "AdamW", "AdamW wd=0"}, summary
    table_rows = [line for line in table[2:-1]]
    for label, line in routes.items():
        rows = [row for row in table_rows if row.split("  ")[1].strip() == label]
        assert f"{len(rows)} groups" in line or f"{len(rows)} group " in line, (line, rows)
    assert "logging.optimizer_table=true" in summary[-1]
    assert [
        line.split()[0] for line in summarize_param_groups(model, OptimizerConfig(name="adamw")).splitlines()[1:3]
    ] == ["AdamW", "AdamW"]


def test_routing_adamw_everywhere():
    model = TinyModel()
    optimizer = build_optimizer(model, OptimizerConfig(name="adamw"))
    assert type(optimizer) is torch.optim.AdamW
    roles = _names_by_role(optimizer)
    assert set(roles) == {"adamw", "adamw_no_decay"}
    assert "layers.0.q_proj.weight" in roles["adamw"]
    assert "layers.0.A_log" in roles["adamw_no_decay"]
    assert "Muon" not in describe_param_groups(model, OptimizerConfig(name="adamw"))


def test_state_dict_round_trip_is_bit_exact():
    """A run restored mid-way from a state dict continues bit-identically."""
    config = OptimizerConfig(lr=1e-2)

    def set_grads(model: nn.Module, step: int) -> None:
        generator = torch.Generator().manual_seed(1000 + step)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=generator)

    torch.manual_seed(6)
    model_a = TinyModel()
    opt_a = build_optimizer(model_a, config)
    for step in range(3):
        set_grads(model_a, step)
        opt_a.step()
    buffer = io.BytesIO()
    torch.save({"model": model_a.state_dict(), "optimizer": opt_a.state_dict()}, buffer)
    assert any("momentum_buffer" in s for s in opt_a.state.values())
    assert any("exp_avg_sq" in s for s in opt_a.state.values())

    torch.manual_seed(7)  # a different init, overwritten by the checkpoint
    model_b = TinyModel()
    opt_b = build_optimizer(model_b, config)
    buffer.seek(0)
    checkpoint = torch.load(buffer)
    model_b.load_state_dict(checkpoint["model"])
    opt_b.load_state_dict(checkpoint["optimizer"])
    for step in range(3, 6):
        for model, opt in ((model_a, opt_a), (model_b, opt_b)):
            set_grads(model, step)
            opt.step()
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(a, b), name


# ---------------------------------------------------------------------------------------------
# Schedules


def test_schedules():
    peak, total = 1.0, 100
    cosine = ScheduleConfig(name="cosine", warmup_steps=10, min_lr_ratio=0.1)
    wsd = ScheduleConfig(name="wsd", warmup_steps=10, min_lr_ratio=0.1, decay_fraction=0.2)
    constant = ScheduleConfig(name="constant", warmup_steps=10)
    for schedule in (cosine, wsd, constant):
        # Warmup: step s trains with peak·(s+1)/warmup, so the first step is not wasted.
        assert lr_at(0, schedule, peak, total) == pytest.approx(0.1)
        assert lr_at(4, schedule, peak, total) == pytest.approx(0.5)
        assert lr_at(9, schedule, peak, total) == pytest.approx(1.0)
    # Cosine: halfway through the decay (n = 55) the lr is halfway to the minimum; ends at it.
    assert lr_at(54, cosine, peak, total) == pytest.approx(0.55)
    assert lr_at(99, cosine, peak, total) == pytest.approx(0.1)
    assert lr_at(500, cosine, peak, total) == pytest.approx(0.1)
    lrs = [lr_at(s, cosine, peak, total) for s in range(9, 100)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    # WSD: plateau at the peak until step 80, linear over the last 20 steps to the minimum.
    assert all(lr_at(s, wsd, peak, total) == 1.0 for s in range(9, 80))
    assert lr_at(89, wsd, peak, total) == pytest.approx(0.55)
    assert lr_at(99, wsd, peak, total) == pytest.approx(0.1)
    # Constant.
    assert lr_at(50, constant, peak, total) == lr_at(99, constant, peak, total) == 1.0
    # Scales with the peak, and no warmup starts (almost) at the peak.
    assert lr_at(54, cosine, 3e-3, total) == pytest.approx(0.55 * 3e-3)
    assert lr_at(0, ScheduleConfig(name="constant", warmup_steps=0), peak, total) == 1.0


# ---------------------------------------------------------------------------------------------
# Clipping


def _grad_params(seed: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> list:
    generator = torch.Generator().manual_seed(seed)
    params = []
    for shape in [(17, 5), (64,), (3, 4, 8), (1,)]:
        p = nn.Parameter(torch.zeros(shape, dtype=dtype))
        p.grad = (torch.randn(shape, generator=generator) * scale).to(dtype)
        params.append(p)
    params.append(nn.Parameter(torch.zeros(3)))  # no grad: ignored
    return params


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clip_matches_torch(max_norm):
    ours, theirs = _grad_params(8, scale=0.3), _grad_params(8, scale=0.3)
    norm_ours = clip_grad_norm_(ours, max_norm)
    norm_theirs = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    torch.testing.assert_close(norm_ours, norm_theirs, rtol=1e-6, atol=0)
    for a, b in zip(ours, theirs):
        if b.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)
    if max_norm < norm_theirs:
        clipped = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in ours[:4]]))
        assert clipped == pytest.approx(max_norm, rel=1e-5)


def test_clip_fp32_norm_reduce_hook_and_nonfinite():
    # bf16 gradients: the norm is accumulated in fp32.
    params = _grad_params(9, dtype=torch.bfloat16)
    expected = torch.linalg.vector_norm(torch.cat([p.grad.float().flatten() for p in params[:4]]))
    norm = clip_grad_norm_(params, 0.0)  # 0: measure only
    assert norm.dtype == torch.float32
    torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)
    # The reduce hook sees the squared norm: two identical "ranks" give sqrt(2)× the norm.
    params = _grad_params(9)
    local = clip_grad_norm_(_grad_params(9), 0.0)
    seen = []

    def two_ranks(squared_norm: torch.Tensor) -> torch.Tensor:
        seen.append(squared_norm.clone())
        return 2 * squared_norm

    total = clip_grad_norm_(params, 0.0, reduce_squared_norm=two_ranks)
    torch.testing.assert_close(seen[0], local.square())
    torch.testing.assert_close(total, local * math.sqrt(2))
    # Non-finite: returned as is, gradients untouched.
    params = _grad_params(10)
    params[0].grad[0, 0] = float("inf")
    before = [p.grad.clone() for p in params[:4]]
    assert clip_grad_norm_(params, 1.0).isinf()
    assert all(torch.equal(a, p.grad) for a, p in zip(before, params))
    params[1].grad[0] = float("nan")
    assert clip_grad_norm_(params, 1.0).isnan()


def test_clip_shares_are_counted_reduced_and_added_in_order():
    """Each share sums the squared norms of the gradients it counts, its own reduction combines
    it, the shares are added and the final reduction sees the total; every gradient is scaled,
    counted or not."""
    params = _grad_params(11)
    first, second = params[:2], params[2:4]
    seen: list[tuple[str, torch.Tensor]] = []

    def reduce(label: str, factor: float):
        def apply(tensor: torch.Tensor) -> torch.Tensor:
            seen.append((label, tensor.clone()))
            return factor * tensor

        return apply

    shares = [
        NormShare(lambda p: any(p is q for q in first), reduce("first", 2.0)),
        NormShare(lambda p: any(p is q for q in second), reduce("second", 3.0)),
    ]
    squared = [grad_squared_norm([p.grad for p in part], torch.device("cpu")) for part in (first, second)]
    before = [p.grad.clone() for p in params[:4]]
    norm = clip_grad_norm_(params, 1e-3, reduce_squared_norm=reduce("total", 5.0), shares=shares)
    assert [label for label, _ in seen] == ["first", "second", "total"]
    assert torch.equal(seen[0][1], squared[0]) and torch.equal(seen[1][1], squared[1])
    assert torch.equal(seen[2][1], 2.0 * squared[0] + 3.0 * squared[1])
    assert torch.equal(norm, (5.0 * (2.0 * squared[0] + 3.0 * squared[1])).sqrt())
    coef = 1e-3 / (norm + 1e-6)
    for old, p in zip(before, params[:4]):  # all four scaled, though each share counts two
        torch.testing.assert_close(p.grad, old * coef, rtol=1e-6, atol=0)
    # No shares: one share of everything, the same bits as the plain call.
    plain = clip_grad_norm_(_grad_params(11), 0.0)
    assert torch.equal(plain, clip_grad_norm_(_grad_params(11), 0.0, shares=[NormShare(lambda p: True)]))


def test_empty_norm_lives_on_the_parameters_device():
    """A rank without gradients (an empty stage, or nothing counted) still joins its reductions
    with a zero on the parameters' device (NCCL reduces device tensors only)."""
    assert grad_squared_norm([], torch.device("meta")).device.type == "meta"
    params = [nn.Parameter(torch.zeros(3, device="meta"))]
    devices = []
    norm = clip_grad_norm_(params, 1.0, reduce_squared_norm=lambda t: devices.append(t.device) or t)
    assert devices[0].type == "meta" and norm.device.type == "meta"


def test_parameter_costs_follow_routing_and_block_layout():
    """ZeRO-1 balances owners by these: Muon parameters by their Newton–Schulz block cost,
    AdamW ones by their element count; every trainable parameter once, in module order."""
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 8, bias=False))
    mark_head_blocks(model[2].weight, num_heads=2, dim=1)
    config = OptimizerConfig()
    costs = parameter_costs(model, config)
    routes = route_parameters(model, config)
    assert list(costs) == [route.name for route in routes]
    for route in routes:
        muon, cost = costs[route.name]
        assert muon == (route.route == "muon")
        expected = block_layout(route.param, config.muon_per_head).cost if muon else route.param.numel()
        assert cost == expected, route.name
    assert costs["2.weight"].cost == 2 * block_layout(torch.empty(8, 16)).cost  # two [8, 16] head blocks
    assert not parameter_costs(model, OptimizerConfig(name="adamw"))["0.weight"].muon
