"""The step loop's and the metric sinks' settings (the `train:` and `logging:` sections)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from k3train.config.recipe import ConfigError, check

__all__ = ["LoggingConfig", "TrainConfig"]


@dataclass
class TrainConfig:
    """The step loop: how long, how big, on what, and when to log and evaluate."""

    steps: int = 100
    """Optimizer steps to train for (the total, counting steps done before a resume)."""
    global_batch_size: int = 8
    """Samples per optimizer step, over all data-parallel ranks and micro-batches."""
    micro_batch_size: int = 4
    """Samples per micro-batch on one data-parallel rank."""
    seed: int = 1234
    """Seed of parameter initialisation and every other random choice of the run."""
    precision: Literal["fp32", "bf16", "fp8"] = "fp32"
    """Compute precision: fp32; bf16 autocast over fp32 master weights; or fp8 = bf16 plus FP8
    GEMMs in the Transformer Engine projections (needs CUDA, transformer-engine and
    model.linear_backend te or auto). AttnRes, router, QB statistics, norms, softmaxes, SiTU-GLU
    and the loss stay fp32/bf16 (docs/precision.md)."""
    weights: Literal["fp32", "bf16_with_fp32_master_shards"] = "fp32"
    """Where the weights live: fp32 parameters on every rank (the optimizer steps them in place),
    or bf16 parameters in the model with fp32 master weights and optimizer state only in the
    ZeRO-1 owners' shards (Megatron's distributed optimizer); the second needs precision bf16 or
    fp8 (docs/precision.md, "Master weights")."""
    grad_dtype: Literal["fp32", "bf16"] = "fp32"
    """Dtype gradients are accumulated over micro-batches and reduced over data parallel in
    (Megatron's --grad-reduce-in-bf16 for bf16); under fp32 weights, the reduction's dtype only."""
    offload_activations: bool = False
    """Copy every tensor a chunk's forward saves for backward to host memory and back when
    backward needs it (pinned buffers on a side stream on CUDA): exact, trades device memory for
    host traffic (docs/planning.md, "Activation options")."""
    fp8_recipe: Literal["delayed", "current", "mxfp8", "blockwise"] = "delayed"
    """FP8 scaling under precision fp8: delayed (per-tensor scales from an amax history),
    current (per-tensor scales from the tensor itself), mxfp8 (32-element blocks; Blackwell) or
    blockwise (Transformer Engine's Float8BlockScaling: 1x128 blocks of inputs and gradients,
    128x128 blocks of weights, as DeepSeek-V3 trains; Hopper with CUDA 12.9 or later)."""
    fp8_amax_history_len: int = 1024
    """Steps of amax history of the delayed recipe."""
    fp8_amax_compute_algo: Literal["max", "most_recent"] = "max"
    """How the delayed recipe turns the amax history into a scale."""
    fp8_excluded_layers: list[int] | None = None
    """0-based decoder layers whose projections stay bf16 under fp8; null means the first and the
    last layer, [] means none."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """'auto' uses CUDA when available, else the CPU."""
    log_interval: int = 1
    """Steps between metric lines."""
    eval_interval: int = 0
    """Steps between validation passes; 0 means never."""
    eval_batches: int = 2
    """Validation batches of global_batch_size rows per validation pass: the same rows under every
    parallel layout, each data-parallel rank taking its share in the training micro-batches."""
    max_nonfinite_steps: int = 3
    """Stop after this many consecutive steps with a NaN/Inf loss or gradient norm (each is skipped)."""
    num_threads: int = 0
    """Intra-op CPU threads per process; 0 means OMP_NUM_THREADS when the user set it (the 1 torchrun
    sets when it is unset does not count), else the cores this process may use that the machine's
    load leaves free, divided among the ranks on its machine."""
    host_heap: Literal["keep_freed", "system"] = "keep_freed"
    """On a CPU run, `keep_freed` has glibc keep the memory torch frees for the step's next tensors
    (mmap and trim thresholds raised to 1 GiB) instead of returning it to the kernel and faulting
    it back in page by page: about 5% of a bf16 step on the 512-wide model, no change in peak
    memory (k3train/training/host_heap.py). `system` leaves glibc's defaults. GPU runs and other C
    libraries are unchanged either way."""
    compile: bool = False
    """torch.compile the per-layer elementwise chains named by `train.compile_regions` (never
    matmuls, routing or collectives). Off by default: the first compile takes tens of seconds to
    minutes on a CPU, longer than a short debug run, and on the CPU only the `attn_res` region
    pays (docs/performance.md)."""
    compile_regions: list[Literal["norms", "activations", "attn_res"]] = field(
        default_factory=lambda: ["norms", "activations", "attn_res"]
    )
    """What `train.compile=true` compiles: `norms` (every RMSNorm and KDA's gated output norm),
    `activations` (the GLU of every dense MLP, shared expert and routed-expert stack), `attn_res`
    (every AttnRes mix with its sublayer's input norm). On the CPU `norms` and `activations`
    trace plain formulas that can run slower than the eager written-out backwards; measure with
    `benchmarks/step_vs_dense.py --compile` (docs/performance.md has the measured ratios)."""
    stop_grace_s: float = 20.0
    """After SIGTERM/SIGINT/SIGHUP, seconds the step in progress may take before the process exits
    without saving (status 4): a rank blocked on a collective whose peer stopped answering cannot
    finish it. Within the grace the run saves at the end of the step and exits with status 3.
    Under torchrun at most its SIGTERM-to-SIGKILL window (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, 30 s by
    default) less 10 s for the save: the default 20 fits."""

    def validate(self) -> None:
        """Raise ConfigError naming the first out-of-range field."""
        check(
            [
                (self.steps >= 1, f"train.steps must be at least 1, got {self.steps}"),
                (
                    self.global_batch_size >= 1,
                    f"train.global_batch_size must be at least 1, got {self.global_batch_size}",
                ),
                (self.micro_batch_size >= 1, f"train.micro_batch_size must be at least 1, got {self.micro_batch_size}"),
                (self.log_interval >= 1, f"train.log_interval must be at least 1, got {self.log_interval}"),
                (
                    self.eval_interval >= 0,
                    f"train.eval_interval must be 0 (never) or positive, got {self.eval_interval}",
                ),
                (self.eval_batches >= 1, f"train.eval_batches must be at least 1, got {self.eval_batches}"),
                (
                    self.max_nonfinite_steps >= 1,
                    f"train.max_nonfinite_steps must be at least 1, got {self.max_nonfinite_steps}",
                ),
                (
                    self.fp8_amax_history_len >= 1,
                    f"train.fp8_amax_history_len must be at least 1, got {self.fp8_amax_history_len}",
                ),
                (
                    self.fp8_excluded_layers is None or all(i >= 0 for i in self.fp8_excluded_layers),
                    f"train.fp8_excluded_layers must be 0-based layer indices, got {self.fp8_excluded_layers}",
                ),
                (
                    self.weights == "fp32" or self.precision != "fp32",
                    "train.weights=bf16_with_fp32_master_shards runs the forward in bf16: set train.precision=bf16 "
                    "(or fp8), or train.weights=fp32",
                ),
                (self.num_threads >= 0, f"train.num_threads must be 0 (automatic) or positive, got {self.num_threads}"),
                (
                    math.isfinite(self.stop_grace_s) and self.stop_grace_s > 0,
                    f"train.stop_grace_s must be a positive number of seconds, got {self.stop_grace_s}",
                ),
                (
                    not self.compile or bool(self.compile_regions),
                    "train.compile_regions is empty while train.compile=true: name a region "
                    "(norms, activations, attn_res) or set train.compile=false",
                ),
            ]
        )

    def micro_batches_per_rank(self, dp: int) -> int:
        """Micro-batches each data-parallel rank runs per step, for `dp` data-parallel ranks.

        Raises ConfigError unless the global batch splits into whole micro-batches on every
        rank. The job's config is checked with its `parallel.dp` (1 when automatic) at load, the
        trainer checks it again with the data-parallel size resolved from the world size.
        """
        per_step = self.micro_batch_size * dp
        if per_step < 1:  # checked by validate(); refused here too rather than divided by
            raise ConfigError(
                f"train.micro_batch_size ({self.micro_batch_size}) and the data-parallel size ({dp}) must be at least 1"
            )
        if self.global_batch_size % per_step:
            lower = max(self.global_batch_size // per_step, 1) * per_step
            fits = sorted({lower, lower + per_step} - {self.global_batch_size})
            raise ConfigError(
                f"train.global_batch_size ({self.global_batch_size}) must be a multiple of train.micro_batch_size * "
                f"data-parallel size ({self.micro_batch_size} * {dp} = {per_step}); use train.global_batch_size="
                f"{' or '.join(map(str, fits))}, or change train.micro_batch_size"
            )
        return self.global_batch_size // per_step


@dataclass
class LoggingConfig:
    """Metric sinks (the console always gets a line every train.log_interval steps)."""

    jsonl: bool = True
    """Write metrics.jsonl in the run directory."""
    tensorboard: bool = False
    """Write TensorBoard event files (needs the tensorboard package)."""
    wandb: bool = False
    """Log to Weights & Biases (needs the wandb package)."""
    wandb_project: str = "k3train"
    """W&B project name."""
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    """W&B mode; 'offline' writes locally for a later `wandb sync`."""
    peak_tflops: float | None = None
    """Peak dense TFLOP/s per device used for MFU; null looks it up from the device name."""
    optimizer_table: bool = False
    """Print the optimizer's table at start-up: one row per parameter group (route, name pattern,
    tensors, elements, block layout or shape). Off: a summary of one line per optimizer."""

    def validate(self) -> None:
        """Raise ConfigError naming the first out-of-range field."""
        check(
            [
                (
                    self.peak_tflops is None or self.peak_tflops > 0,
                    f"logging.peak_tflops must be positive or null, got {self.peak_tflops}",
                ),
            ]
        )
