"""k3train's training step beside a plain dense transformer of the same FLOPs per token: the
dense peer (model, job, sizing), k3train's trainer on a recipe, one profiled step split into
parts, an aten-operation counter and the alternated comparison that `benchmarks/step_vs_dense.py`
prints (and `tools/gpu_check.py` runs on a GPU). The conventions are the benchmark's docstring's.
"""

from __future__ import annotations

import contextlib
import resource
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from k3train.config import JobConfig, load_config
from k3train.model.flops import training_flops_per_token
from k3train.parallel.state import ParallelState
from k3train.planning.measured import build_trainer
from k3train.training.host_heap import configure_host_heap
from k3train.training.loop import Trainer, precision_context
from k3train.training.throughput import measure_cpu_matmul_tflops, muon_step_stats

ROOT = Path(__file__).resolve().parents[2]  # the checkout (recipes/)
DEBUG_RECIPE = ROOT / "recipes" / "debug.yaml"
WIDE_MODEL = [  # the 512-wide K3-shaped model: hidden 512, 3 KDA + 1 MLA, 2,048 tokens per step
    "model.hidden_size=512",
    "model.num_hidden_layers=4",
    "model.num_attention_heads=8",
    "model.q_lora_rank=256",
    "model.kv_lora_rank=128",
    "model.qk_nope_head_dim=64",
    "model.qk_rope_head_dim=32",
    "model.v_head_dim=64",
    "model.linear_attn_config.num_heads=8",
    "model.linear_attn_config.head_dim=64",
    "model.intermediate_size=1408",
    "model.moe_intermediate_size=256",
    "model.routed_expert_hidden_size=256",
    "data.seq_length=512",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
]
MODELS = {"debug": [], "wide512": WIDE_MODEL}
PARTS = (
    "KDA kernel",
    "KDA projections",
    "MLA",
    "routed experts",
    "dispatch",
    "shared experts",
    "AttnRes",
    "optimizer",
    "other",
)


# ---------------------------------------------------------------------------------------------
# The dense peer


def dense_flops_per_token(layers: int, width: int, mlp: int, vocab: int, seq_length: int) -> float:
    """Training FLOPs per token of `DenseTransformer` (k3train/model/flops.py's conventions): per
    layer q, k, v, o (`4 d²` multiply-adds), SwiGLU (`3 d f`) and causal attention (`QKᵀ` and `AV`
    over `(T+1)/2` keys on average, `2 d (T+1)/2` each); the head `d V`; × 2 FLOPs, × 3 for training."""
    per_layer = 2 * (4 * width * width + 3 * width * mlp) + 2 * 2 * width * (seq_length + 1) / 2
    return 3 * (layers * per_layer + 2 * width * vocab)


def size_dense_peer(target: float, layers: int, vocab: int, seq_length: int, head_dim: int = 64) -> tuple[int, int]:
    """(width, SwiGLU size) of a `layers`-deep dense peer with `target` training FLOPs per token:
    the width (a multiple of `head_dim`) whose `8/3 d` SwiGLU comes closest, then the SwiGLU size
    (a multiple of 8) solved exactly for the rest."""

    def error(width: int) -> float:
        return abs(dense_flops_per_token(layers, width, round(8 * width / 3), vocab, seq_length) - target)

    width = min(range(head_dim, 64 * head_dim + 1, head_dim), key=error)
    rest = dense_flops_per_token(layers, width, 0, vocab, seq_length)
    mlp = max(8, round((target - rest) / (3 * layers * 2 * 3 * width) / 8) * 8)
    return width, mlp


class DenseBlock(nn.Module):
    def __init__(self, width: int, mlp: int, head_dim: int):
        super().__init__()
        self.heads = width // head_dim
        self.attn_norm, self.mlp_norm = nn.RMSNorm(width), nn.RMSNorm(width)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.o = nn.Linear(width, width, bias=False)
        self.gate_up = nn.Linear(width, 2 * mlp, bias=False)
        self.down = nn.Linear(mlp, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(batch, seq, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(attended.transpose(1, 2).reshape(batch, seq, width))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class DenseTransformer(nn.Module):
    """nanoGPT-style pre-norm decoder: causal SDPA, SwiGLU, untied head (no positional encoding:
    rotary embeddings are elementwise and left out, as flops.py leaves elementwise work out)."""

    def __init__(self, vocab: int, layers: int, width: int, mlp: int, head_dim: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(DenseBlock(width, mlp, head_dim) for _ in range(layers))
        self.norm = nn.RMSNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


@dataclass
class DenseJob:
    model: DenseTransformer
    optimizer: torch.optim.Optimizer
    batches: Callable[[], list[torch.Tensor]]
    clip: float
    precision: Callable[[], contextlib.AbstractContextManager]  # k3train's own (bf16 autocast or none)

    def step(self) -> float:
        micro_batches = self.batches()
        for tokens in micro_batches:
            with self.precision():
                logits = self.model(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
            (loss / len(micro_batches)).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()


def dense_job(config: JobConfig, width: int, mlp: int, device: torch.device = torch.device("cpu")) -> DenseJob:
    torch.manual_seed(config.train.seed)
    model = DenseTransformer(config.model.vocab_size, config.model.num_hidden_layers, width, mlp).to(device)
    # The same AdamW kernel as k3train's (`optimizer.adamw_fused`), so the ratio compares models.
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=config.optimizer.lr,
        weight_decay=config.optimizer.weight_decay,
        fused=config.optimizer.adamw_fused,
    )
    generator = torch.Generator().manual_seed(0)
    train = config.train
    shape = (train.micro_batch_size, config.data.seq_length + 1)

    def batches() -> list[torch.Tensor]:
        count = train.global_batch_size // train.micro_batch_size
        return [torch.randint(0, config.model.vocab_size, shape, generator=generator).to(device) for _ in range(count)]

    return DenseJob(
        model, optimizer, batches, config.optimizer.clip_grad, precision_context(config.train.precision, device)
    )


# ---------------------------------------------------------------------------------------------
# k3train's step


def _step_loss(trainer: Trainer) -> Callable[[], float]:
    """A contender: one step of `trainer`, returning its loss."""
    return lambda: trainer.train_step()["loss"]


def k3_trainer(config: JobConfig, device: torch.device = torch.device("cpu")) -> Trainer:
    """The job's own objects (`build_rank`) in one process, on the default corpus."""
    return build_trainer(config, ParallelState.single(), device=device)


# ---------------------------------------------------------------------------------------------
# Attribution of one profiled step


def _label_modules(model: nn.Module) -> list:
    """Forward hooks that open a profiler range per part; returns the hook handles."""
    from k3train.model.kda import KimiDeltaAttention
    from k3train.model.mla import GatedMLA
    from k3train.model.moe import GroupedExperts, LatentMoE

    labels: dict[nn.Module, str] = {}
    for module in model.modules():
        if isinstance(module, KimiDeltaAttention):
            labels[module] = "KDA projections"
        elif isinstance(module, GatedMLA):
            labels[module] = "MLA"
        elif isinstance(module, LatentMoE):
            labels[module] = "dispatch"  # router, sort and combine; its sub-parts below
            for sub in (module.routed_expert_down_proj, module.routed_expert_up_proj, module.routed_expert_norm):
                if sub is not None:
                    labels[sub] = "routed experts"  # the latent projections of the routed path
            if module.shared_experts is not None:
                labels[module.shared_experts] = "shared experts"
        elif isinstance(module, GroupedExperts):
            labels[module] = "dispatch"  # the grouped GEMMs inside are "routed experts"
    handles, open_ranges = [], []

    def enter(label):
        def hook(module, args):
            frame = torch.profiler.record_function(label)
            frame.__enter__()
            open_ranges.append(frame)

        return hook

    def leave(module, args, output):
        open_ranges.pop().__exit__(None, None, None)

    for module, label in labels.items():
        handles.append(module.register_forward_pre_hook(enter(label)))
        handles.append(module.register_forward_hook(leave))
    return handles


@contextlib.contextmanager
def _labelled_functions(trainer: Trainer):
    """The KDA kernel, the grouped GEMMs and the optimizer step inside their own ranges."""
    import k3train.kernels.kda.fla_backend as fla_module
    import k3train.kernels.kda.raw_inputs as kda_module
    import k3train.model.moe as moe_module

    def wrap(function, label):
        def wrapped(*args, **kwargs):
            with torch.profiler.record_function(label):
                return function(*args, **kwargs)

        return wrapped

    from k3train.model.attn_res import AttentionResidual

    saved = (
        kda_module.chunk_kda,
        moe_module.grouped_mm,
        trainer.optimizer.step,
        AttentionResidual.normalized_input,
        fla_module.run_fla_chunk_kda_from_raw,
    )
    kda_module.chunk_kda = wrap(saved[0], "KDA kernel")
    # fla's kernel on raw inputs (CUDA): the normalisations and gates it fuses count as the kernel
    fla_module.run_fla_chunk_kda_from_raw = wrap(saved[4], "KDA kernel")
    moe_module.grouped_mm = wrap(saved[1], "routed experts")
    trainer.optimizer.step = wrap(saved[2], "optimizer")
    # AttnRes runs through this method, not `forward` (the mix and the sublayer's input norm).
    # (patching the class's method on purpose for the timing, restored below: mypy refuses method assignment)
    AttentionResidual.normalized_input = wrap(saved[3], "AttnRes")  # type: ignore[method-assign]
    try:
        yield
    finally:
        kda_module.chunk_kda, moe_module.grouped_mm = saved[0], saved[1]
        AttentionResidual.normalized_input = saved[3]  # type: ignore[method-assign]  # restoring the patch above
        fla_module.run_fla_chunk_kda_from_raw = saved[4]
        del trainer.optimizer.step  # the instance attribute; the method shows through again


def _part_of(event, labels: set[str], by_sequence: dict[int, str]) -> str | None:
    """The innermost part range around `event`, else (a backward op) the part of the forward op
    whose autograd node it runs, else None."""
    node = event
    while node is not None:
        if node.name in labels:
            return node.name
        if node.name.startswith("autograd::engine::evaluate_function") and node.sequence_nr >= 0:
            return by_sequence.get(node.sequence_nr)
        node = node.cpu_parent
    return None


def profile_parts(trainer: Trainer, device: torch.device = torch.device("cpu")) -> tuple[dict[str, float], float]:
    """Seconds per part of one profiled `train_step`, and the step's wall time: CPU time of the
    ops on a CPU; on a GPU, the device time of the kernels each op launched (what the GPU waited
    for the host shows in "other")."""
    handles = _label_modules(trainer.model)
    on_gpu = device.type == "cuda"
    try:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if on_gpu:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with _labelled_functions(trainer), torch.profiler.profile(activities=activities) as prof:
            started = time.perf_counter()
            trainer.train_step()
            synchronize(device)
            wall = time.perf_counter() - started
    finally:
        for handle in handles:
            handle.remove()
    events = prof.events()
    labels = set(PARTS)
    by_sequence: dict[int, str] = {}
    for event in events:  # forward ops: the part they ran in
        if event.sequence_nr >= 0 and not event.name.startswith("autograd::") and event.sequence_nr not in by_sequence:
            node = event.cpu_parent
            while node is not None and node.name not in labels:
                node = node.cpu_parent
            if node is not None:
                by_sequence[event.sequence_nr] = node.name
    seconds = dict.fromkeys(PARTS, 0.0)
    for event in events:
        part = _part_of(event, labels, by_sequence)
        if part is not None and part != "other":
            seconds[part] += (event.self_device_time_total if on_gpu else event.self_cpu_time_total) / 1e6
    seconds["other"] = max(0.0, wall - sum(seconds.values()))
    return seconds, wall


# ---------------------------------------------------------------------------------------------
# The comparison


def table(headers: list[str], rows: list[list[str]], title: str) -> None:
    widths = [max(len(str(row[i])) for row in [headers, *rows]) for i in range(len(headers))]
    print(f"\n{title}")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths)) + " |")


class OperationCounter(TorchDispatchMode):
    """Counts the aten operations that reach the kernels while it is active (forward, the
    autograd engine's backward, the optimizer): `compute` those that run a kernel (on a GPU, about
    one launch each), `views` those that only make a view. The dense peer's and k3train's counts
    say how much of the gap is per-operation overhead, whatever the device."""

    def __init__(self):
        super().__init__()
        self.compute = 0
        self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.is_view:
            self.views += 1
        else:
            self.compute += 1
        return func(*args, **(kwargs or {}))


def count_operations(step: Callable[[], object]) -> OperationCounter:
    """One more `step()` under an `OperationCounter` (not timed: the counting slows it)."""
    counter = OperationCounter()
    with counter:
        step()
    return counter


def page_faults() -> int:
    """This process's minor page faults so far (`getrusage`). A step that faults allocates memory
    the process has not touched before: on a CPU each 4 KiB page costs a kernel trap and zeroing
    (a few µs), so a 4 MB tensor written fresh takes ~10× one written into reused memory. glibc's
    heap grows for many steps while mixed-size bf16 and fp32 buffers fragment it, so the steps
    after a short warm-up pay faults a long run does not (the benchmark prints them)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bf16_over_fp32_matmul_rate(size: int = 1024, seconds: float = 0.2) -> float:
    """This CPU's bf16 matmul rate over its fp32 rate at `size`², with this process's threads
    (printed beside the step ratios, so that runs on CPUs with and without bf16 matrix units
    can be read side by side)."""
    rates = []
    for dtype in (torch.float32, torch.bfloat16):
        a, b = (torch.randn(size, size).to(dtype) for _ in range(2))
        a @ b  # warm-up
        calls, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            a @ b
            calls += 1
        rates.append(calls / (time.perf_counter() - start))
    return rates[1] / rates[0]


def measure_matmul_tflops(device: torch.device, precision: str) -> float:
    """The rate the step's matmuls are held to: on a CPU the fp32 1024² rate of this process's
    threads (`measure_cpu_matmul_tflops`, one trial); on a GPU an 8192² GEMM in the compute
    dtype (bf16 under `precision=bf16`, else fp32 as the GPU runs it), median of 5 timed runs."""
    if device.type != "cuda":
        return measure_cpu_matmul_tflops(trials=1)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    size = 8192
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    rates = []
    for _ in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            a @ b
        end.record()
        end.synchronize()
        rates.append(5 * 2 * size**3 / (start.elapsed_time(end) / 1e3) / 1e12)
    return statistics.median(rates[1:])


@dataclass
class Comparison:
    """What `compare` measured: median step seconds per contender, tokens per step, and the
    AdamW step's tokens/s over the dense peer's (the ratio the README's status states)."""

    step_seconds: dict[str, float]
    tokens: int
    adamw_vs_dense: float
    final_losses: dict[str, float]
    operations: dict[str, tuple[int, int]]  # (compute, view) aten operations of one step
    page_faults: dict[str, float]  # median minor page faults per timed step (`page_faults`)


DENSE = "dense peer (SDPA + SwiGLU, AdamW)"
ADAMW = "k3train, AdamW"
MUON = "k3train, Per-Head Muon"
COMPILED_ALL = "k3train, AdamW, train.compile=true"
COMPILED = {  # `--compile`'s contenders (AdamW): label -> train.compile_regions
    COMPILED_ALL: "norms,activations,attn_res",
    "k3train, AdamW, compile_regions=[attn_res]": "attn_res",
}


def compare(
    name: str,
    overrides: list[str],
    steps: int,
    peak_tflops: float,
    with_compile: bool,
    profile: bool,
    device: torch.device = torch.device("cpu"),
    precision: str = "fp32",
    compiled: Sequence[str] = tuple(COMPILED),
    warmup: int = 1,
) -> Comparison:
    """One comparison (tables printed); `with_compile` adds the `compiled` contenders (labels of
    `COMPILED`). `warmup` alternated rounds run untimed first (compiles, and the allocator's
    growth: see `page_faults`)."""
    if warmup < 1:
        raise ValueError(f"warmup must be at least 1 round (the first compiles and allocates), got {warmup}")
    overrides = [*overrides, f"train.precision={precision}"]
    # train.steps covers every step a contender takes: the warm-up, `steps`, the counted one and
    # the profiled one (the learning-rate schedule stays inside its range).
    total_steps = steps + warmup + 3
    base = load_config(str(DEBUG_RECIPE), [*overrides, f"train.steps={total_steps}", "logging.jsonl=false"])
    seq, vocab = base.data.seq_length, base.model.vocab_size
    k3_flops = training_flops_per_token(base.model, seq).total
    width, mlp = size_dense_peer(k3_flops, base.model.num_hidden_layers, vocab, seq)
    dense_flops = dense_flops_per_token(base.model.num_hidden_layers, width, mlp, vocab, seq)
    tokens = base.train.global_batch_size * seq
    print(
        f"\n== {name}: {tokens} tokens per step; k3train {k3_flops / 1e6:.1f} MFLOP/token; dense peer "
        f"{base.model.num_hidden_layers} layers × width {width}, SwiGLU {mlp}: {dense_flops / 1e6:.1f} MFLOP/token "
        f"({100 * (dense_flops / k3_flops - 1):+.1f}%)"
    )

    # The job's host heap setting (pretrain_k3.py sets it per rank), process-wide: both contenders
    # run on it alike.
    heap_line = configure_host_heap(base.train.host_heap, device.type)
    if heap_line:
        print(heap_line)
    contenders: dict[str, Callable[[], float]] = {}
    muon = k3_trainer(base, device)
    contenders[MUON] = lambda: muon.train_step()["loss"]
    adamw = k3_trainer(
        load_config(
            str(DEBUG_RECIPE), [*overrides, f"train.steps={total_steps}", "logging.jsonl=false", "optimizer.name=adamw"]
        ),
        device,
    )
    contenders[ADAMW] = lambda: adamw.train_step()["loss"]
    if with_compile:  # every region, and the AttnRes mixes alone (what pays on a CPU)
        for label in compiled:
            compiled_trainer = k3_trainer(
                load_config(
                    str(DEBUG_RECIPE),
                    [
                        *overrides,
                        f"train.steps={total_steps}",
                        "logging.jsonl=false",
                        "optimizer.name=adamw",
                        "train.compile=true",
                        f"train.compile_regions=[{COMPILED[label]}]",
                    ],
                ),
                device,
            )
            contenders[label] = _step_loss(compiled_trainer)
    contenders[DENSE] = dense_job(base, width, mlp, device).step

    times: dict[str, list[float]] = {label: [] for label in contenders}
    losses: dict[str, float] = {}
    newton_schulz: list[tuple[float, float]] = []
    matmul_rates = [peak_tflops]
    faults: dict[str, list[int]] = {label: [] for label in contenders}
    for round_index in range(warmup + steps):  # the first `warmup` rounds are not timed
        # The matmul rate is sampled between the steps too: a busy machine moves the denominator
        # of "FLOP/s over the matmul rate" as much as the steps.
        matmul_rates.append(measure_matmul_tflops(device, precision))
        timed = round_index >= warmup
        for label, step in contenders.items():
            synchronize(device)
            faults_before = page_faults()
            started = time.perf_counter()
            losses[label] = float(step())
            synchronize(device)
            if timed:
                times[label].append(time.perf_counter() - started)
                faults[label].append(page_faults() - faults_before)
            if label == MUON and timed:
                stats = muon_step_stats(muon.optimizer)
                assert stats is not None, "the Muon contender's optimizer records step_stats"
                newton_schulz.append((stats.ns_seconds, stats.ns_flops))
    peak_tflops = statistics.median(matmul_rates)
    operations = {}
    for label, step in contenders.items():
        if "compile" not in label:  # (a dispatch mode sees a compiled region's eager fallback, not its kernels)
            counter = count_operations(step)
            operations[label] = (counter.compute, counter.views)
    dense = times[DENSE]
    rows = []
    for label, samples in times.items():
        step_s, best_s = statistics.median(samples), min(samples)
        flops = (dense_flops if label.startswith("dense") else k3_flops) * tokens
        rows.append(
            [
                label,
                f"{step_s:.3f} s",
                f"{best_s:.3f} s",
                f"{tokens / step_s:,.0f}",
                f"{statistics.median(dense) / step_s:.2f} / {min(dense) / best_s:.2f}",
                f"{100 * flops / step_s / 1e12 / peak_tflops:.0f}%",
                f"{statistics.median(faults[label]):,.0f}",
            ]
        )
    # The best step is the one a busy machine slowed least: on a shared machine, compare both.
    for row, label in zip(rows, times):
        row.append(f"{operations[label][0]:,} / {operations[label][1]:,}" if label in operations else "-")
    table(
        [
            "",
            "step (median)",
            "step (best)",
            "tokens/s",
            "tokens/s vs dense (median / best)",
            "model FLOP/s over matmul rate",
            "page faults per step (median)",
            "aten ops per step (compute / view)",
        ],
        rows,
        f"{name}: {steps} alternated steps each after {warmup} warm-up round(s) on {device.type}, {precision}; matmul rate {1e3 * peak_tflops:,.1f} GFLOP/s (median of "
        f"{len(matmul_rates)} samples taken between the steps)"
        + (
            f"; bf16/fp32 matmul rate {bf16_over_fp32_matmul_rate():.2f}× (1024², this machine)"
            if device.type == "cpu"
            else ""
        ),
    )
    ns_s = statistics.median(s for s, _ in newton_schulz)
    muon_s = statistics.median(times[MUON])
    print(
        f"Per-Head Muon: Newton–Schulz {newton_schulz[0][1] / 1e9:.1f} GFLOP and {ns_s:.3f} s per step "
        f"({100 * ns_s / muon_s:.0f}% of the step; model work {k3_flops * tokens / 1e9:.1f} GFLOP)"
    )
    if profile:
        seconds, wall = profile_parts(muon, device)
        clock = "kernel time on the GPU" if device.type == "cuda" else "CPU time"
        table(
            ["part", "seconds", "share of the step"],
            [[part, f"{seconds[part]:.3f}", f"{100 * seconds[part] / wall:.1f}%"] for part in PARTS],
            f"{name}: where one profiled k3train step (Per-Head Muon) goes ({wall:.2f} s under the profiler; {clock})",
        )
    medians = {label: statistics.median(samples) for label, samples in times.items()}
    faults_per_step = {label: statistics.median(samples) for label, samples in faults.items()}
    return Comparison(medians, tokens, medians[DENSE] / medians[ADAMW], losses, operations, faults_per_step)
